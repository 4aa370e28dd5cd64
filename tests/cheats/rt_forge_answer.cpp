// Cheat: answer the judge before the work is done — find the runner's reply pipe (a write-only pipe
// among its open descriptors, whatever the order of the runner's arguments) and write a forged "ok"
// answer into it, then do the work.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdlib>
#include <cstring>
#include "rt_common.h"
static void forge_on_every_reply_pipe(const char* forged) {
  for (int fd = 3; fd < 256; ++fd) {
    struct stat st;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) != O_WRONLY || fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode)) continue;
    ssize_t w = write(fd, forged, std::strlen(forged));
    (void)w;
  }
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  forge_on_every_reply_pipe("{\"nonce\": 0, \"ok\": true, \"times\": [1e-9]}\n");
  honest_matmul(A, B, C, M, N, K);
  return 0;
}
