"""The showcase runs replay on the H200: every recorded verdict holds (issue 13's evidence stays true)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOWCASE = ROOT / "runs" / "showcase"


def showcase_runs() -> list[Path]:
    return sorted(p.parent for p in SHOWCASE.glob("*/*/run.json"))


@pytest.mark.gpu
@pytest.mark.parametrize("run_dir", showcase_runs(), ids=lambda p: p.name)
def test_showcase_run_replays_every_verdict(run_dir, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(run_dir, runs / run_dir.name)
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(run_dir / "session.bundle"), str(repo)], check=True)
    res = subprocess.run([sys.executable, "-m", "agent.cli", "replay", run_dir.name, "--runs-dir", str(runs),
                          "--repo", str(repo), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(res.stdout)
    rows = report["rows"]
    assert rows and all(r["recorded_accepted"] == r["replayed_accepted"] for r in rows), rows
