"""Build a task's sources into one shared library, through a generated build.ninja.

Every build is keyed by a hash of what can change its output (the source files, flags, knobs,
target, arch and compiler version) and lives in its own folder of the build cache, so an unchanged
candidate never recompiles and two candidates never share objects. The sources are copied into
the build folder first: what is built is exactly what was hashed.

`ptxas -v` output is kept per object and parsed per kernel (registers, spills, shared memory,
stack, barriers); compile errors are trimmed to what a person needs.

The compiler runs in the sandbox (tools/sandbox.py: the build folder is all it can read or write
besides the toolchain, no network, a minimal environment), writes its dependency list (`-MD`) and a
preprocessed copy (`-E`) of every source beside the objects, for the audit of what was built
(tools/audit.py). Logs never show a file from outside the task: a diagnostic located in such a
file is withheld, and secrets are scrubbed (tools/secrets.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, Field

from tools.proc import demangle, find_program, tail
from tools.sandbox import minimal_env, wrap
from tools.secrets import scrub
from tools.task import KnobValue, Task

BUILD_SCHEME = "kloop-build-4"  # bump when the build recipe changes, to invalidate old cache entries
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".cuh", ".inc", ".inl")
MAX_ERRORS = 6


class CompileError(BaseModel):
    file: str | None = None
    line: int | None = None
    message: str
    context: list[str] = Field(default_factory=list)

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}: " if self.file and self.line else (f"{self.file}: " if self.file else "")
        body = f"{where}{self.message}"
        return "\n".join([body, *("    " + c for c in self.context)])


class KernelResources(BaseModel):
    name: str  # demangled where possible
    mangled: str
    arch: str | None = None
    registers: int | None = None
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    stack_bytes: int = 0
    smem_bytes: int = 0
    cmem_bytes: int = 0
    barriers: int | None = None
    # ptxas advisories about this kernel, shortened (e.g. "C7511 wgmma serialized: insufficient register resources")
    advisories: list[str] = Field(default_factory=list)
    # the register counts `setmaxnreg` sets in a warp-specialised kernel (from the SASS: USETMAXREG), low to high
    setmaxnreg: list[int] = Field(default_factory=list)


class BuildResult(BaseModel):
    ok: bool
    key: str
    lib: str | None = None
    build_dir: str
    cached: bool = False
    seconds: float = 0.0
    compiler: str = ""
    knobs: dict[str, KnobValue] = Field(default_factory=dict)
    errors: list[CompileError] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)  # ptxas performance warnings and the like
    kernels: list[KernelResources] = Field(default_factory=list)
    log_tail: str = ""  # the raw compiler output's end, for when parsing found nothing

    def error_text(self) -> str:
        if self.errors:
            return "\n".join(str(e) for e in self.errors)
        return self.log_tail


class BuildError(Exception):
    pass


# ---- toolchain --------------------------------------------------------------------------------

def _which(name: str) -> str | None:
    return shutil.which(name)  # PATH only: the host compiler and ninja


@functools.lru_cache(maxsize=None)
def compiler_version(target: str) -> str:
    """A one-line description of the compiler that builds `target` tasks (part of the cache key)."""
    if target == "triton":  # Triton bundles its own ptxas: its version is the compiler's
        from tools.triton_build import triton_version

        v = triton_version()
        return f"triton {v}" if v else "missing"
    exe = _nvcc() if target == "cuda" else _cxx()
    if exe is None:
        return "missing"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, env=minimal_env()).stdout.strip().splitlines()
    if target == "cuda":
        # "Cuda compilation tools, release 13.0, V13.0.88"
        release = next((l for l in out if "release" in l), out[-1] if out else "")
        return f"nvcc {release.split('release')[-1].strip(' ,')}" if "release" in release else release
    return out[0] if out else exe


def _nvcc() -> str | None:
    return find_program("nvcc")


def _cxx() -> str | None:
    return os.environ.get("CXX") or _which("c++") or _which("g++") or _which("clang++")


def _ninja() -> str:
    found = _which("ninja")
    if found:
        return found
    try:  # the `ninja` wheel ships the binary
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError as exc:  # pragma: no cover - ninja is a dependency
        raise BuildError("ninja is not installed (pip install ninja)") from exc


def cache_root() -> Path:
    root = os.environ.get("KLOOP_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kloop" / "builds"


# ---- what a build depends on ------------------------------------------------------------------

def build_inputs(task: Task, src_root: Path) -> list[str]:
    """Relative paths of the files a build reads: sources, editable files and headers."""
    wanted = set(task.manifest.sources)
    for p in src_root.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        rel = p.relative_to(src_root).as_posix()
        if task.is_editable(rel) or rel.endswith(HEADER_SUFFIXES):
            wanted.add(rel)
    return sorted(wanted)


def knob_defines(knobs: dict[str, KnobValue]) -> list[str]:
    out = []
    for name, value in sorted(knobs.items()):
        v = int(value) if isinstance(value, bool) else value
        out.append(f"-D{name}={v}")
    return out


def compile_flags(task: Task, knobs: dict[str, KnobValue], extra: list[str] | None = None) -> list[str]:
    m = task.manifest
    if m.target == "triton":  # no compiler flags: the kernels' launch and the knobs are what changes a build
        from tools.triton_build import TRITON_SCHEME

        return [TRITON_SCHEME, f"--arch={m.arch}", "--triton=" + m.triton.model_dump_json(), *knob_defines(knobs),
                *(extra or [])]
    if m.target == "cuda":
        arch = m.arch
        virtual = "compute_" + arch.removeprefix("sm_")
        return [
            f"-gencode=arch={virtual},code={arch}",
            "-Xptxas=-v",
            "-Xcompiler=-fPIC",
            *m.flags,
            *m.cuda_flags,
            *knob_defines(knobs),
            *(extra or []),
        ]
    return ["-fPIC", *m.flags, *m.cxx_flags, *knob_defines(knobs), *(extra or [])]


def build_key(task: Task, src_root: Path, knobs: dict[str, KnobValue], extra: list[str] | None = None) -> str:
    h = hashlib.sha256()
    parts = {
        "scheme": BUILD_SCHEME,
        "target": task.target,
        "compiler": compiler_version(task.target),
        "flags": compile_flags(task, knobs, extra),
        "sources": task.manifest.sources,
    }
    h.update(json.dumps(parts, sort_keys=True).encode())
    for rel in build_inputs(task, src_root):
        f = src_root / rel
        h.update(rel.encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()[:20]


# ---- the build itself -------------------------------------------------------------------------

def _ninja_file(task: Task, knobs: dict[str, KnobValue], lib_name: str, extra: list[str] | None) -> str:
    flags = " ".join(_quote(f) for f in compile_flags(task, knobs, extra))
    lines = [
        "ninja_required_version = 1.5",
        f"flags = {flags}",
        # the compiler's full output (ptxas -v included) goes to $out.log; on failure ninja shows it
        f"rule nvcc\n  command = {_quote(_nvcc() or 'nvcc')} $flags -MD -MF $out.d -c $in -o $out > $out.log 2>&1 || (cat $out.log; exit 1)\n  description = nvcc $in",
        f"rule cxx\n  command = {_quote(_cxx() or 'c++')} $flags -MD -MF $out.d -c $in -o $out > $out.log 2>&1 || (cat $out.log; exit 1)\n  description = c++ $in",
        # the preprocessed source, for the audit's source rules (tools/audit.py)
        f"rule nvcc_e\n  command = {_quote(_nvcc() or 'nvcc')} $flags -E $in -o $out > /dev/null 2>&1 || true\n  description = nvcc -E $in",
        f"rule cxx_e\n  command = {_quote(_cxx() or 'c++')} $flags -E $in -o $out > /dev/null 2>&1 || true\n  description = c++ -E $in",
    ]
    objs = []
    for src in task.manifest.sources:
        obj = f"obj/{src}.o"
        objs.append(obj)
        rule = "nvcc" if src.endswith(".cu") else "cxx"
        lines.append(f"build {_esc(obj)}: {rule} {_esc('src/' + src)}")
        lines.append(f"build {_esc(f'obj/{src}.i')}: {rule}_e {_esc('src/' + src)}")
    if task.target == "cuda":
        link = f"{_quote(_nvcc() or 'nvcc')} -shared $flags -o $out $in > $out.log 2>&1 || (cat $out.log; exit 1)"
    else:
        link = f"{_quote(_cxx() or 'c++')} -shared $flags -o $out $in > $out.log 2>&1 || (cat $out.log; exit 1)"
    lines.append(f"rule link\n  command = {link}\n  description = link $out")
    lines.append(f"build {lib_name}: link {' '.join(_esc(o) for o in objs)}")
    lines.append(f"default {lib_name} " + " ".join(_esc(f"obj/{src}.i") for src in task.manifest.sources))
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _esc(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def build(
    task: Task,
    knobs: dict[str, KnobValue] | None = None,
    src_root: Path | None = None,
    cache_dir: Path | None = None,
    timeout: float | None = None,
    extra_flags: list[str] | None = None,
) -> BuildResult:
    """Build `task` with its sources taken from `src_root` (default: the task folder).

    `knobs` are overrides on the task's current settings (validated against the manifest);
    `extra_flags` are for kloop's own instruments (the gate benchmark's test hooks, the sweep's
    validated `-DNAME=int` exploration constants), never a user's or a model's free text.
    """
    src_root = Path(src_root or task.root)
    knobs = task.resolve_knobs(knobs, folder=src_root)
    missing = [s for s in task.manifest.sources if not (src_root / s).is_file()]
    key = build_key(task, src_root, knobs, extra_flags)
    root = Path(cache_dir or cache_root())
    final = root / key
    lib_name = f"lib{task.name}.so" if task.target != "triton" else f"lib{task.name}.triton.json"
    if missing:
        return BuildResult(ok=False, key=key, build_dir=str(final), knobs=knobs,
                           errors=[CompileError(file=m, message="source file is missing") for m in missing])
    done = final / "build.json"
    if done.is_file():
        cached = BuildResult.model_validate_json(done.read_text())
        if not cached.ok or Path(cached.lib or "").is_file():
            return cached.model_copy(update={"cached": True, "seconds": 0.0})

    started = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    work = root / f"{key}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    (work / "src").mkdir(parents=True)
    for rel in build_inputs(task, src_root):
        dst = work / "src" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_root / rel, dst)
    compiler = compiler_version(task.target)
    if task.target == "triton" and compiler != "missing":
        return _build_triton(task, knobs, work, final, key, lib_name, compiler, started, timeout)
    (work / "obj").mkdir()
    for src in task.manifest.sources:
        (work / "obj" / src).parent.mkdir(parents=True, exist_ok=True)
    (work / "build.ninja").write_text(_ninja_file(task, knobs, lib_name, extra_flags))

    if compiler == "missing":
        shutil.rmtree(work, ignore_errors=True)
        what = {"cuda": "nvcc (the CUDA toolkit)", "triton": "triton (pip install 'kernel-loop[triton]')"}.get(
            task.target, "a C++ compiler")
        return BuildResult(ok=False, key=key, build_dir=str(final), knobs=knobs,
                           errors=[CompileError(message=f"{what} not found on PATH")])
    try:
        # in the sandbox: the build folder (the task's copy and the outputs) and the toolchain only
        argv = wrap([_ninja(), "-C", str(work)], writable=[work], cwd=work, env=minimal_env(home=work))
        # its own session: a first Ctrl-C at the terminal ("stop after this step") must not kill the build
        # under way; a second one raises here and subprocess.run kills it
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=work,
                              env=minimal_env(home=work), start_new_session=True)
        ninja_out = proc.stdout + proc.stderr
        ok = proc.returncode == 0
    except subprocess.TimeoutExpired:
        shutil.rmtree(work, ignore_errors=True)
        return BuildResult(ok=False, key=key, build_dir=str(final), knobs=knobs, compiler=compiler,
                           errors=[CompileError(message=f"build timed out after {timeout:.0f} s")])

    logs = "\n".join(p.read_text(errors="replace") for p in sorted((work / "obj").rglob("*.log")))
    link_log = work / f"{lib_name}.log"
    if link_log.is_file():
        logs += "\n" + link_log.read_text(errors="replace")
    logs, ninja_out = safe_log(logs, work / "src"), safe_log(ninja_out, work / "src")
    result = BuildResult(
        ok=ok,
        key=key,
        build_dir=str(final),
        compiler=compiler,
        knobs=knobs,
        seconds=round(time.monotonic() - started, 3),
        lib=str(final / lib_name) if ok else None,
        errors=[] if ok else parse_compile_errors(logs or ninja_out, work / "src"),
        warnings=(warnings := parse_ptxas_warnings(logs)),
        kernels=kernel_advisories(warnings, parse_ptxas(logs)) if task.target == "cuda" else [],
        log_tail=tail(logs or ninja_out, 3000),
    )
    if ok and task.target == "cuda" and _mentions_setmaxnreg(work):
        result.kernels = with_setmaxnreg(result.kernels, work / lib_name)
    (work / "build.json").write_text(result.model_dump_json(indent=1))
    try:
        work.rename(final)
    except OSError:  # another process finished the same build first: theirs is identical
        shutil.rmtree(work, ignore_errors=True)
    return result


def _build_triton(task: Task, knobs: dict[str, KnobValue], work: Path, final: Path, key: str, lib_name: str,
                  compiler: str, started: float, timeout: float | None) -> BuildResult:
    """A Triton task's build in `work` (its sources already copied): tools/triton_build.py, then the same
    caching as a C++ build."""
    from tools.triton_build import compile_in_sandbox

    ok, log, errors, kernels = compile_in_sandbox(task, knobs, work, lib_name, timeout)
    result = BuildResult(ok=ok, key=key, build_dir=str(final), compiler=compiler, knobs=knobs,
                         seconds=round(time.monotonic() - started, 3), lib=str(final / lib_name) if ok else None,
                         errors=errors, warnings=parse_ptxas_warnings(log), kernels=kernels, log_tail=tail(log, 3000))
    shutil.rmtree(work / "triton-cache", ignore_errors=True)
    (work / "build.json").write_text(result.model_dump_json(indent=1))
    try:
        work.rename(final)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return result


_DIAG = re.compile(r"^(?:In file included from |\s+from )?(?P<file>[^\s:(][^:(]*?)(?::\d+(?::\d+)?[:,]|\(\d+\):)")


def code_digest(lib: str | Path) -> str:
    """A digest of what a library runs: the contents of its loaded (SHF_ALLOC) sections, by name. Two
    sources that compile to the same code (a comment or whitespace apart) have the same digest; any
    change to instructions, constants or the embedded device code (.nv_fatbin) changes it."""
    from elftools.elf.constants import SH_FLAGS
    from elftools.elf.elffile import ELFFile

    if str(lib).endswith(".triton.json"):  # a Triton task's bundle: its launch records and cubins' code
        from tools.triton_build import bundle_digest

        return bundle_digest(lib)
    h = hashlib.sha256()
    with open(lib, "rb") as f:
        for sec in ELFFile(f).iter_sections():
            if sec["sh_flags"] & SH_FLAGS.SHF_ALLOC and sec["sh_type"] != "SHT_NOBITS" \
                    and sec.name != ".note.gnu.build-id":
                h.update(sec.name.encode() + b"\0" + sec.data())
    return h.hexdigest()


def safe_log(log: str, src_dir: Path) -> str:
    """Compiler output fit to show and record: a diagnostic located in a file outside the task's
    copy and the toolchain's include folders (an `#include "/etc/passwd"` outside the sandbox) is
    replaced by one line naming the file, without its text or the source lines quoted after it;
    secret values are scrubbed."""
    from tools.audit import toolchain_include_roots

    roots = (Path(src_dir).resolve(), *toolchain_include_roots())
    out, withhold = [], False
    for line in log.splitlines():
        m = _DIAG.match(line)
        if m and (line.startswith(("In file included", " ")) or ": " in line):
            f = Path(m.group("file"))
            p = f if f.is_absolute() else Path(src_dir).parent / f
            try:
                p = p.resolve()
            except OSError:
                pass
            if any(p.is_relative_to(r) for r in roots) or line.startswith(("In file included", " ")):
                withhold = False
                out.append(line)
            else:
                if not withhold:
                    out.append(f"{m.group('file')}: [diagnostics withheld: this file is outside the task]")
                withhold = True
        elif not withhold:
            out.append(line)
    return scrub("\n".join(out))


# ---- parsing compiler output ------------------------------------------------------------------

_NVCC_ERR = re.compile(r"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): (?P<kind>error|catastrophic error)[^:]*: (?P<msg>.*)$")
_GCC_ERR = re.compile(r"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:\d+:)? (?P<kind>error|fatal error): (?P<msg>.*)$")
_OTHER_ERR = re.compile(r"(ptxas (fatal|error)|nvlink error|undefined reference|ld: |collect2: error|error:)", re.I)


def parse_compile_errors(log: str, src_dir: Path) -> list[CompileError]:
    """The first errors with file:line (relative to the task folder) and a little context."""
    lines = log.splitlines()
    prefix = str(src_dir) + os.sep
    errors: list[CompileError] = []
    for i, line in enumerate(lines):
        m = _NVCC_ERR.match(line) or _GCC_ERR.match(line)
        if m:
            f = m.group("file").replace(prefix, "").removeprefix("src/")
            context = []
            for nxt in lines[i + 1 : i + 4]:  # nvcc and gcc both follow with the source line and a caret
                if _NVCC_ERR.match(nxt) or _GCC_ERR.match(nxt) or not nxt.strip():
                    break
                context.append(nxt.rstrip())
            errors.append(CompileError(file=f, line=int(m.group("line")), message=m.group("msg").strip(), context=context))
        elif _OTHER_ERR.search(line) and "error" in line.lower() and not line.startswith(("FAILED:", "ninja:")):
            errors.append(CompileError(message=line.replace(prefix, "").strip()))
        if len(errors) >= MAX_ERRORS:
            break
    return errors


_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")


def parse_ptxas(log: str) -> list[KernelResources]:
    """Per entry function: registers, spills, stack, smem, cmem[0], barriers from `ptxas -v`."""
    kernels: dict[str, KernelResources] = {}
    current: str | None = None  # the entry function the following "Used ..." line belongs to
    props_for: str | None = None  # the function the next stack/spill line belongs to
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
            kernels.setdefault(current, KernelResources(name=current, mangled=current, arch=m.group(2)))
        elif m := _PROPS.search(line):
            props_for = m.group(1)
        elif m := _FRAME.search(line):
            if props_for in kernels:
                k = kernels[props_for]
                k.stack_bytes, k.spill_store_bytes, k.spill_load_bytes = map(int, m.groups())
            props_for = None
        elif (m := _USED.search(line)) and current in kernels:
            k = kernels[current]
            k.registers = int(m.group(1))
            if b := _BARRIERS.search(line):
                k.barriers = int(b.group(1))
            if s := _SMEM.search(line):
                k.smem_bytes = int(s.group(1))
            if c := _CMEM.search(line):
                k.cmem_bytes = int(c.group(1))
    names = demangle([k.mangled for k in kernels.values()])
    return [k.model_copy(update={"name": names.get(k.mangled, k.mangled)}) for k in kernels.values()]


_CODE = re.compile(r"\((C\d{4})\)")


def shorten_advisory(line: str, mangled: str) -> str:
    """A ptxas warning about one kernel, in a few words: code first, prefixes and the name dropped."""
    text = re.sub(r"^.*?ptxas\s+(?:warning|info)\s*:\s*", "", line.strip())
    code = _CODE.search(text)
    text = _CODE.sub("", text)
    text = re.sub(r"Potential Performance Loss:\s*", "", text)
    text = re.sub(r"wgmma\.mma_async instructions are serialized(?: due to)?", "wgmma serialized:", text)
    text = re.sub(r"\s*(?:in|for)\s+(?:the\s+)?(?:entry\s+)?(?:function\s+)?'?" + re.escape(mangled) + r"'?", "", text)
    text = text.replace(mangled, "").strip(" .,:")
    text = re.sub(r"\s+", " ", text)
    text = f"{code.group(1)} {text}" if code else text
    return text if len(text) <= 110 else text[:107] + "..."


def kernel_advisories(warnings: list[str], kernels: list[KernelResources]) -> list[KernelResources]:
    """Each kernel with the ptxas warnings that name it (C75xx 'wgmma serialized ...', stack size,
    out-of-range launch bounds, ...), shortened; warnings naming no kernel stay general."""
    out = []
    for k in kernels:
        mine = [shorten_advisory(w, k.mangled) for w in warnings if k.mangled and re.search(
            r"(?<![\w$])" + re.escape(k.mangled) + r"(?![\w$])", w)]
        out.append(k.model_copy(update={"advisories": list(dict.fromkeys(mine))}))
    return out


def general_warnings(result: "BuildResult") -> list[str]:
    """The ptxas warnings that name none of the kernels (those are shown with their kernel)."""
    names = [k.mangled for k in result.kernels if k.mangled]
    return [w for w in result.warnings if not any(re.search(r"(?<![\w$])" + re.escape(n) + r"(?![\w$])", w) for n in names)]


def parse_ptxas_warnings(log: str) -> list[str]:
    seen: list[str] = []
    for line in log.splitlines():
        if "ptxas warning" in line or "Potential Performance Loss" in line or re.search(r"\(C7\d{3}\)", line):
            text = line.strip()
            if text not in seen:
                seen.append(text)
    return seen[:20]


def format_build(result: BuildResult) -> str:
    """A compact summary for people and agents."""
    if not result.ok:
        return f"build FAILED ({result.compiler}):\n{result.error_text()}"
    lines = [f"build ok{' (cached)' if result.cached else ''} in {result.seconds:.1f} s, {result.compiler}"]
    if result.knobs:
        lines.append("knobs: " + " ".join(f"{k}={v}" for k, v in result.knobs.items()))
    from tools.fmt import kernel_names

    # short unique names (no return type, namespaces or arguments), as the trailers and `sass` name them
    for k, short in zip(result.kernels, kernel_names([k.name for k in result.kernels])):
        spill = k.spill_store_bytes + k.spill_load_bytes
        lines.append(
            f"  {short}: {registers_text(k)}, {k.smem_bytes} B smem, {k.stack_bytes} B stack, "
            f"spills {k.spill_store_bytes}/{k.spill_load_bytes} B st/ld, barriers {k.barriers}"
            + ("  <-- SPILLS" if spill else ("  <-- local memory (stack)" if k.stack_bytes else ""))
        )
        if k.advisories:
            shown = "; ".join(k.advisories[:3]) + (f" (+{len(k.advisories) - 3} more)" if len(k.advisories) > 3 else "")
            lines.append(f"    ptxas: {shown}")
    for w in general_warnings(result):
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def _mentions_setmaxnreg(work: Path) -> bool:
    """Whether any preprocessed source asks for `setmaxnreg` (only then is the SASS read at build time)."""
    return any(b"setmaxnreg" in p.read_bytes() for p in (work / "obj").rglob("*.i"))


def with_setmaxnreg(kernels: list[KernelResources], lib: Path) -> list[KernelResources]:
    """The kernels with the register counts their `setmaxnreg` instructions set (from the SASS of the
    library: reading the binary, never running it); unchanged when the SASS cannot be read here."""
    from tools.sass import SassError, parse_sass, dump_sass

    try:
        sass = parse_sass(dump_sass(lib))
    except SassError:
        return kernels
    values = {k.mangled: k.summary.setmaxnreg for k in sass.values() if k.summary.setmaxnreg}
    return [k.model_copy(update={"setmaxnreg": values[k.mangled]}) if k.mangled in values else k for k in kernels]


def registers_text(k: KernelResources) -> str:
    """'31 regs', or for a warp-specialised kernel '168 regs at entry; setmaxnreg 40 / 232'."""
    if not k.setmaxnreg:
        return f"{k.registers} regs"
    return f"{k.registers} regs at entry; setmaxnreg {' / '.join(map(str, k.setmaxnreg))}"
