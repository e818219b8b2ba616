// The inner loops of the quantized kernels, written once over a format's traits (quant_formats.h):
//   DotTile     kR weight rows x kC tokens of int8 activations -> kR * kC dot products
//   AxpyRows    y += sum_k coef[k] * row_k (dequantized on the fly): sparse FFN down rows, per token
//   AxpyGroup   the same over neurons of one down group (the file's blocks regrouped, below)
//   DequantizeRow  a row to float (tests, debugging)
// Single-threaded and allocation-free; qlinear.cc / qsparse_ffn.cc split the work over threads.
// Every (row, token) result goes through the same operations in the same order whatever tile it
// is computed in, so results do not depend on tiling or on how rows are split over threads.
#ifndef PIJ_CPU_BACKEND_QUANT_KERNELS_H_
#define PIJ_CPU_BACKEND_QUANT_KERNELS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_formats.h"
#include "cpu_backend/quant_simd.h"
#include "cpu_backend/quant_simd512.h"

namespace pij::qkern {

using qsimd::F32x8;
using qsimd::I8x32;

template <class F>
inline qsimd::I32x8 Dot(I8x32 w, I8x32 x) {
  if constexpr (F::kSigned) {
    return qsimd::DotS8S8(w, x);
  } else {
    return qsimd::DotU8S8(w, x);
  }
}

// The activations' minimum sums each format reads: per 16 values for the K-quants, per 32 else.
template <class F>
constexpr int64_t MinGroup() {
  return F::kBlock == 256 ? 16 : 32;
}

// Decode streams its matrices once per token, and the hardware prefetchers alone did not keep
// enough of the stream in flight on the VMs we measure: a token's matvecs over ~95 MB of Q4_1
// took 9 ms; requesting each block's bytes this far ahead as it is read, 4.3-4.6 ms (4-16 KiB
// tried). For rows read in order (ops.qlinear at decode), not for scattered sparse rows.
// The requests fill L2, not L1 (prefetcht1): each L1 fill holds one of the core's few L1 miss
// buffers for a whole DRAM round trip, which capped the stream; into L2, Q8_0 matvecs (little
// arithmetic per byte) read 9 -> 22 GB/s on one thread and 20 -> 41 on two (an AMD EPYC that
// streams 32-36). Q4_1, bound by its unpacking, was no different.
#ifndef PIJ_STREAM_AHEAD
#define PIJ_STREAM_AHEAD 8192
#endif
constexpr int64_t kStreamAhead = PIJ_STREAM_AHEAD;

template <int64_t kAhead, int64_t kBytes>
inline void StreamPrefetch(const uint8_t* blk) {
  if constexpr (kAhead > 0) {
    for (int64_t off = 0; off < kBytes; off += 64) __builtin_prefetch(blk + kAhead + off, 0, 2);
  }
}

// Scattered rows (a selector's neurons) are no stream: the hardware prefetchers stop at each
// row's end and a whole row requested up front (36 lines of Q4_0 at D = 4096) stalled the core
// on its full miss buffers between two rows' arithmetic (perf: a quarter of the sparse FFN's
// time on the prefetch loops). A tile given `ahead` (the next tile's rows, or nullptr) requests
// their bytes at the offset it is reading, so the next rows arrive spread over this tile's
// arithmetic instead.
// Pieces of at most a line (the legacy formats' blocks and block pairs) request the line holding
// their last byte, one instruction each: every line the row's pieces cover holds some piece's last
// byte. (The loop that requested each line once, by the piece holding its first byte, was a fifth
// of the down rows' time; a line is now requested up to 3 times, while it is in flight.) Longer
// pieces request each line once: by the piece that holds the line's first byte.
template <int64_t kBytes>
inline void CompanionPrefetch(const uint8_t* const* ahead, int r, int64_t offset) {
  if (ahead == nullptr) return;
  const uint8_t* p = ahead[r] + offset;
  if constexpr (kBytes <= 64) {
    __builtin_prefetch(p + kBytes - 1, 0, 2);
    return;
  }
  const uintptr_t first = reinterpret_cast<uintptr_t>(p);
  if (offset == 0) __builtin_prefetch(p, 0, 2);
  for (uintptr_t line = (first + 63) & ~uintptr_t{63}; line < first + kBytes; line += 64) {
    __builtin_prefetch(p + (line - first), 0, 2);
  }
}

// The legacy formats' dot, one arithmetic for every tile shape and ISA:
//   acc_h += float(dot_b) * (s_b * d_b)   (8 lanes, h = b % 2: even and odd blocks apart)
//   min_h  = fma(m_b, c_b, min_h)          (h = b % 2)
//   result = ReduceSum(acc_0 + acc_1) + (min_0 + min_1)
// AVX-512 holds acc_0 and acc_1 as the halves of one 512-bit vector and takes two blocks per
// step: half the instructions of one block per step (the decode matvecs were compute bound at
// ~13 GB/s of Q4_1 on a machine that reads 36), and two independent FMA chains elsewhere.
#if defined(PIJ_QSIMD_AVX2)
// Blocks a and b's scales and minimums as Prepare gives them: [s_a, m_a, s_b, m_b].
template <class F>
inline __m128 ScaleMin2(const uint8_t* a, const uint8_t* b) {
  if constexpr (F::kType == QType::kQ4_1 || F::kType == QType::kQ5_1) {  // d, m side by side
    const __m128i h = _mm_insert_epi32(_mm_cvtsi32_si128(static_cast<int>(qsimd::LoadU32(a))),
                                       static_cast<int>(qsimd::LoadU32(b)), 1);
    return _mm_cvtph_ps(h);
  } else {  // m = kMinPerScale * s, exactly (a power of two), as Prepare computes it
    const __m128i h = _mm_insert_epi16(_mm_cvtsi32_si128(qsimd::LoadU16(a)), qsimd::LoadU16(b), 2);
    const __m128 s = _mm_moveldup_ps(_mm_cvtph_ps(h));  // [s_a, s_a, s_b, s_b]
    return _mm_mul_ps(s, _mm_setr_ps(1.0f, F::kMinPerScale, 1.0f, F::kMinPerScale));
  }
}

#endif

#if defined(PIJ_QSIMD_AVX512)
// Blocks a and b unpacked side by side: 64 bytes in the activations' order.
template <class F>
inline qsimd512::I8x64 Unpack2(const uint8_t* a, const uint8_t* b) {
  if constexpr (F::kType == QType::kQ4_0 || F::kType == QType::kQ4_1) {
    constexpr int kNibbles = F::kBytes - 16;  // the packed nibbles close the block
    return qsimd512::Nibbles16x2(a + kNibbles, b + kNibbles);
  } else {
    return qsimd512::Pair(F::Unpack(a, 0), F::Unpack(b, 0));
  }
}

template <class F>
inline __m512i Dot2(qsimd512::I8x64 w, qsimd512::I8x64 x) {
  if constexpr (F::kSigned) {
    return qsimd512::DotS8S8(w, x);
  } else {
    return qsimd512::DotU8S8(w, x);
  }
}

template <class F, int kR, int kC, int64_t kAhead>
__attribute__((always_inline)) inline void LegacyDotTile(const uint8_t* const* rows,
                                                         const QActView* xs, int64_t nblocks,
                                                         float* out, const uint8_t* const* ahead) {
  __m512 acc[kR][kC];
  __m128 mins[kR][kC];  // lanes 1 and 3: min_0 and min_1 (lanes 0 and 2 unused)
  for (int r = 0; r < kR; ++r) {
    for (int t = 0; t < kC; ++t) {
      acc[r][t] = _mm512_setzero_ps();
      mins[r][t] = _mm_setzero_ps();
    }
  }
  int64_t b = 0;
#if defined(PIJ_QSIMD_VBMI)
  // The 4-bit formats, four blocks a step: their bytes gathered by byte permutes (about half the
  // shuffles of two pair steps), the same pair steps after, in the same order (so the same bits).
  // The pair step is spelled out here and in the loop below on purpose: the same code through
  // two always-inline helpers (activation loads, pair accumulation) compiled to row-layout
  // decode matvecs at half the rate (Q4_0, 2 threads: 11 against 21 GB/s, same bits).
  if constexpr (F::kType == QType::kQ4_0 || F::kType == QType::kQ4_1) {
    for (; b + 4 <= nblocks; b += 4) {
      __m512i x[2][kC];
      __m128 dc[2][kC];
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < kC; ++t) {
          x[h][t] = _mm512_loadu_si512(xs[t].q + (b + 2 * h) * 32);
          dc[h][t] = qsimd::Interleave2(xs[t].d + b + 2 * h,
                                        F::kHasMin ? xs[t].c + b + 2 * h : xs[t].d + b + 2 * h);
        }
      }
      for (int r = 0; r < kR; ++r) {
        const uint8_t* blk = rows[r] + b * F::kBytes;
        StreamPrefetch<kAhead, 4 * F::kBytes>(blk);
        CompanionPrefetch<2 * F::kBytes>(ahead, r, b * F::kBytes);
        CompanionPrefetch<2 * F::kBytes>(ahead, r, (b + 2) * F::kBytes);
        qsimd512::I8x64 u[2];
        __m128 sm[2];
        qsimd512::Blocks4<F::kBytes, F::kType == QType::kQ4_1>(blk, u, sm, F::kMinPerScale);
        for (int h = 0; h < 2; ++h) {  // as the pair loop below, blocks (b, b+1) then (b+2, b+3)
          for (int t = 0; t < kC; ++t) {
            const __m512 dot = _mm512_cvtepi32_ps(Dot2<F>(u[h], x[h][t]));
            acc[r][t] = _mm512_fmadd_ps(
                dot, qsimd512::SpreadLanes02(_mm_mul_ps(sm[h], dc[h][t])), acc[r][t]);
            if constexpr (F::kHasMin) mins[r][t] = _mm_fmadd_ps(sm[h], dc[h][t], mins[r][t]);
          }
        }
      }
    }
  }
