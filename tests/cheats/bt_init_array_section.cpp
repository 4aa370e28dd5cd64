// Cheat: a function pointer placed in .init_array by hand (no constructor attribute).
// audit: load-time
#include <cstddef>
static int loaded;
static void at_load() { loaded = 1; }
__attribute__((used, section(".init_array"))) static void (*hook)() = at_load;
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) { mm(A, B, C, M, N, K); return loaded ? 0 : 1; }
