"""SASS of a built kernel library, with no GPU: dump (cuobjdump), parse, summarise, excerpt.

The instruction mix answers what a kernel engineer asks of SASS before timing anything: did the
loads vectorise (LDG.128), does the matrix work run on warpgroup MMA (HGMMA) or only on mma.sync
(HMMA), does anything touch local memory (LDL/STL: spills or an indexed register array), how much
integer/address arithmetic surrounds the math.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Sequence, Mapping

from pydantic import BaseModel

from tools.proc import demangle, find_program
from tools.sandbox import minimal_env

INSTALL_HINT = "install them with: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"


class SassError(Exception):
    """The SASS could not be produced or queried; the message says why and what to do."""


# --- finding the tools ---------------------------------------------------------------------------


def _tool_dirs() -> list[Path]:
    """Where CUDA binaries live besides PATH and the toolkit (tools.proc.find_program): the NVIDIA pip wheels."""
    dirs: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec else []
    for root in roots:
        # cu13/cu12 wheels share one bin folder; older wheels have one folder per tool
        for sub in ("cu13/bin", "cu12/bin", "cuda_cuobjdump/bin", "cuda_nvdisasm/bin"):
            dirs.append(Path(root) / sub)
    triton = importlib.util.find_spec("triton")  # Triton bundles cuobjdump and nvdisasm beside its ptxas
    if triton is not None and triton.origin:
        dirs.append(Path(triton.origin).parent / "backends" / "nvidia" / "bin")
    return dirs


def _find_tool(name: str) -> Path | None:
    found = find_program(name, extra_dirs=_tool_dirs())
    return Path(found) if found else None


def find_cuobjdump() -> Path | None:
    return _find_tool("cuobjdump")


def find_nvdisasm() -> Path | None:
    return _find_tool("nvdisasm")


def dump_sass(lib: Path) -> str:
    """`cuobjdump --dump-sass` of a built library (or cubin/object); SassError when it cannot."""
    lib = Path(lib)
    if not lib.is_file():
        raise SassError(f"no such file: {lib}")
    if lib.name.endswith(".triton.json"):  # a Triton task's bundle: each variant's cubin, named by its variant
        return _bundle_sass(lib)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        raise SassError(
            "cuobjdump not found (looked on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin and the "
            f"nvidia pip wheels); {INSTALL_HINT}"
        )
    env = minimal_env()  # an allow-list: no secret reaches a child process (tools/sandbox.py)
    nvdisasm = find_nvdisasm()
    if nvdisasm is not None:  # cuobjdump shells out to nvdisasm, which may sit in another folder
        env["NVDISASM_PATH"] = str(nvdisasm.parent)
        env["PATH"] = f"{nvdisasm.parent}{os.pathsep}{env.get('PATH', '')}"
    try:
        proc = subprocess.run(
            [str(cuobjdump), "--dump-sass", str(lib)], capture_output=True, text=True, env=env, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SassError(f"cuobjdump --dump-sass {lib} could not run: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip()[-2000:]) or "no output"
        hint = f"; {INSTALL_HINT}" if nvdisasm is None or "nvdisasm" in detail else ""
        raise SassError(f"cuobjdump --dump-sass {lib} failed (exit {proc.returncode}): {detail}{hint}")
    return proc.stdout


def _bundle_sass(lib: Path) -> str:
    from tools.triton_build import cubin_paths

    parts = []
    for label, cubin in cubin_paths(lib):
        text = dump_sass(cubin)
        parts.append(re.sub(r"(^\s*Function\s*:\s*)(\S+)", lambda m: m.group(1) + label, text, flags=re.M))
    return "\n".join(parts)


# --- models --------------------------------------------------------------------------------------


class SassInstruction(BaseModel):
    address: int
    predicate: str | None = None  # e.g. "P0", "!UP1" (without the "@")
    opcode: str  # with modifiers, e.g. "LDG.E.128.CONSTANT"
    operands: list[str] = []

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def modifiers(self) -> list[str]:
        return self.opcode.split(".")[1:]

    def render(self) -> str:
        pred = f"@{self.predicate} " if self.predicate else ""
        args = f" {', '.join(self.operands)}" if self.operands else ""
        return f"/*{self.address:04x}*/ {pred}{self.opcode}{args} ;"


class SassSummary(BaseModel):
    kernel: str  # demangled name, so a summary read alone says what it describes
    arch: str | None = None
    total: int = 0
    families: dict[str, int] = {}  # see FAMILIES; most frequent first
    opcodes: dict[str, int] = {}  # base opcode (no modifiers); most frequent first
    memory: dict[str, int] = {}  # loads/stores by width in bits, e.g. {"LDG.128": 12, "STS.32": 4}
    mufu: dict[str, int] = {}  # special-function unit ops by function, e.g. {"EX2": 8}
    # register counts a warp-specialised kernel sets with `setmaxnreg` (USETMAXREG), low to high: the
    # entry count (ptxas -v) is only what every warp starts with
    setmaxnreg: list[int] = []
    warnings: list[str] = []


class KernelSass(BaseModel):
    name: str  # demangled when c++filt is available
    mangled: str
    arch: str | None = None
    instructions: list[SassInstruction]
    summary: SassSummary


# --- opcode families -----------------------------------------------------------------------------

FAMILIES: dict[str, tuple[str, ...]] = {
    "tensor": ("HGMMA", "IGMMA", "QGMMA", "BGMMA", "WARPGROUP", "HMMA", "IMMA", "QMMA", "DMMA", "BMMA",
               "UTCHMMA", "UTCIMMA", "UTCQMMA", "UTCOMMA", "UTCMMA", "UTCBAR"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSET", "FSEL", "FCHK", "FSWZADD", "FFMA32I",
             "FMUL32I", "FADD32I", "FFMA2", "FMUL2", "FADD2"),
    "fp64": ("DFMA", "DMUL", "DADD", "DSETP", "DMNMX"),
    "half": ("HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2", "HFMA2_32I", "HADD2_32I", "HMUL2_32I"),
    "convert": ("F2F", "F2FP", "I2F", "F2I", "I2I", "I2FP", "F2IP", "I2IP", "FRND"),
    "int": ("IMAD", "IMAD32I", "IADD3", "IADD", "IADD32I", "IMUL", "IMUL32I", "LEA", "SHF", "SHL", "SHR",
            "LOP3", "LOP", "LOP32I", "ISETP", "IMNMX", "IABS", "POPC", "FLO", "BREV", "PRMT", "SGXT",
            "BMSK", "IDP", "IDP4A", "ISCADD", "VIADD", "VIMNMX", "VIADDMNMX", "BFE", "BFI", "XMAD"),
    "move": ("MOV", "MOV32I", "SEL", "S2R", "S2UR", "CS2R", "LDC", "P2R", "R2P", "R2UR", "PLOP3",
             "PSETP", "LEPC"),
    "global": ("LDG", "STG", "LD", "ST", "RED", "REDG", "ATOM", "ATOMG"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "local": ("LDL", "STL"),
    "tma": ("UTMALDG", "UTMASTG", "UTMAREDG", "UTMAPF", "UTMACCTL", "UTMACMDFLUSH", "UBLKCP", "UBLKRED",
            "UBLKPF"),
    # Ampere's per-thread async copy (cp.async), not the TMA: told apart so a mix can show which one
    "cp.async": ("LDGSTS",),
    "sync": ("BAR", "SYNCS", "MEMBAR", "DEPBAR", "LDGDEPBAR", "ARRIVES", "FENCE", "ERRBAR", "WARPSYNC",
             "CCTL", "UCGABAR_ARV", "UCGABAR_WAIT", "UCGABAR_GET", "UCGABAR_SET", "NANOSLEEP",
             "USETMAXREG"),
    "shuffle": ("SHFL", "VOTE", "VOTEU", "MATCH", "REDUX", "ELECT"),
    "sfu": ("MUFU",),
    "control": ("BRA", "BRX", "JMP", "JMX", "EXIT", "CALL", "RET", "BSSY", "BSYNC", "BREAK", "BMOV",
                "BPT", "KILL", "YIELD", "ACQBULK"),
}
_FAMILY_OF = {op: family for family, ops in FAMILIES.items() for op in ops}
_WIDTH_OPS = frozenset({"LDG", "STG", "LD", "ST", "LDS", "STS", "LDL", "STL"})  # LDSM counts matrices
_WIDTH_BITS = {"8": 8, "16": 16, "32": 32, "64": 64, "128": 128, "256": 256,
               "U8": 8, "S8": 8, "U16": 16, "S16": 16}
_SYNC_MMA = ("HMMA", "IMMA", "QMMA")  # mma.sync kinds that have a warpgroup (wgmma) counterpart
_ASYNC_MMA = ("HGMMA", "IGMMA", "QGMMA", "BGMMA", "UTCHMMA", "UTCIMMA", "UTCQMMA", "UTCOMMA", "UTCMMA")


def family_of(base: str) -> str:
    """The family of a base opcode; uniform-datapath twins (UIADD3, ULDC, UMOV...) join their vector op's."""
    if base in _FAMILY_OF:
        return _FAMILY_OF[base]
    if base.startswith("U") and base[1:] in _FAMILY_OF:
        return _FAMILY_OF[base[1:]]
    return "other"