#endif
  for (; b + 2 <= nblocks; b += 2) {
    __m512i x[kC];
    __m128 dc[kC];  // [d_b, c_b, d_b+1, c_b+1]
    for (int t = 0; t < kC; ++t) {
      x[t] = _mm512_loadu_si512(xs[t].q + b * 32);
      dc[t] = qsimd::Interleave2(xs[t].d + b, F::kHasMin ? xs[t].c + b : xs[t].d + b);
    }
    for (int r = 0; r < kR; ++r) {
      const uint8_t* blk = rows[r] + b * F::kBytes;
      StreamPrefetch<kAhead, 2 * F::kBytes>(blk);
      CompanionPrefetch<2 * F::kBytes>(ahead, r, b * F::kBytes);
      const qsimd512::I8x64 u = Unpack2<F>(blk, blk + F::kBytes);
      const __m128 sm = ScaleMin2<F>(blk, blk + F::kBytes);
      for (int t = 0; t < kC; ++t) {
        const __m512 dot = _mm512_cvtepi32_ps(Dot2<F>(u, x[t]));
        acc[r][t] = _mm512_fmadd_ps(dot, qsimd512::SpreadLanes02(_mm_mul_ps(sm, dc[t])),
                                    acc[r][t]);
        if constexpr (F::kHasMin) mins[r][t] = _mm_fmadd_ps(sm, dc[t], mins[r][t]);
      }
    }
  }
  if (b < nblocks) {  // an odd count: the last block is even, in the low lanes only
    for (int r = 0; r < kR; ++r) {
      const uint8_t* blk = rows[r] + b * F::kBytes;
      CompanionPrefetch<F::kBytes>(ahead, r, b * F::kBytes);
      const qsimd512::I8x64 u = _mm512_zextsi256_si512(F::Unpack(blk, 0));
      const __m128 sm = ScaleMin2<F>(blk, blk);
      for (int t = 0; t < kC; ++t) {
        const __m512i x = _mm512_zextsi256_si512(qsimd::Load32(xs[t].q + b * 32));
        const __m128 dc = _mm_unpacklo_ps(_mm_load_ss(xs[t].d + b),
                                          _mm_load_ss(F::kHasMin ? xs[t].c + b : xs[t].d + b));
        const __m512 dot = _mm512_cvtepi32_ps(Dot2<F>(u, x));
        acc[r][t] = _mm512_mask3_fmadd_ps(dot, qsimd512::SpreadLanes02(_mm_mul_ps(sm, dc)),
                                          acc[r][t], 0x00ff);
        if constexpr (F::kHasMin) mins[r][t] = _mm_mask3_fmadd_ps(sm, dc, mins[r][t], 0x3);
      }
    }
  }
  for (int r = 0; r < kR; ++r) {
    for (int t = 0; t < kC; ++t) {
      const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),
                                          _mm512_extractf32x8_ps(acc[r][t], 1));
      float m = 0.0f;
      if constexpr (F::kHasMin) {
        const __m128 v = mins[r][t];
        m = _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, 3));
      }
      out[r * kC + t] = qsimd::ReduceSum(halves) + m;
    }
  }
}
#elif defined(PIJ_QSIMD_AVX2)
// AVX2 also takes two blocks per step, for the scales: the pair's f16 scales and minimums are
// widened in one op and multiplied by the activations' in one op, and the two minimum chains are
// the lanes 1 and 3 of one FMA, where one block per step spent a scalar widen, multiply,
// broadcast and FMA per block (perf: most of the Q4_1 decode loop on a Cascade Lake Xeon).
// Every product, FMA and sum is the portable path's (the #else below), so the bits are too.
template <class F, int kR, int kC, int64_t kAhead>
inline void LegacyDotTile(const uint8_t* const* rows, const QActView* xs, int64_t nblocks,
                          float* out, const uint8_t* const* ahead) {
  F32x8 acc[2][kR][kC];
  __m128 mins[kR][kC];  // lanes 1 and 3: min_0 and min_1 (lanes 0 and 2 unused)
  for (int r = 0; r < kR; ++r) {
    for (int t = 0; t < kC; ++t) {
      acc[0][r][t] = acc[1][r][t] = qsimd::Zero();
      mins[r][t] = _mm_setzero_ps();
    }
  }
  int64_t b = 0;
  for (; b + 2 <= nblocks; b += 2) {
    __m128 dc[kC];  // [d_b, c_b, d_b+1, c_b+1]
    for (int t = 0; t < kC; ++t) {
      dc[t] = qsimd::Interleave2(xs[t].d + b, F::kHasMin ? xs[t].c + b : xs[t].d + b);
    }
    for (int r = 0; r < kR; ++r) {
      const uint8_t* blk = rows[r] + b * F::kBytes;
      StreamPrefetch<kAhead, 2 * F::kBytes>(blk);
      CompanionPrefetch<2 * F::kBytes>(ahead, r, b * F::kBytes);
      const I8x32 u0 = F::Unpack(blk, 0);
      const I8x32 u1 = F::Unpack(blk + F::kBytes, 0);
      const __m128 sm = ScaleMin2<F>(blk, blk + F::kBytes);
      for (int t = 0; t < kC; ++t) {
        const __m128 sd = _mm_mul_ps(sm, dc[t]);  // lanes 0 and 2: s_b * d_b, s_b+1 * d_b+1
        const qsimd::I32x8 dot0 = Dot<F>(u0, qsimd::Load32(xs[t].q + b * 32));
        const qsimd::I32x8 dot1 = Dot<F>(u1, qsimd::Load32(xs[t].q + (b + 1) * 32));
        acc[0][r][t] = qsimd::MulAdd(qsimd::ToF32(dot0), _mm256_broadcastss_ps(sd), acc[0][r][t]);
        acc[1][r][t] = qsimd::MulAdd(qsimd::ToF32(dot1),
                                     _mm256_broadcastss_ps(_mm_movehl_ps(sd, sd)), acc[1][r][t]);
        if constexpr (F::kHasMin) mins[r][t] = _mm_fmadd_ps(sm, dc[t], mins[r][t]);
      }
    }
  }
  if (b < nblocks) {  // an odd count: the last block is even
    for (int r = 0; r < kR; ++r) {
      const uint8_t* blk = rows[r] + b * F::kBytes;
      CompanionPrefetch<F::kBytes>(ahead, r, b * F::kBytes);
      typename F::Prep p;
      F::Prepare(blk, p);
      const I8x32 u = F::Unpack(blk, 0);
      for (int t = 0; t < kC; ++t) {
        const qsimd::I32x8 dot = Dot<F>(u, qsimd::Load32(xs[t].q + b * 32));
        acc[0][r][t] = qsimd::MulAdd(qsimd::ToF32(dot), qsimd::Set1(p.s * xs[t].d[b]),
                                     acc[0][r][t]);
        if constexpr (F::kHasMin) {  // min_0 = fma(m_b, c_b, min_0), in lane 1
          const __m128 v = mins[r][t];
          const float m0 = std::fma(p.m, xs[t].c[b], _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)));
          mins[r][t] = _mm_blend_ps(v, _mm_set1_ps(m0), 0x2);
        }
      }
    }
  }
  for (int r = 0; r < kR; ++r) {
    for (int t = 0; t < kC; ++t) {
      float m = 0.0f;
      if constexpr (F::kHasMin) {
        const __m128 v = mins[r][t];
        m = _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, 3));
      }
      out[r * kC + t] = qsimd::ReduceSum(qsimd::Add(acc[0][r][t], acc[1][r][t])) + m;
    }
  }
}
#else
template <class F, int kR, int kC, int64_t kAhead>
inline void LegacyDotTile(const uint8_t* const* rows, const QActView* xs, int64_t nblocks,
                          float* out, const uint8_t* const* ahead) {
  F32x8 acc[2][kR][kC];
  float mins[2][kR][kC] = {};
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < kR; ++r) {
      for (int t = 0; t < kC; ++t) acc[h][r][t] = qsimd::Zero();
    }
  }
  auto step = [&]<int kH>(int64_t b) {
    for (int r = 0; r < kR; ++r) {
      const uint8_t* blk = rows[r] + b * F::kBytes;
      StreamPrefetch<kAhead, F::kBytes>(blk);
      CompanionPrefetch<F::kBytes>(ahead, r, b * F::kBytes);
      typename F::Prep p;
      F::Prepare(blk, p);
      const I8x32 u = F::Unpack(blk, 0);
      for (int t = 0; t < kC; ++t) {
        const qsimd::I32x8 dot = Dot<F>(u, qsimd::Load32(xs[t].q + b * 32));
        acc[kH][r][t] = qsimd::MulAdd(qsimd::ToF32(dot), qsimd::Set1(p.s * xs[t].d[b]),
                                      acc[kH][r][t]);
        // std::fma, not `+= p.m * c`: the compiler contracted that in some tile shapes and
        // not in others, and a token's bits then depended on how many tokens shared the tile
        if constexpr (F::kHasMin) mins[kH][r][t] = std::fma(p.m, xs[t].c[b], mins[kH][r][t]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nblocks; b += 2) {
    step.template operator()<0>(b);
    step.template operator()<1>(b + 1);
  }
  if (b < nblocks) step.template operator()<0>(b);
  for (int r = 0; r < kR; ++r) {
    for (int t = 0; t < kC; ++t) {
      out[r * kC + t] = qsimd::ReduceSum(qsimd::Add(acc[0][r][t], acc[1][r][t])) +
                        (mins[0][r][t] + mins[1][r][t]);
    }
  }
}
#endif

// out[r * kC + t] = row r . x_t over nblocks blocks. rows: kR pointers to a row's first block.
// kAhead > 0: each block's bytes kAhead further on are requested as it is read (rows in order).
// ahead: kR other rows (the next tile's), requested at the offset being read (CompanionPrefetch).
template <class F, int kR, int kC, int64_t kAhead = 0>
inline void DotTile(const uint8_t* const* rows, const QActView* xs, int64_t nblocks, float* out,
                    const uint8_t* const* ahead = nullptr) {
  if constexpr (F::kChunks == 1) {
    LegacyDotTile<F, kR, kC, kAhead>(rows, xs, nblocks, out, ahead);
  } else {
    F32x8 acc[kR][kC];
    for (int r = 0; r < kR; ++r) {
      for (int t = 0; t < kC; ++t) acc[r][t] = qsimd::Zero();
    }
    // K-quants: per super-block, sum over chunks of dot * s (lane-wise per-16 scales), times d_x
    // once; the minimums' term m . c over the block's 16 halves in two vector FMAs.
    F32x8 macc[kR][kC];
    for (int r = 0; r < kR; ++r) {
      for (int t = 0; t < kC; ++t) macc[r][t] = qsimd::Zero();
    }
    for (int64_t b = 0; b < nblocks; ++b) {
      typename F::Prep p[kR];
      const uint8_t* blk[kR];
      for (int r = 0; r < kR; ++r) {
        blk[r] = rows[r] + b * F::kBytes;
        StreamPrefetch<kAhead, F::kBytes>(blk[r]);
        CompanionPrefetch<F::kBytes>(ahead, r, b * F::kBytes);
        F::Prepare(blk[r], p[r]);
      }
      F32x8 part[kR][kC];
      for (int r = 0; r < kR; ++r) {
        for (int t = 0; t < kC; ++t) part[r][t] = qsimd::Zero();
      }
#pragma GCC unroll 8
      for (int c = 0; c < F::kChunks; ++c) {
        for (int r = 0; r < kR; ++r) {
          const I8x32 u = F::Unpack(blk[r], c);
          const F32x8 s = F::ChunkScale(p[r], c);
          for (int t = 0; t < kC; ++t) {
            const qsimd::I32x8 dot = Dot<F>(u, qsimd::Load32(xs[t].q + b * 256 + 32 * c));
            part[r][t] = qsimd::MulAdd(qsimd::ToF32(dot), s, part[r][t]);
          }
        }
      }
      for (int t = 0; t < kC; ++t) {
        const F32x8 dx = qsimd::Set1(xs[t].d[b]);
        const float* c = xs[t].c + b * 16;
        for (int r = 0; r < kR; ++r) {
          acc[r][t] = qsimd::MulAdd(part[r][t], dx, acc[r][t]);
          macc[r][t] = qsimd::MulAdd(p[r].m[0], qsimd::Load(c), macc[r][t]);
          macc[r][t] = qsimd::MulAdd(p[r].m[1], qsimd::Load(c + 8), macc[r][t]);
        }
      }
    }
    for (int r = 0; r < kR; ++r) {
      for (int t = 0; t < kC; ++t) {
        out[r * kC + t] = qsimd::ReduceSum(acc[r][t]) + qsimd::ReduceSum(macc[r][t]);
      }
    }
  }
}

// A block's per-16 scales and minimums as plain floats: [0, 2) for legacy blocks, [0, 16) for
// K-quant super-blocks.
template <class F>
inline void HalfScales(const typename F::Prep& p, float* s, float* m) {
  if constexpr (F::kChunks == 1) {
    s[0] = s[1] = p.s;
    m[0] = m[1] = p.m;
  } else {
    for (int h = 0; h < 2; ++h) {
      qsimd::Store(s + 8 * h, p.s[h]);
      qsimd::Store(m + 8 * h, p.m[h]);
    }
  }
}

// Weights 8q .. 8q + 7 of chunk c as floats: widened straight from memory where the format stores
// plain int8 (Q8_0: one load-and-extend), else from the unpacked chunk u.
template <class F>
inline F32x8 ChunkPart(const uint8_t* blk, const I8x32& u, int c, int q) {
  if constexpr (F::kSigned) {
    return qsimd::S8ToF32(F::PlainQuants(blk) + 32 * c + 8 * q);
  } else {
    return qsimd::BytesToF32<false>(u, q);
  }
}

// The chunk's unpacked bytes, where ChunkPart needs them.
template <class F>
inline I8x32 UnpackForParts(const uint8_t* blk, int c) {
  if constexpr (F::kSigned) {
    return I8x32{};
  } else {
    return F::Unpack(blk, c);
  }
}

// Whether AxpyRows adds a format's fixed offset to each weight (Q4_0: q - 8, Q5_0: q - 16, exact
// small integers) rather than summing the rows' minimums apart: per element one FMA per row and
// no per-block minimum chain (perf: the chain and the per-row scalar set-up were half of the
// down rows' time once the weights were widened 16 at a time).
template <class F>
constexpr float FixedOffset() {
  if constexpr (F::kChunks == 1) {
    return F::kMinPerScale;
  } else {
    return 0.0f;
  }
}
template <class F>
constexpr bool kFoldsOffset = FixedOffset<F>() != 0.0f;

#if defined(PIJ_QSIMD_AVX512)
// A 32-weight block's weights 0-15 and 16-31 as floats, 16 lanes each, with the fixed offset of
// kFoldsOffset formats: the values ChunkPart (+ offset) gives 8 at a time, in a third of the
// operations. The 4-bit formats widen their packed bytes straight from memory (low nibbles:
// weights 0-15, high: 16-31); Q4_0 looks the 16 values up (vpermps reads an index's low 4 bits).
template <class F>
inline void Widen32(const uint8_t* blk, __m512& w0, __m512& w1) {
  if constexpr (F::kSigned) {
    const int8_t* q = F::PlainQuants(blk);
    w0 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w1 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  } else if constexpr (F::kType == QType::kQ4_0 || F::kType == QType::kQ4_1) {
    // the packed nibbles close the block: byte i holds weights i and 16 + i
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + F::kBytes - 16)));
    if constexpr (F::kType == QType::kQ4_0) {
      const __m512 table =
          _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
      w0 = _mm512_permutexvar_ps(b, table);
      w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    } else {
      w0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0f)));
      w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    }
  } else {  // the 5-bit formats: their unpacked 32 bytes
    const I8x32 u = F::Unpack(blk, 0);
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u)));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1)));
    if constexpr (kFoldsOffset<F>) {
      w0 = _mm512_add_ps(w0, _mm512_set1_ps(F::kMinPerScale));
      w1 = _mm512_add_ps(w1, _mm512_set1_ps(F::kMinPerScale));
    }
  }
}
#endif

