// Read rate of a sparse FFN's scattered neuron rows against a plain stream (issue 39): per layer
// of a Llama-2-7B shape (F 11008 neurons, Q4_0 rows of D 4096: 2304 bytes), a fraction of the
// neurons (ids ascending, the same draw for every way) is read by 2 threads, half each:
//   split       gate and up rows from two arrays, then the down rows from a third (the in-memory
//               kernel's layout: three 2.3 KB rows per neuron in three places)
//   split_next  split, the next neuron's rows requested whole while this one's are read
//   bundled     the three rows of a neuron adjacent (the neuron store's bundles: one 6.9 KB run)
//   stream      the same threads reading a 1.2 GB array front to back
// The bytes are summed (plain 64-bit loads; no arithmetic to speak of), so the rates are the
// memory system's for these patterns. Threads are started per layer in every way alike.
// Prints one JSON object per round. Built and run by benchmarks/scattered_reads.py.
//   g++ -O2 -march=native -std=c++20 -pthread -o /tmp/scattered_reads
//       benchmarks/cpp/scattered_reads.cc   (then: /tmp/scattered_reads 0.1 3)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {
constexpr size_t kF = 11008, kRow = 2304, kLayers = 32, kThreads = 2, kAhead = 1024;
constexpr size_t kStream = size_t{1200} << 20;

uint64_t Sum(const uint8_t* p, size_t n, uint64_t acc) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  for (size_t i = 0; i < n / 8; i += 8) {
    __builtin_prefetch(p + i * 8 + kAhead, 0, 2);
    for (int k = 0; k < 8; ++k) acc += w[i + k];
  }
  return acc;
}

void Request(const uint8_t* p, size_t n) {
  for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 2);
}

uint8_t* Filled(size_t n) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  std::memset(p, 1, n);
  return p;
}
}  // namespace

int main(int argc, char** argv) {
  const double frac = argc > 1 ? std::atof(argv[1]) : 0.1;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  if (!(frac > 0 && frac <= 1) || rounds < 1) {
    std::fprintf(stderr, "scattered_reads: expected FRACTION in (0, 1] and ROUNDS >= 1\n");
    return 2;
  }
  std::vector<uint8_t*> gate(kLayers), up(kLayers), down(kLayers), bundle(kLayers);
  for (size_t l = 0; l < kLayers; ++l) {
    gate[l] = Filled(kF * kRow), up[l] = Filled(kF * kRow), down[l] = Filled(kF * kRow);
    bundle[l] = Filled(3 * kF * kRow);
  }
  uint8_t* stream = Filled(kStream);
  std::mt19937 rng(1);
  std::vector<std::vector<size_t>> active(kLayers);
  for (auto& a : active) {
    for (size_t i = 0; i < kF; ++i) {
      if (std::uniform_real_distribution<>(0, 1)(rng) < frac) a.push_back(i);
    }
  }
  auto rate = [&](int way) {
    const auto t0 = std::chrono::steady_clock::now();
    size_t bytes = 0;
    uint64_t sink = 0;
    for (int rep = 0; rep < 5; ++rep) {
      for (size_t l = 0; l < kLayers; ++l) {
        const auto& a = active[l];
        uint64_t part[kThreads] = {};
        std::thread th[kThreads];
        for (size_t t = 0; t < kThreads; ++t) {
          th[t] = std::thread([&, t] {
            uint64_t acc = 0;
            const size_t lo = a.size() * t / kThreads, hi = a.size() * (t + 1) / kThreads;
            if (way == 3) {
              const size_t n = kStream / kLayers / kThreads;
              acc = Sum(stream + l * (kStream / kLayers) + t * n, n, acc);
            } else if (way == 2) {
              for (size_t k = lo; k < hi; ++k) acc = Sum(bundle[l] + a[k] * 3 * kRow, 3 * kRow, acc);
            } else {
              for (size_t k = lo; k < hi; ++k) {
                if (way == 1 && k + 1 < hi) {
                  Request(gate[l] + a[k + 1] * kRow, kRow);
                  Request(up[l] + a[k + 1] * kRow, kRow);
                }
                acc = Sum(gate[l] + a[k] * kRow, kRow, acc);
                acc = Sum(up[l] + a[k] * kRow, kRow, acc);
              }
              for (size_t k = lo; k < hi; ++k) {
                if (way == 1 && k + 2 < hi) Request(down[l] + a[k + 2] * kRow, kRow);
                acc = Sum(down[l] + a[k] * kRow, kRow, acc);
              }
            }
            part[t] = acc;
          });
        }
        for (auto& x : th) x.join();
        for (uint64_t p : part) sink += p;
        bytes += way == 3 ? kStream / kLayers : a.size() * 3 * kRow;
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sink == 42) std::puts("");  // keeps the sums
    return bytes / s / 1e9;
  };
  for (int r = 0; r < rounds; ++r) {
    const double split = rate(0), split_next = rate(1), bundled = rate(2), streamed = rate(3);
    std::printf("{\"round\": %d, \"active\": %.3f, \"split_gbs\": %.2f, \"split_next_gbs\": %.2f, "
                "\"bundled_gbs\": %.2f, \"stream_gbs\": %.2f}\n",
                r, frac, split, split_next, bundled, streamed);
  }
}
