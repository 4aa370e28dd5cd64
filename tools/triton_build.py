"""Build and audit of a `target = "triton"` task: static rules, a sandboxed ahead-of-time compile to
cubins, ptxas figures, the bundle the runner loads, and the audit of what was built.

The build (called by tools/build.build, which owns the cache) copies the sources into the build
folder, checks them with the static rules (tools/triton_rules.py: nothing of the candidate runs
before that), and runs tools/triton_compile.py in the build sandbox, where `triton.compile` turns
each kernel x knob setting x variant into a cubin for the task's GPU (no GPU needed). The trusted
side then reads the results as data and writes one file, `lib<task>.triton.json` (the "library" of a
Triton task): per kernel variant its launch record (parameter types, constexprs, num_warps, shared
memory, Triton's scratch sizes) and the cubin. The runner loads it with the CUDA driver
(tools/triton_launch.py): no candidate Python runs there.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tools.task import TRITON_DIVISOR, KnobValue, Task

BUNDLE_FORMAT = "kloop-triton-1"
TRITON_SCHEME = "kloop-triton-build-2"  # bump when the Triton build recipe changes (part of the cache key)
BUNDLE_SUFFIX = ".triton.json"
MAX_SHARED = {90: 232448, 100: 232448, 80: 166912, 89: 101376}  # opt-in dynamic shared memory per block (B)
MAX_EXTRA_PARAMS = 2  # Triton >= 3.5 appends global-scratch and profile-scratch pointers to every kernel
ALLOWED_UNDEFINED = {".nv.reservedSmem.offset0"}  # ptxas's reserved shared-memory marker, in every cubin
# the only module-scope data Triton's cubins carry: libdevice's __nvvm_reflect("__CUDA_...") strings,
# resolved at compile time (no code refers to them: a relocation from the kernel's text to one is refused)
REFLECT_STRINGS = {b"__CUDA_FTZ\0", b"__CUDA_PREC_SQRT\0", b"__CUDA_PREC_DIV\0", b"__CUDA_ARCH\0"}


@functools.lru_cache(maxsize=None)
def triton_version() -> str | None:
    """The installed Triton's version (importlib.metadata: Triton itself is not imported), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None


def capability(arch: str) -> int:
    """sm_90a -> 90 (Triton picks sm_90a itself for capability 90)."""
    return int("".join(ch for ch in arch.removeprefix("sm_") if ch.isdigit()))


def variant_label(kernel: str, variant: dict) -> str:
    return kernel + ("[" + ",".join(f"{k}={v}" for k, v in variant.items()) + "]" if variant else "")


def jobs(task: Task, knobs: dict[str, KnobValue], src_root: Path) -> list[dict]:
    """Every compile of one build: each kernel x each combination of its variant constexprs, with the
    knobs' values for the constexprs named like a knob and for num_warps / num_stages."""
    from tools.triton_rules import kernel_params

    out = []
    for k in task.manifest.triton.kernels:
        rel = k.source or task.manifest.sources[0]
        params = kernel_params((src_root / rel).read_text(errors="replace"), k.name)
        cx_names = params[1] if params else []
        fixed = {n: v for n, v in k.constexprs.items() if not isinstance(v, list)}
        fixed.update({n: knobs[n] for n in cx_names if n in knobs})
        lists = {n: v for n, v in k.constexprs.items() if isinstance(v, list)}
        nw = knobs[k.num_warps] if isinstance(k.num_warps, str) else k.num_warps
        ns = knobs[k.num_stages] if isinstance(k.num_stages, str) else k.num_stages
        for combo in itertools.product(*lists.values()) if lists else [()]:
            variant = dict(zip(lists, combo))
            constexprs = {n: (variant | fixed)[n] for n in cx_names if n in (variant | fixed)}
            out.append({
                "id": len(out), "source": f"src/{rel}", "kernel": k.name, "variant": variant,
                "signature": {n: t.partition(":")[0] for n, t in k.signature.items()},
                "types": list(k.signature.values()), "params": list(k.signature),
                "divisible": [i for i, t in enumerate(k.signature.values()) if t.endswith(f":{TRITON_DIVISOR}")],
                "constexprs": constexprs, "num_warps": int(nw), "num_stages": int(ns),
                "capability": capability(task.manifest.arch),
            })
    return out