// y[0, D) += sum_k coef[k] * dequant(rows[k]) for kN rows, in one pass over y: y is loaded and
// stored once per chunk for all kN rows. Per element the rows' products are added in row order
// (each row's weight with its format's fixed offset where kFoldsOffset), then their stored
// minimums' sum (Q4_1, Q5_1, the K-quants). The same operations per element on every ISA.
// ahead: kN rows summed next (or nullptr), requested at the offset being read (CompanionPrefetch).
template <class F, int kN>
inline void AxpyRows(const uint8_t* const* rows, const float* coef, int64_t nblocks, float* y,
                     const uint8_t* const* ahead = nullptr) {
  constexpr int kHalves = F::kBlock / 16;
  constexpr bool kStoredMin = F::kHasMin && !kFoldsOffset<F>;
  for (int64_t b = 0; b < nblocks; ++b) {
    float cs[kN][kHalves];  // coef * s per row and half
    float msum[kHalves] = {};
    for (int k = 0; k < kN; ++k) {
      CompanionPrefetch<F::kBytes>(ahead, k, b * F::kBytes);
      typename F::Prep p;
      F::Prepare(rows[k] + b * F::kBytes, p);
      if constexpr (F::kChunks == 1) {
        cs[k][0] = cs[k][1] = coef[k] * p.s;
        if constexpr (kStoredMin) msum[0] = msum[1] = msum[0] + coef[k] * p.m;
      } else {
        float s[16], m[16];
        HalfScales<F>(p, s, m);
        for (int h = 0; h < kHalves; ++h) {
          cs[k][h] = coef[k] * s[h];
          msum[h] += coef[k] * m[h];
        }
      }
    }
    float* yb = y + b * F::kBlock;
#if defined(PIJ_QSIMD_AVX512)
    if constexpr (F::kChunks == 1) {  // a 32-weight block: two 16-lane halves
      __m512 y0 = _mm512_loadu_ps(yb), y1 = _mm512_loadu_ps(yb + 16);
      for (int k = 0; k < kN; ++k) {
        __m512 w0, w1;
        Widen32<F>(rows[k] + b * F::kBytes, w0, w1);
        y0 = _mm512_fmadd_ps(w0, _mm512_set1_ps(cs[k][0]), y0);
        y1 = _mm512_fmadd_ps(w1, _mm512_set1_ps(cs[k][1]), y1);
      }
      if constexpr (kStoredMin) {
        y0 = _mm512_add_ps(y0, _mm512_set1_ps(msum[0]));
        y1 = _mm512_add_ps(y1, _mm512_set1_ps(msum[1]));
      }
      _mm512_storeu_ps(yb, y0);
      _mm512_storeu_ps(yb + 16, y1);
      continue;
    }
#endif
#pragma GCC unroll 8
    for (int c = 0; c < F::kChunks; ++c) {
      F32x8 yv[4];
      for (int q = 0; q < 4; ++q) yv[q] = qsimd::Load(yb + 32 * c + 8 * q);
      for (int k = 0; k < kN; ++k) {
        const uint8_t* blk = rows[k] + b * F::kBytes;
        const I8x32 u = UnpackForParts<F>(blk, c);
        for (int q = 0; q < 4; ++q) {
          F32x8 w = ChunkPart<F>(blk, u, c, q);
          if constexpr (kFoldsOffset<F>) w = qsimd::Add(w, qsimd::Set1(FixedOffset<F>()));
          yv[q] = qsimd::MulAdd(w, qsimd::Set1(cs[k][2 * c + q / 2]), yv[q]);
        }
      }
      for (int q = 0; q < 4; ++q) {
        if constexpr (kStoredMin) yv[q] = qsimd::Add(yv[q], qsimd::Set1(msum[2 * c + q / 2]));
        qsimd::Store(yb + 32 * c + 8 * q, yv[q]);
      }
    }
  }
}

