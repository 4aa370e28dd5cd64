"""Audit what was built, not only the source: the gate runs this after a successful build.

Source regexes alone are not a boundary (token pasting, names built by macros, inline asm, computed
includes all got past them), so the gate also looks at what the compiler read and produced:

- **undefined symbols** of the task's own object files (`obj/*.o` of the build folder, not the final
  .so, whose statically linked CUDA runtime imports fopen, mprotect, pthread_*) must be on the
  target's allow-list (+ the manifest's `allowed_symbols`): a kernel that calls fopen, getenv,
  pthread_create, cudaStreamCreate or dl_iterate_phdr, however the name was spelled, imports it;
- **no syscall instructions** (`syscall`, `sysenter`, `int 0x80`) in the task's host code;
- **no load-time code of its own**: no .init_array/.ctors/.preinit_array/.fini_array entries,
  except, for CUDA targets, the one registration constructor nvcc emits (`__sti____cudaRegisterAll`);
- **headers read** (the compiler's `-MD` list): inside the task's source copy or the toolchain's
  include folders only (closes `#include "/etc/passwd"` and computed includes);
- **the source rules on preprocessed text** (`-E`, only the lines that come from the task's files),
  plus flag overrides: `#pragma GCC optimize/target`, `#pragma clang`, `__attribute__((optimize/
  target/constructor/ifunc))`, `[[gnu::optimize]]`.

Every finding names the file (and the line, where one is known), the rule and what was found.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel, Field

from tools.sandbox import minimal_env

# ---- the source rules (also applied to raw sources by the gate's static stage) -----------------

# lifted where the manifest allows threads (`threads` > 1: tools/remote.py then times the wall clock)
THREAD_RULE = (r"\bstd::(thread|jthread|async)\b|\bpthread_create\b",
               "no background threads (the manifest's `threads` allows them): work outside the call skews the timing")

STREAM_RULE = (r"\bcudaStreamCreate\w*|\bcudaStreamPerThread\b|\bcudaLaunchHostFunc\b|\bcudaStreamAddCallback\b",
               "work must run on the stream the harness passes in: other streams escape the timing")
DRIVER_STREAM_RULE = (r"\bcuStreamCreate\w*|\bcuLaunch\w*",
                      "no driver-API streams: work outside the call (or beside the other build) skews the timing")
CUDA_ONLY_RULES = (STREAM_RULE, DRIVER_STREAM_RULE)  # a CPU build has no CUDA headers and links no CUDA symbol

SOURCE_RULES: list[tuple[str, str]] = [
    STREAM_RULE,
    (r"\b(dlopen|dlsym|popen|system|fork|execv|execl|execvp|syscall)\s*\(",
     "a kernel library must not load other code or start processes"),
    THREAD_RULE,
    DRIVER_STREAM_RULE,
    (r"\b(fopen|ifstream|ofstream|mmap|openat|open|creat)\s*\(|\b(ifstream|ofstream)\b|std::filesystem|/proc/",
     "a kernel library must not read or write files (the harness's files included)"),
    (r"__attribute__\s*\(\([^;{]*?\b(constructor|destructor|ifunc|init_priority)\b|\.incbin\b|\bgnu::(constructor|destructor)\b",
     "no code at load time and no embedded files"),
    (r"#\s*include\s*[<\"](/|[^>\"]*\.\./)",
     "includes must stay inside the task folder"),
    (r"#\s*pragma\s+(GCC\s+(optimize|target|push_options|pop_options)|clang\b|optimize\b|nv_(?!diag)|nvcc\b)|\b_Pragma\s*\(",
     "no flag overrides: the manifest's flags are the build's flags"),
    (r"__attribute__\s*\(\([^;{]*?\b(optimize|target|target_clones|__optimize__|__target__)\b|\bgnu::(optimize|target|target_clones)\b",
     "no flag overrides: the manifest's flags are the build's flags"),
]

# ---- the symbol allow-lists ---------------------------------------------------------------------

_MATH = ("acos asin atan atan2 cos sin tan cosh sinh tanh acosh asinh atanh exp exp2 expm1 exp10 log log2 log10 "
         "log1p logb pow sqrt cbrt hypot erf erfc tgamma lgamma ceil floor trunc round lround llround rint lrint "
         "llrint nearbyint fmod remainder remquo fma fmax fmin fdim fabs frexp ldexp modf scalbn scalbln ilogb "
         "nextafter copysign nan sincos").split()
CPU_SYMBOLS = (
    [f"{m}{s}" for m in _MATH for s in ("", "f", "l")] + [f"__{m}_finite" for m in _MATH]
    + ["memcpy", "memmove", "memset", "memcmp", "abs", "labs", "llabs", "malloc", "calloc", "realloc", "free",
       "aligned_alloc", "posix_memalign", "__memcpy_chk", "__memset_chk", "__memmove_chk", "__stack_chk_fail",
       "_Znwm", "_Znam", "_ZdlPv", "_ZdaPv", "_ZdlPvm", "_ZdaPvm", "_ZnwmSt11align_val_t", "_ZnamSt11align_val_t",
       "_ZdlPvSt11align_val_t", "_ZdaPvSt11align_val_t", "_ZdlPvmSt11align_val_t", "_ZdaPvmSt11align_val_t",
       "_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t",
       "__cxa_guard_acquire", "__cxa_guard_release", "__cxa_guard_abort", "__gxx_personality_v0", "_Unwind_Resume",
       "__cxa_begin_catch", "__cxa_end_catch", "__cxa_rethrow", "__cxa_allocate_exception", "__cxa_free_exception",
       "__cxa_throw", "__cxa_pure_virtual", "_ZSt9terminatev", "__dso_handle",
       "_ZSt*__throw_*",  # std::__throw_length_error & co. (vector, string)
       "__*[23]",  # libgcc arithmetic helpers (__divti3, __popcountdi2, __mulsc3, ...)
       "_GLOBAL_OFFSET_TABLE_"]
)
CUDA_SYMBOLS = CPU_SYMBOLS + [
    "__cudaRegisterFatBinary", "__cudaRegisterFatBinaryEnd", "__cudaRegisterFunction", "__cudaRegisterVar",
    "__cudaRegisterManagedVar", "__cudaRegisterSurface", "__cudaRegisterTexture", "__cudaUnregisterFatBinary",
    "__cudaInitModule", "__cudaPushCallConfiguration", "__cudaPopCallConfiguration", "__cudaLaunchKernel",
    "__cudaLaunchKernel_ptsz", "__cudaGetKernel", "atexit",  # nvcc's registration and launch stubs
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel", "cudaGetLastError",
    "cudaPeekAtLastError", "cudaGetErrorString", "cudaGetErrorName", "cudaGetDevice", "cudaDeviceGetAttribute",
    "cudaFuncSetAttribute", "cudaFuncGetAttributes", "cudaFuncSetCacheConfig", "cudaFuncSetSharedMemConfig",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessor", "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
    "cudaOccupancyMaxPotentialClusterSize", "cudaOccupancyMaxActiveClusters", "cudaMemsetAsync",
    "cudaGetFuncBySymbol", "cudaGetKernel",
    # TMA: pure functions of the driver that fill a 128-byte tensor map in host memory (no stream, no
    # allocation, no state). The runner puts the driver in the global scope before the library loads
    # (tools/libhost.py) so these resolve; cudaGetDriverEntryPoint stays off: it would hand out every
    # driver function without an import.
    "cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col", "cuTensorMapReplaceAddress",
]
TARGET_SYMBOLS = {"cpu": CPU_SYMBOLS, "cuda": CUDA_SYMBOLS}
# what std::thread / pthreads import, allowed where the manifest's `threads` > 1 (CPU tasks)
THREAD_SYMBOLS = ["pthread_create", "pthread_join", "pthread_self", "pthread_equal", "pthread_once",
                  "pthread_attr_*", "pthread_mutex_*", "pthread_cond_*", "pthread_barrier_*", "pthread_spin_*",
                  "pthread_key_*", "pthread_getspecific", "pthread_setspecific", "__pthread_key_create",
                  "sched_yield", "get_nprocs", "_ZNSt6thread*", "_ZTINSt6thread6_StateE", "_ZTVNSt6thread6_StateE",
                  "_ZNSt15__exception_ptr*", "_ZSt9terminatev", "_ZSt17__throw_system_errori",
                  "__once_proxy", "__once_callable", "__once_call", "_ZSt15__once_callable", "_ZSt11__once_call",
                  "_ZTVN10__cxxabiv120__si_class_type_infoE", "_ZTVN10__cxxabiv117__class_type_infoE"]  # the thread state's RTTI


def source_rules(threads: int = 1, target: str = "cuda") -> list[tuple[str, str]]:
    """The source rules for a task allowing `threads` threads (above 1: the thread rule lifted); a CPU
    task's list leaves out the CUDA stream rules (its briefing lists only what can apply to it)."""
    return [r for r in SOURCE_RULES if (threads <= 1 or r is not THREAD_RULE)
            and (target != "cpu" or r not in CUDA_ONLY_RULES)]

