#!/usr/bin/env bash
# On the GPU machine: the Triton tasks (flash_attn_fwd_triton, rmsnorm_triton) end to end in one run:
# every knob value built ahead of time and the starters checked (tests/test_kernels.py -k triton), the
# CPU-side Triton tests, `kloop eval` of both beside the CUDA flash_attn_fwd (one table), then
# tests/gpu/test_triton_tasks.py (checks and comparators, knob settings, the Triton cheats rejected at
# the check, the same code not faster, a tuner session landing a gated commit). Writes under $OUT.
#   bash bench/device_triton.sh
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
source bench/device_provision.sh > "$out/provision.txt" 2>&1
python3 -c "import triton" 2>/dev/null || python3 -m pip install -q "triton>=3.4" >> "$out/provision.txt" 2>&1
export COLUMNS=200 KLOOP_TRITON_KNOB_BUILDS=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; nvcc --version | tail -2;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } > "$out/machine.txt" 2>&1
run() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$? $(( $(date +%s) - start )) s" >> "$out/timing.txt"
}
run cpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_tasks.py tests/test_kernels.py -k triton
run eval_rmsnorm_triton 45 python3 -m agent.cli eval kernels/rmsnorm_triton --seconds 0.4
run eval_flash_attn_fwd_triton 45 python3 -m agent.cli eval kernels/flash_attn_fwd_triton --seconds 0.4
run eval_flash_attn_fwd 80 python3 -m agent.cli eval kernels/flash_attn_fwd --seconds 0.4  # nvcc: the one table's CUDA row
run gpu_tests 220 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_triton_tasks.py
cat "$out/timing.txt"