def compile_in_sandbox(task: Task, knobs: dict[str, KnobValue], work: Path, lib_name: str,
                       timeout: float | None) -> tuple[bool, str, list, list]:
    """Rules, then the sandboxed compile, then the bundle. Returns (ok, log, errors, kernels)."""
    from tools.build import CompileError, kernel_advisories, parse_ptxas, parse_ptxas_warnings, safe_log
    from tools.sandbox import minimal_env, wrap
    from tools.triton_rules import check_task_sources

    src = work / "src"
    hits = check_task_sources(task, src)
    if hits:
        return False, "", [CompileError(file=h.file, line=h.line or None, message=f"static rule: {h.reason}",
                                        context=[h.code]) for h in hits[:8]], []
    todo = jobs(task, knobs, src)
    (work / "out").mkdir()
    (work / "request.json").write_text(json.dumps({"capability": capability(task.manifest.arch), "jobs": todo}))
    shutil.copyfile(Path(__file__).with_name("triton_compile.py"), work / "triton_compile.py")
    env = minimal_env({"TRITON_CACHE_DIR": str(work / "triton-cache"), "TRITON_HOME": str(work),
                       "PYTHONDONTWRITEBYTECODE": "1", **_triton_path()}, home=work)
    argv = wrap([sys.executable, "-B", "-s", str(work / "triton_compile.py"), str(work / "request.json"), str(work / "out")],
                writable=[work], cwd=work, env=env)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=work, env=env,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return False, "", [CompileError(message=f"triton compile timed out after {timeout:.0f} s")], []
    raw = safe_log(proc.stdout + proc.stderr, src)
    records, errors, logs = [], [], []
    for job in todo:
        label = variant_label(job["kernel"], job["variant"])
        try:
            res = json.loads((work / "out" / f"{job['id']}.json").read_text())
        except (OSError, ValueError):
            errors.append(CompileError(message=f"{label}: the compile gave no result" + (f": {raw[-1500:]}" if raw else "")))
            continue
        if not res.get("ok"):
            file = job["source"].removeprefix("src/")
            line, diags = compiler_diagnostics(work / "out" / f"{job['id']}.stderr", src, file)
            message = f"{label}: {safe_log(str(res.get('error', '?')), src)}"
            errors.append(CompileError(file=file, line=line, message=message + (f": {diags[0]}" if diags else ""),
                                       context=diags[1:]))
            continue
        rec, problem = _record(job, res, work / "out")
        if problem:
            errors.append(CompileError(message=f"{label}: {problem}"))
            continue
        records.append(rec)
        logs.append(_ptxas_log(safe_log(str(res.get("ptxas_log", "")), src), job["kernel"], label))
    if errors:
        return False, raw, errors, []
    log = "\n".join(logs)
    shared = {r["label"]: r["shared"] for r in records}  # Triton's shared memory is dynamic: ptxas says 0
    kernels = [k.model_copy(update={"smem_bytes": shared.get(k.mangled, k.smem_bytes)})
               for k in kernel_advisories(parse_ptxas_warnings(log), parse_ptxas(log))]
    bundle = {"format": BUNDLE_FORMAT, "task": task.name, "triton": triton_version(), "arch": task.manifest.arch,
              "knobs": knobs, "kernels": records}
    (work / lib_name).write_text(json.dumps(bundle))
    return True, log, [], kernels


_MLIR_DIAG = re.compile(r"^(?P<file>\S+?):(?P<line>\d+):(?P<col>\d+): (?P<kind>error|warning|note|remark): (?P<msg>.+)$")
# MLIR's own words that say nothing of the kernel: the first line of every failed pipeline, and the reproducer
_GENERIC = ("Failures have been detected while processing an MLIR pass pipeline",)
MAX_DIAGNOSTICS = 4


def compiler_diagnostics(path: Path, src: Path, file: str) -> tuple[int | None, list[str]]:
    """(the source line, the diagnostics) a failed job's compiler wrote to its stderr about the task's `file`:
    MLIR's `FILE:LINE:COL: error|warning|note: ...` lines, the generic ones and the reproducer left out (a
    `PassManager::run failed` alone says nothing; "Pipeline failed while executing [`NVGPUWarpSpecialization`
    ...]" does). Data from the sandboxed compile: read capped, lines only about the task's own source,
    scrubbed like every build log."""
    from tools.build import safe_log

    try:
        with open(path, "rb") as f:
            text = f.read(256 * 1024).decode("utf-8", "replace")
    except OSError:
        return None, []
    own = (Path(src) / file).resolve()
    line_no, out = None, []
    for raw in text.splitlines():
        m = _MLIR_DIAG.match(raw.strip())
        if not m or not _resolves_to(m.group("file"), own):
            continue
        msg = m.group("msg").split(": reproducer generated at")[0].strip()
        if any(msg.startswith(g) for g in _GENERIC) or not msg:
            continue
        line_no = line_no or int(m.group("line"))
        item = safe_log(f"{m.group('kind')}: {msg}", src)[:400]
        if item not in out:
            out.append(item)
        if len(out) >= MAX_DIAGNOSTICS:
            break
    return line_no, out


