"""The CUDA runtime cheat corpus on the GPU (tests/cheats/cu_*.cu, on the softmax task).

For every kind: (a) a naive harness is fooled — the library loaded with ctypes into the harness's
own process, called on a non-blocking stream (a framework's usual stream), checked once on a sample
of rows with a loose tolerance and N(0,1) inputs, and timed with events on that stream with neither
L2 flush nor input rotation (and once more with a plain 256 MiB flush) — and (b) the real gate
(`Gate.judge_built`: the judge and its runners, check on fresh secret inputs with adversarial rows,
paired timing in passes with re-checks, probes and the physics floor) rejects it with the expected
reason. The static rules and the audit are past already (tests/test_cheats_cuda_build.py), so this
is what the runtime layers hold on their own. The honest VEC=8 knob change is still accepted, and a
stand-alone probe measures whether L2 lines loaded with an evict_last policy survive the runner's
flush.

Run on the device machine: `python3 -m pytest -m gpu tests/gpu/test_cheats_cuda.py` (one line per
kind is printed: kind, the naive harness's verdict, the gate's verdict and its reason).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys

import pytest

from agent.gate import Candidate, Gate, GateConfig
from tests.cuda_cheats import CU_CHEATS, TASK, build_all, candidates

pytestmark = pytest.mark.gpu
GATE = GateConfig(max_seconds=3.0, min_pairs=8)

NAIVE = r"""
import ctypes, json, sys, torch
libs = json.loads(sys.argv[1])
torch.manual_seed(0)
dev = torch.device("cuda")
side = torch.cuda.Stream()  # torch creates its streams non-blocking, like most frameworks' work streams
CHECK, TIMED, ROWS = (512, 2048), (8192, 2048), [0, 1, 2, 3, 256, 511]
flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

def load(path):
    fn = ctypes.CDLL(path).kloop_softmax
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn

def call(fn, x, y):
    status = fn(x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], side.cuda_stream)
    assert status == 0, status

