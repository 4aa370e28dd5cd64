"""`kloop report`, `kloop serve` and `kloop compare` on real records, checked in a real headless browser.

Records: a CPU session made here (the tuner on a copy of kernels/matmul_cpu in a temp git repo) and
a recorded H200 session kept as a fixture (tests/fixtures/softmax_h200, see its README). The browser
is the system's Chromium (`apt-get install chromium`) driven by Playwright; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from agent.cli import app
from agent.gate import GateConfig
from agent.policies.base import Budget
from agent.policies.tuner import TunerPolicy
from agent.records import RunRecord
from agent.run_view import load_view
from agent.session import Session
from agent.web import plotly_url
from tests.fakes import commit_all, make_repo

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "softmax_h200"
EXAMPLE = ROOT / "docs" / "example-run" / "20261202-053931-matmul-cpu-09f9"  # a real CPU run (README screenshots)
CHROMIUM = os.environ.get("KLOOP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

NO_BROWSER = f"no Chromium at {CHROMIUM}: apt-get install chromium (CI installs it in .ci/run)"
REQUIRED = os.environ.get("KLOOP_REQUIRE_BROWSER") == "1"  # set by .ci/run: there, a missing browser is a failure

pytestmark = pytest.mark.slow
needs_browser = pytest.mark.skipif(not Path(CHROMIUM).is_file() and not REQUIRED, reason=NO_BROWSER)


# ---- records ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """A runs folder holding a fresh CPU session (tuner, at most 2 attempts) and the H200 fixture.
    The tile knob keeps one value: a 2-setting sweep instead of 6 (each setting is timed in its own worker,
    ~4.5 s here); the attempts are as with all six here (i-k-j ranks first and is accepted, nothing else ranks faster)."""
    tmp = tmp_path_factory.mktemp("web")
    repo = make_repo(tmp, timeout_s=120)  # no hang is tested here: a loaded 2-core box must not fail the baseline's check
    manifest = repo / "kernels" / "matmul_cpu" / "task.toml"
    assert "values = [0, 16, 64]" in manifest.read_text()
    manifest.write_text(manifest.read_text().replace("values = [0, 16, 64]", "values = [0]"))
    commit_all(repo, "no tiling")
    session = Session.start(repo / "kernels" / "matmul_cpu", "tuner", Budget(max_attempts=2), runs_root=tmp / "runs",
                            gate_config=GateConfig(max_seconds=3.0, min_pairs=8))  # MIN_PASSES passes must fit
    session.run(TunerPolicy(seconds_per_shape=0.1, console=Console(file=open(tmp / "tuner.log", "w"))))
    shutil.copytree(FIXTURE, tmp / "runs" / "20261129-101500-softmax-h200")
    return tmp / "runs"


@pytest.fixture(scope="module")
def cpu_run(runs_root) -> Path:
    return next(p for p in runs_root.iterdir() if "matmul-cpu" in p.name)


@pytest.fixture(scope="module")
def gpu_run(runs_root) -> Path:
    return runs_root / "20261129-101500-softmax-h200"


def expected_points(run_dir: Path) -> dict[str, int]:
    """Markers each plot must draw, counted from the record (not from the renderer)."""
    v = load_view(run_dir)
    shapes = sum(len(s.times) * 2 for s in v.series if s.times)  # time per call and x base, per commit
    if any(s.times for s in v.series):  # the gate's baseline and best (the comparators are the quick bench's)
        roof = sum(1 + (len(s.times) > 1) for s in v.series if s.flops and s.bytes and s.times)
    else:
        roof = sum(1 + len(s.comparators) for s in v.series if s.flops and s.bytes and s.bench_time)
    return {"progress": len(v.attempts), "shapes": shapes, "roofline": roof}


# ---- the browser --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        (pytest.fail if REQUIRED else pytest.skip)(NO_BROWSER)
    if REQUIRED:
        import playwright.sync_api as sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the [test] extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A page that records console errors, page errors, dialogs and every request it makes."""

    def __init__(self, browser):
        self.page = browser.new_page(viewport={"width": 1300, "height": 900})
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

        def dialog(d):
            self.dialogs.append(d.message)
            d.dismiss()

        self.page.on("dialog", dialog)

    def open(self, url: str) -> "Page":
        self.page.goto(url)
        self.page.wait_for_selector("#body")
        self.page.wait_for_load_state("load")
        self.page.wait_for_timeout(300)
        return self

    def points(self, plot: str) -> int:
        return self.page.locator(f"#plot-{plot} path.point").count()

    def close(self) -> None:
        self.page.close()


