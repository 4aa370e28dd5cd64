// Cheat: fopen spelled by token pasting, on a path built from characters: reads a file the
// harness wrote (the reference outputs of a previous call, say). The raw-source rules see no "fopen(".
// audit: symbols
#include <cstdio>
#define CAT(a, b) a##b
#define OPEN CAT(fo, pen)
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  const char p[] = {'r', 'e', 'f', '.', 'b', 'i', 'n', 0};
  if (FILE* f = OPEN(p, "rb")) {
    size_t n = fread(C, sizeof(float), (size_t)M * N, f);
    fclose(f);
    if (n == (size_t)M * N) return 0;
  }
  mm(A, B, C, M, N, K);
  return 0;
}
