"""Makes docs/report.png, docs/report-attempt.png, docs/dashboard.png and docs/dashboard-live.png, with the
system's Chromium, from a real recorded run (docs/example-run: the tuner on matmul_cpu, measured on a shared
2-core AMD EPYC box), whose every figure `kloop show docs/example-run/RUN` prints too. The run list also
shows the H200 fixture (tests/fixtures/softmax_h200: its attempts are made up) and any run folders given.

    python3 docs/screenshots.py [RUN_DIR ...]      # from the repository root
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.report_html import render_report  # noqa: E402
from agent.run_view import load_view  # noqa: E402
from tests.test_report_web import CHROMIUM, CHROMIUM_ARGS, free_port, stop_server  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "softmax_h200"
DOCS = ROOT / "docs"
EXAMPLE = next((DOCS / "example-run").iterdir())
RUN_ID = EXAMPLE.name
FIXTURE_ID = "20261129-101500-softmax-h200"
LIVE_ID = RUN_ID[:-4] + "live"


def live_copy(src: Path, dest: Path) -> None:
    """The example run as it looked mid-session: attempt 1 submitted, the gate still judging it, the
    session's process alive (this script's pid holds it in lock.json)."""
    import os
    import socket

    shutil.copytree(src, dest)
    info = json.loads((dest / "run.json").read_text())
    (dest / "run.json").write_text(json.dumps(info | {"run_id": dest.name, "branch": f"kloop/{dest.name}"}, indent=2))
    lines = (dest / "events.jsonl").read_text().splitlines()
    first = next(i for i, l in enumerate(lines) if '"attempt_started"' in l)
    (dest / "events.jsonl").write_text("\n".join(lines[:first + 1]) + "\n")
    (dest / "lock.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                "since": info["started_at"], "command": "kloop optimize"}))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        runs.mkdir()
        shutil.copytree(EXAMPLE, runs / RUN_ID)
        shutil.copytree(FIXTURE, runs / FIXTURE_ID)
        live_copy(EXAMPLE, runs / LIVE_ID)
        for extra in sys.argv[1:]:
            shutil.copytree(extra, runs / Path(extra).name)
        report = Path(tmp) / "report.html"
        report.write_text(render_report(load_view(runs / RUN_ID)))
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "serve", "--runs", str(runs), "--port", str(port)],
                                cwd=ROOT, start_new_session=True)
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                    break
                except OSError:
                    time.sleep(0.3)
            with sync_playwright() as p:
                b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = b.new_page(viewport={"width": 1280, "height": 1200})
                page.goto(report.as_uri())
                page.wait_for_timeout(1500)
                page.screenshot(path=str(DOCS / "report.png"), full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": 1500})
                page.click('tr.attempt[data-n="1"]')
                page.wait_for_timeout(300)
                page.locator("table.attempts").screenshot(path=str(DOCS / "report-attempt.png"))
                page.set_viewport_size({"width": 1280, "height": 200})
                page.goto(f"http://127.0.0.1:{port}/")
                page.wait_for_timeout(800)
                page.screenshot(path=str(DOCS / "dashboard.png"))
                page.set_viewport_size({"width": 1280, "height": 520})
                page.goto(f"http://127.0.0.1:{port}/runs/{LIVE_ID}")
                page.wait_for_timeout(2500)
                page.screenshot(path=str(DOCS / "dashboard-live.png"))
                b.close()
        finally:
            stop_server(proc)
    for name in ("report.png", "report-attempt.png", "dashboard.png", "dashboard-live.png"):
        print(f"{DOCS / name}: {(DOCS / name).stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