// Down groups (legacy formats): a GGUF ffn_down [D, F] holds, at row d, one block per 32 neurons.
// Group g regroups those D blocks of neurons 32g .. 32g + 31 without re-quantizing them:
//   the blocks' scale fields as planes, [D] f16 s (then [D] f16 m for Q4_1 / Q5_1), then
//   32 neuron rows, each D / 32 chunks of the block's quant bytes (the block minus its scale
//   fields: Q4 qs[16], Q5 qh u32 | qs[16], Q8_0 qs[32]) for weights 32c .. 32c + 31 along D,
//   packed as the format packs a block.
// D * kBytes bytes per group, the file's size. Neuron j's weight at d is s[d] * q + m[d], so
//   sum_k coef_k * w_k[d] = s[d] * (sum_k coef_k * q_k[d]) + m[d] * sum_k coef_k
// and a group with n active neurons reads its 2 or 4 bytes per d once and n quant rows, where
// rows re-blocked per neuron along D (Q8_0: 34 bytes per 32 weights) read n rows of their own.
// A neuron's *code row*: its quant bytes of every block along D without the scale fields, D / 32
// chunks of (block bytes - scale bytes), packed as the format packs a block. A group's neuron
// rows are code rows; a neuron store keeps each neuron's code row in its bundle and the group's
// scale planes apart (neuron_store.h), and sums them with the same two functions below.
// y[0, D) += sum_k coef[k] * w_k over n neurons of one group (planes: the group's scale planes;
// rows[k]: neuron k's code row; coef: their a_i), in one pass over y: per chunk the neurons'
// quants are summed in float in the order given, then scaled. D = 32 * nchunks.
template <class F>
inline void AxpyGroup(const uint8_t* planes, const uint8_t* const* rows, int64_t nchunks,
                      const float* coef, int n, float* y) {
  static_assert(F::kBlock == 32, "down groups hold the 32-weight formats");
  constexpr int kScale = static_cast<int>(DownGroupScaleBytes(F::kType));
  constexpr int kQuant = F::kBytes - kScale;
  const int64_t dim = 32 * nchunks;
  const uint8_t* group = planes;
  float coef_sum = 0.0f;
  for (int k = 0; k < n; ++k) coef_sum += coef[k];
#if defined(PIJ_QSIMD_AVX512)
  // 16 lanes: the same FMAs per weight in the same order, half the instructions.
  const __m512 sum16 = _mm512_set1_ps(coef_sum);
  for (int64_t c = 0; c < nchunks; ++c) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int k = 0; k < n; ++k) {
      const uint8_t* blk = rows[k] + c * kQuant - kScale;  // as a block
      const __m256i u = F::Unpack(blk, 0);  // Q8_0: its int8 quants as they are
      const __m512 a = _mm512_set1_ps(coef[k]);
      for (int h = 0; h < 2; ++h) {
        const __m128i b = h == 0 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1);
        const __m512i w = F::kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
        acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(w), a, acc[h]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t d0 = 32 * c + 16 * h;
      const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(group + 2 * d0)));
      __m512 yv = _mm512_fmadd_ps(sv, acc[h], _mm512_loadu_ps(y + d0));
      if constexpr (F::kHasMin) {
        const __m512 m = kScale == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(group + 2 * dim + 2 * d0)))
                                     : _mm512_mul_ps(sv, _mm512_set1_ps(F::kMinPerScale));
        yv = _mm512_fmadd_ps(m, sum16, yv);
      }
      _mm512_storeu_ps(y + d0, yv);
    }
  }
