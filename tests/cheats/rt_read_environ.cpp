// Cheat: read the environment of the process and of its parent through /proc, looking for a secret;
// when it finds one it marks its output (so a harness can tell that the secret was reachable).
#include <fcntl.h>
#include <unistd.h>
#include <cstdio>
#include <cstring>
#include "rt_common.h"
static int found = -1;
static int has_secret(const char* path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return 0;
  static char buf[1 << 16];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  for (ssize_t i = 0; i < n; ++i) if (!buf[i]) buf[i] = '\n';
  buf[n] = 0;
  return std::strstr(buf, "KLOOP_TEST_SECRET=") != nullptr;
}
extern "C" int kloop_cheat_found() { return found; }
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (found < 0) {
    char parent[64];
    std::snprintf(parent, sizeof parent, "/proc/%d/environ", (int)getppid());
    found = has_secret("/proc/self/environ") || has_secret(parent);
  }
  honest_matmul(A, B, C, M, N, K);
  if (found && M > 0 && N > 0) C[0] += 1000.f;  // the leak, made visible
  return 0;
}
