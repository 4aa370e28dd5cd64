#!/usr/bin/env bash
# One stop's whole GPU check in two device commands (each under 600 s), logs packed into one file:
#   bash bench/device_final.sh one    the CUDA cheat corpus against today's gate, then the gate benchmark
#                                     (A/A, +0.5%, +2% on softmax, 2 s of timing per decision)
#   bash bench/device_final.sh two    the cheat corpus again, the GPU tasks and showcase replays, the e2e stage
#   bash bench/device_final.sh three  the Triton tasks (a tuner session landing a gated commit), kloop export
#                                     of the showcase runs with the decoder example
# Each step has its own time limit; $OUT/PART.tgz holds every log, $OUT/PART-summary.txt the rc per step.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?one, two or three}
out=${OUT:-/tmp/out}
logs=$(mktemp -d)
source bench/device_provision.sh > "$logs/provision.txt" 2>&1
export COLUMNS=200
summary="$out/$part-summary.txt"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader; nvcc --version | tail -1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } > "$summary" 2>&1
tail -1 "$logs/provision.txt" >> "$summary"
step() {  # NAME LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$logs/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start )) s | $(grep -E '[0-9]+ (passed|failed)' "$logs/$name.txt" | tail -1)" >> "$summary"
}
gpu="python3 -m pytest -q -m gpu -s -p no:cacheprovider --durations=6"  # a word list: `timeout` runs programs, not functions
case "$part" in
one)  # the gate: the CUDA cheat corpus, then the benchmark
  step cheats 250 $gpu tests/gpu/test_cheats_cuda.py
  step gate_bench 270 python3 bench/gate_bench.py --task kernels/softmax --aa 60 --gains 0.005:30,0.02:50 \
    --max-seconds 2 --budget 250 --quiet --json "$logs/gate_bench.json"
  tail -14 "$logs/gate_bench.txt" >> "$summary" ;;
two)  # the gate's CUDA paths again (cheats), the GPU tasks and showcase replays, the e2e stage
  step cheats 240 $gpu tests/gpu/test_cheats_cuda.py
  step tasks 170 $gpu tests/gpu/test_device_buffers_gpu.py tests/gpu/test_gpu_tasks.py tests/gpu/test_showcase_replay.py
  step e2e 70 $gpu tests/gpu/test_e2e_attention.py ;;
three)  # Triton (a tuner session landing a gated commit), kloop export + the decoder, the GPU tasks again
  KLOOP_TRITON_KNOB_BUILDS=0 step triton 130 $gpu tests/gpu/test_triton_tasks.py
  step export 120 bash bench/export_showcase.sh --batch 8 --prompt 1024 --new 16 --layers 2
  tail -6 "$logs/export.txt" >> "$summary"
  step e2e 50 $gpu tests/gpu/test_e2e_attention.py
  step tasks 150 $gpu tests/gpu/test_device_buffers_gpu.py tests/gpu/test_gpu_tasks.py ;;
*) echo "part: one, two or three" >&2; exit 2 ;;
esac
cp "$summary" "$logs/"
tar -czf "$out/$part.tgz" -C "$logs" .
cat "$summary"
