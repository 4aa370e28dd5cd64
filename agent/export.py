"""`kloop export`: a run's accepted kernel as a pip-installable `torch.library` op.

A Triton task's package carries the cubins kloop's own sandboxed build makes of the accepted source (with
the accepted knobs) and the driver launcher the runners use, so the op needs no Triton and launches the
machine code that build makes; a C++/CUDA task's is built at first import as below.

The package holds the task folder of the branch's tip (the last change the gate accepted), the
trusted manifest and spec as of the run's base commit, a generated op module, its own test against
the spec's reference, and the provenance (run, commit, the gate's evidence from the commit's
trailers, GPU and toolchain). The library is built at first import by
`torch.utils.cpp_extension.load` (ninja), with the compile flags and knob settings the gate built
with, and called through the spec's own `launch` (ctypes): the op runs the code that was judged,
with the calling convention that was judged. The fake implementation is the spec's `make_outputs`
(shapes and dtypes only), so `torch.compile(fullgraph=True)` traces through the op.

A run whose accepted commits `kloop audit` (scope, static rules, build, audit of what was built,
check on fresh seeds) would now reject is refused; what the audit could not run here (a CUDA task's
check on a machine without its GPU) is written into the provenance.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from agent.reaudit import AuditReport, AuditTarget, audit
from agent.trailers import parse_trailers
from agent.workspace import commit_log, export_commit, resolve_commit
from tools.build import compile_flags
from tools.spec import load_spec
from tools.task import KNOBS_FILE, MANIFEST, Task, load_task

TEMPLATES = Path(__file__).parent / "templates"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ExportError(Exception):
    """A run that cannot be exported (bad input, nothing accepted, an audit that rejects a commit)."""


@dataclass(frozen=True)
class OpSignature:
    """The op's arguments and results, in the spec's order: tensors first, then the shape's dims."""

    inputs: list[str]
    outputs: list[str]
    dims: list[tuple[str, str]]  # (name, python type name: int | float | bool)
    example: dict  # the dims of the shape the signature was read from (for the README)
    input_meta: dict[str, str]  # name -> "dtype[shape]" for that shape
    output_meta: dict[str, str]


def op_signature(task: Task, spec) -> OpSignature:
    """Read from the spec itself on the task's first shape: the names `make_inputs` / `make_outputs` use,
    and the dims every shape of the manifest gives as numbers (strings such as `inputs = "range"` only
    choose test inputs and are not arguments)."""
    shapes = list(task.manifest.shapes)
    if not shapes:
        raise ExportError(f"{task.root / MANIFEST}: the task has no shapes: the op's arguments cannot be read from it")
    common = [k for k in shapes[0].dims if all(k in s.dims for s in shapes)]
    dims: list[tuple[str, str]] = []
    for key in common:
        values = [s.dims[key] for s in shapes]
        if all(isinstance(v, bool) for v in values):
            kind = "bool"
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            kind = "int"
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            kind = "float"
        else:
            continue
        if not _IDENT.fullmatch(key):
            raise ExportError(f"{task.root / MANIFEST}: dim {key!r} is not a Python identifier: it cannot be an argument")
        dims.append((key, kind))
    # the README's example: the smallest bench shape (a realistic call), else the first plain shape
    plain = [s for s in shapes if "inputs" not in s.dims]
    bench = [s for s in plain if s.bench]
    example = min(bench, key=lambda s: math.prod(abs(int(s.dims[d])) or 1 for d, k in dims if k == "int")) if bench \
        else (plain or shapes)[0]
    gen = torch.Generator().manual_seed(0)
    inputs = spec.make_inputs(example.dims, gen, torch.device("cpu"))
    outputs = spec.make_outputs(example.dims, inputs)
    for what, names in (("input", inputs), ("output", outputs)):
        bad = [n for n in names if not _IDENT.fullmatch(n) or not isinstance(names[n], torch.Tensor)]
        if bad:
            raise ExportError(f"{spec.path}: {what} {bad[0]!r} is not a tensor with an identifier for a name")
    clash = set(inputs) & {d for d, _ in dims}
    if clash:
        raise ExportError(f"{spec.path}: {sorted(clash)[0]!r} is both an input and a dim")

    def meta(t: torch.Tensor) -> str:
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"

    return OpSignature(list(inputs), list(outputs), dims, {k: v for k, v in example.dims.items()},
                       {k: meta(v) for k, v in inputs.items()}, {k: meta(v) for k, v in outputs.items()})


