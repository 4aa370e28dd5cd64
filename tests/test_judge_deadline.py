"""The judge's two deadlines (tools/judge_handle._wait): its start-up and library loads have their own
allowance, and the request's timeout counts only from the `loaded` marker, so a host slowed by load
(a start of many seconds) never turns into a "hang" verdict, and a real hang is still cut off."""

import subprocess
import sys
import time

from tools import judge_handle


def _child(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script])


def test_a_slow_start_does_not_count_against_the_request(tmp_path):
    loaded = tmp_path / "loaded"
    # 1.5 s of "start-up", then 0.5 s of work, under a 1 s request timeout: it finished in time
    proc = _child(f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(loaded)!r}).write_text('1'); time.sleep(0.5)")
    overran, _ = judge_handle._wait(proc, 1.0, loaded)
    assert overran is None and proc.returncode == 0


def test_work_past_the_timeout_after_loading_is_a_hang(tmp_path):
    loaded = tmp_path / "loaded"
    proc = _child(f"import time, pathlib; pathlib.Path({str(loaded)!r}).write_text('1'); time.sleep(30)")
    started = time.monotonic()
    try:
        overran, _ = judge_handle._wait(proc, 1.0, loaded)
    finally:
        proc.kill()
        proc.wait()
    assert overran == "work" and time.monotonic() - started < 10


def test_a_start_that_never_loads_is_cut_off_at_the_start_allowance(tmp_path, monkeypatch):
    monkeypatch.setattr(judge_handle, "STARTUP_TIMEOUT_S", 1.0)
    proc = _child("import time; time.sleep(30)")
    started = time.monotonic()
    try:
        overran, _ = judge_handle._wait(proc, 0.5, tmp_path / "loaded")
    finally:
        proc.kill()
        proc.wait()
    assert overran == "start" and 1.4 <= time.monotonic() - started < 10
