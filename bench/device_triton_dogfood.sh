#!/usr/bin/env bash
# On the GPU machine (issue 24, milestone 4): the Triton flash-attention task driven as its user would,
# then measured beside the CUDA task's best in one run. The user's repository is a fresh git repo holding
# the shipped task; a kloop session starts there, the new kernel is copied in, the session's `sweep` tool
# ranks every knob setting, the fastest is submitted through `kloop submit` (the gate decides), the
# session ends and is replayed. Then `kloop eval` times the Triton head (with its knobs, and the
# comparators) and the CUDA showcase's best (the head of its latest bundle) on the same bench shapes.
#   bash bench/device_triton_dogfood.sh KERNEL_FILE CUDA_BUNDLE "TITLE" "RATIONALE"
# Writes $OUT/triton_dogfood.txt, $OUT/triton_dogfood.tgz (run record + bundle), $OUT/eval_*.txt.
set -uo pipefail
out=${OUT:-/tmp}; here=$PWD
kernel=$(realpath "$1"); cuda_bundle=$(realpath "$2"); title=$3; why=$4
task=flash_attn_fwd_triton
export KLOOP_CACHE=${KLOOP_CACHE:-/tmp/kc} COLUMNS=160 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$here
export KLOOP_RUNS=/tmp/runs_$task
# the carried wheels (.whl) and the sandbox's packages where the machine lacks them
source bench/device_provision.sh > "${out:-/tmp}/provision.txt" 2>&1
log=$out/triton_dogfood.txt
kloop() { timeout "${STEP_S:-240}" python3 -m agent.cli "$@"; }
{
repo=/tmp/userrepo_$task; rm -rf "$repo" "$KLOOP_RUNS"; mkdir -p "$repo"
cp -r "kernels/$task" "$repo/$task"
git -C "$repo" init -q -b main && git -C "$repo" add -A
git -C "$repo" -c user.name=user -c user.email=user@example.invalid commit -qm "$task: the shipped task"
t0=$SECONDS
kloop session start "$repo/$task" --json --gate-seconds 4 > /tmp/start_$task.json; cat /tmp/start_$task.json
echo "== session start: $((SECONDS - t0)) s"
wt=$(python3 -c "import json;print(json.load(open('/tmp/start_$task.json'))['worktree'])")
cd "$wt/$task" && cp "$kernel" flash_attn_fwd.py
t0=$SECONDS
kloop tool sweep '{"seconds": 0.15}' --json > /tmp/sweep.json
python3 -c "import json;print(json.load(open('/tmp/sweep.json'))['text'])"
knobs=$(python3 -c "
import json; rows = [r for r in json.load(open('/tmp/sweep.json'))['data']['rows'] if r['ok']]
print(' '.join(f'--knob {k}={v}' for k, v in rows[0]['knobs'].items()))")
echo "== sweep: $((SECONDS - t0)) s; submitting with: $knobs"
t0=$SECONDS
kloop submit -m "$title" --rationale "$why" $knobs 2>&1 | tail -40
echo "== submit: $((SECONDS - t0)) s"
kloop status 2>&1 | tail -12
kloop session end 2>&1 | tail -3
cd "$here"
run=$(ls "$KLOOP_RUNS" | grep -v "^_" | head -1)
kloop log "$run" 2>&1 | tail -30
git -C "$repo" bundle create "$KLOOP_RUNS/$run/session.bundle" "kloop/$run" 2>&1 | tail -1
tar -C "$KLOOP_RUNS" -czf "$out/triton_dogfood.tgz" "$run"
t0=$SECONDS
STEP_S=${REPLAY_S:-120} kloop replay "$run" 2>&1 | tail -15
echo "== replay: $((SECONDS - t0)) s"
# one table: the Triton head (its knobs) and the CUDA best, same machine, same minutes
git -C "$repo" checkout -q "kloop/$run"
STEP_S=90 kloop eval "$repo/$task" $knobs --seconds 0.4 > "$out/eval_triton_head.txt" 2>&1; echo "eval triton rc=$?"
cuda=/tmp/cudarepo; rm -rf "$cuda"; git clone -q "$cuda_bundle" "$cuda" 2>/dev/null
git -C "$cuda" checkout -q "$(git -C "$cuda" branch -r | head -1 | tr -d ' ')"
STEP_S=150 kloop eval "$cuda/flash_attn_fwd" --no-comparators --seconds 0.4 > "$out/eval_cuda_best.txt" 2>&1; echo "eval cuda rc=$?"
tail -30 "$out/eval_triton_head.txt"; tail -22 "$out/eval_cuda_best.txt"
} > "$log" 2>&1
tail -80 "$log"
