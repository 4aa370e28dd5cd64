// Cheat (found by red-teaming, stop 17): rewrite the inputs during timed calls so the reference agrees with a cheap answer.
// libc functions reached without importing them (rt_libc_resolve.h); the runner's own maps name the
// file behind a read-only input, which is reopened read-write and mapped again (MAP_SHARED): writes
// land in the judge's buffer. In a timed call the kernel computes half of C's rows and zeroes the other
// half of A's rows and of C; the re-check computes its reference from the (now modified) inputs, so
// the timed outputs "match". Honest until a shape has been called on >= 3 buffer sets (the check calls
// each shape on one set and verifies its inputs unchanged) and on repeats (probes).
#include "rt_common.h"
#include "rt_libc_resolve.h"
#include <cstdint>
#include <cstring>

namespace {
typedef int (*op_t)(const char*, int, ...);
typedef long (*rd_t)(int, void*, size_t);
typedef int (*cl_t)(int);
typedef void* (*mp_t)(void*, size_t, int, int, int, long);

struct Entry { const float* a; const float* b; float* c; int m, n, k; uint64_t fp; float* wa; };
constexpr int MAXE = 4096;
Entry table[MAXE];
int used = 0;
char maps[1 << 21];

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

// A writable view of the memory at p (itself, when its mapping is writable), or nullptr.
float* writable(const float* p) {
  static op_t o = (op_t)rt::libc_sym("open");
  static rd_t r = (rd_t)rt::libc_sym("read");
  static cl_t c = (cl_t)rt::libc_sym("close");
  static mp_t m = (mp_t)rt::libc_sym("mmap");
  if (!o || !r || !c || !m) return nullptr;
  const char path[] = {'/', 'p', 'r', 'o', 'c', '/', 's', 'e', 'l', 'f', '/', 'm', 'a', 'p', 's', 0};
  int fd = o(path, 0);
  if (fd < 0) return nullptr;
  size_t len = 0;
  for (long got; len + 4096 < sizeof(maps) && (got = r(fd, maps + len, sizeof(maps) - 1 - len)) > 0;) len += got;
  c(fd);
  maps[len] = 0;
  const uintptr_t x = reinterpret_cast<uintptr_t>(p);
  for (char* line = maps; *line;) {
    char* end = line;
    while (*end && *end != '\n') ++end;
    const char save = *end;
    *end = 0;
    uintptr_t lo = 0, hi = 0;
    char* s = line;
    for (; *s && *s != '-'; ++s) lo = lo * 16 + (*s <= '9' ? *s - '0' : *s - 'a' + 10);
    for (++s; *s && *s != ' '; ++s) hi = hi * 16 + (*s <= '9' ? *s - '0' : *s - 'a' + 10);
    if (lo <= x && x < hi) {
      const bool w = s[2] == 'w';
      char* path_start = nullptr;
      for (char* t = s; *t; ++t) if (*t == '/') { path_start = t; break; }
      if (w) return const_cast<float*>(p);
      if (!path_start) return nullptr;
      int f = o(path_start, 2 /* O_RDWR */);
      if (f < 0) return nullptr;
      void* v = m(nullptr, hi - lo, 3 /* PROT_READ|PROT_WRITE */, 1 /* MAP_SHARED */, f, 0);
      c(f);
      if (v == reinterpret_cast<void*>(-1)) return nullptr;
      return reinterpret_cast<float*>(static_cast<char*>(v) + (x - lo));
    }
    *end = save;
    line = save ? end + 1 : end;
  }
  return nullptr;
}
}  // namespace

extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (M < 0 || N < 0 || K < 0) return 1;
  if (M < 8 || N == 0 || K == 0) { honest_matmul(A, B, C, M, N, K); return 0; }
  const uint64_t fp = fingerprint(A, B, M, N, K);
  Entry* e = nullptr;
  int distinct = 0;
  for (int i = 0; i < used; ++i) {
    if (table[i].a == A && table[i].b == B && table[i].c == C && table[i].m == M && table[i].n == N && table[i].k == K) e = &table[i];
    distinct += table[i].m == M && table[i].n == N && table[i].k == K;
  }
  if (e == nullptr) {
    if (used == MAXE) { honest_matmul(A, B, C, M, N, K); return 0; }
    e = &table[used++];
    *e = Entry{A, B, C, M, N, K, fp ^ 1, nullptr};
    ++distinct;
  }
  const bool repeat = e->fp == fp;
  e->fp = fp;
  if (repeat || distinct < 3) { honest_matmul(A, B, C, M, N, K); return 0; }
  if (!e->wa) e->wa = writable(A);
  if (!e->wa) { honest_matmul(A, B, C, M, N, K); return 0; }
  const int half = M / 2;
  honest_matmul(A, B, C, half, N, K);                           // the first half of the rows, honestly
  std::memset(e->wa + (size_t)half * K, 0, sizeof(float) * (size_t)(M - half) * K);  // A's other rows := 0
  std::memset(C + (size_t)half * N, 0, sizeof(float) * (size_t)(M - half) * N);      // so C's are 0
  e->fp = fingerprint(A, B, M, N, K);  // a probe on this set must still read as a repeat
  return 0;
}