def _resolves_to(named: str, resolved: Path) -> bool:
    try:
        return Path(named).resolve() == resolved
    except (OSError, RuntimeError, ValueError):
        return False


def _ptxas_log(log: str, kernel: str, label: str) -> str:
    """Triton's ptxas -v output in the form tools.build.parse_ptxas reads ("ptxas info", as nvcc prints
    it: Triton's bundled binary may call itself ptxas-blackwell), the kernel named by its variant."""
    import re

    log = re.sub(r"^ptxas[-\w]*\s+(info|warning|error|fatal)", r"ptxas \1", log, flags=re.M)
    return re.sub(r"(?<![\w$\[])" + re.escape(kernel) + r"(?![\w$\[])", label, log)


def _triton_path() -> dict[str, str]:
    """PYTHONPATH for the sandboxed compile when Triton is not in this interpreter's site-packages."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.origin:
        return {}
    return {"PYTHONPATH": str(Path(spec.origin).parent.parent)}


def _record(job: dict, res: dict, out: Path) -> tuple[dict, str | None]:
    """The launch record of one compiled variant, from the trusted job and the compile's data (validated)."""
    cubin = out / f"{job['id']}.cubin"
    ptx = out / f"{job['id']}.ptx"
    if not cubin.is_file() or not ptx.is_file():
        return {}, "the compile wrote no cubin"
    ints = {}
    for key in ("shared", "global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align"):
        v = res.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= (1 << 30):
            return {}, f"metadata {key} = {v!r} is not a size"
        ints[key] = v
    limit = MAX_SHARED.get(job["capability"])
    if limit and ints["shared"] > limit:
        return {}, f"needs {ints['shared']} B of shared memory per program; sm_{job['capability']} has {limit} B"
    if res.get("name") != job["kernel"]:
        return {}, f"the compiled kernel is named {res.get('name')!r}, not {job['kernel']!r}"
    n_ptx = ptx_param_count(ptx.read_text(errors="replace"), job["kernel"])
    extra = (n_ptx if n_ptx is not None else -1) - len(job["types"])
    if not 0 <= extra <= MAX_EXTRA_PARAMS:
        return {}, f"the kernel takes {n_ptx} parameters; its signature has {len(job['types'])}"
    data = cubin.read_bytes()
    return {
        "kernel": job["kernel"], "variant": job["variant"], "label": variant_label(job["kernel"], job["variant"]),
        "constexprs": job["constexprs"], "num_warps": job["num_warps"], "num_stages": job["num_stages"],
        "params": job["params"], "types": job["types"], "extra_params": extra, **ints,
        "cubin_file": f"out/{job['id']}.cubin", "cubin_sha256": hashlib.sha256(data).hexdigest(),
        "cubin": base64.b64encode(data).decode(),
    }, None


def ptx_param_count(ptx: str, name: str) -> int | None:
    """How many parameters the PTX entry `name` declares."""
    import re

    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    return None if m is None else len(re.findall(r"\.param\b", m.group(1)))