CUDA_REGISTRATION = "__sti____cudaRegisterAll"
LOAD_TIME_SECTIONS = (".init_array", ".ctors", ".preinit_array", ".fini_array", ".dtors")
_SYSCALL_INSN = re.compile(r"\t(syscall|sysenter|int\s+\$0x80)\b")


class Finding(BaseModel):
    rule: str  # symbols | syscall | load-time | headers | preprocessed
    file: str  # relative to the task folder where it is a task file
    line: int | None = None
    detail: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: [{self.rule}] {self.detail}"


class AuditReport(BaseModel):
    ok: bool
    findings: list[Finding] = Field(default_factory=list)
    objects: int = 0
    headers: int = 0
    cubins: int = 0  # a Triton build's: its kernels' cubins (no host objects, no headers)

    def reason(self, limit: int = 6) -> str:
        shown = "; ".join(str(f) for f in self.findings[:limit])
        more = len(self.findings) - limit
        return shown + (f"; and {more} more" if more > 0 else "")


class AuditError(Exception):
    pass


# ---- the audit ---------------------------------------------------------------------------------

def audit_build(build_dir: Path, target: str, *, sources: list[str], allowed_symbols: list[str] = (),
                extra_rules: list[tuple[str, str]] = (), threads: int = 1) -> AuditReport:
    """Audit the build folder of tools/build.py: src/ = the task's copy; obj/<source>.o its objects,
    obj/<source>.o.d the compiler's dependency lists, obj/<source>.i the preprocessed sources.
    `extra_rules`: (pattern, reason) of the manifest's `forbidden`, applied to preprocessed text too."""
    build_dir = Path(build_dir)
    src_dir = (build_dir / "src").resolve()
    findings: list[Finding] = []
    objects = 0
    allowed = list(TARGET_SYMBOLS[target]) + list(allowed_symbols)
    for src in sources:
        obj = build_dir / "obj" / f"{src}.o"
        if not obj.is_file():
            raise AuditError(f"{obj}: object file missing (built with an older recipe?)")
        objects += 1
        text = _source_text(src_dir / src)
        findings += undefined_symbol_findings(obj, src, allowed, text, target)
        findings += syscall_findings(obj, src)
        findings += load_time_findings(obj, src, target)
    deps = dependency_findings(build_dir, src_dir, sources)
    findings += deps[0]
    for src in sources:
        pre = build_dir / "obj" / f"{src}.i"
        if not pre.is_file():
            raise AuditError(f"{pre}: the preprocessed source is missing")
        findings += preprocessed_findings(pre.read_text(errors="replace"), src_dir, [*source_rules(threads, target), *extra_rules])
    return AuditReport(ok=not findings, findings=_dedup(findings), objects=objects, headers=deps[1])


