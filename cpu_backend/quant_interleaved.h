// Matrix rows interleaved by 16 for the decode matvec: the layout ops.qlinear reads fastest.
//
// A row-major GGUF matrix [O, nblocks] of 32-weight blocks (Q4_0, Q4_1, Q8_0), O a multiple of
// 16, is stored as records, one per (group of 16 rows g, block b), in the order (g, b): the 16
// rows' f16 scales (32 bytes), for Q4_1 their f16 minimums (32 bytes), then the quants in chunks
// of 4 bytes per row: chunk c holds bytes [4c, 4c + 4) of every row's packed quants, row r at
// 4r (64 bytes a chunk; 4 chunks of nibbles for the 4-bit formats, 8 of int8 for Q8_0). A record
// is 16 times the file's block, so the matrix keeps its size (checkpoint/quants.py `interleave`
// writes it, and knows the same map byte for byte).
//
// Why: the file's layout gives each row's blocks in turn, and the dot of one block needs its own
// scale, unpacking and a horizontal reduction, so the legacy decode dots were bound by shuffles
// and scale arithmetic (~5 weights a cycle), not by memory. Here one vector lane is one row: a
// 4-byte chunk of the token's activations is broadcast to every lane, one integer dot takes 4
// weights of each of 16 rows, the block's integer dot ends in its lane without a reduction, and
// the 16 scales come in one load: (per record) acc = fma(float(dot), s * d_x, acc),
// mins = fma(m, c_x, mins), and a row's result is acc + mins, in lane order the same on every
// ISA (AVX-512: one 16-lane vector; AVX2: two 8-lane halves; elsewhere: a loop per lane), for
// any token tile. Integer dots are exact, so the bits are too.
// Q4_0: m = -8 s (its offset through the activations' block sums); Q4_1: the stored m; Q8_0:
// signed weights, no minimum (mins stays +0).
#ifndef PIJ_CPU_BACKEND_QUANT_INTERLEAVED_H_
#define PIJ_CPU_BACKEND_QUANT_INTERLEAVED_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_formats.h"
#include "cpu_backend/quant_kernels.h"
#include "cpu_backend/quant_simd.h"

