#!/usr/bin/env bash
# On the GPU machine: the CUDA path of the judge/runner split (CUDA IPC buffers, events in the runner,
# probes and floors in the judge). GPU tests, the gate benchmark on softmax (100 A/A, 100 +0.5% and
# 100 +2% trials at 2 s of timing per decision; `looks`: 100 A/A agents re-submitting up to 3 times), the hidden work the escape allowance catches, and the
# per-stage overhead of two real decisions.
#   bash bench/device_gate.sh [all|tests|tests-cheats|tests-flush|tests-tasks|tests-showcase|tests-attention|bench|looks|requests|hidden|overhead]   (writes under $OUT or /tmp)
# One device command may run 600 s. The GPU suite takes more than that on the H200, so it is three
# parts, each given 270 s and run as its own device command: `tests-cheats` (the CUDA cheats against
# the gate: 149 s on 2026-12-07), `tests-tasks` (the GPU tasks and the gate on GPU) and
# `tests-showcase` (every showcase run replayed: ~30 s each, five runs on 2026-12-07). `tests` runs
# all three: more than one device command holds, so use it only where no such limit applies.
# bench takes about 390-570 s, hidden about 200 s, overhead 90 s: run each as its own device command too.
# .whl must hold the wheels the device lacks (scipy among them: tools/stats.py).
set -uo pipefail
out=${OUT:-/tmp}
part=${1:-all}
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
export KLOOP_CACHE=/tmp/kc
# the carried wheels and (where the host lacks it) bubblewrap + libseccomp: the GPU tests run sandboxed
source bench/device_provision.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
gpu_part() {  # NAME FILES...: one part of the GPU suite, its slowest tests listed so the split can be kept true
  local name=$1; shift
  timeout 270 python3 -m pytest -q -x -m gpu "$@" -s -p no:cacheprovider --durations=8 > "$out/gpu_$name.txt" 2>&1
  echo "gpu $name rc=$?"; tail -14 "$out/gpu_$name.txt"
}
if want tests || [ "$part" = tests-cheats ]; then gpu_part cheats tests/gpu/test_cheats_cuda.py; fi
# the L2 probes alone (~60 s with its nvcc build): the judge's flush, from another process, evicts a runner's lines
if [ "$part" = tests-flush ]; then gpu_part flush tests/gpu/test_cheats_cuda.py -k l2_probe; fi
if want tests || [ "$part" = tests-tasks ]; then gpu_part tasks tests/gpu/test_gpu_tasks.py; fi
if want tests || [ "$part" = tests-showcase ]; then gpu_part showcase tests/gpu/test_showcase_replay.py; fi
# the attention tasks' every-knob checks and tuner runs (~200 s): a part of their own, not in `tests`
if [ "$part" = tests-attention ]; then gpu_part attention tests/gpu/test_attention_tasks.py; fi
if want bench; then
# BENCH_BUDGET (seconds, default 540) and BENCH_TRIALS (per case, default 100): a shorter run where device time is short
budget=${BENCH_BUDGET:-540}; n=${BENCH_TRIALS:-100}
timeout $((budget + 30)) python3 bench/gate_bench.py --task kernels/softmax --aa "$n" --gains "0.005:$n,0.02:$n" --max-seconds 2 --budget "$budget" --quiet --json "$out/gate_bench.json" > "$out/gate_bench.txt" 2>&1
echo "gate bench rc=$?"; tail -8 "$out/gate_bench.txt"
fi
if [ "$part" = looks ]; then
# repeated looks (issue 20): 100 agents re-submitting the A/A change up to 3 times, the cap doubling (2, 4, 8 s)
timeout 570 python3 bench/gate_bench.py --task kernels/softmax --aa 100 --looks 3 --gains '' --max-seconds 2 --budget 540 --quiet --json "$out/gate_looks.json" > "$out/gate_looks.txt" 2>&1
echo "gate looks rc=$?"; tail -6 "$out/gate_looks.txt"
fi
if [ "$part" = requests ]; then
# issue 20's under-report bound: A/A decisions with short (one call) and long (10 ms) CUDA requests, runners pinned
# to the judge's CPU or not; the judge's clock beyond the reported times, and the lies it would catch (~420 s)
# REQ_CONFIGS: "SHAPE MS PLACEMENT;..." to run fewer
IFS=';' read -ra cfgs <<< "${REQ_CONFIGS:-65536x4096 0.05 off;65536x4096 0.05 current;65536x4096 10 off;65536x4096 10 current;8192x2048 0.05 off;8192x2048 10 current}"
for cfg in "${cfgs[@]}"; do
  set -- $cfg
  timeout 120 python3 bench/gate_bench.py --task kernels/softmax --shape "$1" --aa 40 --gains '' --max-seconds 2 \
    --budget "${REQ_BUDGET:-45}" --set cuda_request_s="$2"e-3 --set cuda_placement="$3" --quiet \
    --json "$out/requests_$1_$2_$3.json" > "$out/requests_$1_$2_$3.txt" 2>&1
  echo "== $cfg rc=$?"; grep -E "^aa|judge's clock|integrity" "$out/requests_$1_$2_$3.txt" | head -4
done
fi
if want hidden; then
# work on a second stream of 5/10/20% of a call, after the timed stream's, on a 5 us, a 40 us and two ~0.5 ms
# shapes: what the two escape bounds catch (4 x 4 cases x 3 decisions took ~200 s on the H200, 2026-12-04)
timeout 300 python3 bench/hidden_work.py --task kernels/softmax --shapes 128x4096,8192x2048,65536x4096,16384x16384 --fractions 0,0.05,0.1,0.2 --trials 3 --json "$out/hidden_work.json" > "$out/hidden_work.txt" 2>&1
echo "hidden work rc=$?"; tail -12 "$out/hidden_work.txt"
fi
if want overhead; then
# two real softmax decisions (standby judge, check, timing), stage by stage
timeout 90 python3 bench/decision_overhead.py --task "$PWD/kernels/softmax" --knob VEC=8 --decisions 2 2>&1 | tee "$out/overhead.txt"
fi
