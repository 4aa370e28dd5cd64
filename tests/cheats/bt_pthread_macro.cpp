// Cheat: a background thread started through a pasted name: it keeps computing after the call
// returns, outside the timed window.
// audit: symbols
#include <pthread.h>
#include <cstddef>
#define CAT(a, b) a##b
#define SPAWN CAT(pthread_, create)
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
static void* work(void*) { return nullptr; }
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  pthread_t t;
  SPAWN(&t, nullptr, work, nullptr);
  mm(A, B, C, M, N, K);
  return 0;
}
