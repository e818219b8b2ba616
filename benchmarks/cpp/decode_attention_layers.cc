// Standalone timing of ops.decode_attention's kernel (cpu_backend/decode_attention.h) over 30
// layers of SmolLM2 shapes (9 heads, 3 KV heads, head dim 64, bf16 cache of S slots, all
// visible): the best of 100 passes, in us per token. Used for the comment in
// cpu_backend/decode_attention.cc.
//   g++ -O3 -march=native -std=gnu++20 -I. -o /tmp/decode_attention_layers \
//     benchmarks/cpp/decode_attention_layers.cc cpu_backend/decode_attention.cc \
//     cpu_backend/thread_pool.cc -lpthread
//   /tmp/decode_attention_layers THREADS S
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include <algorithm>
#include "cpu_backend/decode_attention.h"
using namespace pij;
int main(int argc, char** argv) {
  const int threads = atoi(argv[1]); const int S = atoi(argv[2]);
  const int L = 30, NH = 9, NK = 3, H = 64;
  std::mt19937 rng(0); std::uniform_int_distribution<int> u(0, 0x3f7f);
  std::vector<std::vector<uint16_t>> kc(L), vc(L);
  for (int l = 0; l < L; ++l) { kc[l].resize(S * NK * H); vc[l].resize(S * NK * H); for (auto& x : kc[l]) x = u(rng) & 0xbf7f; for (auto& x : vc[l]) x = u(rng) & 0xbf7f; }
  std::vector<float> q(NH * H, 0.1f), k(NK * H, 0.1f), v(NK * H, 0.1f), out(NH * H);
  ThreadPool pool(threads);
  double best = 1e9;
  for (int rep = 0; rep < 100; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) {
      DecodeAttentionArgs a; a.n_heads = NH; a.n_kv_heads = NK; a.head_dim = H; a.max_len = S; a.kv_len = S; a.slot = S - 1; a.position = S - 1;
      DecodeAttention<uint16_t>(a, q.data(), k.data(), v.data(), kc[l].data(), vc[l].data(), out.data(), pool);
    }
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  printf("threads %d S %d: %.0f us/token (30 layers)  out[5]=%g\n", threads, S, best, out[5]);
}
