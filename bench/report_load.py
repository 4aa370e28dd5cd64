"""How long `kloop report`'s self-contained page takes to load in Chromium (issue 21: under a second).

Renders the report of a recorded run (the shipped H200 fixture by default), opens it from disk in the
system's Chromium through Playwright `--loads` times (a fresh page each) and prints a table: the
browser's own clock for first contentful paint, DOMContentLoaded and load, and the wall time from
`goto` until the last figure's SVG is in the page. A benchmark, not a test: times move with the box.

    python bench/report_load.py [--run DIR] [--loads 5] [--chromium PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "softmax_h200"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
TIMING = """() => {
  const n = performance.getEntriesByType('navigation')[0];
  const fcp = performance.getEntriesByName('first-contentful-paint')[0];
  return {fcp: fcp ? fcp.startTime : null, dcl: n.domContentLoadedEventEnd, load: n.loadEventEnd};
}"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=FIXTURE, help="a run folder (run.json, events.jsonl)")
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--chromium", default=os.environ.get("KLOOP_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from agent.report_html import render_report
    from agent.run_view import load_view

    html = render_report(load_view(args.run))
    page_file = Path(tempfile.mkdtemp()) / "report.html"
    page_file.write_text(html, encoding="utf-8")
    rows = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=ARGS)
        version = browser.version
        for _ in range(args.loads):
            page = browser.new_page()
            started = time.monotonic()
            page.goto(page_file.as_uri())
            # (the report's CSP forbids eval, so no wait_for_function: wait for the last figure's SVG)
            plots = page.evaluate("document.querySelectorAll('div.plot[data-fig]').length")
            page.locator("div.plot[data-fig] svg.main-svg").nth(plots - 1).wait_for()
            drawn = time.monotonic() - started
            t = page.evaluate(TIMING)
            rows.append((t["fcp"] / 1e3 if t["fcp"] is not None else float("nan"), t["dcl"] / 1e3, t["load"] / 1e3, drawn))
            page.close()
        browser.close()
    print(f"report of {args.run.name}: {len(html.encode()) / 1e6:.2f} MB, Chromium {version}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| load | first paint s | DOMContentLoaded s | load s | every figure drawn s |")
    print("| --- | --- | --- | --- | --- |")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | " + " | ".join(f"{x:.3f}" for x in r) + " |")
    med = [statistics.median(c) for c in zip(*rows)]
    print("| median | " + " | ".join(f"{x:.3f}" for x in med) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
