"""Runtime cheats on the CPU task (tests/cheats/rt_*.cpp): each one (a) fools a naive harness — the
library loaded with ctypes into the harness's own process, timed with its clock, compared once — and
(b) is rejected by the gate's runtime layers (the judge and its runners: check, paired timing,
re-checks, probes, physics floor), with a reason that names what it did.

The gate's static source rules are bypassed here on purpose (`Gate.judge_built` on the built
library): they are not a boundary, and what is tested is what holds when they are fooled.
"""

from __future__ import annotations

import json
import os
import time
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.gate import Gate, GateConfig
from tools.build import build

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "kernels" / "matmul_cpu"
CHEATS = Path(__file__).resolve().parent / "cheats"
GATE = GateConfig(max_seconds=2.0, min_pairs=8)

pytestmark = pytest.mark.slow

NAIVE = r"""
import ctypes, json, sys, time, torch
cheat, honest, check_n, time_n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
torch.set_num_threads(1)
def load(p):
    lib = ctypes.CDLL(p)
    lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    return lib
def bufs(n):
    return torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
def call(lib, a, b, c):
    n = a.shape[0]
    lib.kloop_matmul(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, n, n)
def best_time(lib, a, b, c, calls=60):
    ts = []
    for _ in range(calls):
        t = time.perf_counter(); call(lib, a, b, c); ts.append(time.perf_counter() - t)
    return min(ts[-10:])
h = load(honest)
a, b, c = bufs(time_n)
t_honest = best_time(h, a, b, c, 10)
x = load(cheat)
# the naive check: one call, inputs compared after it, the output against a loose reference
ca, cb, cc = bufs(check_n)
a0 = ca.clone()
call(x, ca, cb, cc)
ok = bool(torch.allclose(cc, ca @ cb, rtol=1e-2, atol=1e-2))
inputs_same = bool(torch.equal(ca, a0))
t_cheat = best_time(x, a, b, c)
t_honest_after = best_time(h, a, b, c, 10)
out = {"ok": ok, "inputs_same": inputs_same, "t_honest": t_honest, "t_cheat": t_cheat, "t_honest_after": t_honest_after}
if mode == "interleave":  # one call of each in turn: a load that comes and goes slows both alike
    tx, th = [], []
    for _ in range(40):
        t = time.perf_counter(); call(x, a, b, c); tx.append(time.perf_counter() - t)
        t = time.perf_counter(); call(h, a, b, c); th.append(time.perf_counter() - t)
    out["t_cheat_interleaved"], out["t_honest_interleaved"] = min(tx[-20:]), min(th[-20:])
for key, probe in (("found", "kloop_cheat_found"), ("patched", "kloop_cheat_patched")):
    try:
        out[key] = getattr(x, probe)()
    except AttributeError:
        pass
print(json.dumps(out))
"""


