#include "cpu_backend/qlinear.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_backend/qcolumns.h"
#include "cpu_backend/quant_interleaved.h"
#include "cpu_backend/quant_kernels.h"

namespace pij {
namespace {

// Below this many weights one thread finishes before a wake-up would pay off.
constexpr int64_t kParallelMinWeights = 1 << 15;
// Rows per task: several tasks per thread even out unequal cores (as linear.cc). Decode takes
// one contiguous range per thread instead: each range is a stream the prefetchers must ramp up
// on, and a model's matrices are small (SmolLM2: 0.35-0.9 MB), so 4 ranges per thread read its
// Q4_1 matvecs at 16-18 GB/s and one at 21-22 (2 threads, a machine that streams 36; min of 40
// calls over distinct matrices, interleaved builds). An idle worker still leaves its range to
// the caller (ThreadPool::Run), so a late thread does not hold the step up.
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kDecodeTasksPerThread = 1;
// Prefill: tokens whose activations stay in cache while a block of rows passes over them, and
// rows that stay in cache while the group's 4-token tiles pass over them.
constexpr int64_t kTokenGroup = 64;
constexpr int64_t kRowBlock = 16;
// Decode: rows per tile, sharing the token's activation loads.
constexpr int kDecodeRows = 2;
// Several tokens: rows per tile.
constexpr int kPairRows = 2;


template <class F>
void Rows(const QLinearOut& out, int64_t dim, std::span<const QActView> xs, int64_t lo,
          int64_t hi) {
  const int64_t nblocks = dim / F::kBlock;
  const int64_t row_bytes = nblocks * F::kBytes;
  const int64_t num_tokens = static_cast<int64_t>(xs.size());
  auto put = [&](int64_t o, int64_t t, float v) {
    out.y[t * out.out_dim + o] = v + (out.bias != nullptr ? out.bias[o] : 0.0f);
  };
  if (num_tokens == 1) {
    float dots[kDecodeRows];
    int64_t o = lo;
    for (; o + kDecodeRows <= hi; o += kDecodeRows) {
      const uint8_t* rows[kDecodeRows];
      for (int r = 0; r < kDecodeRows; ++r) rows[r] = out.w + (o + r) * row_bytes;
      qkern::DotTile<F, kDecodeRows, 1, qkern::kStreamAhead>(rows, xs.data(), nblocks, dots);
      for (int r = 0; r < kDecodeRows; ++r) put(o + r, 0, dots[r]);
    }
    for (; o < hi; ++o) {
      const uint8_t* row = out.w + o * row_bytes;
      qkern::DotTile<F, 1, 1>(&row, xs.data(), nblocks, dots);
      put(o, 0, dots[0]);
    }
    return;
  }
  // Several tokens: rows in pairs (each token's activation loads serve both rows), the tile's
  // arithmetic per (row, token) the same as the decode tile's, so no bit depends on the batch.
  float dots[kPairRows * 4];
  for (int64_t g0 = 0; g0 < num_tokens; g0 += kTokenGroup) {
    const int64_t g1 = std::min(num_tokens, g0 + kTokenGroup);
    for (int64_t r0 = lo; r0 < hi; r0 += kRowBlock) {
      const int64_t r1 = std::min(hi, r0 + kRowBlock);
      int64_t o = r0;
      for (; o + kPairRows <= r1; o += kPairRows) {
        const uint8_t* rows[kPairRows];
        for (int r = 0; r < kPairRows; ++r) rows[r] = out.w + (o + r) * row_bytes;
        for (int64_t t = g0; t < g1; t += 4) {
          const int64_t n = qkern::TokenTile<F, kPairRows>(rows, xs.data(), t, g1, nblocks, dots);
          for (int r = 0; r < kPairRows; ++r) {
            for (int64_t k = 0; k < n; ++k) put(o + r, t + k, dots[r * n + k]);
          }
        }
      }
      for (; o < r1; ++o) {
        const uint8_t* row = out.w + o * row_bytes;
        for (int64_t t = g0; t < g1; t += 4) {
          const int64_t n = qkern::TokenTile<F, 1>(&row, xs.data(), t, g1, nblocks, dots);
          for (int64_t k = 0; k < n; ++k) put(o, t + k, dots[k]);
        }
      }
    }
  }
}

// Rows [lo, hi) of rows interleaved by 16 (lo, hi multiples of 16): each group of 16 rows in
// one tile per token (decode, streamed ahead) or per 4 tokens (the group stays in cache while
// the tiles pass over it); a (row, token) result is the same whatever the tile.
template <class F>
void InterleavedRows(const QLinearOut& out, int64_t dim, std::span<const QActView> xs, int64_t lo,
                     int64_t hi) {
  if constexpr (qkern::Interleavable(F::kType)) {
    constexpr int64_t kG = qkern::kInterleave;
    const int64_t nblocks = dim / F::kBlock;
    const int64_t group_bytes = nblocks * F::kBytes * kG;
    const int64_t num_tokens = static_cast<int64_t>(xs.size());
    float dots[qkern::kMaxTokens * kG];
    for (int64_t g = lo / kG; g < hi / kG; ++g) {
      const uint8_t* group = out.w + g * group_bytes;
      for (int64_t t = 0; t < num_tokens;) {
        const int64_t n =
            qkern::InterleavedTokenTile<F>(group, nblocks, xs.data(), t, num_tokens, dots);
        for (int64_t k = 0; k < n; ++k) {
          for (int64_t r = 0; r < kG; ++r) {
            const int64_t o = g * kG + r;
            out.y[(t + k) * out.out_dim + o] =
                dots[k * kG + r] + (out.bias != nullptr ? out.bias[o] : 0.0f);
          }
        }
        t += n;
      }
    }
  }
}

}  // namespace

void QLinearRows(const QLinearOut& out, int64_t dim, std::span<const QActView> xs, int64_t lo,
                 int64_t hi) {
  if (out.columns) {
    QLinearColumnsRows(out.w, out.qtype, out.out_dim, dim, xs, lo, hi, out.bias, out.y);
    return;
  }
  VisitQType(out.qtype, [&]<class F>(F) {
    if (out.interleaved) {
      InterleavedRows<F>(out, dim, xs, lo, hi);
    } else {
      Rows<F>(out, dim, xs, lo, hi);
    }
  });
}

void QLinearMany(std::span<const QLinearOut> outs, int64_t dim,
                 std::span<const float* const> x_rows, QLinearScratch& scratch, ThreadPool& pool) {
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  if (num_tokens == 0 || outs.empty()) return;
  bool need32 = false, need256 = false;
  int64_t total = 0;
  for (const QLinearOut& o : outs) {
    (GetQTypeInfo(o.qtype).block == 256 ? need256 : need32) = true;
    total += o.out_dim;
  }
  if (need32) QuantizeActs(x_rows, dim, 32, scratch.act32, pool);
  if (need256) QuantizeActs(x_rows, dim, 256, scratch.act256, pool);
  // Token views per block size: legacy formats read c32, K-quants c16.
  std::vector<QActView>& views32 = scratch.views32;
  std::vector<QActView>& views256 = scratch.views256;
  views32.resize(need32 ? num_tokens : 0);
  views256.resize(need256 ? num_tokens : 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (need32) views32[t] = scratch.act32.View(t, 32);
    if (need256) views256[t] = scratch.act256.View(t, 16);
  }
  std::vector<QLinearOut> row_outs;  // decode: the columns matrices go to their own partition
  if (num_tokens == 1) {
    std::vector<QLinearOut> column_outs;
    for (const QLinearOut& o : outs) (o.columns ? column_outs : row_outs).push_back(o);
    if (!column_outs.empty()) {
      const QActView none{};
      QLinearColumnsDecode(column_outs, dim, need32 ? views32[0] : none,
                           need256 ? views256[0] : none, scratch.partial, pool);
      if (row_outs.empty()) return;
      outs = row_outs;
      total = 0;
      for (const QLinearOut& o : outs) total += o.out_dim;
    }
  }
  auto rows = [&](int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (const QLinearOut& o : outs) {
      int64_t a = std::max(lo, base), b = std::min(hi, base + o.out_dim);
      if (o.interleaved || o.columns) {  // whole groups (tiles): each to the task its first
        // row falls in
        const int64_t kG = o.columns ? kColTile : qkern::kInterleave;
        a = base + (a - base + kG - 1) / kG * kG;
        b = base + (b - base + kG - 1) / kG * kG;
      }
      if (a < b) {
        const bool k = GetQTypeInfo(o.qtype).block == 256;
        const std::span<const QActView> xs(k ? views256 : views32);
        QLinearRows(o, dim, xs, a - base, b - base);
      }
      base += o.out_dim;
    }
  };
  if (total * dim < kParallelMinWeights || pool.NumThreads() == 1) {
    rows(0, total);
    return;
  }
  const int64_t per_thread = num_tokens == 1 ? kDecodeTasksPerThread : kTasksPerThread;
  const int64_t tasks = std::min<int64_t>(total, pool.NumThreads() * per_thread);
  pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
    rows(total * task / tasks, total * (task + 1) / tasks);
  });
}

