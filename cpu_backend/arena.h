// Anonymous memory for a store's slots (neuron_store.h, expert_store.h): never the file's page
// cache, zero until written, on 2 MiB boundaries and marked for transparent huge pages (madvise
// mode, the default here) from kHugeMin bytes on. Slots are read scattered, and with 4 KiB pages
// every neuron touched was a TLB miss or two (numpy's large arrays, which the in-memory kernels
// read, get huge pages the same way): a layer's matvec over a neuron store's static part
// measured 1.4x qsparse_ffn's CPU time before this. Smaller arenas stay on 4 KiB pages (a huge
// page's rounding would be a large share). The stores' Python budgets count the rounding: at
// most one huge page per arena (runtime/offload.py HUGE_PAGE, HUGE_MIN).
#ifndef PIJ_CPU_BACKEND_ARENA_H_
#define PIJ_CPU_BACKEND_ARENA_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

namespace pij {

struct Arena {
  static constexpr size_t kHuge = size_t{2} << 20;
  static constexpr size_t kHugeMin = size_t{32} << 20;
  uint8_t* data = nullptr;
  void* base = nullptr;
  size_t bytes = 0, mapped = 0;
  // Throws std::bad_alloc when the mapping fails.
  explicit Arena(size_t n) : bytes(n) {
    if (n == 0) return;
    const bool huge = n >= kHugeMin;
    mapped = huge ? n + kHuge : n;
    base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      base = nullptr;
      throw std::bad_alloc();
    }
    const uintptr_t at = huge ? (reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge
                              : reinterpret_cast<uintptr_t>(base);
    data = reinterpret_cast<uint8_t*>(at);
#ifdef MADV_HUGEPAGE
    if (huge) ::madvise(data, n, MADV_HUGEPAGE);  // advice only: ignored where THP is off
#endif
  }
  ~Arena() {
    if (base != nullptr) ::munmap(base, mapped);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
};

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_ARENA_H_