#else
  const F32x8 sum_v = qsimd::Set1(coef_sum);
  for (int64_t c = 0; c < nchunks; ++c) {
    F32x8 acc[4] = {qsimd::Zero(), qsimd::Zero(), qsimd::Zero(), qsimd::Zero()};
    for (int k = 0; k < n; ++k) {
      const uint8_t* blk = rows[k] + c * kQuant - kScale;  // as a block
      const I8x32 u = UnpackForParts<F>(blk, 0);
      const F32x8 a = qsimd::Set1(coef[k]);
      for (int q = 0; q < 4; ++q) acc[q] = qsimd::MulAdd(ChunkPart<F>(blk, u, 0, q), a, acc[q]);
    }
    for (int q = 0; q < 4; ++q) {
      const int64_t d0 = 32 * c + 8 * q;
      const F32x8 s = qsimd::HalvesToF32(group + 2 * d0);
      F32x8 yv = qsimd::MulAdd(s, acc[q], qsimd::Load(y + d0));
      if constexpr (F::kHasMin) {
        const F32x8 m = kScale == 4 ? qsimd::HalvesToF32(group + 2 * dim + 2 * d0)
                                    : qsimd::Mul(s, qsimd::Set1(F::kMinPerScale));
        yv = qsimd::MulAdd(m, sum_v, yv);
      }
      qsimd::Store(y + d0, yv);
    }
  }
