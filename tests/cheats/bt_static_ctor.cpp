// Cheat: a C++ static object whose constructor runs at load time (no attribute at all).
// audit: load-time
#include <cstddef>
static float table[4096];
struct Prefill { Prefill() { for (int i = 0; i < 4096; ++i) table[i] = (float)i; } };
static Prefill prefill;
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) { mm(A, B, C, M, N, K); return table[1] == 1.f ? 0 : 1; }