def naive(cheat_lib: str, honest_lib: str, check_n: int = 96, time_n: int = 192, env: dict | None = None,
          mode: str = "-") -> dict:
    """The naive in-process harness, in a throwaway process (the cheats leave threads and patches).
    mode "interleave": also the cheat and the honest library timed in turn, after the rest."""
    proc = subprocess.run([sys.executable, "-c", NAIVE, cheat_lib, honest_lib, str(check_n), str(time_n), mode],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def faster(r: dict, factor: float = 3.0) -> bool:
    return r["ok"] and r["t_cheat"] * factor < r["t_honest"]


# name -> (how it fools the naive harness, what the gate must say)
CASES = {
    "rt_cache_pointer": (faster, ("check",), ["wrong results", "call 1"]),
    "rt_cache_content": (faster, ("timing", "undecided"), []),  # the cache never hits: no gain left
    # the best, patched, does its work twice: the cheat says it patched it, and timed in turn with the cheat
    # (a CI neighbour's load that comes and goes slows both alike; one after the other they once read 8.1
    # and 8.3 ms) the best reads slower. Not by a fixed factor: the patched copy is the cheat's own loop,
    # and under CI load the pair read 6.9 vs 4.6 ms (x1.49), below the x1.5 once asked here
    "rt_patch_other": (lambda r: r["ok"] and r.get("patched") == 1 and r["t_honest_interleaved"] > 1.1 * r["t_cheat_interleaved"],
                       ("timing", "undecided"), []),
    "rt_pyapi": (faster, ("timing", "undecided"), []),
    "rt_input_scratch": (lambda r: r["ok"] and r["inputs_same"], ("check",), ["modified its inputs"]),
    "rt_count_calls": (faster, ("timing",), ["outputs of timed calls are wrong"]),
    # back-to-back calls skip the work; the gate's calls never come that close (outputs are poisoned
    # and read between them), so the cheat does its work and there is no gain: refused as wrong, as
    # slower than the bar, or (on a loaded machine, within the test's time cap) as undecided
    "rt_timing_detect": (faster, ("check", "timing", "undecided"), ["wrong|no gain|not measurably faster|regression|undecided"]),
    "rt_thread_after_return": (faster, ("timing",), ["outside the timed region|outputs of timed calls are wrong"]),
    "rt_static_ctor": (faster, ("timing",), ["outside the timed region|outputs of timed calls are wrong"]),
    "rt_less_precise": (lambda r: r["ok"], ("check",), ["wrong results"]),
    # half the work on sq192 (x2): timed in turn with the honest one, as a load that comes and goes slows both alike
    # (one after the other, CI once read the honest 3.1 ms before the cheat and 11.5 ms after, the cheat 2.2)
    "rt_shape_special": (lambda r: r["ok"] and 1.5 * r["t_cheat_interleaved"] < r["t_honest_interleaved"],
                         ("check",), ["wrong results", "sq192"]),
    "rt_read_environ": (lambda r: r.get("found") == 1, ("timing", "undecided"), []),
    # honest, plus ~80 ms in every second cold probe (no sample charges a probe): any naive harness that
    # checks once passes it; the gate bounds a probe's call like for like with the best's
    "rt_probe_spin": (lambda r: r["ok"], ("timing",), ["work in untimed calls"]),
}


INTERLEAVED = {"rt_patch_other", "rt_shape_special"}  # the naive harness also times them in turn with the honest one


def task_copy(tmp: Path, cheat: str) -> Path:
    dest = tmp / cheat
    shutil.copytree(TASK, dest)
    shutil.copyfile(CHEATS / f"{cheat}.cpp", dest / "matmul.cpp")
    for header in CHEATS.glob("rt_*.h"):
        shutil.copyfile(header, dest / header.name)
    return dest


@pytest.fixture(scope="module")
def gate():
    return Gate(TASK, "kernels/matmul_cpu", GATE)


@pytest.fixture(scope="module")
def honest(gate, tmp_path_factory):
    built = build(gate.task, src_root=task_copy(tmp_path_factory.mktemp("honest"), "rt_honest"))
    assert built.ok, built.error_text()
    return built


@pytest.mark.parametrize("cheat", sorted(CASES))
def test_runtime_cheat_fools_a_naive_harness_and_not_the_gate(cheat, gate, honest, tmp_path):
    fooled, stages, words = CASES[cheat]
    built = build(gate.task, src_root=task_copy(tmp_path, cheat))
    assert built.ok, built.error_text()
    env = {"KLOOP_TEST_SECRET": "s3cr3t"} if cheat == "rt_read_environ" else None
    check_n = 64 if cheat == "rt_shape_special" else 96
    r = naive(built.lib, honest.lib, check_n=check_n, env=env, mode="interleave" if cheat in INTERLEAVED else "-")
    assert fooled(r), f"{cheat} does not fool the naive harness: {r}"

    os.environ["KLOOP_TEST_SECRET"] = "s3cr3t"  # the session holds a secret; the judge and runners must not
    try:
        v = gate.judge_built(built, honest)
    finally:
        os.environ.pop("KLOOP_TEST_SECRET", None)
    assert not v.accepted, v.summary()
    assert v.stage in stages, v.summary()
    for w in words:
        assert any(alt in v.reason for alt in w.split("|")), v.summary()
    if cheat == "rt_read_environ":  # passing its check means it never saw the secret (the leak marks C[0])
        assert v.check is not None and v.check.passed, v.summary()


def test_forged_answer_on_the_runners_pipe_is_rejected(gate, honest, tmp_path):
    """A library that finds the runner's reply pipe and answers before the work is done: the answer
    lacks the request's nonce, the judge stops that runner, and the check fails saying so."""
    built = build(gate.task, src_root=task_copy(tmp_path, "rt_forge_answer"))
    assert built.ok, built.error_text()
    v = gate.judge_built(built, honest)
    assert not v.accepted and v.stage == "check" and "out of turn" in v.reason, v.summary()


def test_candidate_code_never_loads_into_the_judge(gate, honest):
    """The judge's process never maps a candidate library: it runs in its runner only."""
    from tools.remote import LibSession

    with LibSession(gate.task, [honest.lib]) as libs:
        runner = libs.runners["lib0"]
        assert runner.proc.pid != os.getpid()
        try:
            maps = Path(f"/proc/{runner.proc.pid}/maps").read_text()
        except PermissionError:  # a hardened runner's map is private to it (and to CAP_SYS_PTRACE)
            maps = None
        assert maps is None or honest.lib in maps
    assert honest.lib not in Path("/proc/self/maps").read_text()


# A careful benchmark's harness: input sets rotated with fresh values every round, each timed call's
# output compared (on copies of the inputs it was given) when it returns, inputs compared after it; the
# honest library and the cheat called in turn, each on its own sets.
NAIVE_ROTATING = r"""
import ctypes, json, sys, time, torch
cheat, honest, n, sets, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0); torch.set_num_threads(1)
def load(p):
    lib = ctypes.CDLL(p); lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3; return lib
def call(lib, a, b, c):
    lib.kloop_matmul(a.data_ptr(), b.data_ptr(), c.data_ptr(), a.shape[0], b.shape[1], a.shape[1])
def timed(libs):
    # each library its own sets, called in turn: a load that comes and goes slows both alike
    S = {k: [(torch.empty(n, n), torch.empty(n, n), torch.empty(n, n)) for _ in range(sets)] for k in libs}
    ts, wrong, changed = {k: [] for k in libs}, dict.fromkeys(libs, 0), dict.fromkeys(libs, 0)
    for r in range(rounds):
        for k in libs:
            for a, b, c in S[k]:
                a.normal_(); b.normal_(); c.fill_(float('nan'))
        for i in range(sets):
            for k, lib in libs.items():
                a, b, c = S[k][i]
                a0, b0 = a.clone(), b.clone()
                t = time.perf_counter(); call(lib, a, b, c); ts[k].append(time.perf_counter() - t)
                wrong[k] += not torch.allclose(c, a0 @ b0, rtol=1e-3, atol=1e-3)
                changed[k] += not (torch.equal(a, a0) and torch.equal(b, b0))
    med = {k: sorted(v)[len(v) // 2] for k, v in ts.items()}
    return med, wrong, changed
h, x = load(honest), load(cheat)
ca, cb, cc = torch.randn(96, 96), torch.randn(96, 96), torch.empty(96, 96)
call(x, ca, cb, cc)
ok = bool(torch.allclose(cc, ca @ cb, rtol=1e-3, atol=1e-3))
med, wrong, changed = timed({"h": h, "x": x})
t_h, t_x, wrong_x, changed_x = med["h"], med["x"], wrong["x"], changed["x"]
print(json.dumps({"check_ok": ok, "speedup": t_h / t_x, "wrong_when_timed": wrong_x, "inputs_changed": changed_x}))
"""


def naive_rotating(cheat_lib: str, honest_lib: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", NAIVE_ROTATING, cheat_lib, honest_lib, "192", "8", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cheat, stages, words", [
    # half the rows in a timed call, the rest paid inside the next untimed call (the cold probe)
    ("rt_lazy_probe", ("timing",), ["outputs of timed calls are wrong"]),
    # libc reached without imports; the read-only input's file reopened writable, half of it zeroed
    ("rt_input_rewrite", ("check", "timing", "undecided"), []),
])
def test_a_cheat_that_fools_a_careful_harness_and_not_the_gate(cheat, stages, words, gate, honest, tmp_path):
    built = build(gate.task, src_root=task_copy(tmp_path, cheat))
    assert built.ok, built.error_text()
    r = naive_rotating(built.lib, honest.lib)
    # half the work: about x2 on an idle 2-core box, x1.33 beside a busy-looping process (its hyperthread
    # sibling); timed in turn with the honest library, so the margin is the load's, not a load swing's
    assert r["check_ok"] and r["speedup"] > 1.2 and (r["wrong_when_timed"] or r["inputs_changed"]), r
    v = gate.judge_built(built, honest)
    assert not v.accepted, v.summary()
    assert v.stage in stages, v.summary()
    for w in words:
        assert any(alt in v.reason for alt in w.split("|")), v.summary()


def test_the_best_cannot_be_slowed_from_the_candidates_runner(gate, honest, tmp_path):
    """rt_sabotage_best is the honest product plus an attack: it finds the best's runner in /proc and
    patches its code through /proc/<pid>/mem so every call runs twice (accepted at x1.9 before the
    runners were hardened). A hardened runner's memory is closed to its neighbour: no gain is left."""
    built = build(gate.task, src_root=task_copy(tmp_path, "rt_sabotage_best"))
    assert built.ok, built.error_text()
    v = gate.judge_built(built, honest)
    assert not v.accepted, v.summary()
    assert v.ab is None or v.ab.speedup < 1.3, v.summary()


def test_a_runner_reaches_neither_the_judge_nor_the_other_runner(gate, honest, tmp_path):
    """rt_probe_reach lists /proc and reports what it could do (tests/cheats/rt_probe_reach.cpp): 10000 x
    (the judge's /proc/<pid>/mem opened for writing) + 1000 x (a sibling runner found) + 100 x (its mem
    opened for writing) + 10 x (kill(sibling, 0) allowed) + other processes visible (at most 9).
    Beside a decoy 'libhost' process, in a plain process, it finds the decoy (so it tests something);
    in a runner it must reach neither. Where runners get PID namespaces of their own
    (tools.sandbox.status().runner_pidns) it sees no other process but its namespace's init (PID 1,
    which only waits for it): not the other runner, whose CPU time in /proc/<pid>/stat would tell it
    the pair order, and not the judge."""
    import re

    from tools.sandbox import status

    built = build(gate.task, src_root=task_copy(tmp_path, "rt_probe_reach"))
    assert built.ok, built.error_text()
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "tools.libhost"])
    try:
        r = naive(built.lib, honest.lib)
    finally:
        decoy.kill()
        decoy.wait()
    assert r["found"] // 1000 % 10 == 1 and r["found"] % 10 >= 1, f"the probe finds no sibling even unconfined: {r}"

    v = gate.judge_built(built, honest)
    assert not v.accepted and v.stage == "check", v.summary()
    got = re.search(r"got (\d+)", v.reason)
    assert got, v.summary()
    code = int(got.group(1)) - 100000
    assert code >= 0, f"the probe could not run ({code})"
    assert code // 10000 == 0, f"a runner opened the judge's memory for writing ({code})"
    assert code // 100 % 10 == 0, f"a runner opened the other runner's memory for writing ({code})"
    assert code // 10 % 10 == 0, f"a runner may signal the other runner ({code})"
    if not status().runner_pidns:
        pytest.skip(f"no PID namespace per runner on this host ({status().runner_pidns_reason}): the sibling is visible")
    assert code == 0, f"a runner sees other processes in /proc ({code}): its PID namespace is not its own"