def load_bundle(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{path}: not a kloop Triton bundle (format {data.get('format')!r})")
    return data


def cubin_paths(lib: str | Path) -> list[tuple[str, Path]]:
    """(variant label, cubin file) of a bundle, for the SASS tools."""
    lib = Path(lib)
    return [(r["label"], lib.parent / r["cubin_file"]) for r in load_bundle(lib)["kernels"]]


def bundle_digest(lib: str | Path) -> str:
    """What a bundle runs: its launch records with the cubins' code sections (tools.build.code_digest's
    rule: comments, whitespace and debug line tables of the source do not count)."""
    from elftools.elf.elffile import ELFFile
    import io

    h = hashlib.sha256()
    for r in load_bundle(lib)["kernels"]:
        meta = {k: v for k, v in r.items() if k not in ("cubin", "cubin_sha256", "cubin_file")}
        h.update(json.dumps(meta, sort_keys=True).encode())
        for sec in ELFFile(io.BytesIO(base64.b64decode(r["cubin"]))).iter_sections():
            if sec.name.startswith((".text.", ".nv.constant", ".nv.shared", ".nv.global", ".nv.info")):
                h.update(sec.name.encode() + b"\0" + sec.data())
    return h.hexdigest()


# ---- the audit of what was built ----------------------------------------------------------------

def audit_triton_build(task: Task, build_dir: Path):
    """The audit of one Triton build: the static rules again on the sources that were built; the bundle
    holds exactly the declared kernels x variants, each cubin the one the compile wrote; in each cubin
    the only global function is its kernel, nothing is imported (no vprintf, no __assertfail, no
    external call), and no module-scope device variable exists (state that survives a call: an
    output cache), only libdevice's reflect string."""
    from tools.audit import AuditError, AuditReport, Finding
    from tools.triton_rules import check_task_sources

    build_dir = Path(build_dir)
    lib = build_dir / f"lib{task.name}{BUNDLE_SUFFIX}"
    if not lib.is_file():
        raise AuditError(f"{lib}: the bundle is missing")
    findings = [Finding(rule="source-rules", file=v.file, line=v.line or None, detail=f"`{v.code}`: {v.reason}")
                for v in check_task_sources(task, build_dir / "src")]
    bundle = load_bundle(lib)
    src = build_dir / "src"
    want = sorted(variant_label(j["kernel"], j["variant"]) for j in jobs(task, bundle.get("knobs", {}), src))
    have = sorted(r.get("label", "?") for r in bundle["kernels"])
    if want != have:
        findings.append(Finding(rule="kernels", file=lib.name, detail=f"the bundle holds {have}; the task declares {want}"))
    for r in bundle["kernels"]:
        data = base64.b64decode(r["cubin"])
        file = build_dir / r["cubin_file"]
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != r["cubin_sha256"] \
                or hashlib.sha256(data).hexdigest() != r["cubin_sha256"]:
            findings.append(Finding(rule="kernels", file=r["cubin_file"], detail="the cubin is not the one the compile wrote"))
        findings += cubin_findings(data, r["kernel"], r["cubin_file"])
    return AuditReport(ok=not findings, findings=findings, cubins=len(bundle["kernels"]))


def cubin_findings(data: bytes, kernel: str, where: str) -> list:
    """What a cubin holds beyond its one kernel (see audit_triton_build)."""
    import io

    from elftools.elf.elffile import ELFFile
    from tools.audit import Finding

    out = []
    try:
        elf = ELFFile(io.BytesIO(data))
        symtab = elf.get_section_by_name(".symtab")
        symbols = list(symtab.iter_symbols()) if symtab is not None else []
    except Exception as exc:  # pyelftools raises several kinds on a malformed file
        return [Finding(rule="kernels", file=where, detail=f"not a readable cubin: {exc}")]
    funcs = sorted(s.name for s in symbols if s["st_info"]["type"] == "STT_FUNC" and s["st_info"]["bind"] != "STB_LOCAL")
    if funcs != [kernel]:
        out.append(Finding(rule="kernels", file=where, detail=f"global functions {funcs}; the task declares only `{kernel}`"))
    for s in symbols:
        if s.name and s["st_shndx"] == "SHN_UNDEF" and s.name not in ALLOWED_UNDEFINED:
            out.append(Finding(rule="symbols", file=where, detail=f"imports `{s.name}` (device printf/assert or an external "
                                                                  "function: nothing outside the kernel may be called)"))
    for sec in elf.iter_sections():
        if sec.name.startswith(".nv.global") and sec.name != ".nv.global.init" and sec["sh_size"]:
            out.append(Finding(rule="device-state", file=where, detail=f"section {sec.name} ({sec['sh_size']} bytes): "
                                                                       "module-scope device memory survives between calls"))
    for s in symbols:
        if s["st_info"]["type"] != "STT_OBJECT" or not isinstance(s["st_shndx"], int):
            continue
        sec = elf.get_section(s["st_shndx"])
        if not sec.name.startswith(".nv.global"):
            continue
        blob = sec.data()[s["st_value"]:s["st_value"] + s["st_size"]] if sec["sh_type"] != "SHT_NOBITS" else b""
        if sec.name == ".nv.global.init" and s.name.startswith("_$_str") and blob in REFLECT_STRINGS:
            continue
        out.append(Finding(rule="device-state", file=where, detail=f"device variable `{s.name}` ({s['st_size']} bytes in "
                                                                   f"{sec.name}): state that survives between calls"))
    for sec in elf.iter_sections():  # code that refers to module-scope data (a reflect string used as state)
        if sec.name.startswith((".rela.text.", ".rel.text.")):
            for r in sec.iter_relocations():
                sym = symbols[r["r_info_sym"]] if r["r_info_sym"] < len(symbols) else None
                if sym is not None and isinstance(sym["st_shndx"], int) and \
                        elf.get_section(sym["st_shndx"]).name.startswith(".nv.global"):
                    out.append(Finding(rule="device-state", file=where, detail=f"the kernel refers to module-scope "
                                                                               f"device data `{sym.name}`"))
    return out
