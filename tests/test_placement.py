"""CPU placement of a timed pair (tools/placement.py): both runners on the CPU the judge's thread is on;
runners cannot move themselves; no runner thread keeps a capability that would make the pinning fail."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from tools import sandbox
from tools.placement import Placement

ROOT = Path(__file__).resolve().parents[1]
CPUS = sorted(os.sched_getaffinity(0))
several = pytest.mark.skipif(len(CPUS) < 2, reason="placement needs at least 2 CPUs")


class _Pinned:
    """A runner stand-in that records the masks it was pinned to."""

    def __init__(self, refuse: bool = False):
        self.masks: list[frozenset[int]] = []
        self.refuse = refuse

    def pin(self, cpus) -> None:
        if self.refuse:
            raise PermissionError(1, "Operation not permitted")
        self.masks.append(frozenset(cpus))


@several
def test_each_pair_puts_both_runners_on_the_judges_cpu():
    """The CPU the judge's thread is on (the scheduler's pick: not a busy neighbour's, mostly); the judge itself
    stays free, so the scheduler can move it, and the next pair with it."""
    from tools.placement import _current_cpu

    a, b = _Pinned(), _Pinned()
    home = os.sched_getaffinity(0)
    place = Placement([a, b], threads=1, rng=random.Random(1))
    for _ in range(10):
        before = _current_cpu()
        cpus = place.draw()
        after = _current_cpu()
        assert cpus is not None and len(cpus) == 1 and cpus <= home and cpus == a.masks[-1] == b.masks[-1]
        assert before in cpus or after in cpus  # where the judge was (it may have moved right after)
    assert place.pinned == 10 and place.error is None
    assert os.sched_getaffinity(0) == home  # the judge is never pinned


@several
def test_where_the_current_cpu_is_unknown_the_cpu_is_drawn(monkeypatch):
    import tools.placement as placement

    monkeypatch.setattr(placement, "_current_cpu", lambda: None)
    a, b = _Pinned(), _Pinned()
    place = Placement([a, b], threads=1, rng=random.Random(1))
    seen = set()
    for _ in range(50 * len(CPUS)):
        cpus = place.draw()
        assert len(cpus) == 1 and a.masks[-1] == b.masks[-1] == cpus
        seen |= cpus
        if seen == set(CPUS):
            break
    assert seen == set(CPUS)


@several
def test_threaded_sides_get_as_many_cpus_as_threads_and_nothing_is_drawn_without_more():
    a = _Pinned()
    place = Placement([a], threads=len(CPUS) - 1, rng=random.Random(2))
    assert len(place.draw()) == len(CPUS) - 1
    whole = Placement([a], threads=len(CPUS))
    assert not whole.active and whole.draw() is None  # a side may use every CPU: nothing to choose


@several
def test_a_refused_pin_leaves_the_decision_unplaced_and_says_why():
    home = frozenset(os.sched_getaffinity(0))
    a, b = _Pinned(), _Pinned(refuse=True)
    place = Placement([a, b], rng=random.Random(3))
    with pytest.raises(RuntimeError, match="could not be put back"):
        place.draw()  # b refuses its way back too: the sides would differ, so the decision stops

    class _RefusesOnce(_Pinned):
        def pin(self, cpus) -> None:
            if not self.masks and frozenset(cpus) != home:
                self.masks.append(None)
                raise PermissionError(1, "Operation not permitted")
            self.masks.append(frozenset(cpus))

    a, b = _Pinned(), _RefusesOnce()
    place = Placement([a, b], rng=random.Random(3))
    assert place.draw() is None
    assert not place.active and "refused" in place.error
    assert a.masks[-1] == b.masks[-1] == home  # both back on every CPU
    assert place.draw() is None and place.pinned == 0


def test_a_gone_runner_is_an_error_not_a_refusal():
    class _Gone:
        def pin(self, cpus) -> None:
            raise FileNotFoundError(2, "No such file or directory: '/proc/123/task'")

    place = Placement([_Gone()], rng=random.Random(4))
    place.active = True  # even on one CPU
    with pytest.raises(FileNotFoundError):
        place.draw()


def _needs_lockdown():
    try:
        import pyseccomp  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"no seccomp: {exc}")


def test_a_cpu_runner_cannot_move_itself(tmp_path):
    """lockdown(own_placement=False), a CPU runner's filter: sched_setaffinity is denied even on itself,
    so a runner cannot leave the CPU the judge drew for the pair (for the faster one, say)."""
    _needs_lockdown()
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tools.sandbox import lockdown\n"
        "lockdown(own_placement=sys.argv[1] == 'own')\n"
        "cpus = os.sched_getaffinity(0)\n"
        "try:\n"
        "    os.sched_setaffinity(0, cpus); print('moved')\n"
        "except PermissionError:\n"
        "    print('denied')\n")
    import subprocess

    got = {mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60)
           for mode in ("own", "judge")}
    assert got["own"].stdout.strip() == "moved", got["own"].stderr[-500:]
    assert got["judge"].stdout.strip() == "denied", got["judge"].stderr[-500:]


def test_no_runner_thread_keeps_a_capability(tmp_path, monkeypatch):
    """Capabilities are per thread: a runner drops them before torch starts a thread (tools/libhost.py). A
    thread started earlier kept CAP_SYS_ADMIN where the judge held it, and the judge, which drops its own,
    could then not pin that runner (EPERM: the target had capabilities the caller lacked)."""
    from tools.runner import Runner

    pidns = sandbox.status().runner_pidns
    own = int(Path("/proc/self/status").read_text().split("CapEff:")[1].split()[0], 16)
    if not own and not pidns:
        pytest.skip("runners start without capabilities here (no capability of ours, no user namespace of theirs)")
    monkeypatch.setenv(sandbox.RUNNER_PIDNS_VAR, "1" if pidns else "0")
    runner = Runner(tmp_path, "caps")
    try:
        runner.prepare(ROOT / "kernels" / "matmul_cpu" / "spec.py", "cpu", 120)
        assert runner.threads() >= 1
        assert sandbox.threads_with_capabilities(runner.pid) == []
        if len(CPUS) >= 2:  # and the judge can pin every one of its threads
            runner.pin({CPUS[-1]})
            for tid in os.listdir(f"/proc/{runner.pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {CPUS[-1]}
    finally:
        runner.close()


_PINNING_KERNEL = r"""
// Moves itself (to the CPU it is on: a no-op where allowed). A CPU runner must not be able to: its CPU is
// the judge's to choose for each timed pair. The output is right only where the call was refused.
#include <sched.h>
#include <cmath>
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(sched_getcpu(), &set);
  bool moved = sched_setaffinity(0, sizeof set, &set) == 0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = moved ? NAN : acc;
    }
  return 0;
}
"""


def test_a_cpu_kernel_cannot_repin_its_runner(tmp_path):
    """The wiring, end to end: the judge's CPU runner is locked down with own_placement=False
    (tools/libhost.py), so a kernel's sched_setaffinity(0) fails there (where seccomp runs at all)."""
    import json
    import shutil
    import subprocess

    if not sandbox.status().seccomp:
        pytest.skip("no seccomp here: runners are not locked down")
    folder = tmp_path / "task"
    shutil.copytree(ROOT / "kernels" / "matmul_cpu", folder)
    (folder / "matmul.cpp").write_text(_PINNING_KERNEL)
    from tests.test_sandbox import _CHECK_SCRIPT  # the same run_check in a child, one way to read its answer

    p = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT, str(folder)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ok"] and got["passed"], got  # NaN had the kernel moved its runner
