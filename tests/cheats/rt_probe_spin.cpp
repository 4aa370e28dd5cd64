// Cheat (ingredient): free CPU in untimed calls. Honest every call, but a call on the same output
// buffer as the call before it (the gate's second cold probe of a pass: both probes use one set)
// spins ~80 ms more. No sample charges a probe, so before the probe-call bound this was CPU a kernel
// could spend on anything (a red-team kernel spun 40 ms per probe, unflagged) - such as recovering the
// seed of the judge's inputs, had they come from one generator in sequence (tests/test_draws.py).
#include "rt_common.h"
static const float* last_c = nullptr;
static volatile unsigned long long sink;
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  honest_matmul(A, B, C, M, N, K);
  if (C == last_c) {
    const unsigned long long t0 = __builtin_ia32_rdtsc();
    while (__builtin_ia32_rdtsc() - t0 < 200000000ull) sink = sink + 1;  // ~60-80 ms at 2.5-3.3 GHz
  }
  last_c = C;
  return 0;
}