def audit_task_build(task, build_dir: Path) -> AuditReport:
    """The gate's audit of one build of `task` (a tools.task.Task): the target's allow-list plus the
    manifest's `allowed_symbols`, the source rules plus the manifest's `forbidden`. The one function
    the gate, `kloop eval` and the agent's build tool share. AuditError when it cannot be done."""
    m = task.manifest
    if m.target == "triton":  # cubins and the bundle, not ELF objects of a host library
        from tools.triton_build import audit_triton_build

        return audit_triton_build(task, Path(build_dir))
    threads = getattr(m, "threads", 1)
    return audit_build(Path(build_dir), m.target, sources=m.sources,
                       allowed_symbols=[*m.allowed_symbols, *(THREAD_SYMBOLS if threads > 1 else [])],
                       extra_rules=[(f.pattern, f.reason) for f in m.forbidden], threads=threads)


def audit_line(report: AuditReport | None, error: str | None = None) -> str:
    """One line for people and agents: what the gate's audit of this build would say at submit."""
    if report is None:
        return f"audit: could not run ({error}); the gate would reject this build"
    if report.ok and report.cubins:
        return (f"audit: ok ({report.cubins} cubin{'s' * (report.cubins != 1)}: only the declared kernels, nothing imported, "
                "no module-scope device data; the static rules on the sources, as the gate checks them at submit)")
    if report.ok:
        return (f"audit: ok ({report.objects} object{'s' * (report.objects != 1)}, {report.headers} headers read; "
                "symbols, syscalls, load-time code and includes as the gate checks them at submit)")
    return f"audit: REJECTED (the gate refuses this build at submit): {report.reason()}"