@dataclass
class ExportResult:
    out: Path
    package: str  # import name, e.g. kloop_matmul_cpu
    op: str  # e.g. torch.ops.kloop.matmul_cpu
    commit: str
    audit: AuditReport


def export(target: AuditTarget, out: Path, namespace: str = "kloop", run_dir: Path | None = None,
           run_audit=audit) -> ExportResult:
    """Write the package for `target`'s best commit (the branch tip) into `out` (new or empty); `run_dir`
    (the run record, when there is one) adds where the gate measured to the provenance."""
    if not _IDENT.fullmatch(namespace):
        raise ExportError(f"--namespace {namespace!r}: must be a Python identifier (it names torch.ops.<namespace>)")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty folder (nothing was written)")
    tip = resolve_commit(target.repo, target.branch)
    accepted = commit_log(target.repo, f"{target.base}..{tip}")
    if not accepted:
        raise ExportError(f"{target.branch}: no accepted commit on the branch: nothing the gate proved to export "
                          f"(the baseline is the code you started from)")
    report = run_audit(target, no_timing=True)
    if report.rejected:
        raise ExportError(f"{target.branch}: kloop audit would now reject {len(report.rejected)} of {len(report.rows)} "
                          "accepted commits, so the run is not exported: " + "; ".join(
                              f"{r.commit[:10]} {r.title!r}: {r.reason[:200]}" for r in report.rejected))
    with tempfile.TemporaryDirectory(prefix="kloop-export-") as tmp:
        base_task = load_task(export_commit(target.repo, target.base, Path(tmp) / "base", target.task_rel))
        best_dir = export_commit(target.repo, tip, Path(tmp) / "best", target.task_rel)
        spec = load_spec(base_task.root / base_task.manifest.spec)
        sig = op_signature(base_task, spec)
        knobs = base_task.knob_settings(best_dir)
        name = base_task.name
        if not _IDENT.fullmatch(name):
            raise ExportError(f"{base_task.root / MANIFEST}: task name {name!r} is not a Python identifier")
        pkg = f"kloop_{name}"
        trailers = dict(parse_trailers(accepted[-1].message))  # the tip: the exported commit
        provenance = _provenance(target, run_dir, tip, accepted, trailers, report, knobs, base_task)
        bundle = _triton_bundle(base_task, best_dir, knobs, Path(tmp) / "build") if base_task.target == "triton" else None
        if bundle is not None:
            provenance["built"] = {"compiler": bundle[1], "arch": base_task.manifest.arch}
        files = _render(base_task, sig, pkg, namespace, knobs, provenance)
        out.mkdir(parents=True, exist_ok=True)
        pkg_dir = out / pkg
        # the kernel: every file of the accepted task folder the build reads (sources, headers, knobs.toml)
        shutil.copytree(best_dir, pkg_dir / "kernel", ignore=shutil.ignore_patterns(MANIFEST, base_task.manifest.spec,
                                                                                     "__pycache__", "*.pyc"))
        # the trusted manifest and spec, as of the base commit (never the candidate's copies)
        shutil.copy2(base_task.root / MANIFEST, pkg_dir / "task.toml")
        spec_text = (base_task.root / base_task.manifest.spec).read_text()
        (pkg_dir / "spec.py").write_text(_vendor_spec_imports(spec_text, spec.path))
        shutil.copy2(Path(__file__).parents[1] / "tools" / "spec.py", pkg_dir / "_kloop_spec.py")
        if bundle is not None:  # the cubins kloop's sandboxed build made of the accepted source, and their launcher
            shutil.copy2(bundle[0], pkg_dir / TRITON_BUNDLE)
            shutil.copy2(Path(__file__).parents[1] / "tools" / "triton_launch.py", pkg_dir / "_triton_launch.py")
        for rel, text in files.items():
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (pkg_dir / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    (pkg_dir / "kernel" / KNOBS_FILE).unlink(missing_ok=True)  # its settings are the defines in _build.py
    return ExportResult(out, pkg, f"torch.ops.{namespace}.{name}", tip, report)


TRITON_BUNDLE = "kernel.bundle.json"


def _triton_bundle(task: Task, best_dir: Path, knobs: dict, cache: Path) -> tuple[Path, str]:
    """A Triton task's accepted source built as the gate builds it (the sandboxed ahead-of-time compile, the
    accepted knobs, the manifest's arch): (the bundle of cubins and launch records, the compiler). The package
    launches those cubins through the driver (tools/triton_launch.py, vendored): no Triton at run time, the
    machine code the gate's kind of build makes rather than a re-JIT with whatever Triton the user has."""
    from tools.build import build

    res = build(task, knobs, src_root=best_dir, cache_dir=cache)
    if not res.ok or not res.lib:
        raise ExportError(f"{task.name}: the accepted source does not build here: {res.error_text()[:1500]}")
    return Path(res.lib), res.compiler


def _vendor_spec_imports(text: str, path: Path) -> str:
    """The spec's helpers come from kloop's `tools.spec`; the package carries a copy of that module."""
    vendored = re.sub(r"^from tools\.spec import", "from ._kloop_spec import", text, flags=re.M)
    vendored = re.sub(r"^import tools\.spec as (\w+)", r"from . import _kloop_spec as \1", vendored, flags=re.M)
    if re.search(r"^\s*(from|import)\s+(tools|agent)\b", vendored, flags=re.M):
        raise ExportError(f"{path}: imports kloop modules beyond tools.spec's helpers: the package cannot carry them")
    return vendored


def _provenance(target: AuditTarget, run_dir: Path | None, tip: str, accepted, trailers: dict, report: AuditReport,
                knobs: dict, task: Task) -> dict:
    from agent import __version__
    from agent.records import RecordError, RunRecord

    info: dict = {}
    if run_dir is not None:
        try:
            info = RunRecord.open(Path(run_dir)).info.model_dump(mode="json")
        except RecordError:
            info = {}
    return {
        "kloop_version": __version__,
        "task": task.name,
        "target": task.target,
        "run_id": target.run_id,
        "branch": target.branch,
        "base_commit": target.base,
        "commit": tip,
        "accepted_commits": [{"commit": c.sha, "title": c.summary} for c in accepted],
        "evidence": trailers,  # the gate's trailers on the exported commit
        "knobs": knobs,
        "measured_on": {"gpu": info.get("gpu"), "machine": info.get("machine"), "versions": info.get("versions")},
        "audit": {"machine": report.machine, "layers_run_up_to": report.upto, "not_run": report.not_run,
                  "commits": len(report.rows), "rejected": len(report.rejected)},
    }


def _render(task: Task, sig: OpSignature, pkg: str, namespace: str, knobs: dict, provenance: dict) -> dict[str, str]:
    m = task.manifest
    flags = [f for f in compile_flags(task, knobs) if f != "-Xptxas=-v"]
    env = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, keep_trailing_newline=True)
    check_shapes = [{"name": s.name, "dims": dict(s.dims)} for s in task.check_shapes]
    tolerances = {o: task.tolerance(o).model_dump() for o in sig.outputs}
    ctx = dict(task=task.name, pkg=pkg, namespace=namespace, sig=sig, target=m.target, sources=list(m.sources),
               flags=flags, check_shapes=check_shapes, tolerances=tolerances, provenance=provenance,
               dist=f"kloop-{task.name.replace('_', '-')}", version=f"0.1.0+g{provenance['commit'][:12]}",
               description=m.description, json=json.dumps, repr=repr, bundle=TRITON_BUNDLE,
               device="cpu" if m.target == "cpu" else "cuda")
    return {
        "pyproject.toml": env.get_template("export_pyproject.toml.j2").render(ctx),
        "README.md": env.get_template("export_README.md.j2").render(ctx),
        f"{pkg}/__init__.py": env.get_template("export_init.py.j2").render(ctx),
        f"{pkg}/_build.py": env.get_template("export_build_triton.py.j2" if m.target == "triton"
                                             else "export_build.py.j2").render(ctx),
        f"tests/test_{task.name}.py": env.get_template("export_test.py.j2").render(ctx),
    }
