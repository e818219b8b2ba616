// Standalone timing of the quantized kernels over L layers of SmolLM2 FFN shapes (D 576, F 1536;
// $D, $F, $L override): qlinear (the gate rows as one product) and the quantized sparse FFN
// (gate/up in $GU, down rows in $DN, random valid blocks), best of 100 passes, us per layer.
// Numbers drift 10-20% run to run on the 2-core VM: compare variants in alternation.
//   g++ -O3 -march=native -std=gnu++20 -I. -o /tmp/quant_layers benchmarks/cpp/quant_layers.cc \
//     cpu_backend/q{linear,sparse_ffn}.cc cpu_backend/quant_{act,formats}.cc \
//     cpu_backend/thread_pool.cc -lpthread
//   /tmp/quant_layers THREADS ACTIVE_FRACTION     (GU=Q4_1 DN=Q8_0 by default; L=1: cached)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_backend/qlinear.h"
#include "cpu_backend/qsparse_ffn.h"

using namespace pij;

static QType Parse(const char* env, QType fallback) {
  const char* s = getenv(env);
  if (s == nullptr) return fallback;
  for (int id = 0; id < 16; ++id) {
    if (IsQType(id) && std::string(GetQTypeInfo(static_cast<QType>(id)).name) == s) {
      return static_cast<QType>(id);
    }
  }
  fprintf(stderr, "%s: unknown type %s\n", env, s);
  exit(2);
}

// Random blocks whose f16 fields hold a small finite value (scales and minimums alike).
static std::vector<uint8_t> Blocks(QType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const QTypeInfo info = GetQTypeInfo(t);
  std::vector<uint8_t> b(rows * cols / info.block * info.bytes);
  for (auto& v : b) v = static_cast<uint8_t>(rng());
  const uint16_t small = 0x1c00;  // 2^-8
  for (size_t off = 0; off < b.size(); off += info.bytes) {
    int f16[2] = {0, 2};
    int n = (t == QType::kQ4_0 || t == QType::kQ5_0 || t == QType::kQ8_0) ? 1 : 2;
    if (t == QType::kQ2_K) { f16[0] = 80; f16[1] = 82; }
    if (t == QType::kQ3_K) { f16[0] = 108; n = 1; }
    if (t == QType::kQ6_K) { f16[0] = 208; n = 1; }
    for (int k = 0; k < n; ++k) std::memcpy(&b[off + f16[k]], &small, 2);
  }
  return b;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const float active = argc > 2 ? atof(argv[2]) : 1.0f;
  const int64_t D = getenv("D") ? atoi(getenv("D")) : 576, F = getenv("F") ? atoi(getenv("F")) : 1536;
  const int L = getenv("L") ? atoi(getenv("L")) : 30;
  const QType gu = Parse("GU", QType::kQ4_1), dn = Parse("DN", QType::kQ8_0);
  std::mt19937 rng(0);
  std::vector<std::vector<uint8_t>> gate(L), up(L), down(L);
  for (int l = 0; l < L; ++l) {
    gate[l] = Blocks(gu, F, D, rng);
    up[l] = Blocks(gu, F, D, rng);
    down[l] = Blocks(dn, F, D, rng);
  }
  std::vector<float> x(D), y(D);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  std::vector<float> scores(F, 0.0f);
  std::vector<int32_t> perm(F);
  for (int64_t i = 0; i < F; ++i) perm[i] = static_cast<int32_t>(i);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t k = 0; k < static_cast<int64_t>(active * F); ++k) scores[perm[k]] = 1.0f;
  ThreadPool pool(threads);
  const float* xr[1] = {x.data()};
  const float* sr[1] = {scores.data()};
  std::vector<float> yl(F);
  QLinearScratch ls;
  QSparseFfnScratch fs;
  int32_t na = 0;
  auto time_best = [&](auto&& body) {
    double best = 1e30;
    for (int pass = 0; pass < 100; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int l = 0; l < L; ++l) body(l);
      best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    return best / L;
  };
  const double lin = time_best([&](int l) {
    QLinearOut o{gate[l].data(), gu, nullptr, F, yl.data()};
    QLinearMany(std::span<const QLinearOut>(&o, 1), D, xr, ls, pool);
  });
  const double ffn = time_best([&](int l) {
    QFfnWeights w;
    w.gate = gate[l].data(); w.up = up[l].data(); w.down = down[l].data();
    w.gate_type = w.up_type = gu; w.down_type = dn; w.num_neurons = F; w.dim = D;
    QSparseFfnParams p;
    p.criterion = Criterion::kScores;
    p.threshold = 0.5f;
    QSparseFfn(w, xr, sr, p, y.data(), &na, fs, pool);
  });
  printf("threads %d D %ld F %ld L %d %s/%s active %.2f: qlinear [F, D] %.1f us, qsparse_ffn %.1f us (n_active %d)\n",
         threads, (long)D, (long)F, L, GetQTypeInfo(gu).name, GetQTypeInfo(dn).name, active, lin, ffn, na);
}