def _dedup(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if str(f) not in seen:
            seen.add(str(f))
            out.append(f)
    return out


def _source_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _line_of(text: str, name: str) -> int | None:
    """The first line of `text` naming `name` (a hint for the reader; None when the name was built)."""
    m = re.search(r"\b" + re.escape(name) + r"\b", text)
    return text.count("\n", 0, m.start()) + 1 if m else None


def _elf(obj: Path):
    from elftools.elf.elffile import ELFFile

    return ELFFile(open(obj, "rb"))


def undefined_symbols(obj: Path) -> list[str]:
    from elftools.elf.sections import SymbolTableSection

    elf = _elf(obj)
    try:
        names = []
        for sec in elf.iter_sections():
            if isinstance(sec, SymbolTableSection):
                for sym in sec.iter_symbols():
                    if sym.name and sym["st_shndx"] == "SHN_UNDEF":
                        names.append(sym.name)
        return sorted(set(names))
    finally:
        elf.stream.close()


def undefined_symbol_findings(obj: Path, src: str, allowed: list[str], text: str, target: str) -> list[Finding]:
    out = []
    bad = [n for n in undefined_symbols(obj) if not any(fnmatch.fnmatchcase(n, pat) for pat in allowed)]
    pretty = _demangle(bad)
    for name in bad:
        shown = pretty.get(name, name)
        base = re.sub(r"\(.*", "", shown).split("::")[-1]
        out.append(Finding(rule="symbols", file=src, line=_line_of(text, base),
                           detail=f"calls `{shown}`, which is not on the {target} allow-list of what a kernel "
                                  f"library may import (add it to the manifest's allowed_symbols if it is needed)"))
    return out


def _demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    mangled = [n for n in names if n.startswith("_Z")]
    if not tool or not mangled:
        return {}
    out = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True,
                         env=minimal_env()).stdout.splitlines()
    return dict(zip(mangled, out)) if len(out) == len(mangled) else {}


def syscall_findings(obj: Path, src: str) -> list[Finding]:
    tool = shutil.which("objdump")
    if tool is None:
        raise AuditError("objdump not found (apt-get install binutils): cannot audit the object code")
    dis = subprocess.run([tool, "-d", "--no-show-raw-insn", "-C", str(obj)], capture_output=True, text=True,
                         errors="replace", env=minimal_env()).stdout
    out, func = [], "?"
    for line in dis.splitlines():
        if m := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            func = m.group(1)
        elif m := _SYSCALL_INSN.search(line):
            out.append(Finding(rule="syscall", file=src, detail=f"`{m.group(1)}` instruction in host function "
                                                                 f"`{func}`: a kernel library makes no system calls"))
    return out


def load_time_findings(obj: Path, src: str, target: str) -> list[Finding]:
    """Entries of .init_array & co., each resolved to the function it runs."""
    from elftools.elf.relocation import RelocationSection
    from elftools.elf.sections import SymbolTableSection

    elf = _elf(obj)
    try:
        symtab = next((s for s in elf.iter_sections() if isinstance(s, SymbolTableSection)), None)
        funcs: dict[tuple[int, int], str] = {}
        out = []
        if symtab is not None:
            for sym in symtab.iter_symbols():
                if sym["st_info"]["type"] == "STT_FUNC" and isinstance(sym["st_shndx"], int):
                    funcs[(sym["st_shndx"], sym["st_value"])] = sym.name
                elif sym["st_info"]["type"] == "STT_LOOS" and isinstance(sym["st_shndx"], int):  # STT_GNU_IFUNC
                    shown = _demangle([sym.name]).get(sym.name, sym.name)
                    out.append(Finding(rule="load-time", file=src, detail=(
                        f"`{shown}` is an indirect function (ifunc): its resolver runs when the library loads")))
        for sec in elf.iter_sections():
            if not sec.name.startswith(LOAD_TIME_SECTIONS) or sec["sh_size"] == 0:
                continue
            rel = next((r for r in elf.iter_sections() if isinstance(r, RelocationSection)
                        and r.name in (".rela" + sec.name, ".rel" + sec.name)), None)
            targets = []
            for r in (rel.iter_relocations() if rel is not None else []):
                sym = symtab.get_symbol(r["r_info_sym"]) if symtab is not None else None
                if sym is None:
                    targets.append("?")
                elif sym["st_info"]["type"] == "STT_SECTION":
                    targets.append(funcs.get((sym["st_shndx"], r["r_addend"]), "?"))
                else:
                    targets.append(sym.name)
            if not targets:
                targets = ["?"] * max(1, sec["sh_size"] // 8)
            for t in targets:
                shown = _demangle([t]).get(t, t)
                if target == "cuda" and sec.name == ".init_array" and re.sub(r"\(.*", "", shown) == CUDA_REGISTRATION:
                    continue
                out.append(Finding(rule="load-time", file=src, detail=(
                    f"code that runs when the library loads or unloads ({sec.name} -> `{shown}`: a static "
                    "object's constructor, __attribute__((constructor)) or the like); a kernel library runs "
                    "only when called")))
        return out
    finally:
        elf.stream.close()


# ---- headers ------------------------------------------------------------------------------------

def parse_depfile(text: str) -> list[str]:
    """The prerequisites of a make-style dependency file (`-MD -MF`)."""
    body = text.replace("\\\n", " ")
    _, _, deps = body.partition(": ")
    out = []
    for tok in re.split(r"(?<!\\) ", deps.replace("\n", " ")):
        tok = tok.replace("\\ ", " ").strip()
        if tok:
            out.append(tok)
    return out


@functools.lru_cache(maxsize=None)
def toolchain_include_roots() -> tuple[Path, ...]:
    """Folders a build may read headers from: the C++ compiler's search path and the CUDA toolkit."""
    roots: set[Path] = set()
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx:
        p = subprocess.run([cxx, "-xc++", "-E", "-v", "-"], input="", capture_output=True, text=True, env=minimal_env())
        inside = False
        for line in p.stderr.splitlines():
            if line.startswith("#include <...> search starts here") or line.startswith('#include "..." search'):
                inside = True
            elif line.startswith("End of search list"):
                inside = False
            elif inside and line.startswith(" "):
                roots.add(Path(line.strip()).resolve())
    roots |= {Path("/usr/include").resolve(), Path("/usr/local/include").resolve()}
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parents[1]))
    for home in filter(None, homes):
        cuda = Path(home).resolve()
        if (cuda / "bin" / "nvcc").exists():
            roots |= {cuda / "include", cuda / "targets"}
    return tuple(sorted(r for r in roots if r.exists()))


