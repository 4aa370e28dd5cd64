// Cheat: makes another library's code writable to patch it (the checker, the best's kernel).
// audit: symbols
#include <sys/mman.h>
#include <cstdint>
#include <cstddef>
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  uintptr_t page = (uintptr_t)(void*)&mm & ~(uintptr_t)4095;
  mprotect((void*)page, 4096, PROT_READ | PROT_WRITE | PROT_EXEC);
  mm(A, B, C, M, N, K);
  return 0;
}
