// Read bandwidth of the access patterns a sparse matvec can have, on this machine (no kernel
// arithmetic: one add per 64-byte line), 2 threads, each over its half of a 512 MiB buffer on
// transparent huge pages, best of 6 passes, the last-level cache evicted before each:
//   rows     one sequential stream per thread (the rows kernels' pattern);
//   columns  the columns layout's pattern (cpu_backend/qcolumns.cc): blocks of 32 channels of
//            CLEN bytes each (channel stride an odd number of lines), a random SPARSITY of the
//            channels skipped per block, the kept ones read a line at a time in turn (~20
//            concurrent streams), with the kernel's prefetches (NTA, 384 bytes ahead, and the
//            next block's first 256 bytes);
//   chunked  the same bytes kept, read as runs: per block, K-byte pieces of each kept channel
//            one after another, G channels in turn (G = 1: sequential runs with holes).
// Reports GB/s of the bytes actually read and the time against the rows pattern reading all.
//   g++ -O3 -march=native -std=gnu++20 -o /tmp/access_patterns \
//     benchmarks/cpp/access_patterns.cc -lpthread
//   /tmp/access_patterns CLEN SPARSITY [K [G]]     e.g. 2048 0.4 2048 1
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kBytes = size_t{512} << 20;
uint8_t* buf;
std::vector<uint8_t> junk(96 << 20, 1);

void Evict() {
  uint64_t a = 0;
  for (size_t i = 0; i < junk.size(); i += 64) a += junk[i];
  static volatile uint64_t sink;
  sink = a;
}

#if defined(__AVX512F__)
using Acc = __m512i;
inline Acc Zero() { return _mm512_setzero_si512(); }
inline Acc Add(Acc a, const uint8_t* p) { return _mm512_add_epi32(a, _mm512_load_si512(p)); }
inline int Reduce(Acc a) { return _mm512_reduce_add_epi32(a); }
#else
using Acc = __m256i;  // AVX2: two loads a line
inline Acc Zero() { return _mm256_setzero_si256(); }
inline Acc Add(Acc a, const uint8_t* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return _mm256_add_epi32(_mm256_add_epi32(a, _mm256_load_si256(q)), _mm256_load_si256(q + 1));
}
inline int Reduce(Acc a) {
  alignas(32) int v[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), a);
  int s = 0;
  for (int x : v) s += x;
  return s;
}
#endif

inline void Nta(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA); }

Acc Rows(size_t lo, size_t hi) {
  Acc a = Zero(), b = Zero();
  for (size_t i = lo; i < hi; i += 128) {
    a = Add(a, buf + i);
    b = Add(b, buf + i + 64);
  }
  return Add(a, reinterpret_cast<const uint8_t*>(&b));
}

Acc Columns(size_t lo, size_t hi, size_t clen, const std::vector<std::vector<int>>& keep) {
  const size_t stride = (clen / 64) % 2 == 0 ? clen + 64 : clen;
  const size_t block = 32 * stride;
  Acc a = Zero();
  const size_t nb = (hi - lo) / block;
  for (size_t b = 0; b < nb; ++b) {
    const uint8_t* base = buf + lo + b * block;
    if (b + 1 < nb) {
      for (int j : keep[(b + 1) % keep.size()]) {
        for (int k = 0; k < 256; k += 64) Nta(base + block + j * stride + k);
      }
    }
    const auto& kept = keep[b % keep.size()];
    for (size_t t = 0; t < clen; t += 64) {
      for (int j : kept) {
        const uint8_t* p = base + j * stride + t;
        Nta(p + 384);
        a = Add(a, p);
      }
    }
  }
  return a;
}

Acc Chunked(size_t lo, size_t hi, size_t clen, size_t piece, size_t g,
            const std::vector<std::vector<int>>& keep) {
  const size_t block = 32 * clen;
  Acc a = Zero();
  const size_t nb = (hi - lo) / block;
  for (size_t b = 0; b < nb; ++b) {
    const uint8_t* base = buf + lo + b * block;
    const auto& kept = keep[b % keep.size()];
    for (size_t c = 0; c < clen; c += piece) {
      const uint8_t* run = base + c * 32;  // piece c of every channel: 32 * piece bytes
      for (size_t i = 0; i < kept.size(); i += g) {
        const size_t n = std::min(g, kept.size() - i);
        for (size_t t = 0; t < piece; t += 64) {
          for (size_t k = 0; k < n; ++k) a = Add(a, run + kept[i + k] * piece + t);
        }
      }
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s CLEN SPARSITY [K [G]]\n", argv[0]);
    return 2;
  }
  const size_t clen = atoll(argv[1]);
  const double sparsity = atof(argv[2]);
  const size_t piece = argc > 3 ? atoll(argv[3]) : clen;
  const size_t g = argc > 4 ? atoll(argv[4]) : 1;
  if (clen % 64 != 0 || piece % 64 != 0 || clen % piece != 0 || g < 1) {
    fprintf(stderr, "CLEN and K: multiples of 64, K dividing CLEN; G >= 1\n");
    return 2;
  }
  buf = static_cast<uint8_t*>(aligned_alloc(2 << 20, kBytes));
  madvise(buf, kBytes, MADV_HUGEPAGE);
  memset(buf, 1, kBytes);
  std::mt19937 rng(1);
  std::vector<std::vector<int>> keep(997);
  size_t kept = 0;
  for (auto& k : keep) {
    for (int j = 0; j < 32; ++j) {
      if (std::uniform_real_distribution<>(0, 1)(rng) >= sparsity) k.push_back(j);
    }
    kept += k.size();
  }
  const double frac = static_cast<double>(kept) / (32.0 * keep.size());
  constexpr int kThreads = 2;
  auto run = [&](int which) {
    Evict();
    const auto t0 = Clock::now();
    std::vector<std::thread> th;
    for (int i = 0; i < kThreads; ++i) {
      th.emplace_back([&, i] {
        const size_t lo = kBytes / kThreads * i, hi = kBytes / kThreads * (i + 1);
        const Acc r = which == 0   ? Rows(lo, hi)
                      : which == 1 ? Columns(lo, hi, clen, keep)
                                   : Chunked(lo, hi, clen, piece, g, keep);
        static volatile int sink;
        sink = Reduce(r);
      });
    }
    for (auto& t : th) t.join();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  double best[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 6; ++rep) {
    for (int w = 0; w < 3; ++w) best[w] = std::min(best[w], run(w));
  }
  const double gb = kBytes / 1e9;
  // the columns pattern's blocks are 32 channel strides long (a stride: CLEN rounded to an odd
  // number of lines), so it reads that much less of the buffer
  const double stride = (clen / 64) % 2 == 0 ? clen + 64.0 : static_cast<double>(clen);
  printf("CLEN %zu sparsity %.2f (kept %.3f) K %zu G %zu: rows %.1f GB/s | columns %.1f GB/s "
         "read, %.2fx the rows' time | chunked %.1f GB/s read, %.2fx the rows' time\n",
         clen, sparsity, frac, piece, g, gb / best[0], gb * frac * clen / stride / best[1],
         best[0] / best[1],
         gb * frac / best[2], best[0] / best[2]);
  return 0;
}
