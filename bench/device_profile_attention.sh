#!/usr/bin/env bash
# On the GPU machine (issue 24, milestone 3): what stands between the FP8 forward / the backward and their
# targets, as their user's agent would see it: a kloop session on a fresh repo holding the shipped task,
# then `kloop build` (registers, spills, smem), `kloop sass` (instruction mix) and `kloop profile` (ncu:
# tensor-pipe and DRAM throughput, occupancy, stalls) on the d128 16k shape, and the session ended.
#   bash bench/device_profile_attention.sh [TASK:SHAPE ...]   (default: both tasks at d128_s16k)
# Writes $OUT/profile_TASK.txt.
set -uo pipefail
out=${OUT:-/tmp}; here=$PWD
export KLOOP_CACHE=${KLOOP_CACHE:-/tmp/kc} COLUMNS=160 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$here
# the carried wheels (.whl) and the sandbox's packages where the machine lacks them
source bench/device_provision.sh > "${out:-/tmp}/provision.txt" 2>&1
kloop() { timeout "${STEP_S:-200}" python3 -m agent.cli "$@"; }
jobs=("$@"); [ ${#jobs[@]} -gt 0 ] || jobs=(flash_attn_fwd_fp8:d128_s16k flash_attn_bwd:d128_s16k)
for job in "${jobs[@]}"; do
  task=${job%%:*}; shape=${job#*:}
  export KLOOP_RUNS=/tmp/runs_prof_$task
  {
  repo=/tmp/profrepo_$task; rm -rf "$repo" "$KLOOP_RUNS"; mkdir -p "$repo"
  cp -r "kernels/$task" "$repo/$task"
  git -C "$repo" init -q -b main && git -C "$repo" add -A
  git -C "$repo" -c user.name=user -c user.email=user@example.invalid commit -qm "$task: the shipped task"
  t0=$SECONDS
  kloop session start "$repo/$task" --json --gate-seconds 2 > /tmp/start_$task.json; tail -c 600 /tmp/start_$task.json; echo
  echo "== session start: $((SECONDS - t0)) s"
  wt=$(python3 -c "import json;print(json.load(open('/tmp/start_$task.json'))['worktree'])")
  cd "$wt/$task"
  kloop build 2>&1 | tail -20
  kloop sass 2>&1 | tail -40
  t0=$SECONDS
  kloop profile --shape "$shape" 2>&1 | tail -60
  echo "== profile $shape: $((SECONDS - t0)) s"
  kloop session end 2>&1 | tail -2
  cd "$here"
  } > "$out/profile_$task.txt" 2>&1
  tail -75 "$out/profile_$task.txt"
done
