// fp32 C[M,N] = A[M,K] @ B[K,N], all row-major and contiguous.
// The baseline is the textbook triple loop; the knobs pick a loop order and a blocking.
#include <cstddef>

#ifndef LOOP_ORDER
#define LOOP_ORDER 0  // 0: i-j-k, 1: i-k-j
#endif
#ifndef TILE
#define TILE 0  // 0: no blocking
#endif

namespace {

void matmul_ijk(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}

// i-k-j: the inner loop walks a row of B and a row of C, so it streams and vectorises.
void matmul_ikj(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i) {
    float* c = C + (size_t)i * N;
    for (int j = 0; j < N; ++j) c[j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += (TILE ? TILE : K)) {
      const int k1 = TILE && k0 + TILE < K ? k0 + TILE : K;
      for (int j0 = 0; j0 < N; j0 += (TILE ? TILE : N)) {
        const int j1 = TILE && j0 + TILE < N ? j0 + TILE : N;
        for (int k = k0; k < k1; ++k) {
          const float a = A[(size_t)i * K + k];
          const float* b = B + (size_t)k * N;
          for (int j = j0; j < j1; ++j) c[j] += a * b[j];
        }
      }
    }
  }
}

}  // namespace

extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (M < 0 || N < 0 || K < 0) return 1;
#if LOOP_ORDER == 1
  matmul_ikj(A, B, C, M, N, K);
#else
  matmul_ijk(A, B, C, M, N, K);
#endif
  return 0;
}
