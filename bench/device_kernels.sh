#!/usr/bin/env bash
# On the GPU machine: the showcase kernels' exploration benches (issue 24), each variant checked on every
# check shape and timed on the bench shapes beside the accepted kernel, in one device command.
#   bash bench/device_kernels.sh [decode] [decode-gate] [flash] [flash-gate]   (writes under $OUT or /tmp; ~90 s, ~150 s, ~150 s on the H200)
# decode-gate: the fastest passing decode variant through a kloop session (bench/device_dogfood.sh), when it wins by 3%
# flash-gate: v4 (TMA, ping-pong) with the tile sizes that were fastest on the d128 16k shape in stop 35's devbench
#   (bench/results/2026-12-07-h100-stop35/flash_devbench4.json: v4_tma_bn176_d64bn192, 638 TFLOP/s there, every
#   check shape passed), through a kloop session continued from the showcase run's bundle
set -uo pipefail
out=${OUT:-/tmp}
parts=${*:-decode flash}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$out/machine.txt"
nvcc --version | tail -2 | tee -a "$out/machine.txt"
for p in $parts; do
  case $p in
    decode) DEVBENCH_JSON=$out/decode_devbench5.json timeout "${DEVBENCH_S:-200}" python3 runs/showcase/paged_decode/exploration/devbench5.py . > "$out/decode_devbench5.txt" 2>&1
            echo "decode devbench rc=$?"; tail -20 "$out/decode_devbench5.txt" ;;
    # the fastest passing variant, if it beats the accepted kernel by 3%, through kloop's gate as a user would
    decode-gate) ex=runs/showcase/paged_decode/exploration
            python3 $ex/pick_winner.py "$out/decode_devbench5.json" v4_t128 /tmp/v5_best.cu 0.03 &&
            timeout "${GATE_PART_S:-300}" bash bench/device_dogfood.sh paged_decode runs/showcase/paged_decode/20261201-090210-paged-decode-0230/session.bundle /tmp/v5_best.cu \
              "Tensor cores for the GQA group: mma.sync scores and P V, per-warp cp.async rings" \
              "The kernel was issue-bound on shuffle reductions (v4: 16 lanes per score). S = Q K^T and O^T += V^T P^T run on mma.sync m16n8k16 (the group's query heads as 8 rows), K/V pages staged by per-warp cp.async rings of 16-byte copies, one max/rescale per 16-token chunk, split-KV chosen at run time to fill the SMs" 4 ;;
    flash-gate) ex=runs/showcase/flash_attn_fwd/exploration
            { echo "// v4_tma_bn176_d64bn192 (stop 35's devbench): its tile sizes baked in as defaults"
              echo "#define FA4_BN_D128 176"; echo "#define FA4_BN_D64 192"; cat $ex/fa_wgmma_v4.cu; } > /tmp/fa4_best.cu
            timeout "${GATE_PART_S:-420}" bash bench/device_dogfood.sh flash_attn_fwd runs/showcase/flash_attn_fwd/20261201-110327-flash-attn-fwd-0148/session.bundle /tmp/fa4_best.cu \
              "TMA loads, a producer warp with setmaxnreg, two consumer warpgroups in ping-pong" \
              "v2 was issue-bound in its cp.async address math and serialised softmax with the GEMMs. K/V tiles now come by TMA (cuTensorMapEncodeTiled) into a 2-3 stage ring driven by a producer warp that gives its registers away (setmaxnreg); two consumer warpgroups of 64 query rows alternate (one's softmax under the other's wgmma), O rescaled under the next S MMA; 176-key tiles at d128, 192 at d64" 4 ;;
    flash) timeout "${DEVBENCH_S:-200}" python3 runs/showcase/flash_attn_fwd/exploration/devbench4.py "$PWD" /tmp/call4 > "$out/flash_devbench4.txt" 2>&1
           echo "flash devbench rc=$?"; tail -40 "$out/flash_devbench4.txt"
           cp /tmp/call4/results.json "$out/flash_devbench4.json" 2>/dev/null ;;
  esac
done
