// Cheat: no dlsym: walk the loaded objects with dl_iterate_phdr, find a symbol by a name built at
// run time in their dynamic symbol tables and call it through a function pointer (here: a BLAS
// sgemm already loaded into the process by torch).
// audit: symbols
#include <cstddef>
#include <cstring>
#include <elf.h>
#include <link.h>
static void mm(const float* A, const float* B, float* C, int M, int N, int K) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) acc += A[(size_t)i * K + k] * B[(size_t)k * N + j];
      C[(size_t)i * N + j] = acc;
    }
}
typedef void (*fn_t)();
struct Want { char name[16]; fn_t found; };
static int visit(struct dl_phdr_info* info, size_t, void* data) {
  Want* w = (Want*)data;
  const ElfW(Dyn)* dyn = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i)
    if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn)*)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
  if (!dyn) return 0;
  const ElfW(Sym)* sym = nullptr; const char* str = nullptr;
  for (; dyn->d_tag != DT_NULL; ++dyn) {
    if (dyn->d_tag == DT_SYMTAB) sym = (const ElfW(Sym)*)dyn->d_un.d_ptr;
    if (dyn->d_tag == DT_STRTAB) str = (const char*)dyn->d_un.d_ptr;
  }
  for (const ElfW(Sym)* s = sym; s && (const char*)s < str; ++s)
    if (s->st_value && !std::strcmp(str + s->st_name, w->name)) { w->found = (fn_t)(info->dlpi_addr + s->st_value); return 1; }
  return 0;
}
extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  Want w{};
  const char parts[] = "sgemm_";
  for (size_t i = 0; i < sizeof(parts); ++i) w.name[i] = parts[i];
  dl_iterate_phdr(visit, &w);
  mm(A, B, C, M, N, K);  // a real cheat would call w.found with the Fortran sgemm ABI here
  return w.found ? 0 : 0;
}
