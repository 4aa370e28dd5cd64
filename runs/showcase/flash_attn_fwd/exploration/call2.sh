#!/usr/bin/env bash
# call 2: devbench (v1 control, v2 variants, SDPA), then the gate on the best v2 that passes
set -uo pipefail
timeout 100 python3 .dogfood/fa/devbench.py $PWD $OUT/call2 2>&1 | tail -45
pick=$(python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/call2/results.json"))
ok = [(v["bench"]["d128_s16k"]["tflops"], n) for n, v in r.items()
      if n.startswith("v2") and v.get("check_ok") and "d128_s16k" in v.get("bench", {})]
print(max(ok)[1] if ok else "")
PY
)
echo "picked: $pick"
[ -z "$pick" ] && exit 0
bn=$(python3 -c "import json;print(json.load(open('.dogfood/fa/variants.json'))['$pick'][1]['BLOCK_N'])")
d64=$(python3 -c "import json;print(json.load(open('.dogfood/fa/variants.json'))['$pick'][1]['BLOCK_N_D64'])")
sed -i "s/^#define BLOCK_N_D64 64$/#define BLOCK_N_D64 $d64/" .dogfood/fa/fa_wgmma_v2.cu
REPLAY_S=80 timeout 130 bash .dogfood/fa/dogfood.sh .dogfood/fa/fa_wgmma_v2.cu \
  "wgmma: S and P in registers, swizzled cp.async K/V in 3 stages, softmax under the previous tile's P V" \
  "Per 128 query rows two warpgroups run wgmma m64n${bn}k16 for S=QK^T (Q, K from 128B-swizzled smem) and m64nDk16 for O+=PV with P as the A operand from registers, V as transposed B; online softmax in registers (exp2, quad shuffles only); S_j and P_{j-1}V_{j-1} are issued together so the softmax of tile j runs under the P V MMA; causal blocks stop at the diagonal and mask only crossing tiles. devbench on the H200: $pick, see runs/showcase/flash_attn_fwd." \
  BLOCK_N=$bn 2>&1 | tail -60