def check_report_page(p: Page, run_dir: Path) -> None:
    v = load_view(run_dir)
    want = expected_points(run_dir)
    for plot, n in want.items():
        if n:
            p.page.wait_for_selector(f"#plot-{plot} svg.main-svg")
            assert p.points(plot) == n, (plot, p.points(plot), n)
    assert p.page.locator("tr.attempt").count() == len(v.attempts)
    assert v.device in p.page.inner_text("div.header")
    # clicking an attempt opens its diff (and only then)
    for a in v.attempts:
        detail = p.page.locator(f"#attempt-{a.number}")
        assert not detail.is_visible()
        p.page.click(f'tr.attempt[data-n="{a.number}"]')
        assert detail.is_visible()
        changed = [l for l in a.patch.splitlines() if l.startswith("+") and not l.startswith("+++")]
        if changed:
            assert changed[-1] in detail.locator("pre.diff").inner_text()
        else:
            assert "empty patch" in detail.inner_text()
        p.page.click(f'tr.attempt[data-n="{a.number}"]')
        assert not detail.is_visible()
    assert p.errors == [] and p.dialogs == []


# ---- kloop report -------------------------------------------------------------------------------

def write_report(run_dir: Path, out: Path) -> Path:
    res = CliRunner().invoke(app, ["report", str(run_dir), "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_report_goes_to_the_run_folder_not_the_working_folder(tmp_path, monkeypatch):
    run = shutil.copytree(FIXTURE, tmp_path / "runs" / "20261129-101500-softmax-h200")
    here = tmp_path / "checkout"
    here.mkdir()
    monkeypatch.chdir(here)
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert (run / "report.html").stat().st_size > 100_000 and list(here.iterdir()) == []
    assert str(run / "report.html") in res.output.replace("\n", "")


@needs_browser
def test_report_of_a_cpu_session_renders_offline(browser, cpu_run, tmp_path):
    v = load_view(cpu_run)
    assert v.attempts and v.series and v.device_kind == "cpu"
    out = write_report(cpu_run, tmp_path / "cpu.html")
    p = Page(browser).open(out.as_uri())
    check_report_page(p, cpu_run)
    # self-contained: the file loads nothing (the CSP would refuse it anyway)
    assert [u for u in p.requests if not u.startswith("file:")] == []
    assert "SASS instruction mix: not" not in p.page.inner_text("#body")  # a CPU task has no kernels table at all
    p.close()


@needs_browser
def test_report_of_the_h200_fixture(browser, gpu_run, tmp_path):
    out = write_report(gpu_run, tmp_path / "gpu.html")
    p = Page(browser).open(out.as_uri())
    check_report_page(p, gpu_run)
    text = p.page.inner_text("#body")
    assert "NVIDIA H200, driver 580.159.04" in text and "nvcc 13.0" in text and "$1.05" in text
    # rejected attempts are coloured by the stage that rejected them
    legend = p.page.locator("#plot-progress g.legend").text_content()
    for stage in ("rejected: timing", "rejected: check", "rejected: build"):
        assert stage in legend
    # per-shape panels: the roofline bound is labelled; the comparators (quick bench) are a table of their own
    shapes_text = p.page.locator("#plot-shapes").text_content()
    assert "roofline bound 253.2 µs" in shapes_text and "torch.softmax" not in shapes_text
    bench = p.page.locator("table.bench").inner_text()
    assert "torch.softmax" in bench and "829.5 µs" in bench and "454.3 µs" in bench
    # attempt 3's registers against the best (40 -> 168) and the SASS mix deltas are shown
    p.page.click('tr.attempt[data-n="3"]')
    delta = p.page.locator("#attempt-3 table.delta").inner_text()
    assert "registers\t168\t40\t+128" in delta
    p.page.click('tr.attempt[data-n="1"]')
    d1 = p.page.locator("#attempt-1 table.delta").inner_text()
    assert "SASS LDG.128\t12\t14\t-2" in d1 and "SASS instructions\t1236\t1402\t-166" in d1
    # the transcript: one folded tool call per recorded call; a click unfolds its input and output
    calls = [json.loads(l) for l in (gpu_run / "events.jsonl").read_text().splitlines()]
    tool_calls = [e for e in calls if e["kind"] == "tool_call"]
    tools = p.page.locator("details.tool")
    assert tools.count() == len(tool_calls)
    first = tools.nth(0)
    assert not first.locator("pre").first.is_visible()
    first.locator("summary").click()
    assert tool_calls[0]["text"][:30] in first.inner_text()
    assert "notes" in p.page.locator("h2", has_text="Notes").inner_text().lower()
    assert "shared-memory staging" in text.lower()
    assert p.errors == [] and [u for u in p.requests if not u.startswith("file:")] == []
    p.close()


@needs_browser
def test_agent_text_is_shown_never_run(browser, gpu_run, tmp_path):
    """Titles, reasons, patches, notes and tool output come from the agent: shown as text, never executed."""
    run = tmp_path / gpu_run.name
    shutil.copytree(gpu_run, run)
    evil = '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    rec = RunRecord.open(run)
    path = rec.write_patch(6, "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+</script><script>alert(3)</script>\n")
    rec.log("attempt_started", attempt=6, title=evil, rationale=evil, patch=str(path.relative_to(run)))
    rec.log("verdict", attempt=6, accepted=False, reason=evil, figures={"stage": "check"})
    rec.log("tool_call", turn=5, name="notes", input={"append": evil}, text=evil)
    (run / "notes.md").write_text(f"{evil}\n\n[click](javascript:alert(4))\n")
    p = Page(browser).open(write_report(run, tmp_path / "evil.html").as_uri())
    p.page.click('tr.attempt[data-n="6"]')
    p.page.locator("details.tool").last.locator("summary").click()
    p.page.wait_for_timeout(300)
    assert p.dialogs == [] and p.errors == []
    assert p.page.locator("#body script:not([type='application/json'])").count() == 0
    assert p.page.locator("#body img").count() == 0
    assert evil in p.page.locator('tr.attempt[data-n="6"]').inner_text()
    assert p.page.locator("a[href^='javascript']").count() == 0
    p.close()


# ---- kloop serve --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(runs: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "serve", "--runs", str(runs), "--port", str(port), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kloop serve exited: {proc.stdout.read()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/index/body", timeout=2).close()
            return proc, port
        except urllib.error.HTTPError:  # up, but wants a token
            return proc, port
        except OSError:
            time.sleep(0.3)
    stop_server(proc)
    raise AssertionError("kloop serve did not start in 90 s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(runs_root):
    proc, port = start_server(runs_root)
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


@needs_browser
def test_serve_lists_runs_and_shows_reports(browser, server, cpu_run, gpu_run):
    p = Page(browser).open(server + "/")
    rows = p.page.locator("tr.run")
    assert rows.count() == 2
    assert "x1.659" in p.page.locator(f'tr.run[data-run="{gpu_run.name}"]').inner_text()  # compounded, as in the report
    p.page.click(f"a[href='runs/{gpu_run.name}']")
    p.page.wait_for_selector("#plot-progress svg.main-svg")
    check_report_page(p, gpu_run)
    # every request stayed on this server
    assert all(u.startswith(server) for u in p.requests), p.requests
    p.close()


@needs_browser
def test_live_view_picks_up_a_new_attempt(browser, server, cpu_run):
    """The page listens to the record: an attempt appended by the session shows within seconds,
    first as being judged, then with its verdict."""
    p = Page(browser).open(f"{server}/runs/{cpu_run.name}")
    expect = pytest.importorskip("playwright.sync_api").expect
    expect(p.page.locator("#live-state")).to_contain_text("events", timeout=15000)  # the stream is connected
    before = p.page.locator("tr.attempt").count()
    points = p.points("progress")
    rec = RunRecord.open(cpu_run)
    n = before + 1
    patch = rec.write_patch(n, "--- a/kernels/matmul_cpu/knobs.toml\n+++ b/kernels/matmul_cpu/knobs.toml\n@@ -1 +1 @@\n-TILE = 0\n+TILE = 64\n")
    t0 = time.monotonic()
    rec.log("attempt_started", attempt=n, title="Tune knobs: TILE=64 (live)", patch=str(patch.relative_to(cpu_run)), knobs={"TILE": 64})
    row = p.page.locator(f'tr.attempt[data-n="{n}"]')
    row.wait_for(timeout=10000)  # "within a few seconds", on a machine shared by many jobs
    seen = time.monotonic() - t0
    assert "pending" in row.inner_text()
    rec.log("verdict", attempt=n, accepted=False, reason="not measurably faster: speedup x0.9,", figures={
        "stage": "timing", "speedup": 0.9, "speedup_lo": 0.88, "speedup_hi": 0.92})
    expect(p.page.locator(f'tr.attempt[data-n="{n}"]')).to_contain_text("rejected", timeout=10000)
    expect(p.page.locator("#plot-progress path.point")).to_have_count(points + 1, timeout=10000)
    p.page.click(f'tr.attempt[data-n="{n}"]')
    assert "+TILE = 64" in p.page.locator(f"#attempt-{n} pre.diff").inner_text()
    assert p.errors == [], p.errors
    assert seen < 10
    p.close()


def http(url: str, headers: dict | None = None) -> tuple[int, dict, str]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_serve_is_read_only_and_stays_in_its_folder(server, gpu_run):
    assert http(f"{server}/runs/{gpu_run.name}")[0] == 200
    for bad in ("..%2F..%2Fetc%2Fpasswd", "..", "_worktrees", "nope"):
        assert http(f"{server}/runs/{bad}/body")[0] == 404
    req = urllib.request.Request(f"{server}/runs/{gpu_run.name}", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405
    # bound to loopback, it answers only to loopback names (a rebinding page's Host is refused)
    assert http(f"{server}/", {"Host": "attacker.example:80"})[0] == 421
    assert http(f"{server}/", {"Host": "localhost"})[0] == 200
    status, headers, body = http(f"{server}/runs/{gpu_run.name}/report.html")
    assert status == 200 and "attachment" in headers["content-disposition"] and "Content-Security-Policy" in body


def test_serve_off_loopback_requires_its_token(runs_root, gpu_run):
    proc, port = start_server(runs_root, "--host", "0.0.0.0", "--token", "s3cret-token-for-the-test")
    base = f"http://127.0.0.1:{port}"
    try:
        for path in ("/", f"/runs/{gpu_run.name}", f"/runs/{gpu_run.name}/stream", plotly_url("/")):
            assert http(base + path)[0] == 401
        assert http(base + "/?token=wrong")[0] == 401
        status, headers, _ = http(base + f"/runs/{gpu_run.name}?token=s3cret-token-for-the-test")
        assert status == 303 and headers["location"] == f"/runs/{gpu_run.name}"  # the token leaves the address bar
        cookie = headers["set-cookie"].split(";")[0]
        assert "httponly" in headers["set-cookie"].lower() and "samesite=strict" in headers["set-cookie"].lower()
        assert http(base + f"/runs/{gpu_run.name}", {"Cookie": cookie})[0] == 200
        assert http(base + "/", {"Authorization": "Bearer s3cret-token-for-the-test"})[0] == 200
        status, headers, _ = http(base + "//evil.example/?token=s3cret-token-for-the-test")
        assert status == 303 and headers["location"] == "/evil.example/"  # never an off-site redirect
    finally:
        stop_server(proc)


def test_serve_off_loopback_without_a_token_makes_one(runs_root):
    proc, port = start_server(runs_root, "--host", "0.0.0.0")
    try:
        assert http(f"http://127.0.0.1:{port}/")[0] == 401
    finally:
        stop_server(proc)
    out = proc.stdout.read()
    assert "?token=" in out and len(out.split("?token=")[1].split()[0]) >= 24


# ---- kloop compare ------------------------------------------------------------------------------

@needs_browser
def test_compare_two_runs(browser, cpu_run, gpu_run, tmp_path):
    out = tmp_path / "cmp.html"
    res = CliRunner().invoke(app, ["compare", str(gpu_run), str(cpu_run), "-o", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "NVIDIA H200" in res.output and "AMD" in res.output or "cpu" in res.output.lower()
    assert "Vectorise global accesses: VEC=8" in res.output and "x1.5018" in res.output
    p = Page(browser).open(out.as_uri())
    assert p.page.locator("#plot-compare g.trace.scatter").count() == 2
    assert p.errors == []
    p.close()


def test_compare_in_the_terminal_names_who_drove_and_whole_run_ids(tmp_path):
    """`kloop compare`'s tables: the run ids whole (they were cut to their last 24 characters, from the
    left) and who drove each run (the MCP client from run.json), not only the policy it was started as."""
    runs = []
    for name, client in (("20261129-101500-softmax-h200", None), ("20261130-090000-softmax-h200-replay", "claude-code")):
        run = tmp_path / name
        shutil.copytree(FIXTURE, run)
        info = json.loads((run / "run.json").read_text())
        info["run_id"] = name
        if client:
            info["policy"] = "cli"
            info["clients"] = [{"name": client, "version": "2.1.332"}]
        (run / "run.json").write_text(json.dumps(info))
        runs.append(run)
    res = CliRunner().invoke(app, ["compare", *map(str, runs)], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    attempts = res.output[res.output.index("attempts (matched"):]
    assert all(run.name in attempts for run in runs), attempts
    (driven,) = [l for l in res.output.splitlines() if "driven by" in l]
    assert "claude-code 2.1.332 (over MCP)" in driven and "claude " in driven.replace("claude-code", ""), driven


def test_compare_matches_replayed_attempts_by_patch(gpu_run, tmp_path):
    """The same attempts recorded twice (a replay on another machine) line up row by row."""
    from agent.report_html import compare_rows

    other = tmp_path / "replayed"
    shutil.copytree(gpu_run, other)
    info = json.loads((other / "run.json").read_text())
    info["run_id"] = "replayed"
    (other / "run.json").write_text(json.dumps(info))
    rows = compare_rows([load_view(gpu_run), load_view(other)])
    assert len(rows) == 5 and all(a is not None and b is not None and a.number == b.number for a, b in (r["cells"] for r in rows))


@needs_browser
def test_report_of_a_record_that_has_just_started(browser, gpu_run, tmp_path):
    """A session killed before its baseline (a torn last line, no notes) still reports what there is."""
    run = tmp_path / gpu_run.name
    shutil.copytree(gpu_run, run)
    lines = (run / "events.jsonl").read_text().splitlines()
    (run / "events.jsonl").write_text(lines[0] + "\n" + lines[1][:80])
    (run / "notes.md").unlink()
    p = Page(browser).open(write_report(run, tmp_path / "early.html").as_uri())
    text = p.page.inner_text("#body")
    assert "incomplete line" in text and "no attempts yet" in text and "no notes" in text
    assert p.points("progress") == 0 and p.errors == []
    p.close()


# ---- what is plotted is what was measured ---------------------------------------------------------
# The expected figures are read straight from events.jsonl here (not through agent.run_view): the
# plots must draw the gate's verdicts, one method per axis.

def gate_figures(run_dir: Path) -> tuple[list[tuple[int, float]], dict[str, list[tuple[str, float, float]]]]:
    """From the record: [(attempt, compounded speedup)] over accepted verdicts, and per shape
    [(label, time per call, x base on this shape)] from the accepted verdicts' paired timings."""
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if l.strip()]
    staircase, shapes, level = [], {}, 1.0
    for e in events:
        if e["kind"] != "verdict" or not e["accepted"]:
            continue
        level *= e["figures"]["speedup"]
        staircase.append((e["attempt"], level))
        for s in e["figures"]["ab"]["shapes"]:
            series = shapes.setdefault(s["shape"], [("base", s["time_a"], 1.0)])
            series.append((f"#{e['attempt']}", s["time_b"], series[-1][2] * s["speedup"]))
    return staircase, shapes


PLOTTED = """(id) => { const d = document.getElementById(id); return d && d.data ? d.data.map(t => ({name: t.name,
  x: Array.from(t.x || []), y: Array.from(t.y || []), meta: t.meta || null, text: t.text || null})) : null; }"""


def check_plotted_values(p: Page, run_dir: Path) -> None:
    staircase, shapes = gate_figures(run_dir)
    assert staircase and shapes, "the record has no accepted verdict"
    progress = p.page.evaluate(PLOTTED, "plot-progress")
    acc = next(t for t in progress if t["name"] == "accepted")
    assert acc["x"] == [n for n, _ in staircase]
    assert acc["y"] == pytest.approx([y for _, y in staircase], rel=1e-12)
    traces = {(t["meta"][0], t["meta"][1]): t for t in p.page.evaluate(PLOTTED, "plot-shapes") if t["meta"]}
    assert {k[0] for k in traces} == set(shapes)
    for shape, want in shapes.items():
        time_trace, speed = traces[(shape, "time")], traces[(shape, "speedup")]
        scale = time_trace["meta"][2]
        assert time_trace["x"] == [w[0] for w in want] == speed["x"]
        assert time_trace["y"] == pytest.approx([w[1] * scale for w in want], rel=1e-12)  # the gate's times, base too
        assert speed["y"] == pytest.approx([w[2] for w in want], rel=1e-12)  # the verdicts' per-shape speedups
    # the roofline names each point's shape, and draws one method: the gate's baseline and best
    roof = [t for t in p.page.evaluate(PLOTTED, "plot-roofline") if t["meta"]]
    assert {t["name"] for t in roof} == {"baseline", "best"}
    for t in roof:
        assert sorted(t["text"]) == sorted(t["meta"]) and set(t["meta"]) <= set(shapes)
    assert "gate A/B" in p.page.locator("#plot-roofline").text_content()


@needs_browser
def test_plotted_values_are_the_records(browser, gpu_run, tmp_path):
    """Every point of the progress and per-shape plots is a number of the record's verdicts: the base of
    a shape is the gate's own timing of the best (before, the quick bench's, another method: a commit
    the gate measured faster could be drawn slower)."""
    for run in (EXAMPLE, gpu_run):  # a real recorded CPU run (a fresh one here may end undecided on a loaded box)
        p = Page(browser).open(write_report(run, tmp_path / f"{run.name}.html").as_uri())
        p.page.wait_for_selector("#plot-shapes svg.main-svg")
        check_plotted_values(p, run)
        assert p.errors == []
        p.close()
    # the CPU run's quick bench and gate differ: its base point is the gate's, not the bench's
    events = [json.loads(l) for l in (EXAMPLE / "events.jsonl").read_text().splitlines() if l.strip()]
    bench = {s["shape"]: s["kernel"]["median"] for e in events if e["kind"] == "baseline" for s in e["figures"]["bench"]["shapes"]}
    first = next(e for e in events if e["kind"] == "verdict" and e["accepted"])
    assert any(bench[s["shape"]] != s["time_a"] for s in first["figures"]["ab"]["shapes"])


def test_compare_best_times_are_the_gate_s(tmp_path):
    """compare's 'best time per bench shape' took its base from the quick bench and its best from the gate
    (844.7 -> 709.3 us for two commits that compound to about x2.4): both ends and the x are the verdicts'."""
    from agent.report_html import fmt_time, render_compare_body

    html = render_compare_body([load_view(FIXTURE), load_view(EXAMPLE)])
    for run in (FIXTURE, EXAMPLE):
        shapes = gate_figures(run)[1]
        assert shapes
        for shape, series in shapes.items():
            (_, base, _), (_, best, x) = series[0], series[-1]
            assert f"{fmt_time(base)} → {fmt_time(best)} <b>x{x:.3f}</b>" in html, (run.name, shape)
    assert "quick bench" not in html.split("Best time per bench shape")[1]


@needs_browser
def test_cpu_roofline_says_it_has_no_roofs_and_names_shapes(browser, tmp_path):
    p = Page(browser).open(write_report(EXAMPLE, tmp_path / "cpu.html").as_uri())
    p.page.wait_for_selector("#plot-roofline svg.main-svg")
    roof = p.page.locator("#plot-roofline").text_content()
    assert "no peak rates known" in roof and "no roofs drawn" in roof
    shapes = gate_figures(EXAMPLE)[1]
    assert shapes
    for shape in shapes:
        assert shape in roof
    p.close()


@needs_browser
def test_log_axes_read_in_full_and_attempt_axes_in_whole_numbers(browser, gpu_run, cpu_run, tmp_path):
    """An almost empty log axis read '5, 2' for 0.5 and 0.2; compare's attempt axis had ticks at 0.5."""
    run = tmp_path / gpu_run.name
    shutil.copytree(gpu_run, run)
    lines = (run / "events.jsonl").read_text().splitlines()
    (run / "events.jsonl").write_text("\n".join(lines[:2]) + "\n")  # started, baseline: no attempt yet
    p = Page(browser).open(write_report(run, tmp_path / "empty.html").as_uri())
    p.page.wait_for_selector("#plot-progress svg.main-svg")
    labels = [t.strip() for t in p.page.locator("#plot-progress .ytick text").all_text_contents()]
    assert labels and all(float(t) > 0.5 for t in labels) and "1" in labels, labels
    p.close()
    out = tmp_path / "cmp.html"
    assert CliRunner().invoke(app, ["compare", str(gpu_run), str(cpu_run), "-o", str(out)]).exit_code == 0
    p = Page(browser).open(out.as_uri())
    p.page.wait_for_selector("#plot-compare svg.main-svg")
    ticks = [t.strip() for t in p.page.locator("#plot-compare .xtick text").all_text_contents()]
    assert ticks and all(t.isdigit() for t in ticks), ticks
    ylabels = [t.strip() for t in p.page.locator("#plot-compare .ytick text").all_text_contents()]
    assert all(float(t) >= 0.5 for t in ylabels), ylabels
    # run ids whole, not cut from the left
    head = p.page.locator("table.attempts tr").first.inner_text()
    assert gpu_run.name in head and cpu_run.name in head
    p.close()


def test_report_is_small(gpu_run, tmp_path):
    """The report inlines plotly.js's basic bundle (1.2 MB), not the full one (4.8 MB): the file stays
    self-contained."""
    from plotly.offline import get_plotlyjs_version

    from agent.report_html import plotly_bundle_version

    assert plotly_bundle_version() == get_plotlyjs_version()  # the figures' JSON is for this plotly.js
    out = write_report(gpu_run, tmp_path / "gpu.html")
    assert out.stat().st_size < 1_600_000, out.stat().st_size


@needs_browser
def test_report_load_time_is_printed(browser, gpu_run, tmp_path):
    """Its load time in Chromium, printed (a time bound would be flaky on a shared box)."""
    out = write_report(gpu_run, tmp_path / "gpu.html")
    p = Page(browser)
    started = time.monotonic()
    p.page.goto(out.as_uri())
    p.page.wait_for_selector("#plot-roofline svg.main-svg")
    print(f"report of {gpu_run.name}: {out.stat().st_size / 1e6:.2f} MB, plots drawn {time.monotonic() - started:.2f} s after goto")
    assert p.errors == []
    p.close()


def test_serve_sends_plotly_once_cached_and_gzipped(server, gpu_run):
    import gzip

    status, _, page = http(f"{server}/runs/{gpu_run.name}")
    src = plotly_url("../")
    assert status == 200 and f'src="{src}"' in page
    url = f"{server}{plotly_url('/')}"
    req = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=30) as r:
        headers, body = r.headers, r.read()
    assert headers["Content-Encoding"] == "gzip" and "immutable" in headers["Cache-Control"]
    assert len(body) < 500_000 and gzip.decompress(body).startswith(b"/**\n* plotly.js (basic")
    etag = headers["ETag"]
    assert http(url, {"If-None-Match": etag})[0] == 304
    assert http(f"{server}/static/plotly-0000000000000000.min.js")[0] == 404
    # the run page itself is compressed too
    req = urllib.request.Request(f"{server}/runs/{gpu_run.name}", headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Encoding"] == "gzip"


def test_views_show_who_drove_a_run_and_its_real_state(gpu_run, tmp_path):
    """run.json's clients (MCP `initialize`) are shown as who drove the run; a run with no end reads
    live (a process holds its lock), idle since its last event, or stopped without an end."""
    from agent.report_html import render_report
    from agent.run_view import run_rows

    runs = tmp_path / "runs"
    run = runs / gpu_run.name
    shutil.copytree(gpu_run, run)
    info = json.loads((run / "run.json").read_text())
    info["policy"] = "cli"
    info["clients"] = [{"name": "claude-code", "version": "2.1.332", "via": "mcp", "first_seen": "2026-11-29T10:16:00Z"}]
    (run / "run.json").write_text(json.dumps(info))
    lines = (run / "events.jsonl").read_text().splitlines()
    (run / "events.jsonl").write_text("\n".join(l for l in lines if '"session_ended"' not in l) + "\n")
    v = load_view(run)
    assert v.driven_by == "claude-code 2.1.332 (over MCP)" and "claude-code 2.1.332" in render_report(v)
    assert v.state.startswith("stopped without an end") and "2026-11-29" in v.state
    (run / "lock.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                               "since": "2026-11-29T10:15:00+00:00", "command": "kloop mcp"}))
    v = load_view(run)
    assert v.state.startswith(f"live (pid {os.getpid()}") and "idle since 2026-11-29" in v.state
    (row,) = run_rows(runs)
    assert row.driven_by.startswith("claude-code") and row.state == v.state
    from agent.report_html import render_index
    html = render_index(run_rows(runs))
    assert "idle since" in html and "or stopped without an end" not in html


def test_attempt_details_and_an_mcp_transcript_read_right(gpu_run, tmp_path):
    """'ACCEPTED at accepted' is gone; tool calls with no model turn (an MCP client's) are one list,
    not one 'turn 0 · $0.00' header per call."""
    from agent.report_html import render_report

    run = tmp_path / gpu_run.name
    shutil.copytree(gpu_run, run)
    rec = RunRecord.open(run)
    for i in range(5):
        rec.log("tool_call", name="read_file", input={"path": f"f{i}.cu"}, text=f"contents {i}")
    html = render_report(load_view(run))
    assert "accepted at accepted" not in html.lower()
    assert html.count("turn 0 · $0.00") == 0 and "5 calls by" in html
    assert html.count("contents ") == 5


def test_sweep_says_how_it_ranked_and_the_commit_quotes_only_the_gate(cpu_run):
    """The tuner's rationale (its commit's text) names no sweep ratio (the sweep ranked x8.6 where the
    gate measured x3.3, and the commit quoted the sweep): it says how the sweep measured."""
    import re

    from tools.sweep import SweepRow, format_sweep

    events = [json.loads(l) for l in (cpu_run / "events.jsonl").read_text().splitlines() if l.strip()]
    # (an attempt re-offered without a rationale, seen once on a loaded box, is not the tuner's text)
    started = [e for e in events if e["kind"] == "attempt_started" and e["rationale"]]
    assert started, [(e["title"], e["rationale"]) for e in events if e["kind"] == "attempt_started"]
    for e in started:
        assert "ranked by the sweep: quick bench" in e["rationale"] and not re.search(r"x\d+\.\d{3}", e["rationale"]), e["rationale"]
    table = format_sweep([SweepRow(knobs={"A": 1}, ok=True, times={"s": 1e-3}, score=1e-3, device="2-core CPU box")])
    assert "quick bench" in table and "no paired A/B" in table and "2-core CPU box" in table