def timed(fn, x, y, warm, n, flush):
    for _ in range(warm):
        call(fn, x, y)
    torch.cuda.synchronize()
    events = []
    for _ in range(n):
        if flush:
            with torch.cuda.stream(side):
                flush_buf.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(side)
        call(fn, x, y)
        e.record(side)
        events.append((s, e))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e-3 for s, e in events)
    return times[len(times) // 2]

def naive(fn):
    # the check: one call, a sample of rows against torch with a loose tolerance, inputs compared after
    x = torch.randn(CHECK, device=dev).bfloat16()
    x0 = x.clone()
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    call(fn, x, y)
    torch.cuda.synchronize()
    ref = torch.softmax(x.float(), -1)
    ok = bool(torch.allclose(y[ROWS].float(), ref[ROWS], atol=1e-3, rtol=1e-2))
    same = bool(torch.equal(x, x0))
    # the timing: the same buffers every call, median of events on the stream it passed
    xt = torch.randn(TIMED, device=dev).bfloat16()
    yt = torch.empty_like(xt)
    t = timed(fn, xt, yt, warm=40, n=40, flush=False)
    t_flush = timed(fn, xt, yt, warm=3, n=20, flush=True)
    return {"ok": ok, "inputs_same": same, "t": t, "t_flush": t_flush}

out = {"baseline": naive(load(libs.pop("baseline")))}
for name, path in libs.items():
    try:
        out[name] = naive(load(path))
    except Exception as exc:
        out[name] = {"error": repr(exc)}
    torch.cuda.synchronize()
print(json.dumps(out))
"""


def _faster(factor: float):
    def fooled(r: dict, base: dict) -> bool:
        return r["ok"] and r["inputs_same"] and r["t"] * factor < base["t"]
    return fooled


INEFFECTIVE = None  # the trick costs more than it saves even against the naive harness
NOT_FASTER = ("timing", "undecided")  # the trick never fires under the gate: no gain left (or a loss)
WRONG = ("check", "timing")
# kind -> (fooled(naive result, naive baseline), stages the gate may reject at, words its reason must hold
#          (alternatives split by |)
CASES = {
    "cu_cache_pointer": (_faster(2.0), ("check",), ["wrong results", "call 1"]),
    "cu_cache_content": (_faster(1.5), NOT_FASTER, []),
    "cu_output_reuse": (_faster(1.5), NOT_FASTER, []),
    "cu_count_calls": (_faster(2.0), ("timing",), ["outputs of timed calls are wrong|faster than physics"]),
    "cu_timing_detect": (_faster(1.5), WRONG, ["wrong"]),
    "cu_stream_legacy": (_faster(2.0), NOT_FASTER, []),
    "cu_stream_per_thread": (_faster(2.0), NOT_FASTER, []),
    # half the rows on a stream of its own after the timed stream's end event (driver reached without imports)
    # caught by the device-clock bound after the sample, or by the probe's stream-ordered copy of its outputs;
    # the naive harness reads it x1.24 faster on an H100 (33.5 vs 41.7 us: the side stream overlaps the next call)
    "cu_side_tail": (_faster(1.15), ("timing",), ["outside the timed region|after the call's stream had finished"]),
    # the same on the short shape only (two calls a sample): the copy, not the bound after the sample
    "cu_side_tail_small": (_faster(1.15), ("timing",), ["outside the timed region|after the call's stream had finished"]),
    "cu_sparse_rows": (_faster(2.0), ("check",), ["wrong results"]),
    "cu_shape_special": (_faster(3.0), ("check",), ["wrong results", "65536x4096|16384x16384|8192x2048"]),
    "cu_fast_exp": (_faster(1.04), ("check",), ["wrong results"]),
    "cu_no_max": (_faster(1.1), ("check",), ["wrong results"]),
    "cu_bf16_sum": (_faster(1.1), ("check",), ["wrong results", "3x100003"]),
    # not effective on the H200 (measured 2026-12-01 with this naive harness: 52.5 / 50.7 us against the
    # baseline's 40.3 us): kept as probes of the layers, the gate must still not accept them
    "cu_l2_evict_last": (INEFFECTIVE, NOT_FASTER, []),
    "cu_input_scratch": (INEFFECTIVE, ("check",), ["mapped read-only on the device"]),
}


def test_every_cheat_has_a_case():
    assert sorted(CASES) == sorted(p.stem for p in CU_CHEATS)


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    trusted = tmp_path_factory.mktemp("trusted") / "softmax"
    shutil.copytree(TASK, trusted)
    return Gate(trusted, "kernels/softmax", GATE)


@pytest.fixture(scope="module")
def builds(gate, tmp_path_factory):
    from tools.build import build

    cands = candidates(gate, tmp_path_factory.mktemp("cands"), CU_CHEATS)
    built = build_all(gate, cands)
    best = build(gate.task, src_root=gate.trusted_dir)
    assert best.ok, best.error_text()
    for name, b in built.items():
        assert b.ok, f"{name}: {b.error_text()}"
    return best, built


@pytest.fixture(scope="module")
def naive(builds):
    """The naive harness over every cheat, in one throwaway process (the cheats leave device state)."""
    best, built = builds
    # the L2 cheat last: the lines it pins would shrink the L2 of every kind timed after it
    order = sorted(built, key=lambda n: n == "cu_l2_evict_last")
    libs = {"baseline": best.lib, **{n: built[n].lib for n in order}}
    proc = subprocess.run([sys.executable, "-c", NAIVE, json.dumps(libs)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _us(x) -> str:
    return f"{x * 1e6:.1f} us" if isinstance(x, (int, float)) else "?"


@pytest.mark.parametrize("kind", sorted(CASES))
def test_cheat_fools_a_naive_harness_and_not_the_gate(kind, gate, builds, naive, capsys):
    fooled, stages, words = CASES[kind]
    best, built = builds
    r, base = naive[kind], naive["baseline"]
    assert "error" not in r, r
    was_fooled = fooled(r, base) if fooled is not INEFFECTIVE else False
    v = gate.judge_built(built[kind], best)
    with capsys.disabled():
        print(f"\n{kind:<22} naive: {'FOOLED' if was_fooled else 'not fooled'} (check {'ok' if r['ok'] else 'FAILED'}, "
              f"{_us(r['t'])} vs baseline {_us(base['t'])}; flushed {_us(r['t_flush'])} vs {_us(base['t_flush'])}) "
              f"| gate: {'ACCEPTED' if v.accepted else 'rejected'} at {v.stage}: {v.reason[:300]}")
    if fooled is not INEFFECTIVE:
        assert was_fooled, f"{kind} does not fool the naive harness: {r} (baseline {base})"
    assert not v.accepted, v.summary()
    assert v.stage in stages, v.summary()
    for w in words:
        assert any(alt in v.reason for alt in w.split("|")), v.summary()


def test_honest_vec_knob_change_is_still_accepted(gate, builds, tmp_path, capsys):
    best, _ = builds
    cand = tmp_path / "softmax"
    shutil.copytree(TASK, cand)
    gate.task.write_knob_settings(cand, {"VEC": 8})
    change = Candidate(cand, ["kernels/softmax/knobs.toml"])
    v = gate.evaluate(change, best)
    with capsys.disabled():
        print(f"\n{'honest VEC=8':<22} gate: {'ACCEPTED' if v.accepted else 'rejected'} at {v.stage}: {v.reason[:300]}")
    if v.stage == "undecided" and "noisy machine" in v.reason:
        # what its user would do (and what the reason says): the same change again with a longer gate, the
        # best's second look. A noisy hour (H100, 2026-12-07: [0.957, 1.077] in 9 s) must not read as a rejection;
        # an integrity bound firing on an honest change would
        v = gate.evaluate(change, best, max_seconds=gate._longer_gate(v.ab), look=2)
        with capsys.disabled():
            print(f"{'honest VEC=8, again':<22} gate: {'ACCEPTED' if v.accepted else 'rejected'} at {v.stage}: {v.reason[:300]}")
    assert v.accepted, v.summary()


# ---- the L2 probe: do lines loaded with evict_last survive the runner's flush? ------------------

PROBE = r"""
#include <cuda_runtime.h>
#include <stdint.h>
__device__ unsigned g_sink;
template <bool kEvictLast>
__global__ void __launch_bounds__(256) read_all(const uint4* p, int64_t n16) {
    unsigned long long policy = 0;
    if (kEvictLast) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    unsigned seen = 0;
    for (int64_t i = blockIdx.x * int64_t(256) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * 256) {
        unsigned a, b, c, d;
        if (kEvictLast)
            asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                         : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p + i), "l"(policy));
        else
            asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p + i));
        seen ^= a ^ b ^ c ^ d;
    }
    if (seen == 0x9e3779b9u) g_sink = seen;
}
__global__ void fill(unsigned char* p, int64_t n, unsigned char v) {
    for (int64_t i = blockIdx.x * int64_t(256) + threadIdx.x; i < n; i += int64_t(gridDim.x) * 256) p[i] = v;
}
extern "C" int probe_fill(void* p, long long bytes, int v) {
    fill<<<264, 256>>>(static_cast<unsigned char*>(p), bytes, static_cast<unsigned char>(v));
    return static_cast<int>(cudaGetLastError());
}
extern "C" int probe_read(const void* p, long long bytes, int evict_last, cudaStream_t s) {
    if (evict_last) read_all<true><<<1056, 256, 0, s>>>(static_cast<const uint4*>(p), bytes / 16);
    else read_all<false><<<1056, 256, 0, s>>>(static_cast<const uint4*>(p), bytes / 16);
    return static_cast<int>(cudaGetLastError());
}
"""


@pytest.fixture(scope="module")
def probe_lib(tmp_path_factory) -> str:
    from tools.proc import find_program

    nvcc = find_program("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.cu").write_text(PROBE)
    subprocess.run([nvcc, "-arch=sm_90a", "-O3", "-shared", "-Xcompiler", "-fPIC", "-o", str(folder / "probe.so"),
                    str(folder / "probe.cu")], check=True, capture_output=True, timeout=300)
    return str(folder / "probe.so")


JUDGE_FLUSH = r"""
import sys, torch
from tools import timing
torch.cuda.init()
buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
for line in sys.stdin:
    timing.flush_l2(buf)
    torch.cuda.synchronize()
    print("ok", flush=True)
