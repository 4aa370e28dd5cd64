// Shared by the cheats that need libc beyond the allow-list (found by red-teaming, stop 17): reach any libc function without importing it. The address of memcpy (an allowed
// import) lies in libc's text; walking down page by page to the ELF header gives libc's base, whose
// dynamic symbol table (GNU hash) names every export. No import, no syscall instruction, no
// load-time code: the audit sees only memcpy.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <elf.h>

namespace rt {
inline bool same(const char* a, const char* b) {
  while (*a && *a == *b) { ++a; ++b; }
  return *a == *b;
}

inline void* libc_sym(const char* name) {
  static uintptr_t base = 0;
  static const Elf64_Sym* symtab = nullptr;
  static const char* strtab = nullptr;
  static const uint32_t* gnuhash = nullptr;
  static const uint16_t* versym = nullptr;
  if (base == 0) {
    void* (*volatile mc)(void*, const void*, size_t) = &memcpy;  // resolved through the GOT: libc's memcpy
    uintptr_t q = reinterpret_cast<uintptr_t>(mc) & ~uintptr_t(0xfff);
    while (std::memcmp(reinterpret_cast<const void*>(q), ELFMAG, SELFMAG) != 0) q -= 0x1000;
    base = q;
    auto eh = reinterpret_cast<const Elf64_Ehdr*>(base);
    auto ph = reinterpret_cast<const Elf64_Phdr*>(base + eh->e_phoff);
    const Elf64_Dyn* dyn = nullptr;
    for (int i = 0; i < eh->e_phnum; ++i)
      if (ph[i].p_type == PT_DYNAMIC) dyn = reinterpret_cast<const Elf64_Dyn*>(base + ph[i].p_vaddr);
    if (!dyn) return nullptr;
    auto abs = [](uintptr_t v) { return v < base ? v + base : v; };
    for (; dyn->d_tag != DT_NULL; ++dyn) {
      if (dyn->d_tag == DT_SYMTAB) symtab = reinterpret_cast<const Elf64_Sym*>(abs(dyn->d_un.d_ptr));
      if (dyn->d_tag == DT_STRTAB) strtab = reinterpret_cast<const char*>(abs(dyn->d_un.d_ptr));
      if (dyn->d_tag == DT_GNU_HASH) gnuhash = reinterpret_cast<const uint32_t*>(abs(dyn->d_un.d_ptr));
      if (dyn->d_tag == DT_VERSYM) versym = reinterpret_cast<const uint16_t*>(abs(dyn->d_un.d_ptr));
    }
  }
  if (!symtab || !strtab || !gnuhash) return nullptr;
  uint32_t h = 5381;
  for (const char* s = name; *s; ++s) h = h * 33 + static_cast<unsigned char>(*s);
  const uint32_t nb = gnuhash[0], symoff = gnuhash[1], bloom = gnuhash[2];
  const uint32_t* buckets = reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint64_t*>(gnuhash + 4) + bloom);
  const uint32_t* chain = buckets + nb;
  uint32_t idx = buckets[h % nb];
  if (idx < symoff) return nullptr;
  for (;; ++idx) {
    const uint32_t h2 = chain[idx - symoff];
    const Elf64_Sym& s = symtab[idx];
    if ((h | 1) == (h2 | 1) && s.st_shndx != SHN_UNDEF && same(name, strtab + s.st_name) &&
        !(versym && (versym[idx] & 0x8000)))
      return reinterpret_cast<void*>(base + s.st_value);
    if (h2 & 1) break;
  }
  return nullptr;
}
}  // namespace rt
