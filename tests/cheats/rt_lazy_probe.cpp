// Cheat (found by red-teaming, stop 17): "pay at the probe". A timed call computes only the first half of C's rows and owes the
// rest; the owed rows are computed inside the next *cold probe* call, which the cheat recognises as a
// call on buffers whose input values it has already seen (a probe re-runs a set already called in the
// pass; timed calls always see fresh values). The probe's duration never enters the speedup, and its
// extra work is single-threaded (CPU == wall: nothing "beyond"), with nothing after return. The
// re-check of timed outputs runs only after the probes, when every owed row has been written.
// Lazy mode only once a shape has been called on >= 3 distinct buffer sets (the check calls each
// shape on one set of buffers, twice: always honest there).
#include "rt_common.h"
#include <cstdint>
#include <cstring>

namespace {
struct Entry {
  const float* a; const float* b; float* c; int m, n, k;
  uint64_t fp;     // fingerprint of the input values at its last call
  int owed_from;   // rows [owed_from, m) still owed; -1 none
};
constexpr int MAXE = 4096;
Entry table[MAXE];
int used = 0;

uint64_t fingerprint(const float* A, const float* B, int M, int N, int K) {
  uint64_t h = 1469598103934665603ull;
  size_t na = (size_t)M * K, nb = (size_t)K * N;
  for (int i = 0; i < 16; ++i) {
    uint32_t x, y;
    std::memcpy(&x, A + (na * (2 * i + 1)) / 33, 4);
    std::memcpy(&y, B + (nb * (2 * i + 1)) / 33, 4);
    h = (h ^ x) * 1099511628211ull;
    h = (h ^ y) * 1099511628211ull;
  }
  return h;
}

int distinct_for_shape(int M, int N, int K) {
  int d = 0;
  for (int i = 0; i < used; ++i) d += table[i].m == M && table[i].n == N && table[i].k == K;
  return d;
}

void rows(const float* A, const float* B, float* C, int r0, int r1, int N, int K) {
  if (r1 > r0) honest_matmul(A + (size_t)r0 * K, B, C + (size_t)r0 * N, r1 - r0, N, K);
}

void pay_all() {
  for (int i = 0; i < used; ++i) {
    Entry& e = table[i];
    if (e.owed_from >= 0) {
      rows(e.a, e.b, e.c, e.owed_from, e.m, e.n, e.k);
      e.owed_from = -1;
    }
  }
}
}  // namespace

extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (M < 0 || N < 0 || K < 0) return 1;
  if (M < 8 || N == 0 || K == 0) { honest_matmul(A, B, C, M, N, K); return 0; }
  const uint64_t fp = fingerprint(A, B, M, N, K);
  Entry* e = nullptr;
  for (int i = 0; i < used; ++i)
    if (table[i].a == A && table[i].b == B && table[i].c == C && table[i].m == M && table[i].n == N && table[i].k == K) { e = &table[i]; break; }
  if (e == nullptr) {
    if (used == MAXE) { pay_all(); honest_matmul(A, B, C, M, N, K); return 0; }
    e = &table[used++];
    *e = Entry{A, B, C, M, N, K, fp ^ 1, -1};
  }
  if (e->fp == fp) {
    // the same values again on the same buffers: a cold probe (or a repeat). Pay every debt here.
    pay_all();
    honest_matmul(A, B, C, M, N, K);
    return 0;
  }
  e->fp = fp;
  if (distinct_for_shape(M, N, K) < 3) {  // the check: one buffer set per shape
    e->owed_from = -1;
    honest_matmul(A, B, C, M, N, K);
    return 0;
  }
  const int half = M / 2;
  rows(A, B, C, 0, half, N, K);  // the timed call does half the rows...
  e->owed_from = half;           // ...and owes the other half until the probe
  return 0;
}