namespace pij::qkern {

constexpr int64_t kInterleave = 16;
// A qtype id with this bit set names the format's rows interleaved by 16 (ops.qlinear's
// "Q4_0x16" etc.: checkpoint/quants.py `type_id`).
constexpr int32_t kInterleavedQTypeFlag = 0x100;

constexpr bool Interleavable(QType t) {
  return t == QType::kQ4_0 || t == QType::kQ4_1 || t == QType::kQ8_0;
}

// Whether a matrix of `rows` rows in t has the layout (checkpoint/quants.py `can_interleave`).
constexpr bool CanInterleave(QType t, int64_t rows) {
  return Interleavable(t) && rows > 0 && rows % kInterleave == 0;
}

// Bytes of a record before its quants: scales, and minimums for Q4_1.
constexpr int64_t InterleavedHead(QType t) { return t == QType::kQ4_1 ? 64 : 32; }

namespace interleaved_detail {

inline int32_t Chunk4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The portable path, the arithmetic every vector path keeps: lane r of out[t * 16 + r].
template <class F, int kC>
inline void TileScalar(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  constexpr int64_t kRecord = kInterleave * F::kBytes;
  constexpr int64_t kHead = InterleavedHead(F::kType);
  constexpr int kQBytes = F::kType == QType::kQ8_0 ? 32 : 16;
  for (int r = 0; r < kInterleave; ++r) {
    float acc[kC], mins[kC];
    for (int t = 0; t < kC; ++t) acc[t] = mins[t] = 0.0f;
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec = group + b * kRecord;
      const float s = qsimd::HalfAt(rec + 2 * r);
      float m = 0.0f;
      if constexpr (F::kType == QType::kQ4_1) m = qsimd::HalfAt(rec + 32 + 2 * r);
      if constexpr (F::kType == QType::kQ4_0) m = s * -8.0f;
      for (int t = 0; t < kC; ++t) {
        const int8_t* x = xs[t].q + b * 32;
        int32_t dot = 0;
        for (int j = 0; j < kQBytes; ++j) {
          const uint8_t v = rec[kHead + (j / 4) * 64 + 4 * r + j % 4];
          if constexpr (F::kType == QType::kQ8_0) {
            dot += static_cast<int8_t>(v) * x[j];
          } else {
            dot += (v & 0x0f) * x[j] + (v >> 4) * x[j + 16];
          }
        }
        acc[t] = std::fma(static_cast<float>(dot), s * xs[t].d[b], acc[t]);
        if constexpr (F::kType != QType::kQ8_0) mins[t] = std::fma(m, xs[t].c[b], mins[t]);
      }
    }
    for (int t = 0; t < kC; ++t) out[t * kInterleave + r] = acc[t] + mins[t];
  }
}

#if defined(PIJ_QSIMD_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define PIJ_INTERLEAVED_512 1
inline __m512i Broadcast4(const int8_t* p) { return _mm512_set1_epi32(Chunk4(p)); }

template <class F, int kC, int64_t kAhead>
inline void Tile512(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  constexpr int64_t kRecord = kInterleave * F::kBytes;
  constexpr int64_t kHead = InterleavedHead(F::kType);
  __m512 acc[kC], mins[kC];
  for (int t = 0; t < kC; ++t) acc[t] = mins[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* rec = group + b * kRecord;
    if constexpr (kAhead > 0) {
      for (int64_t off = 0; off < kRecord; off += 64) __builtin_prefetch(rec + kAhead + off, 0, 2);
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    const uint8_t* q = rec + kHead;
    if constexpr (F::kType == QType::kQ8_0) {
      // signed weights: |w| times x negated where w < 0 (the sign trick)
      __m512i w[8];
      __mmask64 negative[8];
      for (int c = 0; c < 8; ++c) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        negative[c] = _mm512_movepi8_mask(v);
        w[c] = _mm512_abs_epi8(v);
      }
      for (int t = 0; t < kC; ++t) {
        const int8_t* x = xs[t].q + b * 32;
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
          const __m512i xa = Broadcast4(x + 4 * c), xb = Broadcast4(x + 4 * c + 4);
          d0 = _mm512_dpbusd_epi32(
              d0, w[c], _mm512_mask_sub_epi8(xa, negative[c], _mm512_setzero_si512(), xa));
          d1 = _mm512_dpbusd_epi32(
              d1, w[c + 1],
              _mm512_mask_sub_epi8(xb, negative[c + 1], _mm512_setzero_si512(), xb));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
        acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(xs[t].d[b])), acc[t]);
      }
    } else {
      __m512 m;
      if constexpr (F::kType == QType::kQ4_1) {
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
      } else {
        m = _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
      }
      __m512i lo[4], hi[4];  // weights j and j + 16 of the chunk's bytes
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        lo[c] = _mm512_and_si512(v, low4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      for (int t = 0; t < kC; ++t) {
        const int8_t* x = xs[t].q + b * 32;
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          d0 = _mm512_dpbusd_epi32(d0, lo[c], Broadcast4(x + 4 * c));
          d1 = _mm512_dpbusd_epi32(d1, hi[c], Broadcast4(x + 16 + 4 * c));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
        acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(xs[t].d[b])), acc[t]);
        mins[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t].c[b]), mins[t]);
      }
    }
  }
  for (int t = 0; t < kC; ++t) _mm512_storeu_ps(out + t * kInterleave, _mm512_add_ps(acc[t], mins[t]));
}
#elif defined(PIJ_QSIMD_AVX2)
inline __m256i Broadcast4(const int8_t* p) { return _mm256_set1_epi32(Chunk4(p)); }

// u (unsigned) times x into int16 pairs (vpmaddubsw; the caller keeps the sums in range).
inline __m256i MulPairs(__m256i u, __m256i x) { return _mm256_maddubs_epi16(u, x); }

#if defined(PIJ_QDOT_AVX512VNNI)
inline __m256i DotAccumulate(__m256i acc, __m256i u, __m256i x) {
  return _mm256_dpbusd_epi32(acc, u, x);
}
#elif defined(PIJ_QDOT_AVXVNNI)
inline __m256i DotAccumulate(__m256i acc, __m256i u, __m256i x) {
  return _mm256_dpbusd_avx_epi32(acc, u, x);
}
#endif

