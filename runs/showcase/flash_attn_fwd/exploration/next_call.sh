#!/usr/bin/env bash
# Ready for the lead (not run yet): the same two-commit session as call 3, with a 12 s gate per decision so
# that d128_s1k_causal (0.27 ms, 8 pairs at 4 s) gets enough pairs to decide v3. Run from the repo root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#   && export PYTHONPATH=/tmp/site:$PWD KLOOP_CACHE=/tmp/kc PYTHONUNBUFFERED=1; bash .dogfood/fa/next_call.sh
# PROFILE=1 adds `kloop profile --shape d128_s16k` on v3 before its submit (then use REPLAY_S=40 to stay in 240 s).
# (run tool: carry [".whl", ".dogfood"], timeout_s 240; expect ~35 s start + 2 x ~30 s submits + ~45 s replay)
set -uo pipefail
GATE_S=12 REPLAY_S=${REPLAY_S:-100} SECOND=v3_ws_pingpong PROFILE=${PROFILE:-} timeout 230 bash .dogfood/fa/dogfood2.sh 2>&1 | tail -70
