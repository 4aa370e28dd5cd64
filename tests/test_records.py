"""agent.records: write-ahead run records that survive kills and never hold a secret."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agent.records import (
    TORN,
    AttemptStarted,
    Baseline,
    Committed,
    LlmTurn,
    Note,
    RecordError,
    Restored,
    RunInfo,
    RunRecord,
    SecretScrubber,
    SessionEnded,
    SessionStarted,
    ToolCall,
    Verdict,
    list_runs,
    new_run_id,
)

REPO = Path(__file__).resolve().parents[1]


def info(run_id: str = "20261129-0915-softmax-3fa2", **kw) -> RunInfo:
    data = dict(
        run_id=run_id,
        task="softmax",
        task_rel="kernels/softmax",
        task_path="/repo/kernels/softmax",
        policy="claude",
        config={"max_turns": 50, "knobs": {"BLOCK": 256}},
        base_commit="a" * 40,
        branch=f"kloop/{run_id}",
        repo_root="/repo",
        worktree=f"/tmp/wt/{run_id}",
        versions={"kloop": "0.1.0", "python": "3.11.7", "compiler": "nvcc 12.6", "driver": "560.35.03"},
        gpu="NVIDIA H200",
        machine={"hostname": "box", "sm_clock_mhz": 1980},
    )
    data.update(kw)
    return RunInfo.model_validate(data)


@pytest.fixture
def record(tmp_path: Path) -> RunRecord:
    return RunRecord.create(tmp_path / "runs", info())


def test_create_open_and_layout(record: RunRecord, tmp_path: Path):
    d = tmp_path / "runs" / "20261129-0915-softmax-3fa2"
    assert record.dir == d
    assert (d / "run.json").is_file() and (d / "events.jsonl").is_file() and (d / "attempts").is_dir()
    again = RunRecord.open(d)
    assert again.info == record.info
    assert again.info.versions.compiler == "nvcc 12.6"
    assert again.info.machine["sm_clock_mhz"] == 1980
    assert again.info.started_at.tzinfo is not None
    with pytest.raises(RecordError, match="already exists"):
        RunRecord.create(tmp_path / "runs", info())
    with pytest.raises(RecordError, match="not a run record"):
        RunRecord.open(tmp_path)


def test_every_kind_round_trips(record: RunRecord):
    events = [
        SessionStarted(),
        Baseline(figures={"n_4096": {"median_us": 12.3}}),
        AttemptStarted(attempt=1, title="Unroll", rationale="why", patch="attempts/001.patch", knobs={"BLOCK": 128}),
        Verdict(attempt=1, accepted=True, reason="faster", figures={"speedup": 1.08, "ci": [1.05, 1.11]}),
        Committed(attempt=1, commit="b" * 40),
        Restored(to="b" * 40, attempt=2),
        ToolCall(name="build", input="knobs={}", ok=False, duration_s=1.5, error="nvcc failed"),
        LlmTurn(turn=3, usage={"input_tokens": 1000}, cost_usd=0.02, stop_reason="tool_use"),
        Note(text="hello", data={"x": 1}),
        SessionEnded(reason="max_turns"),
    ]
    written = [record.append(e) for e in events]
    assert [w.seq for w in written] == list(range(len(events)))
    back = RunRecord.open(record.dir).events()
    assert back == written
    assert [type(e) for e in back] == [type(e) for e in events]
    for e in back:
        assert e.t.tzinfo is not None
    lines = (record.dir / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "session_started"
    assert json.loads(lines[0])["t"].endswith("Z")
    # a generic logger for PolicyContext.log
    ev = record.log("note", text="via log")
    assert ev.seq == len(events) and isinstance(ev, Note)
    with pytest.raises(RecordError, match="invalid 'verdict' event"):
        record.log("verdict", attempt=1)


def test_seq_continues_after_reopen(record: RunRecord):
    record.append(Note(text="one"))
    record.append(Note(text="two"))
    again = RunRecord.open(record.dir)
    assert again.append(Note(text="three")).seq == 2


def test_truncated_last_line_ignored_reported_and_repaired(record: RunRecord, caplog):
    for i in range(3):
        record.append(Note(text=f"n{i}"))
    with open(record.events_path, "ab") as f:
        f.write(b'{"kind":"note","seq":3,"t":"2026-11-29T09:1')  # a write cut by kill -9
    reader = RunRecord.open(record.dir)
    events, torn = reader.read()
    assert [e.text for e in events] == ["n0", "n1", "n2"]
    assert torn is not None and torn.length > 0
    with caplog.at_level("WARNING"):
        assert len(reader.events()) == 3
    assert "incomplete last line" in caplog.text
    # readers never modify the file
    assert record.events_path.read_bytes().endswith(b"09:1")

    writer = RunRecord.open(record.dir)
    ev = writer.append(Note(text="after"))
    assert ev.seq == 3
    assert writer.repaired is not None
    events, torn = writer.read()
    assert torn is None and [e.text for e in events] == ["n0", "n1", "n2", "after"]
    assert b"09:1" in (record.dir / TORN).read_bytes()  # kept aside, not lost


def test_corrupt_middle_line_is_an_error(record: RunRecord):
    record.append(Note(text="ok"))
    with open(record.events_path, "ab") as f:
        f.write(b"garbage\n")
    with pytest.raises(RecordError, match=r"events.jsonl:2"):
        record.events()


def test_sigkill_while_appending_leaves_readable_record(record: RunRecord):
    child = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from agent.records import RunRecord, Note
        rec = RunRecord.open({str(record.dir)!r})
        i = 0
        while True:
            rec.append(Note(text="x" * 2000, data={{"i": i}}))
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 10
        while record.events_path.stat().st_size < 40_000 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    events = RunRecord.open(record.dir).events()
    assert len(events) >= 10
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.data["i"] for e in events] == list(range(len(events)))
    nxt = RunRecord.open(record.dir).append(SessionStarted(resumed=True))
    assert nxt.seq == len(events)


def test_write_patch_atomic(record: RunRecord):
    text = "diff --git a/x b/x\n+caf\udce9\n"  # a non-UTF-8 byte, as workspace.diff() decodes it
    p = record.write_patch(3, text)
    assert p == record.dir / "attempts" / "003.patch"
    assert p.read_bytes() == b"diff --git a/x b/x\n+caf\xe9\n"
    assert record.read_patch(3) == text
    record.write_patch(3, "replaced\n")
    assert p.read_text() == "replaced\n"
    assert sorted(x.name for x in (record.dir / "attempts").iterdir()) == ["003.patch"]  # no tmp files left
    assert record.write_patch(1234, "x").name == "1234.patch"


SECRET = "sk-ant-api03-" + "A1b2C3d4" * 6
TOKEN = "ghp_" + "z9" * 18


def test_secrets_never_reach_the_record(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
    monkeypatch.setenv("MY_SECRET", "hunter2-hunter2")
    monkeypatch.setenv("SOME_KEY", "1")  # too short to be a secret: left alone
    rec = RunRecord.create(
        tmp_path / "runs", info(config={"env": {"ANTHROPIC_API_KEY": SECRET}, "flag": "1"})
    )
    rec.append(ToolCall(name="bash", input=f"curl -H 'x-api-key: {SECRET}'", ok=True))
    rec.append(Note(text="token", data={"nested": [{"t": TOKEN}], TOKEN: "as a key", "pw": "hunter2-hunter2"}))
    rec.append(Verdict(attempt=1, accepted=False, reason=f"crashed; env had {SECRET}", figures={"speedup": 1}))
    rec.write_patch(1, f"+const char* k = \"{SECRET}\";\n")

    everything = b"".join(p.read_bytes() for p in rec.dir.rglob("*") if p.is_file())
    for s in (SECRET, TOKEN, "hunter2-hunter2"):
        assert s.encode() not in everything
    assert b"[REDACTED:ANTHROPIC_API_KEY]" in everything
    assert b"[REDACTED:GITHUB_TOKEN]" in everything
    assert b"[REDACTED:MY_SECRET]" in everything
    events = rec.events()
    assert events[0].input == "curl -H 'x-api-key: [REDACTED:ANTHROPIC_API_KEY]'"
    assert events[1].data["nested"][0]["t"] == "[REDACTED:GITHUB_TOKEN]"
    assert rec.info.config["flag"] == "1"


def test_scrubber_unit():
    s = SecretScrubber.from_env({"ANTHROPIC_API_KEY": SECRET, "PATH": "/usr/bin:/bin", "X_TOKEN": "short"})
    assert [n for n, _ in s.secrets] == ["ANTHROPIC_API_KEY"]
    text, hits = s.scrub_text(f"a {SECRET} b")
    assert text == "a [REDACTED:ANTHROPIC_API_KEY] b" and hits == ["ANTHROPIC_API_KEY"]
    assert s.find(json.dumps({"k": SECRET})) == ["ANTHROPIC_API_KEY"]
    assert s.find("/usr/bin:/bin") == []


def test_list_runs(tmp_path: Path):
    runs = tmp_path / "runs"
    a = RunRecord.create(runs, info("20261129-0900-softmax-aaaa"))
    a.append(SessionStarted())
    for n, (ok, sp) in enumerate([(True, 1.05), (False, 1.5), (True, 1.12)], start=1):
        a.append(AttemptStarted(attempt=n, title=f"t{n}"))
        a.append(Verdict(attempt=n, accepted=ok, reason="r", figures={"speedup": sp}))
    a.append(SessionEnded(reason="budget"))
    b = RunRecord.create(runs, info("20261129-1000-softmax-bbbb", policy="tuner"))
    b.append(SessionStarted())
    with open(b.events_path, "ab") as f:
        f.write(b'{"kind":')
    (runs / "not-a-run").mkdir()

    out = list_runs(runs)
    assert [s.run_id for s in out] == ["20261129-0900-softmax-aaaa", "20261129-1000-softmax-bbbb"]
    sa, sb = out
    assert (sa.task, sa.policy, sa.attempts, sa.accepted) == ("softmax", "claude", 3, 2)
    assert sa.best_speedup == pytest.approx(1.12)  # rejected verdicts do not count
    assert sa.ended and sa.end_reason == "budget" and not sa.torn
    assert sa.last_event_at is not None and sa.started_at is not None
    assert (sb.policy, sb.attempts, sb.best_speedup, sb.ended, sb.torn) == ("tuner", 0, None, False, True)
    assert list_runs(tmp_path / "missing") == []


def test_new_run_id():
    when = datetime(2026, 11, 29, 9, 15, tzinfo=timezone.utc)
    rid = new_run_id("Soft_Max v2!", now=when)
    assert re.fullmatch(r"20261129-091500-soft-max-v2-[0-9a-f]{4}", rid)
    ids = {new_run_id("softmax") for _ in range(50)}
    assert len(ids) > 45
    later = new_run_id("softmax", now=datetime(2026, 11, 29, 9, 16, tzinfo=timezone.utc))
    assert later > rid.replace("soft-max-v2", "softmax")
