// Shared by the runtime cheats (tests/cheats/rt_*.cpp): the honest i-k-j product they start from.
#pragma once
#include <cstddef>
static void honest_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
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
