#!/usr/bin/env bash
# On the GPU machine (issue 24): continue a showcase run as its user would. The user's repository is the
# showcase session's bundle (the branch of accepted commits, its head = the best kernel), with today's task
# files (spec, manifest) committed over the old ones; a new kloop session starts from that head, the new
# kernel is submitted through `kloop submit` (the gate decides), the session ends, and the run is replayed.
#   bash bench/device_dogfood.sh TASK BUNDLE KERNEL_FILE "TITLE" "RATIONALE" [GATE_SECONDS]   (KERNEL_FILE replaces the task's first source)
# BUNDLE "-": the user's repository is a fresh one holding the shipped task (a task's first session).
# SWEEP=1: the session's `sweep` tool ranks every knob setting of the new kernel and the fastest is submitted
# with it (its knobs are left in /tmp/knobs_TASK as `--knob` arguments).
# Writes $OUT/dogfood_TASK.txt (every command's output) and $OUT/dogfood_TASK.tgz (the run record + bundle).
set -uo pipefail
out=${OUT:-/tmp}; here=$PWD
task=$1; bundle=$2; kernel=$(realpath "$3"); title=$4; why=$5; gate_s=${6:-4}
[ "$bundle" = - ] || bundle=$(realpath "$bundle")
export KLOOP_CACHE=${KLOOP_CACHE:-/tmp/kc} COLUMNS=160 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$here
export KLOOP_RUNS=/tmp/runs_$task
log=$out/dogfood_$task.txt
kloop() { timeout "${STEP_S:-240}" python3 -m agent.cli "$@"; }
{
repo=/tmp/userrepo_$task; rm -rf "$repo" "$KLOOP_RUNS"
if [ "$bundle" = - ]; then
  mkdir -p "$repo" && cp -r "kernels/$task" "$repo/$task" && git -C "$repo" init -q -b main
else
  git clone -q "$bundle" "$repo" 2>/dev/null
  branch=$(git -C "$repo" branch -r | head -1 | tr -d ' ' | sed 's#^origin/##')
  git -C "$repo" checkout -q -b main "origin/$branch"
  for f in task.toml spec.py README.md devcheck.py e2e.py; do
    [ -f "kernels/$task/$f" ] && cp "kernels/$task/$f" "$repo/$task/$f"
  done
fi
git -C "$repo" add -A
git -C "$repo" -c user.name=user -c user.email=user@example.invalid commit -qm "$task: the task files of today's kloop" || true
echo "== user repo: $(git -C "$repo" log --oneline | head -3 | tr '\n' '|')"
t0=$SECONDS
kloop session start "$repo/$task" --json --gate-seconds "$gate_s" > /tmp/start_$task.json; cat /tmp/start_$task.json
echo "== session start: $((SECONDS - t0)) s"
wt=$(python3 -c "import json;print(json.load(open('/tmp/start_$task.json'))['worktree'])")
src=$(python3 -c "import tomllib,sys;print(tomllib.load(open(sys.argv[1],'rb'))['sources'][0])" "$repo/$task/task.toml")
cd "$wt/$task" && cp "$kernel" "$src"
knobs=""
if [ "${SWEEP:-0}" = 1 ]; then
  t0=$SECONDS
  kloop tool sweep '{"seconds": 0.15}' --json > /tmp/sweep_$task.json
  python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['text'])" /tmp/sweep_$task.json
  knobs=$(python3 -c "
import json, sys; rows = [r for r in json.load(open(sys.argv[1]))['data']['rows'] if r['ok']]
print(' '.join(f'--knob {k}={v}' for k, v in rows[0]['knobs'].items()))" /tmp/sweep_$task.json)
  echo "== sweep: $((SECONDS - t0)) s; submitting with: $knobs"
fi
echo "$knobs" > /tmp/knobs_$task
t0=$SECONDS
kloop submit -m "$title" --rationale "$why" $knobs 2>&1 | tail -40
echo "== submit: $((SECONDS - t0)) s"
kloop status 2>&1 | tail -12
kloop session end 2>&1 | tail -3
cd "$here"
run=$(ls "$KLOOP_RUNS" | grep -v "^_" | head -1)
kloop log "$run" 2>&1 | tail -30
git -C "$repo" bundle create "$KLOOP_RUNS/$run/session.bundle" "kloop/$run" 2>&1 | tail -1
tar -C "$KLOOP_RUNS" -czf "$out/dogfood_$task.tgz" "$run"
t0=$SECONDS
STEP_S=${REPLAY_S:-120} kloop replay "$run" 2>&1 | tail -15
echo "== replay: $((SECONDS - t0)) s"
} > "$log" 2>&1
tail -45 "$log"
