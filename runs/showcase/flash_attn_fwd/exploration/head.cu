// FlashAttention forward, bf16 in / bf16 out, fp32 log-sum-exp, for Hopper (sm_90a): warpgroup MMA.
//
// One thread block = 128 query rows of one (batch, head) = two warpgroups of 64 rows each (256
// threads). Per K/V tile of BLOCK_N keys, each warpgroup:
//
//   S = Q K^T        wgmma m64nBLOCK_Nk16, Q and K from shared memory (128-byte swizzled, K-major)
//   online softmax   in registers on the accumulator fragments (exp2, one rescale of O per tile);
//                    the row max/sum need only the 4 lanes of a quad (each thread holds 2 rows)
//   O += P V         wgmma m64nDk16 with P as the A operand from registers (the fp32 accumulator
//                    layout of S packed pairwise to bf16 IS the A-fragment layout), V from shared
//                    memory as an MN-major (transposed) B operand
//
// K/V tiles arrive through cp.async into a 128-byte-swizzled layout, double buffered (tile j+1 is
// fetched while tile j is used). Keys past seqlen are zero-filled and masked; causal blocks stop at
// the diagonal and only tiles that cross it (or seqlen) are masked. The epilogue stages O / l in
// the warpgroup's own Q rows of shared memory and writes 16-byte rows out.
//
// Knob: BLOCK_N (keys per tile, 64 or 128).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#ifndef BLOCK_N
#define BLOCK_N 128
#endif
static_assert(BLOCK_N == 64 || BLOCK_N == 128, "BLOCK_N must be 64 or 128");

namespace {

constexpr int BLOCK_M = 128;      // query rows per block: two warpgroups of 64
constexpr int NUM_THREADS = 256;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