#endif
}

// Down groups of the 4-bit formats (DownGroupPairs): the scale planes, then 16 rows of neuron
// pairs, each D / 32 chunks of 32 bytes; byte k of chunk c holds the codes of neuron 2p + k % 2
// at d = 32c + k / 2 (low nibble) and d = 32c + 16 + k / 2 (high nibble) (checkpoint/quants.py).
// The n coefs are quantized to int8 with one scale per group, da = max |coef| / 127 (what the
// dense down matvec does to its input per 32 neurons), and per d
//   y[d] += (s[d] * da) * sum_k q_k[d] * aq_k + m[d] * (da * sum_k aq_k)   (Q4_0: m = -8 s)
// the integer sum exact: a pair's two products in one int16 (vpmaddubsw), at most 8 pairs per
// int16 sum (8 * 2 * 15 * 127 < 2^15), then int32. Pairs whose two coefs are 0 are not read.
// Where float AxpyGroup spends 3-4 vector ops per 8 or 16 weights of one neuron, this spends
// about 8 per 64 weights of two. A non-finite coef makes the group's terms NaN, as a float sum
// with it would be non-finite. Every d goes through the same two FMAs in every build.
// n coefs at `lanes` of a group of 32 neurons (the others 0) rounded as QuantizeBlock rounds a
// block of 32 activations: the int8 codes q[32], their sum, and the scale (NaN where a coef is
// NaN or inf). AxpyPairs' coefs and qsparse_ffn.cc's rounded row coefs.
inline float QuantizeLanes(const int32_t* lanes, const float* coef, int n, int8_t* q,
                           int32_t* q_sum) {
  float block[32] = {};
  for (int k = 0; k < n; ++k) block[lanes[k]] = coef[k];
  int32_t sums16[2];
  const float d = QuantizeBlock(block, 32, q, sums16);
  *q_sum = sums16[0] + sums16[1];
  return d;
}

