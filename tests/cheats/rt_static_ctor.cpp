// Cheat: a static constructor starts, at load time, a helper thread that takes the work of later
// calls after they return (no thread is created inside a call).
#include <atomic>
#include <thread>
#include "rt_common.h"
struct Job { const float* A; const float* B; float* C; int M, N, K; };
static std::atomic<Job*> pending{nullptr};
static long calls = 0;
struct Helper {
  Helper() {
    std::thread([] {
      for (;;) {
        Job* j = pending.exchange(nullptr);
        if (j) { honest_matmul(j->A, j->B, j->C, j->M, j->N, j->K); delete j; }
        else std::this_thread::yield();
      }
    }).detach();
  }
} helper;
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (++calls <= 40) { honest_matmul(A, B, C, M, N, K); return 0; }
  pending.store(new Job{A, B, C, M, N, K});
  return 0;
}
