#!/usr/bin/env bash
# call 4 (not run yet): v2 (accepted reference), v3, and the v4 TMA variants: build, check every check shape,
# time the gated bench shapes against SDPA flash/cuDNN. From the repo root on the device machine:
#   bash runs/showcase/flash_attn_fwd/exploration/call4.sh        (run tool: timeout_s 200; expect ~70-150 s)
set -uo pipefail
timeout 190 python3 runs/showcase/flash_attn_fwd/exploration/devbench4.py "$PWD" "${OUT:-/tmp/out}/call4" 2>&1 | tail -90