"""


def test_l2_probe_evict_last_does_not_survive_the_judge_flush(probe_lib, capsys):
    """A 16 MiB buffer read once (normal or evict_last), then flushed (a plain 256 MiB write; the gate's
    flush, persisting lines reset, then the write; or that flush written by *another process*, as the judge
    does it from its own context before each timed or probed request of a runner), then read again and
    timed. The flush must leave evict_last lines no faster than cold ones, and the other process's flush
    must evict this one's lines (L2 is the device's, shared by every context): a runner then has no flush
    to skip. The warm read shows the probe can see L2 hits at all."""
    import os
    from pathlib import Path

    import torch

    from tools import libhost, timing

    lib = ctypes.CDLL(probe_lib)
    lib.probe_read.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
    lib.probe_read.restype = ctypes.c_int

    dev = torch.device("cuda")
    torch.cuda.init()
    libhost._no_persisting_l2()  # as in a runner
    nbytes = 16 << 20  # well inside one L2 partition (2 x 25 MB on the H100/H200 die)
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    root = str(Path(__file__).resolve().parents[2])
    judge = subprocess.Popen([sys.executable, "-c", JUDGE_FLUSH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})

    def read(evict_last: bool) -> None:
        assert lib.probe_read(buf.data_ptr(), nbytes, int(evict_last), ctypes.c_void_p(stream or None)) == 0

    def second_read(first_evict_last: bool, how: str) -> float:
        times = []
        for _ in range(30):
            read(first_evict_last)
            if how == "plain":
                flush.zero_()
            elif how == "gate":
                timing.flush_l2(flush)
            elif how == "other process":
                torch.cuda.synchronize()  # this context idle, as a runner is between requests
                judge.stdin.write("f\n")
                judge.stdin.flush()
                assert judge.stdout.readline().strip() == "ok"
            # the device busy while the host enqueues: the events then time the read, not launch gaps
            torch.cuda._sleep(200_000)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            read(False)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        return sorted(times)[len(times) // 2]

    try:
        cold = second_read(False, "plain")
        warm = second_read(False, "none")
        evict_last_plain = second_read(True, "plain")
        evict_last_gate = second_read(True, "gate")
        other = second_read(False, "other process")
        evict_last_other = second_read(True, "other process")
    finally:
        judge.stdin.close()
        judge.wait(timeout=60)
    with capsys.disabled():
        print(f"\nL2 probe ({nbytes >> 20} MiB read): cold {_us(cold)}, warm {_us(warm)}, evict_last + plain flush "
              f"{_us(evict_last_plain)}, evict_last + gate flush {_us(evict_last_gate)}; flushed by another "
              f"process: {_us(other)}, evict_last {_us(evict_last_other)}")
    assert warm < 0.85 * cold, "the probe cannot tell L2 hits from HBM reads: it measures nothing"
    assert evict_last_gate > 0.9 * cold, "evict_last lines survive the gate's flush: inputs stay in L2"
    assert other > 0.9 * cold, "another process's flush leaves this one's lines in L2: the judge cannot flush for a runner"
    assert evict_last_other > 0.9 * cold, "evict_last lines survive another process's flush"


# ---- the fix the input-scratch hole needs: does the driver enforce read-only device mappings? ------

VMM = r"""
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
probe = ctypes.CDLL(sys.argv[1])
probe.probe_fill.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int]
probe.probe_read.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p]
u64, size_t = ctypes.c_ulonglong, ctypes.c_size_t

