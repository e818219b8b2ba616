// Standalone timing of the q4 FFN (cpu_backend/q4_ffn.h) over 30 layers of SmolLM2 shapes (F 1536,
// D 576 or $D, bf16 down rows, random q4 rows): the best of 200 passes, in us per token. Used for
// the kernel comments in cpu_backend/sparse_ffn_kernel.h; numbers drift 10-20% run to run on the
// 2-core VM, so compare variants in alternation.
//   g++ -O3 -march=native -std=gnu++20 -I. -o /tmp/q4_ffn_layers benchmarks/cpp/q4_ffn_layers.cc \
//     cpu_backend/q4_ffn.cc cpu_backend/q4_estimate.cc cpu_backend/thread_pool.cc \
//     cpu_backend/sparse_ffn.cc -lpthread
//   /tmp/q4_ffn_layers THREADS THRESHOLD      (threshold 2: ~52% active; 1e9: estimate only)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>
#include "cpu_backend/q4_ffn.h"
#include "cpu_backend/q4_estimate.h"
using namespace pij;
int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  const float thr = argc > 2 ? atof(argv[2]) : 0.0f;
  const int L = 30; const int64_t F = 1536, D = getenv("D") ? atoi(getenv("D")) : 576, P = Q4Pairs(D);
  std::mt19937 rng(0);
  std::vector<std::vector<uint8_t>> q(L); std::vector<std::vector<F16>> dm(L); std::vector<std::vector<Bf16>> down(L);
  for (int l = 0; l < L; ++l) {
    q[l].resize(F * 2 * P * 32); for (auto& b : q[l]) b = rng();
    dm[l].resize(F * 2 * 4 * P); for (size_t i = 0; i < dm[l].size(); ++i) dm[l][i] = F16{uint16_t(i % (8*P) < 4*P ? 0x1c00 : 0x9c00)}; // d=2^-8 ; m=-2^-8
    down[l].resize(F * D); for (auto& b : down[l]) b = ToBf16(0.01f);
  }
  std::vector<float> x(D); std::normal_distribution<float> nd; for (auto& v : x) v = nd(rng);
  std::vector<float> y(D); int32_t na = 0;
  ThreadPool pool(threads);
  std::vector<Q4FfnScratch> sc(L);
  const float* xr[1] = {x.data()};
  double best = 1e9; long tot = 0;
  for (int rep = 0; rep < 200; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    tot = 0;
    for (int l = 0; l < L; ++l) {
      Q4EstimateArgs a; a.q = q[l].data(); a.dm = dm[l].data(); a.num_neurons = F; a.dim = D;
      Q4SparseFfn<Bf16>(a, down[l].data(), nullptr, thr, std::span<const float* const>(xr, 1), y.data(), &na, sc[l], pool);
      tot += na;
    }
    auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  double bytes = double(L) * F * 2 * (P * 32 + 4 * P * 2) + double(tot) * D * 2;
  printf("threads %d thr %g active %.3f  best %.0f us/token (30 layers)  %.1f GB/s\n", threads, thr, double(tot) / (L * F), best, bytes / best / 1e3);
}
