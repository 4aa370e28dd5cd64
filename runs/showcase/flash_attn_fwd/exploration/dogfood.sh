#!/usr/bin/env bash
# Dogfood on the H200: drive flash_attn_fwd through kloop's shell session commands, as a user's agent would.
# usage (repo root, after the pip install): bash .dogfood/fa/dogfood.sh KERNEL.cu "TITLE" "RATIONALE" [KNOB=V ...]
set -uo pipefail
out=${OUT:-/tmp}; here=$(pwd)
kernel=$(realpath "$1"); title=$2; why=$3; shift 3
knobs=(); for kv in "$@"; do knobs+=(--knob "$kv"); done
export KLOOP_CACHE=/tmp/kc COLUMNS=160 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$here
kloop() { python3 -m agent.cli "$@"; }
repo=/tmp/userrepo; rm -rf $repo; mkdir -p $repo && cp -r kernels/flash_attn_fwd $repo/flash_attn_fwd
git -C $repo init -q && git -C $repo add -A && git -C $repo -c user.name=u -c user.email=u@x commit -qm flash_attn_fwd
export KLOOP_RUNS=/tmp/runs
t0=$SECONDS
timeout 60 python3 -m agent.cli session start $repo/flash_attn_fwd --json --gate-seconds 4 > $out/start.json; cat $out/start.json
echo "[session start: $((SECONDS - t0)) s]"
wt=$(python3 -c "import json;print(json.load(open('$out/start.json'))['worktree'])")
cd $wt/flash_attn_fwd
cp "$kernel" flash_attn_fwd.cu
t0=$SECONDS
timeout 120 python3 -m agent.cli submit -m "$title" --rationale "$why" "${knobs[@]}" 2>&1 | tail -30 | tee $out/submit.txt
echo "[submit: $((SECONDS - t0)) s]"
kloop status 2>&1 | tail -15
kloop session end 2>&1 | tail -3
cd $here
run=$(ls /tmp/runs | grep -v "^_" | head -1)
kloop log $run 2>&1 | tail -30 | tee $out/log.txt
git -C $repo bundle create /tmp/runs/$run/session.bundle kloop/$run 2>&1 | tail -1
tar -C /tmp/runs -czf $out/dogfood_run.tgz $run
t0=$SECONDS
timeout ${REPLAY_S:-90} python3 -m agent.cli replay $run 2>&1 | tail -15 | tee $out/replay.txt
echo "[replay: $((SECONDS - t0)) s]"