namespace {

// One (16 rows, block) record from the 16 rows' blocks at `src` (row stride `row_bytes`): each
// field of the 16 rows as one plane (quant_interleaved.h Fields). The format's sizes are
// constants, so the loops unroll into plain 1-, 2- and 4-byte moves (a loop over runtime sizes
// moved ~1 GB/s per core: most of a model's load copy).
template <class F>
void InterleaveRecord(const uint8_t* src, int64_t row_bytes, uint8_t* rec) {
  constexpr int64_t kG = qkern::kInterleave;
  constexpr qkern::RecordFields kFields = qkern::Fields(F::kType);
  for (int64_t r = 0; r < kG; ++r) {
    const uint8_t* blk = src + r * row_bytes;
    int64_t at = 0;  // the field run's first byte in the block (its planes start at kG * at)
    [&]<int... kI>(std::integer_sequence<int, kI...>) {
      (([&] {
         constexpr int kBytes = kFields.runs[kI].bytes, kW = kFields.runs[kI].width;
         for (int64_t f = 0; f < kBytes / kW; ++f) {
           std::memcpy(rec + kG * (at + f * kW) + kW * r, blk + at + f * kW, kW);
         }
         at += kBytes;
       }()), ...);
    }(std::make_integer_sequence<int, kFields.n>{});
  }
}

}  // namespace

