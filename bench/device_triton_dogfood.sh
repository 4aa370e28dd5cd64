#!/usr/bin/env bash
# On the GPU machine (issue 24, milestone 4): the Triton flash-attention task driven as its user would,
# then measured beside the CUDA task's best in one run. bench/device_dogfood.sh does the session: a fresh
# user repository holding the shipped task, the new kernel copied in, the session's `sweep` ranking every
# knob setting, the fastest submitted through `kloop submit`, the session ended and replayed. Then
# `kloop eval` times the Triton head (with its knobs, and the comparators) and the CUDA showcase's best
# (the head of its latest bundle) on the same bench shapes.
#   bash bench/device_triton_dogfood.sh KERNEL_FILE CUDA_BUNDLE "TITLE" "RATIONALE"
# Writes $OUT/dogfood_flash_attn_fwd_triton.txt, .tgz (bench/device_dogfood.sh) and $OUT/eval_*.txt.
set -uo pipefail
out=${OUT:-/tmp}
kernel=$1; cuda_bundle=$(realpath "$2"); title=$3; why=$4
task=flash_attn_fwd_triton
# the carried wheels (.whl) and the sandbox's packages where the machine lacks them
source bench/device_provision.sh > "$out/provision.txt" 2>&1
SWEEP=1 bash bench/device_dogfood.sh "$task" - "$kernel" "$title" "$why"
export KLOOP_CACHE=${KLOOP_CACHE:-/tmp/kc} COLUMNS=160 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
kloop() { timeout "${STEP_S:-240}" python3 -m agent.cli "$@"; }
# one table: the Triton head (its knobs) and the CUDA best, same machine, same minutes
repo=/tmp/userrepo_$task; run=$(ls "/tmp/runs_$task" | grep -v "^_" | head -1)
git -C "$repo" checkout -q "kloop/$run"
STEP_S=90 kloop eval "$repo/$task" $(cat /tmp/knobs_$task) --seconds 0.4 > "$out/eval_triton_head.txt" 2>&1; echo "eval triton rc=$?"
cuda=/tmp/cudarepo; rm -rf "$cuda"; git clone -q "$cuda_bundle" "$cuda" 2>/dev/null
git -C "$cuda" checkout -q "$(git -C "$cuda" branch -r | head -1 | tr -d ' ')"
STEP_S=150 kloop eval "$cuda/flash_attn_fwd" --no-comparators --seconds 0.4 > "$out/eval_cuda_best.txt" 2>&1; echo "eval cuda rc=$?"
tail -30 "$out/eval_triton_head.txt"; tail -22 "$out/eval_cuda_best.txt"
