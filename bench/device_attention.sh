#!/usr/bin/env bash
# On the GPU machine: the two attention tasks (flash_attn_fwd_fp8, flash_attn_bwd) end to end in one
# run: `kloop eval` of each (check, timing against the comparators), every knob value checked, the
# tuner through the gate (tests/gpu/test_attention_tasks.py). Writes under $OUT (or /tmp/out).
#   bash bench/device_attention.sh
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
source bench/device_provision.sh > "$out/provision.txt" 2>&1
export COLUMNS=200
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; nvcc --version | tail -2;
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"; date -u; } > "$out/machine.txt" 2>&1
# every one-knob-at-a-time variant of both tasks, built in parallel into the cache the evaluations use
start=$(date +%s)
timeout 45 python3 - > "$out/prebuild.txt" 2>&1 <<'PY'
from concurrent.futures import ThreadPoolExecutor
from tests.kernel_builds import one_knob_at_a_time
from tools.build import build
from tools.task import load_task
jobs = [(load_task(f"kernels/{n}"), c) for n in ("flash_attn_fwd_fp8", "flash_attn_bwd") for c in one_knob_at_a_time(load_task(f"kernels/{n}"))]
with ThreadPoolExecutor(16) as pool:
    for (t, c), r in zip(jobs, pool.map(lambda j: build(j[0], knobs=j[1]), jobs)):
        print(t.name, c, r.ok, r.seconds if hasattr(r, "seconds") else "", "" if r.ok else r.error_text()[:500])
PY
echo "prebuild $(( $(date +%s) - start )) s" >> "$out/timing.txt"
for t in flash_attn_fwd_fp8 flash_attn_bwd; do
  start=$(date +%s)
  timeout 50 python3 -m agent.cli eval "kernels/$t" --seconds 0.4 > "$out/eval_$t.txt" 2>&1
  echo "eval $t rc=$? $(( $(date +%s) - start )) s" >> "$out/timing.txt"
done
start=$(date +%s)
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_attention_tasks.py -k knob -s -p no:cacheprovider > "$out/gpu_knobs.txt" 2>&1
echo "knob checks rc=$? $(( $(date +%s) - start )) s" >> "$out/timing.txt"
start=$(date +%s)
timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_attention_tasks.py -k tuner -s -p no:cacheprovider > "$out/gpu_tuner.txt" 2>&1
echo "tuner rc=$? $(( $(date +%s) - start )) s" >> "$out/timing.txt"
cat "$out/timing.txt"
