#!/usr/bin/env bash
# call 3: devbench (v2 control, v3 warp-specialised with and without ping-pong, SDPA), then a
# two-commit session through the gate: v2, then the best v3 if it passed and beat v2 in devbench
set -uo pipefail
timeout 110 python3 .dogfood/fa/devbench.py $PWD $OUT/call3 2>&1 | tail -40
pick=$(python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/call3/results.json"))
def mean(n):
    b = r.get(n, {}).get("bench", {})
    return sum(x["tflops"] for x in b.values()) / len(b) if r.get(n, {}).get("check_ok") and len(b) == 8 else 0
base = mean("v2_bn128_d64n128")
best = max(["v3_ws_pingpong", "v3_ws_nopingpong"], key=mean)
print(best if mean(best) > 1.02 * base else "")
PY
)
echo "picked v3: '$pick'"
pp=1; [ "$pick" = "v3_ws_nopingpong" ] && pp=0
sed -i "s/^#define FA_PINGPONG 1 /#define FA_PINGPONG $pp /" .dogfood/fa/fa_wgmma_v3.cu
grep -n "^#define FA_PINGPONG" .dogfood/fa/fa_wgmma_v3.cu
REPLAY_S=70 SECOND="${pick}" timeout 125 bash .dogfood/fa/dogfood2.sh 2>&1 | tail -70