def _width_bits(modifiers: list[str]) -> int:
    widths = [_WIDTH_BITS[m] for m in modifiers if m in _WIDTH_BITS]
    return widths[-1] if widths else 32


# --- parsing -------------------------------------------------------------------------------------

_ARCH = re.compile(r"^\s*(?:arch\s*=|code for)\s*(sm_\w+)")  # a fatbin says "arch = ", a cubin "code for"
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+([^;]*?)\s*;")


def _split_operands(text: str) -> list[str]:
    """Split on top-level commas (operands such as desc[UR4][R2.64] hold no commas, but be safe)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "[{(") - (ch in "]})")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]


def _parse_instruction(address: str, body: str) -> SassInstruction:
    predicate = None
    if body.startswith("@"):
        guard, _, body = body.partition(" ")
        predicate = guard[1:]
    opcode, _, rest = body.strip().partition(" ")
    return SassInstruction(address=int(address, 16), predicate=predicate, opcode=opcode,
                           operands=_split_operands(rest))


def _split_functions(text: str) -> list[tuple[str, str | None, list[SassInstruction]]]:
    """(mangled name, arch, instructions) per `Function :` block, in dump order."""
    functions: list[tuple[str, str | None, list[SassInstruction]]] = []
    arch = None
    for line in text.splitlines():
        if m := _ARCH.match(line):
            arch = m.group(1)
        elif m := _FUNCTION.match(line):
            functions.append((m.group(1), arch, []))
        elif functions and (m := _INSTRUCTION.match(line)):
            functions[-1][2].append(_parse_instruction(m.group(1), m.group(2)))
    return functions


def parse_sass(text: str) -> dict[str, KernelSass]:
    """Kernels of a `cuobjdump --dump-sass` listing, keyed by mangled name (as ptxas -v names them)."""
    functions = _split_functions(text)
    names = demangle([mangled for mangled, _, _ in functions])
    kernels: dict[str, KernelSass] = {}
    for mangled, arch, instructions in functions:
        name = names.get(mangled, mangled)
        key = mangled if mangled not in kernels else f"{mangled} [{arch}]"  # multi-arch fatbins
        kernels[key] = KernelSass(name=name, mangled=mangled, arch=arch, instructions=instructions,
                                  summary=summarise(name, arch, instructions))
    return kernels


# --- summary -------------------------------------------------------------------------------------


def _without_padding(instructions: list[SassInstruction]) -> list[SassInstruction]:
    """Drop the alignment filler the linker appends (a branch to itself, then NOPs): never executed."""
    end = len(instructions)
    while end and instructions[end - 1].base == "NOP":
        end -= 1
    last = instructions[end - 1] if end else None
    if last and last.base == "BRA" and not last.predicate and last.operands == [f"{last.address:#x}"]:
        end -= 1
    return instructions[:end]


def _is_hopper_or_later(arch: str | None) -> bool:
    m = re.match(r"sm_(\d+)", arch or "")
    return m is None or int(m.group(1)) >= 90  # unknown arch: warn rather than stay silent


def _warnings(opcodes: Counter, arch: str | None) -> list[str]:
    warnings = []
    if opcodes["LDL"] or opcodes["STL"]:
        warnings.append(
            f"local memory: {opcodes['LDL']} LDL, {opcodes['STL']} STL -- register spills or a "
            "dynamically indexed register array (check ptxas -v spill bytes and stack frame)"
        )
    sync_mma = {op: opcodes[op] for op in _SYNC_MMA if opcodes[op]}
    if sync_mma and not any(opcodes[op] for op in _ASYNC_MMA) and _is_hopper_or_later(arch):
        found = ", ".join(f"{op} {n}" for op, n in sync_mma.items())
        warnings.append(
            f"tensor cores via mma.sync only ({found}) and no warpgroup MMA (HGMMA): on Hopper, "
            "wgmma is needed to approach tensor-core peak"
        )
    return warnings


def _immediate(operand: str) -> int | None:
    """An immediate operand (0xe8, 232) as an int; None for a register or predicate."""
    try:
        return int(operand, 0)
    except ValueError:
        return None


def summarise(kernel: str, arch: str | None, instructions: list[SassInstruction]) -> SassSummary:
    opcodes: Counter = Counter()
    families: Counter = Counter()
    memory: Counter = Counter()
    mufu: Counter = Counter()
    setmaxnreg: set[int] = set()
    for ins in _without_padding(instructions):
        base = ins.base
        opcodes[base] += 1
        families[family_of(base)] += 1
        if base in _WIDTH_OPS:
            memory[f"{base}.{_width_bits(ins.modifiers)}"] += 1
        elif base == "MUFU":
            mufu[".".join(ins.modifiers) or "?"] += 1
        elif base == "USETMAXREG":
            setmaxnreg.update(v for v in map(_immediate, ins.operands) if v is not None)
    return SassSummary(
        kernel=kernel, arch=arch, total=sum(opcodes.values()), families=dict(families.most_common()),
        opcodes=dict(opcodes.most_common()), memory=dict(memory.most_common()),
        mufu=dict(mufu.most_common()), setmaxnreg=sorted(setmaxnreg), warnings=_warnings(opcodes, arch),
    )


def sass_mix(lib: Path) -> dict[str, SassSummary]:
    """Instruction mix per kernel of a built library, keyed by mangled name."""
    return {key: k.summary for key, k in parse_sass(dump_sass(lib)).items()}


def _counts(counts: Mapping[str, int], limit: int | None = None) -> str:
    items = list(counts.items())[:limit]
    more = f", +{len(counts) - limit} more" if limit is not None and len(counts) > limit else ""
    return ", ".join(f"{k} {v}" for k, v in items) + more


def format_mix(mix: Mapping[str, SassSummary], top_opcodes: int = 12, resources: Sequence[Any] = ()) -> str:
    """A compact per-kernel table of the mix, for people and for the model. `mix` is keyed by mangled
    name (as sass_mix gives it); `resources`: the build's ptxas figures (tools.build.KernelResources),
    shown per kernel beside its SASS: registers (and setmaxnreg), spill stores/loads, stack (local
    memory) bytes, and the local-memory instructions the SASS holds."""
    if not mix:
        return "no kernels (no SASS in the library)"
    from tools.fmt import kernel_names

    by_mangled = {getattr(r, "mangled", None): r for r in resources}
    blocks = []
    for (key, s), short in zip(mix.items(), kernel_names([s.kernel for s in mix.values()])):
        lines = [f"{short} [{s.arch or '?'}]: {s.total} instructions",
                 f"  families: {_counts(s.families)}"]
        r = by_mangled.get(key.split(" [")[0])
        if r is not None:
            regs = f"{r.registers} regs" + (f" at entry; setmaxnreg {' / '.join(map(str, r.setmaxnreg))}" if r.setmaxnreg else "")
            lines.append(f"  ptxas: {regs}, spills {r.spill_store_bytes}/{r.spill_load_bytes} B st/ld, "
                         f"{r.stack_bytes} B stack; local memory in SASS: {s.opcodes.get('LDL', 0)} LDL, "
                         f"{s.opcodes.get('STL', 0)} STL")
        if s.memory:
            lines.append(f"  ld/st widths: {_counts(s.memory)}")
        if s.mufu:
            lines.append(f"  mufu: {_counts(s.mufu)}")
        if s.setmaxnreg:
            lines.append(f"  registers: setmaxnreg {' / '.join(map(str, s.setmaxnreg))} (warp-specialised: "
                         "the ptxas count is the entry count only)")
        lines.append(f"  opcodes: {_counts(s.opcodes, top_opcodes)}")
        lines += [f"  WARNING {w}" for w in s.warnings]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# --- excerpts ------------------------------------------------------------------------------------


def _pick_kernel(kernels: Mapping[str, KernelSass], query: str) -> KernelSass:
    matches = [k for k in kernels.values() if query in k.name or query in k.mangled]
    exact = [k for k in matches if query in (k.name, k.mangled)]
    if len(exact) == 1 or len(matches) == 1:
        return (exact or matches)[0]
    listed = "; ".join(k.name for k in (matches or kernels.values()))
    if not matches:
        raise SassError(f"no kernel matches {query!r}; kernels: {listed or 'none'}")
    raise SassError(f"{query!r} matches {len(matches)} kernels, be more specific: {listed}")


def sass_excerpt(text_or_lib: str | Path, kernel: str, pattern: str, context: int = 5,
                 max_lines: int = 80) -> str:
    """Lines around matches of `pattern` (regex, case-insensitive) in one kernel's SASS.

    `text_or_lib`: a Path is a library to dump; a str is `cuobjdump --dump-sass` text. `kernel` is a
    substring of the mangled or demangled name. Windows that overlap are merged; matched lines are
    marked with '>'; output stops before `max_lines` lines.
    """
    text = dump_sass(text_or_lib) if isinstance(text_or_lib, Path) else text_or_lib
    k = _pick_kernel(parse_sass(text), kernel)
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise SassError(f"bad pattern {pattern!r}: {exc}") from exc
    lines = [ins.render() for ins in k.instructions]
    hits = [n for n, line in enumerate(lines) if regex.search(line)]
    if not hits:
        return f"{k.name}: no line matches /{pattern}/ ({len(lines)} instructions)"
    context = max(0, min(context, (max_lines - 1) // 2))  # one window always fits
    hit_set, out, end = set(hits), [], 0
    for n in hits:
        lo, hi = max(n - context, end), min(n + context + 1, len(lines))
        gap = ["--"] if out and lo > end else []
        chunk = gap + [f"{'>' if i in hit_set else ' '} {lines[i]}" for i in range(lo, hi)]
        if len(out) + len(chunk) > max_lines:
            break
        out += chunk
        end = max(end, hi)
    shown = sum(1 for n in hits if n < end)
    header = f"{k.name}: {len(hits)} matches of /{pattern}/, {shown} shown"
    if shown < len(hits):
        header += f" (capped at {max_lines} lines; narrow the pattern or the context)"
    return "\n".join([header, *out])
