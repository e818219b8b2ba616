// Standalone timing of the columns-layout matvec (cpu_backend/qcolumns.h) against the rows kernel
// (interleaved by 16 where the format has it) on one [O, I] matrix, decode (one token), at
// several input sparsities, best of $REPS passes each, alternated. Random valid blocks; before
// each timed call a 96 MiB buffer is read (EVICT=0: not), so the matrix comes from memory as a
// model's layers do (without it a 66 MB matrix partly stays in a 32 MiB L3 between passes and the
// columns kernel looked 1.7x the rows kernel at 40% where it is 1.24x from memory).
//   g++ -O3 -march=native -std=gnu++20 -I. -o /tmp/qcolumns_bench benchmarks/cpp/qcolumns_bench.cc \
//     cpu_backend/q{linear,columns}.cc cpu_backend/quant_{act,formats}.cc \
//     cpu_backend/thread_pool.cc -lpthread
//   /tmp/qcolumns_bench THREADS O I [QTYPE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "cpu_backend/qcolumns.h"
#include "cpu_backend/qlinear.h"
#include "cpu_backend/quant_interleaved.h"

using namespace pij;

// Reads a buffer three times the last-level cache before each timed call (EVICT=0: not), so
// the matrix comes from memory as a model's layers do, not from the cache of the last pass.
static void Evict() {
  static std::vector<uint8_t> junk(96 << 20, 1);
  static const bool on = !(getenv("EVICT") && atoi(getenv("EVICT")) == 0);
  if (!on) return;
  uint64_t acc = 0;
  for (size_t i = 0; i < junk.size(); i += 64) acc += junk[i];
  static volatile uint64_t sink;
  sink = acc;
}

static QType Parse(const char* s) {
  for (int id = 0; id < 16; ++id) {
    if (IsQType(id) && std::string(GetQTypeInfo(static_cast<QType>(id)).name) == s) {
      return static_cast<QType>(id);
    }
  }
  fprintf(stderr, "unknown type %s\n", s);
  exit(2);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s THREADS O I [QTYPE]\n", argv[0]);
    return 2;
  }
  const int threads = atoi(argv[1]);
  const int64_t O = atoll(argv[2]), I = atoll(argv[3]);
  const QType t = Parse(argc > 4 ? argv[4] : "Q4_0");
  const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 20;
  const QTypeInfo info = GetQTypeInfo(t);
  std::mt19937 rng(1);
  std::vector<uint8_t> rows(O * I / info.block * info.bytes);
  for (auto& v : rows) v = static_cast<uint8_t>(rng());
  const uint16_t small = 0x1c00;  // 2^-8: every f16 field finite
  const int64_t nb = I / info.block;
  for (int64_t r = 0; r < O * nb; ++r) {
    uint8_t* blk = rows.data() + r * info.bytes;
    if (info.block == 32) {
      memcpy(blk, &small, 2);
      if (t == QType::kQ4_1) memcpy(blk + 2, &small, 2);
    } else if (t == QType::kQ6_K) {
      memcpy(blk + 208, &small, 2);
    } else {
      memcpy(blk, &small, 2);
      memcpy(blk + 2, &small, 2);
    }
  }
  ThreadPool pool(threads);
  struct Span2 { uint8_t* p; uint8_t* data() { return p; } };
  Span2 inter{nullptr};
  const bool can_inter = qkern::CanInterleave(t, O);
  inter.p = nullptr;
  // (set below, after the huge-page buffers exist)
  if (false) InterleaveRows(rows.data(), t, O, QRowBytes(t, I), inter.data(), pool);
  // the arranged copy in transparent huge pages where the system allows (HUGE=0: not)
  const size_t cbytes = O * ColumnsRowBytes(t, O, I);
  const size_t cround = (cbytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  uint8_t* cols_mem = static_cast<uint8_t*>(aligned_alloc(2 << 20, cround));
  if (!(getenv("HUGE") && atoi(getenv("HUGE")) == 0)) madvise(cols_mem, cround, MADV_HUGEPAGE);
  uint8_t* inter_mem = static_cast<uint8_t*>(aligned_alloc(2 << 20, cround + (4 << 20)));
  if (!(getenv("HUGE") && atoi(getenv("HUGE")) == 0)) madvise(inter_mem, cround + (4 << 20), MADV_HUGEPAGE);
  struct Span { uint8_t* p; uint8_t* data() { return p; } };
  Span cols{cols_mem};
  ArrangeColumns(rows.data(), t, O, I, cols.data(), pool);
  inter.p = inter_mem;
  if (can_inter) {
    InterleaveRows(rows.data(), t, O, QRowBytes(t, I), inter.data(), pool);
  } else {
    memcpy(inter.p, rows.data(), rows.size());
  }
  std::vector<float> y(O), x(I);
  QLinearScratch scratch;
  std::normal_distribution<float> nd;
  const double mb = static_cast<double>(rows.size()) / 1e6;
  printf("%s [%lld, %lld] %.1f MB, %d threads\n", info.name, (long long)O, (long long)I, mb, threads);
  for (double s : {0.0, 0.25, 0.4, 0.5, 0.6}) {
    for (auto& v : x) v = (std::uniform_real_distribution<double>(0, 1)(rng) < s) ? 0.0f : nd(rng);
    const float* xr = x.data();
    double best_r = 1e9, best_c = 1e9, best_k = 1e9;
    // split along the input: one block range per thread, partial sums added after
    std::vector<std::vector<float>> part(threads, std::vector<float>(O));
    QActs acts;
    QuantizeActs({&xr, 1}, I, info.block, acts, pool);
    const QActView view = acts.View(0, info.block == 256 ? 16 : 32);
    const int64_t nbk = ColumnsBlocks(t, I);
    for (int rep = 0; rep < reps; ++rep) {
      {
        Evict();
        const auto t0 = std::chrono::steady_clock::now();
        QuantizeActs({&xr, 1}, I, info.block, acts, pool);
        pool.Run(0, threads, [&](int64_t task, int) {
          QLinearColumnsBlocks(cols.data(), t, O, I, {&view, 1}, nbk * task / threads,
                               nbk * (task + 1) / threads, part[task].data());
        });
        for (int64_t o = 0; o < O; ++o) {
          float acc = 0;
          for (int k = 0; k < threads; ++k) acc += part[k][o];
          y[o] = acc;
        }
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best_k = std::min(best_k, dt);
      }
      for (int which = 0; which < 2; ++which) {
        QLinearOut out{which == 0 ? inter.data() : cols.data(), t,
                       nullptr, O, y.data(), which == 0 && can_inter, which == 1};
        Evict();
        const auto t0 = std::chrono::steady_clock::now();
        QLinearMany({&out, 1}, I, {&xr, 1}, scratch, pool);
        const double dt =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        (which == 0 ? best_r : best_c) = std::min(which == 0 ? best_r : best_c, dt);
      }
    }
    printf("  sparsity %.2f: rows %.3f ms (%.1f GB/s)  columns %.3f ms (%.1f GB/s of dense bytes)"
           "  rows/columns %.2fx  split-K %.3f ms (%.2fx)\n", s, best_r * 1e3, mb / 1e3 / best_r,
           best_c * 1e3, mb / 1e3 / best_c, best_r / best_c, best_k * 1e3, best_r / best_k);
  }
  return 0;
}
