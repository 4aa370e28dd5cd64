#!/usr/bin/env bash
# A whole tuner session on the GPU, end to end, in a throwaway user repository holding a copy of a
# shipped task: optimize -> log -> show -> replay, then the agent's sass and profile tools on the result.
#   bash bench/device_session.sh [task] [max-attempts]     (on a machine with a GPU; writes under $OUT or /tmp)
set -uo pipefail
task=${1:-softmax}
attempts=${2:-6}
out=${OUT:-/tmp}
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(mktemp -d)/userrepo
mkdir -p "$repo" && cp -r "$here/kernels/$task" "$repo/$task"
git -C "$repo" init -q && git -C "$repo" add -A && git -C "$repo" -c user.name=u -c user.email=u@x commit -qm "$task"
export KLOOP_RUNS=$out/runs COLUMNS=150
kloop() { python3 -m agent.cli "$@"; }
kloop optimize "$repo/$task" --agent tuner --max-attempts "$attempts" 2>&1 | tee "$out/session_optimize.txt"
kloop log last 2>&1 | tee "$out/session_log.txt"
kloop show last 2>&1 | tee "$out/session_show.txt"
kloop replay last 2>&1 | tee "$out/session_replay.txt"
python3 - <<'PY' 2>&1 | tee "$out/session_tools.txt"
import os
from pathlib import Path
from agent.records import list_runs
from agent.session import Session
root = Path(os.environ["KLOOP_RUNS"])
s = Session.resume(root / list_runs(root)[-1].run_id)
box = s.toolbox  # every agent tool, bound to the session port
for name, args in (("sass", {}), ("profile", {})):
    r = box.call(name, args)
    print(f"== {name} (ok={r.ok})\n{r.text}\n")
PY