def dependency_findings(build_dir: Path, src_dir: Path, sources: list[str]) -> tuple[list[Finding], int]:
    roots = toolchain_include_roots()
    out, count = [], 0
    for src in sources:
        dep = build_dir / "obj" / f"{src}.o.d"
        if not dep.is_file():
            raise AuditError(f"{dep}: the compiler's dependency list is missing")
        for raw in parse_depfile(dep.read_text(errors="replace")):
            count += 1
            p = Path(raw) if Path(raw).is_absolute() else build_dir / raw
            try:
                r = p.resolve()
            except OSError:
                r = p
            if r.is_relative_to(src_dir) or any(r.is_relative_to(root) for root in roots):
                continue
            out.append(Finding(rule="headers", file=src, detail=(
                f"reads `{raw}`, outside the task folder and the toolchain's include folders "
                "(an absolute, ../ or computed #include)")))
    return out, count


# ---- preprocessed text --------------------------------------------------------------------------

_MARKER = re.compile(r'^#\s*(?:line\s+)?(\d+)\s+"((?:[^"\\]|\\.)*)"')


def task_lines(text: str, src_dir: Path):
    """(file relative to src_dir, line, text) of the preprocessed lines that come from task files."""
    cur, line, ours = None, 0, False
    known: dict[str, str | None] = {}  # marker name -> path relative to src_dir, None when outside

    def task_file(name: str) -> str | None:
        if name not in known:
            p = Path(name)
            if not p.is_absolute():
                p = src_dir.parent / name  # the compiler ran in the build folder: src/<file>
            try:
                known[name] = p.resolve().relative_to(src_dir).as_posix()
            except (ValueError, OSError):
                known[name] = None
        return known[name]

    for raw in text.splitlines():
        if raw.startswith("#") and (m := _MARKER.match(raw)):
            line = int(m.group(1))
            rel = task_file(m.group(2))
            cur, ours = (rel, True) if rel is not None else (m.group(2), False)
            continue
        if ours:
            yield cur, line, raw
        line += 1


def preprocessed_findings(text: str, src_dir: Path, rules: list[tuple[str, str]]) -> list[Finding]:
    out = []
    compiled = [(re.compile(p), r) for p, r in rules]
    hit_rules: set[tuple[str, str]] = set()
    for rel, line, raw in task_lines(text, src_dir):
        joined = re.sub(r'"\s*"', "", raw)  # adjacent string literals, as the compiler will join them
        for pattern, reason in compiled:
            m = pattern.search(raw) or pattern.search(joined)
            if m and (rel, pattern.pattern) not in hit_rules:
                hit_rules.add((rel, pattern.pattern))
                out.append(Finding(rule="preprocessed", file=rel, line=line,
                                   detail=f"after preprocessing: `{m.group(0).strip()}` — {reason}"))
    return out

