"""The task manifest (`task.toml`): what may change, how to build, which shapes, what tolerance.

A task is a folder holding `task.toml`, a read-only spec module (inputs, reference, the ctypes call,
FLOP/byte counts) and the kernel sources. Loading validates everything up front and fails with the
file, the field, the value and what was expected, so a broken manifest never reaches a build.
"""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

KnobValue = int | float | str | bool
MANIFEST = "task.toml"
# the session's knob settings, versioned beside the sources; absent means the manifest's defaults
KNOBS_FILE = "knobs.toml"
DEFAULT_CPU_MEMORY_LIMIT_GB = 8.0


class TaskError(Exception):
    """A task folder or manifest that cannot be used; the message names file, field and value."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Knob(Strict):
    values: list[KnobValue] = Field(min_length=1)
    default: KnobValue
    help: str = ""

    @model_validator(mode="after")
    def _default_allowed(self) -> "Knob":
        if self.default not in self.values:
            raise ValueError(f"default {self.default!r} is not one of the allowed values {self.values!r}")
        return self


class Shape(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    dims: dict[str, KnobValue]
    # strict: `bench = "yes"` (or "no", or 0) is an error, not a silent true (TOML has true/false)
    check: StrictBool = True
    bench: StrictBool = False
    weight: float = Field(default=1.0, gt=0)
    # largest slowdown this shape may show in a gate decision; None -> the task's max_regression
    max_regression: float | None = Field(default=None, ge=0, lt=1)

    def label(self) -> str:
        return self.name


class Tolerance(Strict):
    atol: float = Field(default=1e-5, ge=0)
    rtol: float = Field(default=1e-5, ge=0)
    # ||out - ref|| / ||ref||; None means only the element-wise bound applies
    norm_rtol: float | None = Field(default=None, ge=0)


class Forbidden(Strict):
    pattern: str  # a Python regular expression searched in every editable file
    reason: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        import re

        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return pattern


TRITON_TYPES = ("i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "fp16", "bf16", "fp32", "fp64")
TRITON_DIVISOR = 16  # the one divisibility a ":16" parameter promises (the runner checks it at every launch)


class TritonKernel(Strict):
    """One `@triton.jit` kernel of a `target = "triton"` task and how the trusted side launches it.

    `signature`: every non-constexpr parameter in the function's order, typed as Triton spells it
    ("*bf16", "i32", "fp32"); a ":16" suffix promises a pointer or integer divisible by 16 (compiled
    in as tt.divisibility, checked by the runner before every launch). Constexpr parameters get their
    value from a knob of the same name, or from `constexprs`: one value, or a list (one build per
    value, e.g. HEAD_DIM = [64, 128]; the spec picks the variant per call). `num_warps`/`num_stages`:
    an int or the name of a knob."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    source: str | None = None  # which of `sources` defines it (default: the first)
    signature: dict[str, str] = Field(min_length=1)
    constexprs: dict[str, KnobValue | list[KnobValue]] = Field(default_factory=dict)
    num_warps: int | str = 4
    num_stages: int | str = 3

    @field_validator("signature")
    @classmethod
    def _types(cls, sig: dict[str, str]) -> dict[str, str]:
        for param, ty in sig.items():
            base, _, div = ty.partition(":")
            if base.removeprefix("*") not in TRITON_TYPES or (div and div != str(TRITON_DIVISOR)):
                raise ValueError(f"parameter {param!r}: type {ty!r} is not one of {list(TRITON_TYPES)} "
                                 f"(a pointer: '*' first; divisibility: ':{TRITON_DIVISOR}' last)")
        return sig

    @field_validator("constexprs")
    @classmethod
    def _variants(cls, cx: dict) -> dict:
        for k, v in cx.items():
            if isinstance(v, list) and not v:
                raise ValueError(f"constexpr {k!r}: an empty list of variants")
        return cx


class TritonSection(Strict):
    kernels: list[TritonKernel] = Field(min_length=1)


