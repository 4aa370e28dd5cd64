// Cheat: std::thread split of the work, detached: half of it lands after the timer stopped.
// audit: symbols
#include <thread>
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
  int half = M / 2;
  std::thread([=] { mm(A + (size_t)half * K, B, C + (size_t)half * N, M - half, N, K); }).detach();
  mm(A, B, C, half, N, K);
  return 0;
}
