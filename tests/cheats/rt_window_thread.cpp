// Cheat (issue 20, "work in a window no clock charges"): a helper thread, started without an import
// (pthread_create found in libc through rt_libc_resolve.h, so the audit sees only memcpy), watches
// the output buffers of every set it has seen. When the harness poisons one (it drew fresh inputs
// first), the helper computes it then, in the harness's own time (its flush, its fresh values, its
// bookkeeping); the call that follows finds its output done and returns at once. Every output is
// right. Against a clock that charges only the calls, it is many times faster; the work still costs
// the same CPU, and nothing of it happens inside a call.
#include <atomic>
#include <cstddef>
#include "rt_common.h"
#include "rt_libc_resolve.h"

namespace {
struct Set {
  const float* A; const float* B; float* C; int M, N, K;
  std::atomic<int> state;  // 0 idle, 1 the helper computes C, 2 the helper computed C, 3 the call computes C
};
constexpr int kMax = 512;
Set sets[kMax];
std::atomic<int> count{0};
std::atomic<int> started{0};
typedef int (*create_t)(void*, const void*, void* (*)(void*), void*);
typedef int (*usleep_t)(unsigned);

// NaN at both ends: the harness finished poisoning (after drawing the inputs)
bool poisoned(const float* c, int n) { return c[0] != c[0] && c[n - 1] != c[n - 1]; }

void* helper(void*) {
  usleep_t nap = (usleep_t)rt::libc_sym("usleep");
  for (;;) {
    const int n = count.load();
    for (int i = 0; i < n; ++i) {
      Set& s = sets[i];
      int idle = 0;
      if (s.M * s.N > 0 && poisoned(s.C, s.M * s.N) && s.state.compare_exchange_strong(idle, 1)) {
        honest_matmul(s.A, s.B, s.C, s.M, s.N, s.K);
        s.state.store(2);
      }
    }
    if (nap) nap(100);
  }
  return nullptr;
}

Set* find(const float* A, const float* B, float* C, int M, int N, int K) {
  const int n = count.load();
  for (int i = 0; i < n; ++i)
    if (sets[i].C == C && sets[i].A == A && sets[i].B == B && sets[i].M == M && sets[i].N == N && sets[i].K == K)
      return &sets[i];
  if (n >= kMax) return nullptr;
  Set& s = sets[n];
  s.A = A; s.B = B; s.C = C; s.M = M; s.N = N; s.K = K; s.state.store(0);
  count.store(n + 1);
  return &s;
}
}  // namespace

extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (!started.exchange(1)) {
    create_t create = (create_t)rt::libc_sym("pthread_create");
    unsigned long tid;
    if (create) create(&tid, nullptr, helper, nullptr);
  }
  Set* s = find(A, B, C, M, N, K);
  if (!s) { honest_matmul(A, B, C, M, N, K); return 0; }
  for (;;) {
    int st = s->state.load();
    if (st == 1) continue;  // the helper is at it: wait for it
    if (st == 2) {  // done in the window before this call
      if (s->state.compare_exchange_strong(st, 0) && C[0] == C[0] && C[M * N - 1] == C[M * N - 1]) return 0;
      continue;
    }
    if (st == 0 && s->state.compare_exchange_strong(st, 3)) break;  // ours: the helper keeps off it
  }
  honest_matmul(A, B, C, M, N, K);
  s->state.store(0);
  return 0;
}