# A harness with the gate's pass structure, in process: per pass every input set gets fresh values in
# place (outputs poisoned), then each set is called once by the honest best and once by the cheat, in
# random order within each pair, each call timed and its output compared when it returns. The per-call
# pairs go to the statistic of commit 7546d11 (tests/stats_7546d11.py: 20% trimmed mean of per-pair log
# ratios) and to today's (tools/stats.ratio_of_sums over the passes' summed times).
NAIVE_PASSES = r"""
import ctypes, json, random, sys, time, torch
cheat, honest, n, sets, passes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0); torch.set_num_threads(1); rng = random.Random(0)
def load(p):
    lib = ctypes.CDLL(p); lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3; return lib
def call(lib, a, b, c):
    t = time.perf_counter(); lib.kloop_matmul(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, n, n); return time.perf_counter() - t
h, x = load(honest), load(cheat)
S = [tuple(torch.empty(n, n) for _ in range(4)) for _ in range(sets)]  # a, b, c of the best, c of the cheat
pairs, wrong = [], 0
for p in range(passes + 1):  # pass 0 is the warm-up: both libraries see every set once
    for a, b, ca, cb in S:
        a.normal_(); b.normal_(); ca.fill_(float('nan')); cb.fill_(float('nan'))
    this = []
    for i in rng.sample(range(sets), sets):
        a, b, ca, cb = S[i]
        if rng.random() < 0.5:
            tb = call(x, a, b, cb); ta = call(h, a, b, ca)
        else:
            ta = call(h, a, b, ca); tb = call(x, a, b, cb)
        wrong += not torch.allclose(cb, ca, rtol=1e-4, atol=1e-4)
        this.append((ta, tb))
    if p:
        pairs.append(this)
print(json.dumps({"pairs": pairs, "wrong": wrong}))
"""


