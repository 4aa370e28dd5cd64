// Not a cheat: the honest i-k-j product every cheat is measured against (the "best").
#include "rt_common.h"
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  honest_matmul(A, B, C, M, N, K);
  return 0;
}
