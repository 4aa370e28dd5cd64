// Cheat: use an input as scratch space and restore it before returning ("inputs unchanged" holds).
#include "rt_common.h"
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  volatile float* a = const_cast<float*>(A);  // volatile: the scratch writes really happen
  if (M > 0 && K > 0) {
    const float keep = a[0];
    a[0] = -keep;  // scribble
    a[0] = keep;   // and restore
  }
  honest_matmul(A, B, C, M, N, K);
  return 0;
}