def naive_passes(cheat_lib: str, honest_lib: str, n: int = 192, sets: int = 8, passes: int = 8) -> dict:
    import math

    from tests import stats_7546d11 as old
    from tools.stats import ratio_of_sums

    proc = subprocess.run([sys.executable, "-c", NAIVE_PASSES, cheat_lib, honest_lib, str(n), str(sets), str(passes)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    flat = [pair for p in got["pairs"] for pair in p]
    before = old.trimmed_estimate([math.log(ta / tb) for ta, tb in flat])
    lo, hi = before.interval()
    now = ratio_of_sums([sum(ta for ta, _ in p) for p in got["pairs"]], [sum(tb for _, tb in p) for p in got["pairs"]])
    median = sorted(ta for ta, _ in flat)[len(flat) // 2] / sorted(tb for _, tb in flat)[len(flat) // 2]
    return {"wrong": got["wrong"], "naive_median_speedup": median, "old_speedup": math.exp(before.mean),
            "old_lo": math.exp(lo), "old_hi": math.exp(hi), "throughput_speedup": now.speedup}


@pytest.mark.parametrize("cheat, most", [
    # its own output and a whole other set's per computing call: total work unchanged
    ("rt_work_ahead", 1.25),
    # one call per pass computes the whole pass with a cache-hostile loop, the others are free
    ("rt_sacrifice", 0.9),
])
def test_work_spread_over_calls_fools_the_old_statistic_and_not_the_gate(cheat, most, gate, honest, tmp_path):
    """Statistical cheats: every output right, no call faster for a user. A naive harness (same
    buffers, best of the last calls) and the trimmed mean of per-pair log ratios (the gate's statistic
    before the workload ratio, commit 7546d11) both read a gain; the gate's ratio of the passes'
    summed times reads none, and the gate does not accept."""
    built = build(gate.task, src_root=task_copy(tmp_path, cheat))
    assert built.ok, built.error_text()
    assert faster(naive(built.lib, honest.lib)), f"{cheat} does not fool the naive harness"
    r = naive_passes(built.lib, honest.lib)
    assert r["wrong"] == 0, r  # every output right when its call returns
    assert r["old_lo"] > 1.01, f"the 7546d11 statistic would not have accepted {cheat}: {r}"
    assert r["throughput_speedup"] < most, r
    v = gate.judge_built(built, honest)
    assert not v.accepted, v.summary()
    assert v.stage in ("timing", "undecided"), v.summary()
    if v.ab is not None and v.ab.passes >= 2:  # the verdict's own estimate says no faster
        assert v.ab.speedup < most, v.summary()
    if cheat == "rt_sacrifice" and v.stage == "timing":  # a x0.3: a regression, or (per-shape intervals
        # too wide to name one under load) not faster, never a gain
        assert v.reason.startswith(("regression beyond the allowance", "not measurably faster")), v.summary()
# A harness that charges the calls only: fresh values and poison for every set, then its own work (a
# cache flush, references, bookkeeping: 100 ms here), then each call timed on its own, each output compared.
NAIVE_WINDOW = r"""
import ctypes, json, sys, time, torch
cheat, honest, n, sets, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0); torch.set_num_threads(1)
def load(p):
    lib = ctypes.CDLL(p); lib.kloop_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3; return lib
def call(lib, a, b, c):
    lib.kloop_matmul(a.data_ptr(), b.data_ptr(), c.data_ptr(), a.shape[0], b.shape[1], a.shape[1])
def timed(lib):
    S = [(torch.empty(n, n), torch.empty(n, n), torch.empty(n, n)) for _ in range(sets)]
    ts, wrong = [], 0
    for r in range(rounds):
        for a, b, c in S:
            a.normal_(); b.normal_(); c.fill_(float('nan'))
        time.sleep(0.1)
        for a, b, c in S:
            t = time.perf_counter(); call(lib, a, b, c); ts.append(time.perf_counter() - t)
            wrong += not torch.allclose(c, a @ b, rtol=1e-3, atol=1e-3)
    ts.sort()
    return ts[len(ts) // 2], wrong
h, x = load(honest), load(cheat)
t_h, _ = timed(h)
t_x, wrong_x = timed(x)
print(json.dumps({"speedup": t_h / t_x, "wrong": wrong_x}))
"""


def test_work_in_the_window_between_calls_is_charged(gate, honest, tmp_path):
    """rt_window_thread: a helper thread (no import) computes each set's output in the harness's own
    time between calls (issue 20: the family was accepted 4 of 9 times at x1.86-2.27 by the gate of
    7546d11, whose clock charged no sample from a cold probe to the next sample, nor the judge's flush;
    this version also works in charged gaps, so 7546d11 already rejects it as work after return).
    Runners are now frozen between requests and every CPU-ns of theirs is charged: the helper can work
    only inside a timed request, beside the call, and its CPU lands in that sample."""
    built = build(gate.task, src_root=task_copy(tmp_path, "rt_window_thread"))
    assert built.ok, built.error_text()
    proc = subprocess.run([sys.executable, "-c", NAIVE_WINDOW, built.lib, honest.lib, "128", "4", "6"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["wrong"] == 0 and r["speedup"] > 5, f"rt_window_thread does not fool the naive harness: {r}"
    v = gate.judge_built(built, honest)
    # every CPU-ns of the candidate's runner went to a sample, a probe or an untimed call: the helper's
    # work costs what it costs (frozen between requests, it can only work beside a timed call)
    assert v.ab is not None, v.summary()
    assert v.ab.measure == "cpu" and v.ab.cpu_in_samples_b > 0, v.ab
    assert abs(v.ab.cpu_unattributed_b) < 1e-3 * v.ab.cpu_in_samples_b, v.ab
    # each pair's two samples on the judge's CPU (tools/placement.py), wherever there is more than one
    cpus = len(os.sched_getaffinity(0))
    assert (v.ab.placed_from_cpus, v.ab.placement_error) == (cpus if cpus > 1 else 0, None), v.ab
    # what is left is work moved between calls (the helper computes the next sets beside this call): the
    # per-pair trimmed mean (7546d11's statistic) read x2.23 [1.24, 4.01] on this branch before the
    # workload ratio landed (2-core box, under load); the ratio of workload times sees the summed CPU
    assert not v.accepted, v.summary()
    assert v.stage in ("timing", "undecided"), v.summary()


def test_a_frozen_runner_uses_no_cpu_between_requests(gate, tmp_path):
    """The window closed at its source: between requests a CPU runner is stopped (SIGSTOP), so
    rt_window_thread's helper, which polls its sets every 100 us while it runs, gets no CPU at all."""
    from tools.remote import LibSession

    built = build(gate.task, src_root=task_copy(tmp_path, "rt_window_thread"))
    assert built.ok, built.error_text()
    with LibSession(gate.task, [built.lib]) as s:
        lib, runner = s.libs[0], s.libs[0].runner
        import torch
        from tools.spec import load_spec

        spec = load_spec(gate.task.spec_path)
        dims = gate.task.shape("odd").dims
        inputs = s.arena.share_dict(spec.make_inputs(dims, torch.Generator().manual_seed(1), s.device), inputs=True)
        lib.bind("k", dims, inputs, s.arena.share_dict(spec.make_outputs(dims, inputs)))
        lib.call(["k"])  # the first call starts the helper thread
        assert runner.frozen and runner.threads() >= 2

        def states() -> set[str]:  # every thread's: the stop lands on each asynchronously
            return {t.read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{runner.pid}/task").glob("*/stat")}

        for _ in range(500):
            if states() == {"T"}:
                break
            time.sleep(0.002)
        assert states() == {"T"}
        c0 = runner.cpu_ns()
        time.sleep(0.2)
        assert runner.cpu_ns() == c0, "a frozen runner's helper thread ran"
        runner.resume()
        time.sleep(0.2)
        assert runner.cpu_ns() > c0, "the helper thread does not run even when resumed: this tests nothing"
        runner.stop()