def ck(r, what):
    if r != 0:
        print(f"RESULT setup-failed {what} CUresult {r}")
        sys.exit(0)

class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]
class Access(ctypes.Structure):
    _fields_ = [("location", Loc), ("flags", ctypes.c_int)]

cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size_t, size_t, u64, u64]
cu.cuMemMap.argtypes = [u64, size_t, size_t, u64, u64]
cu.cuMemSetAccess.argtypes = [u64, size_t, ctypes.POINTER(Access), size_t]
cu.cuMemCreate.argtypes = [ctypes.POINTER(u64), size_t, ctypes.POINTER(Prop), u64]
cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, u64, size_t]
ck(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
DEVICE, PINNED, READ, READWRITE = 1, 1, 1, 3
prop = Prop(type=PINNED, requestedHandleTypes=0, location=Loc(DEVICE, 0))
gran = size_t()
ck(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
size = gran.value
handle = u64()
ck(cu.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0), "cuMemCreate")
rw, ro = u64(), u64()
for va in (rw, ro):
    ck(cu.cuMemAddressReserve(ctypes.byref(va), size, 0, 0, 0), "cuMemAddressReserve")
    ck(cu.cuMemMap(va.value, size, 0, handle.value, 0), "cuMemMap")
ck(cu.cuMemSetAccess(rw.value, size, ctypes.byref(Access(Loc(DEVICE, 0), READWRITE)), 1), "access rw")
r = cu.cuMemSetAccess(ro.value, size, ctypes.byref(Access(Loc(DEVICE, 0), READ)), 1)
if r != 0:
    print(f"RESULT read-only-unsupported CUresult {r}")
    sys.exit(0)
ck(probe.probe_fill(rw.value, size, 7), "fill rw")
ck(cu.cuCtxSynchronize(), "fill rw sync")
ck(probe.probe_read(ro.value, size, 0, None), "read ro")
ck(cu.cuCtxSynchronize(), "read ro sync")
probe.probe_fill(ro.value, size, 9)  # the write a scratch-and-restore kernel would do
r = cu.cuCtxSynchronize()
if r != 0:
    print(f"RESULT fault CUresult {r}")
    sys.exit(0)
host = (ctypes.c_ubyte * 16)()
ck(cu.cuMemcpyDtoH_v2(host, rw.value, 16), "read back")
print("RESULT landed" if host[0] == 9 else "RESULT dropped")
"""


def test_read_only_device_mapping_stops_a_write(probe_lib, capsys):
    """The fix the input-scratch hole needs (docs/ARCHITECTURE.md): one physical allocation mapped twice
    with the VMM API, read-write and read-only; a kernel writing through the read-only mapping must
    fault (or at least not land). Run in a throwaway process: a fault ends its context."""
    proc = subprocess.run([sys.executable, "-c", VMM, probe_lib], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    outcome = lines[-1][len("RESULT "):] if lines else f"no result (rc {proc.returncode}): {proc.stderr[-500:]}"
    with capsys.disabled():
        print(f"\nread-only VMM mapping, a kernel writes through it: {outcome}")
    if not outcome.startswith(("fault", "dropped")):
        pytest.xfail(f"read-only device mappings do not stop a write here ({outcome}): the proposed fix of "
                     "the input-scratch hole needs another mechanism")
