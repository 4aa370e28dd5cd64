// Probe (not a cheat; found by red-teaming, stop 17): can a runner reach the other runner (the best's) or the judge?
// It lists /proc (readdir: every process, whatever its pid; a fixed pid range missed siblings once the
// machine's pids passed it), finds a 'libhost' process other than itself, tries to open its memory for
// writing and to signal it, and tries the judge's (its parent's) memory. The answer, plus 100000, is C[0]
// of the first call (so the gate's check failure prints it) and returned by kloop_cheat_found():
// 10000 * (/proc/<parent = the judge>/mem opened O_RDWR) + 1000 * (a sibling runner found)
// + 100 * (/proc/<sibling>/mem opened O_RDWR) + 10 * (kill(sibling, 0) == 0) + (other processes visible but PID 1,
// at most 9).
#include <dirent.h>
#include "rt_common.h"
#include "rt_libc_resolve.h"

namespace {
typedef int (*op_t)(const char*, int, ...);
typedef long (*rd_t)(int, void*, size_t);
typedef int (*cl_t)(int);
typedef int (*kl_t)(int, int);
typedef int (*gp_t)();
typedef DIR* (*od_t)(const char*);
typedef dirent* (*rdd_t)(DIR*);
typedef int (*cd_t)(DIR*);
int done = 0;
int result = 0;

void itoa(int v, char* out) {
  char t[16]; int n = 0;
  do { t[n++] = char('0' + v % 10); v /= 10; } while (v);
  while (n) *out++ = t[--n];
  *out = 0;
}

int probe() {
  op_t o = (op_t)rt::libc_sym("open"); rd_t r = (rd_t)rt::libc_sym("read"); cl_t c = (cl_t)rt::libc_sym("close");
  kl_t k = (kl_t)rt::libc_sym("kill"); gp_t g = (gp_t)rt::libc_sym("getpid"); gp_t gp = (gp_t)rt::libc_sym("getppid");
  od_t od = (od_t)rt::libc_sym("opendir"); rdd_t rdd = (rdd_t)rt::libc_sym("readdir"); cd_t cd = (cd_t)rt::libc_sym("closedir");
  if (!o || !r || !c || !k || !g || !gp || !od || !rdd || !cd) return -1;
  const int me = g();
  int found = 0, memw = 0, sig = 0, visible = 0;
  const char proc[] = {'/', 'p', 'r', 'o', 'c', 0};
  DIR* d = od(proc);
  if (!d) return -2;
  while (dirent* e = rdd(d)) {
    int pid = 0;
    const char* p = e->d_name;
    if (*p < '0' || *p > '9') continue;
    while (*p >= '0' && *p <= '9') pid = pid * 10 + (*p++ - '0');
    // PID 1 is never a sibling: the machine's init, or in a runner's own namespace its init (a shell
    // that only waits for it: tools.sandbox.PIDNS_INIT), which every PID namespace must have
    if (*p || pid == me || pid == 1) continue;
    ++visible;
    if (found) continue;
    char path[64] = {'/', 'p', 'r', 'o', 'c', '/'};
    itoa(pid, path + 6);
    char* end = path; while (*end) ++end;
    const char cmd[] = {'/', 'c', 'm', 'd', 'l', 'i', 'n', 'e', 0};
    for (int i = 0; i < 9; ++i) end[i] = cmd[i];
    int fd = o(path, 0);
    if (fd < 0) continue;
    char buf[512]; long n = r(fd, buf, sizeof(buf) - 1); c(fd);
    if (n <= 0) continue;
    for (long i = 0; i < n; ++i) if (!buf[i]) buf[i] = ' ';
    buf[n] = 0;
    const char needle[] = {'l', 'i', 'b', 'h', 'o', 's', 't', 0};
    bool hit = false;
    for (long i = 0; i + 7 <= n && !hit; ++i) { int j = 0; while (j < 7 && buf[i + j] == needle[j]) ++j; hit = j == 7; }
    if (!hit) continue;
    found = 1;
    const char mem[] = {'/', 'm', 'e', 'm', 0};
    for (int i = 0; i < 5; ++i) end[i] = mem[i];
    int mfd = o(path, 2);
    if (mfd >= 0) { memw = 1; c(mfd); }
    sig = k(pid, 0) == 0;
  }
  cd(d);
  int judge = 0;
  const int parent = gp();
  if (parent > 0) {
    char jp[64] = {'/', 'p', 'r', 'o', 'c', '/'};
    itoa(parent, jp + 6);
    char* q = jp; while (*q) ++q;
    const char mm[] = {'/', 'm', 'e', 'm', 0};
    for (int i = 0; i < 5; ++i) q[i] = mm[i];
    int jfd = o(jp, 2);
    if (jfd >= 0) { judge = 1; c(jfd); }
  }
  return 10000 * judge + 1000 * found + 100 * memw + 10 * sig + (visible > 9 ? 9 : visible);
}
}  // namespace

extern "C" int kloop_cheat_found() {
  if (!done) { done = 1; result = probe(); }
  return result;
}

extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  const bool first = !done;
  kloop_cheat_found();
  honest_matmul(A, B, C, M, N, K);
  if (M * N > 0 && first) C[0] = float(100000 + result);  // never near a reference value: the check prints it
  return 0;
}