class E2E(Strict):
    """A trusted end-to-end check (tools/e2e.py): a short training run of a small model with the
    candidate in place of its layer, against the same run with the spec's reference, judged on the
    loss curve. The script lives in the task folder and is read-only like the spec."""

    script: str = "e2e.py"
    # when the gate runs it: every accept, every N-th accept (the N-th judges all N changes together),
    # or only before `kloop export`
    when: str = Field(default="accept", pattern=r"^(accept|export|every:[1-9][0-9]*)$")
    steps: int = Field(default=40, ge=2, le=100_000)
    last: int = Field(default=10, ge=1)  # the verdict compares the mean loss over the last `last` steps
    bound: float = Field(default=0.01, gt=0, lt=1)  # |mean_cand - mean_ref| <= bound * |mean_ref|
    # any loss above `diverge` times the reference run's first loss: diverged
    diverge: float = Field(default=4.0, gt=1)
    timeout_s: float = Field(default=300, gt=0)

    @model_validator(mode="after")
    def _window(self) -> "E2E":
        if self.last > self.steps:
            raise ValueError(f"last = {self.last} is more than steps = {self.steps}")
        return self

    def every(self) -> int | None:
        """N of `every:N` (1 for `accept`), None for `export`."""
        if self.when == "export":
            return None
        return 1 if self.when == "accept" else int(self.when.split(":", 1)[1])


class CheckPlan(Strict):
    """Long checks: the agent's `check` tool runs the quick set, the gate the long one. Unset lists
    mean every shape with check = true; unset rounds mean the gate's configured rounds (2)."""

    quick: list[str] | None = None
    gate: list[str] | None = None
    quick_rounds: int | None = Field(default=None, ge=1, le=64)
    gate_rounds: int | None = Field(default=None, ge=1, le=64)


