// Activations quantized to int8 for the quantized kernels' integer dot products, as llama.cpp
// does: per block of `block` values (32 for the legacy formats, Q8_0-style; 256 for the
// K-quants, Q8_K-style) a float scale d = max|x| / 127 and q = round-half-even(x * (1 / d)) in
// [-127, 127]; plus the blocks' sums of q, pre-scaled by d (c16 per 16 values, c32 per 32), which
// carry the formats' minimums and offsets: sum(w * x) = sum_chunks(s * dot(u, q)) * d + m * c.
// ops/reference.py rounds activations the same way, so kernels and reference agree to float
// rounding. Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_QUANT_ACT_H_
#define PIJ_CPU_BACKEND_QUANT_ACT_H_

#include <cstdint>
#include <span>
#include <vector>

#include "cpu_backend/thread_pool.h"

namespace pij {

// One token's view: q [D], d [D / block], c [D / 16] (K-quants) or [D / 32] (legacy formats).
struct QActView {
  const int8_t* q;
  const float* d;
  const float* c;
  // Nonzero: names this token's values for as long as they stay unchanged, so a kernel called
  // on it again may reuse what it derived from them (qcolumns.cc: the nonzero channels); 0:
  // nothing is reused.
  uint64_t id = 0;
};

// T rows quantized for one block size. Grows, never shrinks (reused across calls).
struct QActs {
  int64_t block = 0, dim = 0, rows = 0;
  std::vector<int8_t> q;
  std::vector<float> d, c16, c32;

  // Row t's view for a format whose minimums come per `min_group` (16 or 32) values.
  QActView View(int64_t t, int64_t min_group) const {
    return {q.data() + t * dim, d.data() + t * (dim / block),
            min_group == 16 ? c16.data() + t * (dim / 16) : c32.data() + t * (dim / 32)};
  }
};

// Quantizes the rows (each `dim` floats, dim a multiple of block; block 32 or 256) into out,
// splitting rows over the pool when there are many. Deterministic: each row is quantized by one
// task, the same way whatever the split.
void QuantizeActs(std::span<const float* const> x_rows, int64_t dim, int64_t block, QActs& out,
                  ThreadPool& pool);

// One block of n values (n a multiple of 32): q, and d as returned; sums16[n / 16] the sums of q.
// A block holding a NaN or an infinity gets d = NaN and q = 0, so its dots come out NaN.
float QuantizeBlock(const float* x, int64_t n, int8_t* q, int32_t* sums16);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_QUANT_ACT_H_