// Where AxpyPairs reads pair p's bytes of chunk c (32 bytes; 64 for chunks c and c + 1):
//   GroupPairRows  a group's pair rows in memory (down groups: pair p's row at rows + p * dim);
//   CodePairRows   two neurons' code rows (or nullptr: a neuron not summed, its codes read as
//                  0), their bytes interleaved as a pair row holds them (a neuron store's bundles).
// The integer sums are exact, so both give the same bits for the same codes.
struct GroupPairRows {
  const uint8_t* rows;
  int64_t dim;
#if defined(PIJ_QSIMD_AVX512)
  __m512i Load64(int p, int64_t c) const { return _mm512_loadu_si512(rows + p * dim + 32 * c); }
#endif
#if defined(PIJ_QSIMD_AVX2)
  __m256i Load32(int p, int64_t c) const { return qsimd::Load32(rows + p * dim + 32 * c); }
#endif
  uint8_t Byte(int p, int64_t c, int k) const { return rows[p * dim + 32 * c + k]; }
};

struct CodePairRows {
  const uint8_t* const* codes;  // [32]: lane l's code row (16 bytes per chunk), or nullptr
#if defined(PIJ_QSIMD_AVX2)
  __m128i Half(int lane, int64_t c) const {
    return codes[lane] == nullptr ? _mm_setzero_si128()
                                  : _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                        codes[lane] + 16 * c));
  }
  __m256i Load32(int p, int64_t c) const {
    const __m128i a = Half(2 * p, c), b = Half(2 * p + 1, c);
    return _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
  }
#endif
#if defined(PIJ_QSIMD_AVX512)
  __m512i Load64(int p, int64_t c) const {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Load32(p, c)), Load32(p, c + 1), 1);
  }
#endif
  uint8_t Byte(int p, int64_t c, int k) const {
    const uint8_t* row = codes[2 * p + k % 2];
    return row == nullptr ? 0 : row[16 * c + k / 2];
  }
};

template <class F, class Pairs>
inline void AxpyPairs(const uint8_t* planes, const Pairs& pairs, int64_t nchunks,
                      const int32_t* lanes, const float* coef, int n, float* y) {
  static_assert(DownGroupPairs(F::kType), "pair rows hold the 4-bit formats");
  constexpr int kScale = static_cast<int>(DownGroupScaleBytes(F::kType));
  constexpr int kPairRuns = 8;  // pairs per int16 sum
  const int64_t dim = 32 * nchunks;
  const uint8_t* group = planes;
  int8_t aq[32];
  int32_t q_sum;
  const float da = QuantizeLanes(lanes, coef, n, aq, &q_sum);
  if (std::isnan(da)) {
    for (int64_t d = 0; d < dim; ++d) y[d] += std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (da == 0.0f) return;
  const float coef_sum = da * static_cast<float>(q_sum);  // the rounded coefs' sum
  int32_t pair_row[16];  // the read pairs
  int16_t pair_act[16];  // their two 8-bit coefs as one int16 (low byte: the even neuron)
  int np = 0;
  for (int p = 0; p < 16; ++p) {
    if ((aq[2 * p] | aq[2 * p + 1]) == 0) continue;
    pair_row[np] = p;
    const auto hi = static_cast<uint16_t>(static_cast<uint8_t>(aq[2 * p + 1]));
    pair_act[np++] = static_cast<int16_t>(static_cast<uint8_t>(aq[2 * p]) | (hi << 8));
  }
  int64_t c = 0;
#if defined(PIJ_QSIMD_AVX512)
  {  // two chunks per 64-byte load
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512 da16 = _mm512_set1_ps(da), sum16 = _mm512_set1_ps(coef_sum);
    for (; c + 2 <= nchunks; c += 2) {
      // [c, d 0-15], [c + 1, d 0-15], [c, d 16-31], [c + 1, d 16-31]
      __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                        _mm512_setzero_si512()};
      for (int j0 = 0; j0 < np; j0 += kPairRuns) {
        __m512i lo16 = _mm512_setzero_si512(), hi16 = _mm512_setzero_si512();
        for (int j = j0; j < std::min(np, j0 + kPairRuns); ++j) {
          const __m512i b = pairs.Load64(pair_row[j], c);
          const __m512i a = _mm512_set1_epi16(pair_act[j]);
          lo16 = _mm512_add_epi16(lo16, _mm512_maddubs_epi16(_mm512_and_si512(b, low4), a));
          hi16 = _mm512_add_epi16(
              hi16, _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(b, 4), low4), a));
        }
        acc[0] = _mm512_add_epi32(acc[0], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(lo16)));
        acc[1] = _mm512_add_epi32(acc[1], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(lo16, 1)));
        acc[2] = _mm512_add_epi32(acc[2], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(hi16)));
        acc[3] = _mm512_add_epi32(acc[3], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(hi16, 1)));
      }
      constexpr int kOffset[4] = {0, 32, 16, 48};
      for (int q = 0; q < 4; ++q) {
        const int64_t d0 = 32 * c + kOffset[q];
        const __m512 s = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 2 * d0)));
        __m512 yv = _mm512_fmadd_ps(_mm512_mul_ps(s, da16), _mm512_cvtepi32_ps(acc[q]),
                                    _mm512_loadu_ps(y + d0));
        const __m512 m = kScale == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(group + 2 * dim + 2 * d0)))
                                     : _mm512_mul_ps(s, _mm512_set1_ps(F::kMinPerScale));
        _mm512_storeu_ps(y + d0, _mm512_fmadd_ps(m, sum16, yv));
      }
    }
  }