class Manifest(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    target: Literal["cuda", "cpu", "triton"]
    arch: str = Field(default="sm_90a", pattern=r"^sm_\d+[a-z]?$")
    spec: str = "spec.py"
    sources: list[str] = Field(min_length=1)
    editable: list[str] = Field(min_length=1)
    flags: list[str] = Field(default_factory=list)
    # extra flags per compiler; `flags` goes to both
    cuda_flags: list[str] = Field(default_factory=list)
    cxx_flags: list[str] = Field(default_factory=list)
    knobs: dict[str, Knob] = Field(default_factory=dict)
    shapes: list[Shape] = Field(min_length=1)
    tolerance: Tolerance = Tolerance()
    # per-output overrides, e.g. [tolerance_for.lse]
    tolerance_for: dict[str, Tolerance] = Field(default_factory=dict)
    forbidden: list[Forbidden] = Field(default_factory=list)
    # undefined symbols the task's object files may import beyond the target's allow-list
    # (tools/audit.py), as names or shell-style patterns: e.g. ["cudaMalloc", "cudaFree"]
    allowed_symbols: list[str] = Field(default_factory=list)
    min_gain: float = Field(default=0.01, ge=0, lt=1)
    max_regression: float = Field(default=0.03, ge=0, lt=1)
    timeout_s: float = Field(default=300, gt=0)
    # host memory one evaluation worker may use (GiB), applied as RLIMIT_DATA (private writable memory:
    # heap, anonymous mmaps). None: 8 GiB for CPU tasks; for CUDA tasks no limit unless set here, since
    # the CUDA driver's address-space reservations must not be refused (RLIMIT_DATA does not count them,
    # but this is not yet measured on a GPU).
    memory_limit_gb: float | None = Field(default=None, gt=0)
    # which unit the FLOPs run on, for the roofline: its peak rate comes from agent/briefing.py
    compute_unit: Literal["fp32", "bf16_tensor", "fp8_tensor", "fp64"] = "fp32"
    # target = "triton": the kernels and their launch (required there, refused elsewhere)
    triton: TritonSection | None = None
    check: CheckPlan = CheckPlan()
    e2e: E2E | None = None
    # CPU tasks: threads a kernel may run (the calling one included). Above 1 the build may start threads
    # (tools/audit.THREAD_SYMBOLS, the thread source rule lifted) and the timing reads the judge's wall
    # clock around each call instead of the runner's CPU time (tools/remote.py)
    threads: int = Field(default=1, ge=1, le=256)

    @field_validator("allowed_symbols")
    @classmethod
    def _symbol_names(cls, names: list[str]) -> list[str]:
        import re

        for name in names:
            if not re.fullmatch(r"[A-Za-z_.$*?\[\]][A-Za-z0-9_.$*?\[\]@]*", name) or name.strip("*?") == "":
                raise ValueError(f"{name!r} is not a symbol name or a pattern naming some (e.g. 'cudaMalloc', 'cudaMemcpy*')")
        return names

    @field_validator("knobs", mode="before")
    @classmethod
    def _knob_shorthand(cls, knobs: Any) -> Any:
        # `NAME = [a, b, c]` is shorthand for values = [a, b, c], default = a
        if isinstance(knobs, dict):
            return {
                k: ({"values": v, "default": v[0]} if isinstance(v, list) and v else v) for k, v in knobs.items()
            }
        return knobs

    @field_validator("knobs")
    @classmethod
    def _knob_names(cls, knobs: dict[str, Knob]) -> dict[str, Knob]:
        import re

        for name in knobs:
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
                raise ValueError(f"knob name {name!r} must be an upper-case C identifier (it becomes -D{name}=...)")
        return knobs

    @model_validator(mode="after")
    def _shapes_sane(self) -> "Manifest":
        names = [s.name for s in self.shapes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"shape names repeat: {dupes}")
        if not any(s.check for s in self.shapes):
            raise ValueError("no shape has check = true: a task must be checked on at least one shape")
        if not any(s.bench for s in self.shapes):
            raise ValueError("no shape has bench = true: a task must be timed on at least one shape")
        if (self.target == "triton") != (self.triton is not None):
            raise ValueError("a [triton] section (the kernels and their launch) is required for target = 'triton' "
                             "and only there")
        for k in self.triton.kernels if self.triton else []:
            for field, v in (("num_warps", k.num_warps), ("num_stages", k.num_stages)):
                if isinstance(v, str) and v not in self.knobs:
                    raise ValueError(f"triton kernel {k.name!r}: {field} = {v!r} is neither an int nor a knob name")
                if isinstance(v, str) and not all(isinstance(x, int) and x > 0 for x in self.knobs[v].values):
                    raise ValueError(f"triton kernel {k.name!r}: knob {v} ({field}) must take positive ints")
                if isinstance(v, int) and v <= 0:
                    raise ValueError(f"triton kernel {k.name!r}: {field} must be positive")
            if k.source is not None and k.source not in self.sources:
                raise ValueError(f"triton kernel {k.name!r}: source {k.source!r} is not one of sources {self.sources}")
            both = sorted(set(k.constexprs) & set(self.knobs))
            if both:
                raise ValueError(f"triton kernel {k.name!r}: constexprs {both} are knobs too; a knob sets its constexpr")
        for field in ("quick", "gate"):
            listed = getattr(self.check, field)
            if listed is None:
                continue
            if not listed:
                raise ValueError(f"check.{field} is empty: list shape names, or leave it out (every check shape)")
            unknown = [n for n in listed if n not in names]
            if unknown:
                raise ValueError(f"check.{field} names shapes the manifest does not define: {unknown} (shapes: {names})")
        if self.threads > 1 and self.target != "cpu":
            raise ValueError(f"threads = {self.threads}: only CPU tasks may allow threads (target is {self.target!r})")
        return self


class Task:
    """A loaded, validated task folder."""

    def __init__(self, root: Path, manifest: Manifest):
        self.root = root
        self.manifest = manifest

    # -- identity -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def target(self) -> str:
        return self.manifest.target

    @property
    def on_gpu(self) -> bool:
        """Whether the task's kernels run on a CUDA GPU (CUDA C++ and Triton tasks)."""
        return self.target in ("cuda", "triton")

    @property
    def spec_path(self) -> Path:
        return self.root / self.manifest.spec

    @property
    def memory_limit_bytes(self) -> int | None:
        """The worker's memory limit (see Manifest.memory_limit_gb); None: unlimited."""
        gb = self.manifest.memory_limit_gb
        if gb is None:
            gb = DEFAULT_CPU_MEMORY_LIMIT_GB if not self.on_gpu else None
        return int(gb * 2**30) if gb else None

    # -- shapes --------------------------------------------------------------------------------
    @property
    def check_shapes(self) -> list[Shape]:
        return [s for s in self.manifest.shapes if s.check]

    @property
    def bench_shapes(self) -> list[Shape]:
        return [s for s in self.manifest.shapes if s.bench]

    def check_plan(self, which: Literal["quick", "gate"]) -> tuple[list[Shape], int | None]:
        """The shapes and rounds (None: the caller's default) of the agent's quick check or the gate's
        check (manifest [check]; unset: every check shape). The quick set defaults to the gate's."""
        plan = self.manifest.check
        names = plan.gate if which == "gate" or plan.quick is None else plan.quick
        rounds = plan.gate_rounds if which == "gate" else (plan.quick_rounds or plan.gate_rounds)
        return ([self.shape(n) for n in names] if names is not None else self.check_shapes), rounds

    @property
    def e2e_path(self) -> Path | None:
        return self.root / self.manifest.e2e.script if self.manifest.e2e else None

    def trusted_files(self) -> list[str]:
        """Task-relative files the gate trusts and no candidate may change: the spec, the e2e script."""
        out = [self.manifest.spec]
        if self.manifest.e2e:
            out.append(self.manifest.e2e.script)
        return out

    def shape(self, name: str) -> Shape:
        for s in self.manifest.shapes:
            if s.name == name:
                return s
        raise TaskError(f"{self.root / MANIFEST}: no shape named {name!r} (have {[s.name for s in self.manifest.shapes]})")

    def tolerance(self, output: str) -> Tolerance:
        return self.manifest.tolerance_for.get(output, self.manifest.tolerance)

    def allowance(self, shape: Shape) -> float:
        return self.manifest.max_regression if shape.max_regression is None else shape.max_regression

    # -- files ---------------------------------------------------------------------------------
    def is_editable(self, relpath: str) -> bool:
        """True when `relpath` (relative to the task folder, '/'-separated) matches an editable glob."""
        rel = relpath.replace("\\", "/")
        return any(fnmatch.fnmatchcase(rel, pat) for pat in self.manifest.editable)

    def editable_files(self, root: Path | None = None) -> list[str]:
        base = root or self.root
        found = []
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.is_symlink():
                rel = p.relative_to(base).as_posix()
                if self.is_editable(rel):
                    found.append(rel)
        return found

    # -- knobs ---------------------------------------------------------------------------------
    def knob_defaults(self) -> dict[str, KnobValue]:
        return {k: v.default for k, v in self.manifest.knobs.items()}

    def knob_settings(self, folder: Path | None = None) -> dict[str, KnobValue]:
        """The knob values in force for the task copy in `folder`: defaults, then its knobs.toml."""
        knobs = self.knob_defaults()
        path = Path(folder or self.root) / KNOBS_FILE
        if path.is_file():
            try:
                saved = tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise TaskError(f"{path}: not valid TOML: {exc}") from None
            knobs.update(self._validated(saved, path))
        return knobs

    def resolve_knobs(self, overrides: dict[str, Any] | None = None, folder: Path | None = None) -> dict[str, KnobValue]:
        """The settings in force (see knob_settings) updated with `overrides`.

        Each override must name a knob and an allowed value; strings (from the command line) are
        matched against the allowed values' text.
        """
        knobs = self.knob_settings(folder)
        knobs.update(self._validated(overrides or {}, self.root / MANIFEST))
        return knobs

    def _validated(self, settings: dict[str, Any], where: Path) -> dict[str, KnobValue]:
        knobs: dict[str, KnobValue] = {}
        for name, raw in settings.items():
            if name not in self.manifest.knobs:
                raise TaskError(f"{where}: unknown knob {name!r} (knobs: {sorted(self.manifest.knobs)})")
            allowed = self.manifest.knobs[name].values
            value = _match_knob_value(raw, allowed)
            if value is None:
                raise TaskError(f"{where}: knob {name}={raw} is not allowed (allowed values: {allowed})")
            knobs[name] = value
        return knobs

    def write_knob_settings(self, folder: Path, knobs: dict[str, KnobValue]) -> Path:
        """Save the settings that differ from the defaults into folder/knobs.toml (removed when none)."""
        path = Path(folder) / KNOBS_FILE
        changed = {k: v for k, v in self._validated(knobs, path).items() if v != self.manifest.knobs[k].default}
        if not changed:
            path.unlink(missing_ok=True)
            return path
        lines = ["# knob settings chosen by kloop sessions (values must be allowed by task.toml)"]
        for k, v in sorted(changed.items()):
            lines.append(f"{k} = {_toml_value(v)}")
        path.write_text("\n".join(lines) + "\n")
        return path

    def knob_space_size(self) -> int:
        n = 1
        for k in self.manifest.knobs.values():
            n *= len(k.values)
        return n

    def __repr__(self) -> str:
        return f"Task({self.name!r}, {self.target}, {self.root})"


def _toml_value(v: KnobValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def _match_knob_value(raw: Any, allowed: list[KnobValue]) -> KnobValue | None:
    for v in allowed:
        if raw == v and type(raw) is type(v):
            return v
    text = str(raw).strip().lower()
    for v in allowed:
        if str(v).lower() == text:
            return v
    return None


def _field_name(loc: tuple, data: Any) -> str:
    """`shapes[6] "sq192".dims.m` for pydantic's ('shapes', 6, 'dims', 'm'): TOML's own spelling, and a
    list entry named by its `name` where it has one (a shape is found by its name, not by counting)."""
    out, node = "", data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                out += f' "{node["name"]}"'
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "(top level)"


def _format_validation_error(path: Path, exc: ValidationError, data: Any = None) -> str:
    lines = [f"{path}: invalid manifest"]
    for err in exc.errors():
        loc = _field_name(tuple(err["loc"]), data)
        value = err.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not a manifest field; check the spelling)"
        elif err["type"] == "missing":
            msg = "required field is missing"
            shown = ""
        elif err["type"] == "value_error":
            # our own validators' words without pydantic's prefix; the value only where it is a scalar the
            # message does not already name (never a whole table)
            msg = str(err.get("ctx", {}).get("error", msg.removeprefix("Value error, ")))
            if isinstance(value, (dict, list)) or repr(value) in msg:
                shown = ""
        lines.append(f"  field {loc}: {msg}" + (f" (got {shown})" if shown else ""))
    return "\n".join(lines)


def load_task(path: str | Path) -> Task:
    """Load and validate the task in folder `path` (or the `task.toml` file itself)."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == MANIFEST:
        p = p.parent
    manifest_path = p / MANIFEST
    if not p.is_dir():
        raise TaskError(f"{p}: no such task folder")
    if not manifest_path.is_file():
        raise TaskError(f"{p}: not a task folder (no {MANIFEST} in it)")
    try:
        data = tomllib.loads(manifest_path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{manifest_path}: not valid TOML: {exc}") from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        raise TaskError(_format_validation_error(manifest_path, exc, data)) from None

    root = p.resolve()
    e2e_rel = [manifest.e2e.script] if manifest.e2e else []
    for field, rels in (("spec", [manifest.spec]), ("sources", manifest.sources), ("e2e.script", e2e_rel)):
        for rel in rels:
            f = (root / rel).resolve()
            if not f.is_relative_to(root):
                raise TaskError(f"{manifest_path}: field {field}: {rel!r} points outside the task folder")
            if not f.is_file():
                raise TaskError(f"{manifest_path}: field {field}: file {rel!r} does not exist in {root}")
    task = Task(root, manifest)
    if task.is_editable(manifest.spec) or task.is_editable(MANIFEST) or any(task.is_editable(r) for r in e2e_rel):
        raise TaskError(
            f"{manifest_path}: field editable: {manifest.editable} matches the spec, the e2e script or the "
            "manifest, which must stay read-only (the gate trusts them)"
        )
    if e2e_rel and not e2e_rel[0].endswith(".py"):
        raise TaskError(f"{manifest_path}: field e2e.script: {e2e_rel[0]!r} must be a Python file (.py)")
    for src in manifest.sources:
        suffix = Path(src).suffix
        if (suffix == ".py") != (manifest.target == "triton"):
            raise TaskError(f"{manifest_path}: field sources: {src!r}: a triton task's sources are .py files, "
                            "and only a triton task's")
        if suffix == ".py":
            continue
        if suffix not in (".cu", ".cpp", ".cc", ".cxx", ".c"):
            raise TaskError(f"{manifest_path}: field sources: {src!r} has suffix {suffix!r}; expected .cu, .cpp, .cc, .cxx or .c")
        if suffix == ".cu" and manifest.target != "cuda":
            raise TaskError(f"{manifest_path}: field sources: {src!r} is CUDA but target is {manifest.target!r}")
    return task


def find_tasks(root: Path) -> list[Path]:
    """Task folders under `root` (folders holding a task.toml), sorted."""
    return sorted(p.parent for p in root.glob(f"*/{MANIFEST}"))
