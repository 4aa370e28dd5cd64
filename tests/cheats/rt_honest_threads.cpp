// Honest (not a cheat): the shared i-k-j product split by rows over two std::threads, both joined
// before the call returns. Allowed only where the manifest says `threads = 2` (the audit's thread
// symbols and source rule); then the gate times the wall clock, so the parallel gain is the user's.
#include <thread>
#include "rt_common.h"
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  const int half = M / 2;
  std::thread other([=] { honest_matmul(A + (size_t)half * K, B, C + (size_t)half * N, M - half, N, K); });
  honest_matmul(A, B, C, half, N, K);
  other.join();
  return 0;
}