void InterleaveRows(const uint8_t* src, QType t, int64_t rows, int64_t row_bytes, uint8_t* dst,
                    ThreadPool& pool) {
  VisitQType(t, [&]<class F>(F) {
    if constexpr (qkern::Interleavable(F::kType)) {
      constexpr int64_t kG = qkern::kInterleave;
      const int64_t nblocks = row_bytes / F::kBytes;
      const int64_t groups = rows / kG;
      // Threads take ranges of groups: a load's page faults (the file's pages, the new
      // buffer's) and copies split over the cores.
      const int64_t tasks = std::min<int64_t>(groups, pool.NumThreads());
      pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
        for (int64_t g = groups * task / tasks; g < groups * (task + 1) / tasks; ++g) {
          for (int64_t b = 0; b < nblocks; ++b) {
            InterleaveRecord<F>(src + g * kG * row_bytes + b * F::kBytes, row_bytes,
                                dst + (g * nblocks + b) * kG * F::kBytes);
          }
        }
      });
    }
  });
}

void QLinearInterleavedPortable(const QLinearOut& out, int64_t dim,
                                std::span<const float* const> x_rows) {
  QActs acts;
  ThreadPool pool(1);
  const bool k = GetQTypeInfo(out.qtype).block == 256;
  QuantizeActs(x_rows, dim, k ? 256 : 32, acts, pool);
  VisitQType(out.qtype, [&]<class F>(F) {
    if constexpr (qkern::Interleavable(F::kType)) {
      constexpr int64_t kG = qkern::kInterleave;
      const int64_t nblocks = dim / F::kBlock;
      float dots[kG];
      for (size_t t = 0; t < x_rows.size(); ++t) {
        const QActView x = acts.View(static_cast<int64_t>(t), k ? 16 : 32);
        for (int64_t g = 0; g < out.out_dim / kG; ++g) {
          qkern::InterleavedTileScalar<F, 1>(out.w + g * nblocks * F::kBytes * kG, nblocks, &x,
                                             dots);
          for (int64_t r = 0; r < kG; ++r) {
            const int64_t o = g * kG + r;
            out.y[t * out.out_dim + o] = dots[r] + (out.bias != nullptr ? out.bias[o] : 0.0f);
          }
        }
      }
    }
  });
}

void DequantizeRows(const uint8_t* blocks, QType t, int64_t rows, int64_t cols, float* out) {
  VisitQType(t, [&]<class F>(F) {
    const int64_t nblocks = cols / F::kBlock;
    for (int64_t r = 0; r < rows; ++r) {
      qkern::DequantizeRow<F>(blocks + r * nblocks * F::kBytes, nblocks, out + r * cols);
    }
  });
}

void DequantizeGather(const uint8_t* blocks, QType t, int64_t cols, std::span<const int32_t> ids,
                      float* out) {
  VisitQType(t, [&]<class F>(F) {
    const int64_t nblocks = cols / F::kBlock;
    for (size_t k = 0; k < ids.size(); ++k) {
      qkern::DequantizeRow<F>(blocks + ids[k] * nblocks * F::kBytes, nblocks, out + k * cols);
    }
  });
}

}  // namespace pij
