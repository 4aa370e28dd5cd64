// Cheat: the process environment through the environ variable (no call at all).
// audit: symbols
#include <cstddef>
extern "C" char** environ;
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  mm(A, B, C, M, N, K);
  return environ && environ[0] && environ[0][0] == '\x7f' ? 1 : 0;  // a real cheat would search it
}
