// fp32 C[M,N] = A[M,K] @ B[K,N], all row-major and contiguous.
// The baseline is the textbook triple loop; the knobs pick a loop order and a blocking.
#include <cstddef>
#include <cstring>

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

// i-k-j: the inner loop walks a row of B and a row of C, so it streams and vectorises. The 8-wide
// step is written with 128-bit vector types: GCC's -O2 (whose cheap cost model will not version a
// loop for aliasing or peel an epilogue) leaves the plain loop scalar, Clang vectorises it; written
// this way both compilers emit the same SIMD code (x7-8 over i-j-k at -O2 on an AMD EPYC, either one).
typedef float f32x4 __attribute__((vector_size(16)));

void matmul_ikj(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
  for (int i = 0; i < M; ++i) {
    float* __restrict__ c = C + (size_t)i * N;
    for (int j = 0; j < N; ++j) c[j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += (TILE ? TILE : K)) {
      const int k1 = TILE && k0 + TILE < K ? k0 + TILE : K;
      for (int j0 = 0; j0 < N; j0 += (TILE ? TILE : N)) {
        const int j1 = TILE && j0 + TILE < N ? j0 + TILE : N;
        for (int k = k0; k < k1; ++k) {
          const float a = A[(size_t)i * K + k];
          const float* __restrict__ b = B + (size_t)k * N;
          int j = j0;
          for (; j + 8 <= j1; j += 8) {
            f32x4 c0, c1, b0, b1;
            std::memcpy(&c0, c + j, 16);
            std::memcpy(&c1, c + j + 4, 16);
            std::memcpy(&b0, b + j, 16);
            std::memcpy(&b1, b + j + 4, 16);
            c0 += a * b0;
            c1 += a * b1;
            std::memcpy(c + j, &c0, 16);
            std::memcpy(c + j + 4, &c1, 16);
          }
          for (; j < j1; ++j) c[j] += a * b[j];
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
