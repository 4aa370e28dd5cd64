#!/usr/bin/env bash
# On the GPU machine: the CUDA path of the judge/runner split (CUDA IPC buffers, events in the runner,
# probes and floors in the judge). GPU tests, the gate benchmark on softmax, and one decision's overhead.
#   bash bench/device_gate.sh            (writes under $OUT or /tmp)
set -uo pipefail
out=${OUT:-/tmp}
export KLOOP_CACHE=/tmp/kc
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout 280 python3 -m pytest -q -x -m gpu tests/gpu -s -p no:cacheprovider > "$out/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -5 "$out/gpu_tests.txt"
timeout 150 python3 bench/gate_bench.py --task kernels/softmax --aa 20 --gains 0.02:20 --quiet --json "$out/gate_bench.json" > "$out/gate_bench.txt" 2>&1
echo "gate bench rc=$?"; tail -6 "$out/gate_bench.txt"
timeout 90 python3 - <<'PY' 2>&1 | tee "$out/overhead.txt"
import shutil, tempfile, time
from pathlib import Path
from agent.gate import Candidate, Gate, GateConfig
from tools.build import build
trusted = Path("kernels/softmax").resolve()
gate = Gate(trusted, "kernels/softmax", GateConfig(max_seconds=3.0))
best = build(gate.task)
cand = Path(tempfile.mkdtemp()) / "softmax"
shutil.copytree(trusted, cand)
gate.task.write_knob_settings(cand, {"VEC": 8})
build(gate.task, src_root=cand)  # compile outside the measured decision
for i in range(2):
    t = time.monotonic()
    v = gate.evaluate(Candidate(cand, ["kernels/softmax/knobs.toml"]), best)
    total = time.monotonic() - t
    timing = v.ab.timing_seconds if v.ab else 0.0
    print(f"decision {i}: {total:.2f} s total, {timing:.2f} s of paired timing, overhead beyond compile and timing "
          f"{total - timing:.2f} s; {v.summary().splitlines()[0]}")
PY
