// Cheat: find the other matmul library loaded in the process (the best, in an in-process A/B) with
// dl_iterate_phdr, mprotect its entry point writable and patch in a jump to a slow copy of the work.
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>
#include <cstdint>
#include <cstring>
#include "rt_common.h"
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K);
static int slow_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  honest_matmul(A, B, C, M, N, K);
  honest_matmul(A, B, C, M, N, K);  // the best now does its work twice
  return 0;
}
static int patched = 0;
static int visit(struct dl_phdr_info* info, size_t, void*) {
  if (!info->dlpi_name || !std::strstr(info->dlpi_name, ".so")) return 0;
  void* h = dlopen(info->dlpi_name, RTLD_NOW | RTLD_NOLOAD);
  if (!h) return 0;
  void* other = dlsym(h, "kloop_matmul");
  if (other && other != (void*)&kloop_matmul) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)other & ~(uintptr_t)(page - 1);
    if (mprotect((void*)start, 2 * page, PROT_READ | PROT_WRITE | PROT_EXEC) == 0) {
      unsigned char jump[12] = {0x48, 0xB8, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xE0};  // movabs rax, X; jmp rax
      void* target = (void*)&slow_matmul;
      std::memcpy(jump + 2, &target, 8);
      std::memcpy(other, jump, sizeof jump);
      mprotect((void*)start, 2 * page, PROT_READ | PROT_EXEC);
      patched = 1;
    }
  }
  dlclose(h);
  return 0;
}
extern "C" int kloop_cheat_patched() { return patched; }
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (!patched) dl_iterate_phdr(visit, nullptr);
  honest_matmul(A, B, C, M, N, K);
  return 0;
}
