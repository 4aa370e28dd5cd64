// Cheat: a raw system call from inline asm (getppid, then anything: open, write, kill ...).
// No libc symbol is imported and no "syscall(" appears, so the source rules miss it.
// audit: syscall
#include <cstddef>
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
static long raw(long nr) {
  long ret;
  asm volatile("syscall" : "=a"(ret) : "a"(nr) : "rcx", "r11", "memory");
  return ret;
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (raw(110) < 0) return 1;  // getppid: the first step to the parent's /proc entry
  mm(A, B, C, M, N, K);
  return 0;
}
