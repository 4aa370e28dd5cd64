"""CPU placement of a timed pair (tools/placement.py): both runners, and the judge's flushing thread, on the
CPU the judge's thread is on; runners cannot move themselves; no runner thread keeps a capability that
would make the judge's pinning fail."""

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
def test_each_pair_puts_both_runners_and_the_judge_thread_on_one_cpu():
    """By default the CPU the judge's thread is on (the scheduler's pick: not a busy neighbour's, mostly)."""
    from tools.placement import _current_cpu

    a, b = _Pinned(), _Pinned()
    home = os.sched_getaffinity(0)
    place = Placement([a, b], threads=1, rng=random.Random(1))
    try:
        for _ in range(10):
            here = _current_cpu()
            cpus = place.draw()
            assert cpus == frozenset({here}) == frozenset(os.sched_getaffinity(0)) == a.masks[-1] == b.masks[-1]
            place.release()
        assert place.pinned == 10 and place.error is None
    finally:
        place.release()
    assert os.sched_getaffinity(0) == home


@several
def test_where_the_current_cpu_is_unknown_the_cpu_is_drawn(monkeypatch):
    import tools.placement as placement

    monkeypatch.setattr(placement, "_current_cpu", lambda: None)
    a, b = _Pinned(), _Pinned()
    place = Placement([a, b], threads=1, rng=random.Random(1))
    try:
        seen = set()
        for _ in range(40):
            cpus = place.draw()
            assert len(cpus) == 1 and a.masks[-1] == b.masks[-1] == cpus == frozenset(os.sched_getaffinity(0))
            seen |= cpus
        assert seen == set(CPUS)
    finally:
        place.release()


@several
def test_threaded_sides_get_as_many_cpus_as_threads_and_nothing_is_drawn_without_more():
    a = _Pinned()
    place = Placement([a], threads=len(CPUS) - 1, rng=random.Random(2))
    try:
        assert len(place.draw()) == len(CPUS) - 1
    finally:
        place.release()
    whole = Placement([a], threads=len(CPUS))
    assert not whole.active and whole.draw() is None  # a side may use every CPU: nothing to choose


@several
def test_a_refused_pin_leaves_the_decision_unplaced_and_says_why():
    home = os.sched_getaffinity(0)
    a, b = _Pinned(), _Pinned(refuse=True)
    place = Placement([a, b], rng=random.Random(3))
    assert place.draw() is None
    assert not place.active and "refused" in place.error
    assert os.sched_getaffinity(0) == home and a.masks[-1] == frozenset(home)  # everything back where it was
    assert place.draw() is None and place.pinned == 0


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

    monkeypatch.setenv(sandbox.RUNNER_PIDNS_VAR, "1" if sandbox.status().runner_pidns else "0")
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
