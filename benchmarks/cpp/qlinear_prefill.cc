// Standalone timing of ops.qlinear's product of T tokens with one [O, I] matrix per GGUF format
// (prefill: T > 1; decode: T = 1), rows interleaved by 16 where the format has that layout
// (quant_interleaved.h) next to the file's rows, best of 5 calls each (the matrix stays in cache
// between calls: a compute figure, GMAC/s). Checks the interleaved result against the file's
// rows (float rounding) and bit for bit against the portable loops. Random valid blocks.
//   g++ -O3 -march=native -std=gnu++20 -I. -o /tmp/qlinear_prefill \
//     benchmarks/cpp/qlinear_prefill.cc cpu_backend/q{linear,columns}.cc \
//     cpu_backend/quant_{act,formats}.cc cpu_backend/thread_pool.cc -lpthread
//   /tmp/qlinear_prefill THREADS T O I QTYPE...
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "cpu_backend/qlinear.h"
#include "cpu_backend/quant_interleaved.h"
using namespace pij;
static QType Parse(const char* s) {
  for (int id = 0; id < 16; ++id)
    if (IsQType(id) && std::string(GetQTypeInfo(static_cast<QType>(id)).name) == s) {
      return static_cast<QType>(id);
    }
  fprintf(stderr, "unknown type %s\n", s);
  exit(2);
}
using Clock = std::chrono::steady_clock;

// Best of 5 calls, seconds.
static double Best(const QLinearOut& out, int64_t dim, const std::vector<const float*>& xr,
                   QLinearScratch& scratch, ThreadPool& pool) {
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    QLinearMany({&out, 1}, dim, xr, scratch, pool);
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// Random blocks whose f16 fields are all 2^-8 (finite).
static std::vector<uint8_t> RandomBlocks(QType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const QTypeInfo info = GetQTypeInfo(t);
  std::vector<uint8_t> b(rows * cols / info.block * info.bytes);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  const uint16_t small = 0x1c00;
  for (int64_t r = 0; r < rows * (cols / info.block); ++r) {
    uint8_t* blk = b.data() + r * info.bytes;
    if (t == QType::kQ6_K) {
      memcpy(blk + 208, &small, 2);
    } else if (t == QType::kQ3_K) {
      memcpy(blk + 108, &small, 2);
    } else {
      memcpy(blk, &small, 2);
      const bool two = t == QType::kQ4_1 || t == QType::kQ5_1 || info.block == 256;
      if (two) memcpy(blk + 2, &small, 2);
    }
  }
  return b;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: %s THREADS T O I QTYPE...\n", argv[0]);
    return 2;
  }
  const int threads = atoi(argv[1]);
  const int64_t T = atoll(argv[2]), O = atoll(argv[3]), I = atoll(argv[4]);
  ThreadPool pool(threads);
  std::mt19937 rng(1);
  std::vector<float> x(T * I);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  std::vector<const float*> xr(T);
  for (int64_t t = 0; t < T; ++t) xr[t] = x.data() + t * I;
  const double macs = static_cast<double>(T) * O * I;
  for (int a = 5; a < argc; ++a) {
    const QType t = Parse(argv[a]);
    const std::vector<uint8_t> rows = RandomBlocks(t, O, I, rng);
    std::vector<float> y(T * O), y_rows(T * O), y_port(T * O);
    QLinearScratch scratch;
    const QLinearOut file{rows.data(), t, nullptr, O, y_rows.data(), false, false};
    const double rows_s = Best(file, I, xr, scratch, pool);
    printf("%-5s T=%lld [%lld, %lld] file's rows: %.2f ms, %.1f GMAC/s\n", argv[a],
           static_cast<long long>(T), static_cast<long long>(O), static_cast<long long>(I),
           rows_s * 1e3, macs / rows_s / 1e9);
    if (!qkern::CanInterleave(t, O)) continue;
    std::vector<uint8_t> inter(rows.size());
    InterleaveRows(rows.data(), t, O, QRowBytes(t, I), inter.data(), pool);
    const QLinearOut il{inter.data(), t, nullptr, O, y.data(), true, false};
    const double il_s = Best(il, I, xr, scratch, pool);
    double diff = 0, peak = 0;
    for (int64_t i = 0; i < T * O; ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(y[i] - y_rows[i])));
      peak = std::max(peak, static_cast<double>(std::fabs(y_rows[i])));
    }
    QLinearInterleavedPortable({inter.data(), t, nullptr, O, y_port.data(), true, false}, I, xr);
    const bool same = memcmp(y_port.data(), y.data(), sizeof(float) * T * O) == 0;
    printf("      interleaved by 16: %.2f ms, %.1f GMAC/s (%.2fx); max |diff| %.3g of |y| %.3g;"
           " portable bits %s\n", il_s * 1e3, macs / il_s / 1e9, rows_s / il_s, diff, peak,
           same ? "equal" : "DIFFER");
  }
  return 0;
}
