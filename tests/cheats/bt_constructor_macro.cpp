// Cheat: code that runs when the library is loaded (before the harness checks anything), through
// __attribute__((constructor)) spelled by a macro.
// audit: load-time
#include <cstddef>
#define CAT(a, b) a##b
#define ATTR(x) __attribute__((x))
static float warm[1024];
ATTR(CAT(constr, uctor)) static void at_load() { for (int i = 0; i < 1024; ++i) warm[i] = 1.f; }
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) { mm(A, B, C, M, N, K); return warm[0] == 1.f ? 0 : 1; }
