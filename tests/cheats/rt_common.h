// Shared by the runtime cheats (tests/cheats/rt_*.cpp): the honest i-k-j product they start from.
// Not inlined and 64-byte aligned, so every library runs the same machine code at the same alignment:
// inlined into each cheat's own function, the loop's placement alone made a cheat whose cache never
// hits read x1.025-1.036 faster than rt_honest (Intel Xeon, GCC -O2, three gate runs out of three).
#pragma once
#include <cstddef>
__attribute__((noinline, aligned(64))) static void honest_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i) {
    float* c = C + (size_t)i * N;
    for (int j = 0; j < N; ++j) c[j] = 0.f;
    for (int k = 0; k < K; ++k) {
      const float a = A[(size_t)i * K + k];
      const float* b = B + (size_t)k * N;
      for (int j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}
