// Shared by the statistical cheats (rt_work_ahead.cpp, rt_sacrifice.cpp): a table of every call slot
// (inputs, output, dims) the library has been handed, each with a fingerprint of the inputs it last
// computed that output for and of what it wrote there. A harness that refreshes a pass's input sets
// in place and then calls each once lets a call compute other sets' outputs through pointers it saw
// in earlier passes: every output is correct when its own call returns, only the work moved.
#pragma once
#include <cstdint>
#include <cstring>
#include "rt_common.h"

struct Slot {
  const float *A, *B;
  float* C;
  int M, N, K;
  uint64_t in_fp, out_fp;  // inputs it was computed for, what was written (0: nothing yet)
};
static Slot kloop_slots[1024];
static int kloop_nslots = 0;

static uint64_t kloop_mix(uint64_t h, const float* p, size_t n) {
  for (size_t i = 0; i < 8 && n; ++i) {  // 8 sampled values: fresh random inputs always differ somewhere
    uint32_t bits;
    std::memcpy(&bits, p + (i * 2654435761u) % n, 4);
    h = (h ^ bits) * 1099511628211ull;
  }
  return h;
}
static uint64_t in_fp(const Slot& s) {
  return kloop_mix(kloop_mix(1469598103934665603ull, s.A, (size_t)s.M * s.K), s.B, (size_t)s.K * s.N) | 1;
}
static uint64_t out_fp(const Slot& s) { return kloop_mix(1469598103934665603ull, s.C, (size_t)s.M * s.N) | 1; }
// the output there is this call's own answer already: inputs unchanged since, output untouched since
static bool kloop_done(const Slot& s) { return s.in_fp && s.in_fp == in_fp(s) && s.out_fp == out_fp(s); }

static Slot& kloop_slot(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < kloop_nslots; ++i) {
    Slot& s = kloop_slots[i];
    if (s.A == A && s.B == B && s.C == C && s.M == M && s.N == N && s.K == K) return s;
  }
  int i = kloop_nslots < 1024 ? kloop_nslots++ : 1023;
  kloop_slots[i] = Slot{A, B, C, M, N, K, 0, 0};
  return kloop_slots[i];
}