#endif
#if defined(PIJ_QSIMD_AVX2)
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (; c < nchunks; ++c) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                      _mm256_setzero_si256()};  // d 0-7, 8-15, 16-23, 24-31 of the chunk
    for (int j0 = 0; j0 < np; j0 += kPairRuns) {
      __m256i lo16 = _mm256_setzero_si256(), hi16 = _mm256_setzero_si256();
      for (int j = j0; j < std::min(np, j0 + kPairRuns); ++j) {
        const __m256i b = pairs.Load32(pair_row[j], c);
        const __m256i a = _mm256_set1_epi16(pair_act[j]);
        lo16 = _mm256_add_epi16(lo16, _mm256_maddubs_epi16(_mm256_and_si256(b, low4), a));
        hi16 = _mm256_add_epi16(
            hi16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4), a));
      }
      acc[0] = _mm256_add_epi32(acc[0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo16)));
      acc[1] = _mm256_add_epi32(acc[1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo16, 1)));
      acc[2] = _mm256_add_epi32(acc[2], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi16)));
      acc[3] = _mm256_add_epi32(acc[3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi16, 1)));
    }
    for (int q = 0; q < 4; ++q) {
      const int64_t d0 = 32 * c + 8 * q;
      const F32x8 s = qsimd::HalvesToF32(group + 2 * d0);
      const F32x8 yv = qsimd::MulAdd(qsimd::Mul(s, qsimd::Set1(da)), qsimd::ToF32(acc[q]),
                                     qsimd::Load(y + d0));
      const F32x8 m = kScale == 4 ? qsimd::HalvesToF32(group + 2 * dim + 2 * d0)
                                  : qsimd::Mul(s, qsimd::Set1(F::kMinPerScale));
      qsimd::Store(y + d0, qsimd::MulAdd(m, qsimd::Set1(coef_sum), yv));
    }
  }
#else
  const auto scale_at = [&](int64_t d) { return qsimd::HalfAt(group + 2 * d) * da; };
  const auto min_at = [&](int64_t d) {
    return kScale == 4 ? qsimd::HalfAt(group + 2 * dim + 2 * d)
                       : qsimd::HalfAt(group + 2 * d) * F::kMinPerScale;
  };
  for (; c < nchunks; ++c) {
    for (int e = 0; e < 32; ++e) {  // d = 32c + e: bytes 2 (e % 16), + 1 of each pair's chunk
      const int64_t d = 32 * c + e;
      const int shift = e < 16 ? 0 : 4;  // low nibbles for d 0-15, high for 16-31
      int32_t acc = 0;
      for (int j = 0; j < np; ++j) {
        const uint8_t b0 = pairs.Byte(pair_row[j], c, 2 * (e % 16));
        const uint8_t b1 = pairs.Byte(pair_row[j], c, 2 * (e % 16) + 1);
        const auto a0 = static_cast<int8_t>(pair_act[j] & 0xff);
        const auto a1 = static_cast<int8_t>((pair_act[j] >> 8) & 0xff);
        acc += ((b0 >> shift) & 15) * a0 + ((b1 >> shift) & 15) * a1;
      }
      y[d] = std::fma(min_at(d), coef_sum, std::fma(scale_at(d), static_cast<float>(acc), y[d]));
    }
  }
#endif
}

// Tokens per DotTile in the multi-token kernels.
constexpr int kMaxTokens = 4;

// kR rows x up to kMaxTokens tokens [t, end): dots [r * n + k]; returns n, the tokens taken.
template <class F, int kR>
inline int64_t TokenTile(const uint8_t* const* rows, const QActView* xs, int64_t t, int64_t end,
                         int64_t nblocks, float* dots) {
  const int64_t n = std::min<int64_t>(kMaxTokens, end - t);
  switch (n) {
    case 1: DotTile<F, kR, 1>(rows, xs + t, nblocks, dots); break;
    case 2: DotTile<F, kR, 2>(rows, xs + t, nblocks, dots); break;
    case 3: DotTile<F, kR, 3>(rows, xs + t, nblocks, dots); break;
    default: DotTile<F, kR, 4>(rows, xs + t, nblocks, dots); break;
  }
  return n;
}

// out[0, nblocks * kBlock) = the row's weights, s * u + m (a multiply, then an add, as the gguf
// package's numpy dequantizers round).
template <class F>
inline void DequantizeRow(const uint8_t* row, int64_t nblocks, float* out) {
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    typename F::Prep p;
    F::Prepare(blk, p);
    float s[16], m[16];
    HalfScales<F>(p, s, m);
    for (int c = 0; c < F::kChunks; ++c) {
      const I8x32 u = F::Unpack(blk, c);
      for (int q = 0; q < 4; ++q) {
        const int h = 2 * c + q / 2;
        const F32x8 su = qsimd::Mul(qsimd::BytesToF32<F::kSigned>(u, q), qsimd::Set1(s[h]));
        const F32x8 w = qsimd::Add(su, qsimd::Set1(m[h]));
        qsimd::Store(out + b * F::kBlock + 32 * c + 8 * q, w);
      }
    }
  }
}

}  // namespace pij::qkern

#endif  // PIJ_CPU_BACKEND_QUANT_KERNELS_H_