// Each half of 8 rows in turn: lanes 8h .. 8h + 7.
template <class F, int kC, int64_t kAhead>
inline void Tile256(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  constexpr int64_t kRecord = kInterleave * F::kBytes;
  constexpr int64_t kHead = InterleavedHead(F::kType);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[kC], mins[kC];
    for (int t = 0; t < kC; ++t) acc[t] = mins[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec = group + b * kRecord;
      if constexpr (kAhead > 0) {
        if (h == 0) {
          for (int64_t off = 0; off < kRecord; off += 64) {
            __builtin_prefetch(rec + kAhead + off, 0, 2);
          }
        }
      }
      const __m256 s =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
      const uint8_t* q = rec + kHead + 32 * h;
      if constexpr (F::kType == QType::kQ8_0) {
        __m256i w[8];
        for (int c = 0; c < 8; ++c) {
          w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
        }
        for (int t = 0; t < kC; ++t) {
          const int8_t* x = xs[t].q + b * 32;
          __m256i dot = _mm256_setzero_si256();
          for (int c = 0; c < 8; ++c) {  // |w| * sign(x, w): pairs up to 2 * 128 * 127
#if defined(PIJ_QDOT_AVX512VNNI) || defined(PIJ_QDOT_AVXVNNI)
            dot = DotAccumulate(dot, _mm256_abs_epi8(w[c]),
                                       _mm256_sign_epi8(Broadcast4(x + 4 * c), w[c]));
#else
            dot = _mm256_add_epi32(
                dot, _mm256_madd_epi16(MulPairs(_mm256_abs_epi8(w[c]),
                                                _mm256_sign_epi8(Broadcast4(x + 4 * c), w[c])),
                                       ones16));
#endif
          }
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                   _mm256_mul_ps(s, _mm256_set1_ps(xs[t].d[b])), acc[t]);
        }
      } else {
        __m256 m;
        if constexpr (F::kType == QType::kQ4_1) {
          m = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + 16 * h)));
        } else {
          m = _mm256_mul_ps(s, _mm256_set1_ps(-8.0f));
        }
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
          lo[c] = _mm256_and_si256(v, low4);
          hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        for (int t = 0; t < kC; ++t) {
          const int8_t* x = xs[t].q + b * 32;
#if defined(PIJ_QDOT_AVX512VNNI) || defined(PIJ_QDOT_AVXVNNI)
          __m256i dot = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c) {
            dot = DotAccumulate(dot, lo[c], Broadcast4(x + 4 * c));
            dot = DotAccumulate(dot, hi[c], Broadcast4(x + 16 + 4 * c));
          }
#else
          // the 8 products' int16 pairs summed: |sum| <= 8 * 2 * 15 * 127 = 30480, no saturation
          __m256i pairs = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c) {
            pairs = _mm256_add_epi16(pairs, MulPairs(lo[c], Broadcast4(x + 4 * c)));
            pairs = _mm256_add_epi16(pairs, MulPairs(hi[c], Broadcast4(x + 16 + 4 * c)));
          }
          const __m256i dot = _mm256_madd_epi16(pairs, ones16);
#endif
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                   _mm256_mul_ps(s, _mm256_set1_ps(xs[t].d[b])), acc[t]);
          mins[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t].c[b]), mins[t]);
        }
      }
    }
    for (int t = 0; t < kC; ++t) {
      _mm256_storeu_ps(out + t * kInterleave + 8 * h, _mm256_add_ps(acc[t], mins[t]));
    }
  }
}
#endif

}  // namespace interleaved_detail

// out[t * 16 + r] = row r of the group . x_t, for kC tokens. group: the group's first record
// (nblocks records). kAhead > 0: each record's bytes kAhead further on are requested as it is
// read (groups read in order, as decode streams a matrix).
template <class F, int kC, int64_t kAhead = 0>
inline void InterleavedTile(const uint8_t* group, int64_t nblocks, const QActView* xs,
                            float* out) {
  static_assert(Interleavable(F::kType), "rows interleaved by 16: Q4_0, Q4_1 and Q8_0 only");
#if defined(PIJ_INTERLEAVED_512)
  interleaved_detail::Tile512<F, kC, kAhead>(group, nblocks, xs, out);
#elif defined(PIJ_QSIMD_AVX2)
  interleaved_detail::Tile256<F, kC, kAhead>(group, nblocks, xs, out);
#else
  interleaved_detail::TileScalar<F, kC>(group, nblocks, xs, out);
#endif
}

// Tokens [t, min(t + kMaxTokens, end)) of xs through one group's tile: out[k * 16 + r] for the
// k-th of them; returns their count. A lone token (end == 1: decode) streams the group's records
// ahead, as decode reads a matrix's groups in order.
template <class F>
inline int64_t InterleavedTokenTile(const uint8_t* group, int64_t nblocks, const QActView* xs,
                                    int64_t t, int64_t end, float* out) {
  const int64_t n = std::min<int64_t>(kMaxTokens, end - t);
  switch (n) {
    case 1:
      if (end == 1) {
        InterleavedTile<F, 1, kStreamAhead>(group, nblocks, xs, out);
      } else {
        InterleavedTile<F, 1>(group, nblocks, xs + t, out);
      }
      break;
    case 2: InterleavedTile<F, 2>(group, nblocks, xs + t, out); break;
    case 3: InterleavedTile<F, 3>(group, nblocks, xs + t, out); break;
    default: InterleavedTile<F, 4>(group, nblocks, xs + t, out); break;
  }
  return n;
}

// The portable path on every build (tests compare the vector paths' bits against it).
template <class F, int kC>
inline void InterleavedTileScalar(const uint8_t* group, int64_t nblocks, const QActView* xs,
                                  float* out) {
  interleaved_detail::TileScalar<F, kC>(group, nblocks, xs, out);
}

}  // namespace pij::qkern

#endif  // PIJ_CPU_BACKEND_QUANT_INTERLEAVED_H_
