#!/usr/bin/env bash
# On the GPU machine: the CUDA path of the judge/runner split (CUDA IPC buffers, events in the runner,
# probes and floors in the judge). GPU tests, the gate benchmark on softmax (100 A/A and 100 +2% trials),
# and the per-stage overhead of two real decisions.
#   bash bench/device_gate.sh [all|tests|bench|overhead]   (writes under $OUT or /tmp)
# all three take about 280 + 240 + 90 s: past one 600 s device command, run them as separate parts.
set -uo pipefail
out=${OUT:-/tmp}
part=${1:-all}
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
export KLOOP_CACHE=/tmp/kc
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
if want tests; then
timeout 280 python3 -m pytest -q -x -m gpu tests/gpu -s -p no:cacheprovider > "$out/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -5 "$out/gpu_tests.txt"
fi
if want bench; then
timeout 240 python3 bench/gate_bench.py --task kernels/softmax --aa 100 --gains 0.02:100 --budget 225 --quiet --json "$out/gate_bench.json" > "$out/gate_bench.txt" 2>&1
echo "gate bench rc=$?"; tail -8 "$out/gate_bench.txt"
fi
if want overhead; then
# two real softmax decisions (standby judge, check, timing), stage by stage
timeout 90 python3 bench/decision_overhead.py --task "$PWD/kernels/softmax" --knob VEC=8 --decisions 2 2>&1 | tee "$out/overhead.txt"
fi
