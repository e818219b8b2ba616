// Matrix rows interleaved by 16 for the decode matvec: the layout ops.qlinear reads fastest.
//
// A row-major GGUF matrix [O, nblocks] of blocks (Q4_0, Q4_1, Q8_0: 32 weights; Q4_K, Q6_K: 256),
// O a multiple of 16, is stored as records, one per (group of 16 rows g, block b), in the order
// (g, b). A block is a sequence of fields in the file's order, each of a width per format
// (RecordFields): f16 scales and minimums 2 bytes, quants in chunks of 4 bytes, Q4_K's packed
// 6-bit scales in 4-byte words, Q6_K's int8 scales 1 byte; the record holds each field of the 16
// rows as one plane, planes in the field order, row r at width * r. So for the 32-weight formats:
// the 16 rows' f16 scales (32 bytes), for Q4_1 their f16 minimums (32 bytes), then the quants,
// chunk c holding bytes [4c, 4c + 4) of every row's packed quants, row r at 4r (64 bytes a chunk).
// A record is 16 times the file's block, so the matrix keeps its size (checkpoint/quants.py
// `interleave` writes it, and knows the same map byte for byte).
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
// The K-quants (activations quantized per 256, sums per 16): the super-block's sub-block dots
// times their integer scales summed in int32 (exact: |sum| < 2^31), then
// acc = fma(float(sum), d * d_x, acc); the minimums per sub-block in turn, m_j = float(min_j) *
// -dmin (Q4_K) or float(sc_g) * (d * -32) (Q6_K's offset), mins = fma(m_j, c16, mins) once per
// 16 activations. Prefill runs 4 tokens per pass over a record, as for the 32-weight formats
// (the file's rows took ~3.5x longer per weight there: a horizontal sum and a float scale per
// 32 weights and token).
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

constexpr bool Interleavable(QType t) {
  return t == QType::kQ4_0 || t == QType::kQ4_1 || t == QType::kQ5_0 || t == QType::kQ5_1 ||
         t == QType::kQ8_0 || t == QType::kQ4_K || t == QType::kQ5_K || t == QType::kQ6_K;
}

// Whether a matrix of `rows` rows in t has the layout (checkpoint/quants.py `can_interleave`).
constexpr bool CanInterleave(QType t, int64_t rows) {
  return Interleavable(t) && rows > 0 && rows % kInterleave == 0;
}

// Bytes of a 32-weight format's record before its quants: scales, minimums (Q4_1, Q5_1), the
// 5-bit formats' high bits (a 4-byte word a row, the plane just before the quants).
constexpr int64_t InterleavedHead(QType t) {
  switch (t) {
    case QType::kQ4_1: return 64;
    case QType::kQ5_0: return 96;
    case QType::kQ5_1: return 128;
    default: return 32;
  }
}
// The 5-bit formats: weight j's fifth bit is bit j of the block's 32-bit qh word.
constexpr bool FiveBit(QType t) { return t == QType::kQ5_0 || t == QType::kQ5_1; }
// The minimum's ratio to the scale where it is fixed (Q4_0: -8, Q5_0: -16), else 0.
constexpr float FixedMin(QType t) {
  return t == QType::kQ4_0 ? -8.0f : t == QType::kQ5_0 ? -16.0f : 0.0f;
}
constexpr bool StoredMin(QType t) { return t == QType::kQ4_1 || t == QType::kQ5_1; }

// A block's fields, in the file's order: `bytes` bytes of fields `width` bytes wide (module doc).
struct FieldRun {
  int bytes, width;
};
struct RecordFields {
  FieldRun runs[4];
  int n;
};
constexpr RecordFields Fields(QType t) {
  switch (t) {
    case QType::kQ4_0: return {{{2, 2}, {16, 4}}, 2};
    case QType::kQ4_1: return {{{4, 2}, {16, 4}}, 2};
    case QType::kQ5_0: return {{{2, 2}, {20, 4}}, 2};  // d; the high bits' word, 4 chunks
    case QType::kQ5_1: return {{{4, 2}, {20, 4}}, 2};
    case QType::kQ8_0: return {{{2, 2}, {32, 4}}, 2};
    case QType::kQ4_K: return {{{4, 2}, {140, 4}}, 2};  // d, dmin; 3 scale words, 32 chunks
    case QType::kQ5_K: return {{{4, 2}, {172, 4}}, 2};  // and 8 chunks of high bits
    case QType::kQ6_K: return {{{192, 4}, {16, 1}, {2, 2}}, 3};  // ql, qh; scales; d
    default: return {{}, 0};
  }
}

// Byte offsets of the K-quants' planes in a record (16 rows x the fields above).
namespace k4 {  // Q4_K: d, dmin, scale words w0 w1 w2, 32 chunks of quants
constexpr int64_t kD = 0, kDmin = 32, kWords = 64, kQs = 256, kRecord = 2304;
}
namespace k5 {  // Q5_K: as Q4_K, the high bits' 8 chunks before the quants
constexpr int64_t kD = 0, kDmin = 32, kWords = 64, kQh = 256, kQs = 768, kRecord = 2816;
}
namespace k6 {  // Q6_K: 32 chunks of low nibbles, 16 of high bits, 16 scale planes, d
constexpr int64_t kQl = 0, kQh = 2048, kSc = 3072, kD = 3328, kRecord = 3360;
}

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
      if constexpr (StoredMin(F::kType)) m = qsimd::HalfAt(rec + 32 + 2 * r);
      if constexpr (FixedMin(F::kType) != 0.0f) m = s * FixedMin(F::kType);
      uint32_t qh = 0;
      if constexpr (FiveBit(F::kType)) std::memcpy(&qh, rec + kHead - 64 + 4 * r, 4);
      for (int t = 0; t < kC; ++t) {
        const int8_t* x = xs[t].q + b * 32;
        int32_t dot = 0;
        for (int j = 0; j < kQBytes; ++j) {
          const uint8_t v = rec[kHead + (j / 4) * 64 + 4 * r + j % 4];
          if constexpr (F::kType == QType::kQ8_0) {
            dot += static_cast<int8_t>(v) * x[j];
          } else {
            const int lo = (v & 0x0f) | static_cast<int>(((qh >> j) & 1) << 4);
            const int hi = (v >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
            dot += lo * x[j] + hi * x[j + 16];
          }
        }
        acc[t] = std::fma(static_cast<float>(dot), s * xs[t].d[b], acc[t]);
        if constexpr (F::kType != QType::kQ8_0) mins[t] = std::fma(m, xs[t].c[b], mins[t]);
      }
    }
    for (int t = 0; t < kC; ++t) out[t * kInterleave + r] = acc[t] + mins[t];
  }
}

// ---------------------------------------------------------------------------------------------
// The K-quants' records (module doc). Scalar first: the arithmetic every vector path keeps.

// Q4_K's 6-bit scale and minimum of sub-block j from a row's three scale words (llama.cpp's
// packing: sc[0..3] = w0 & 63, m[0..3] = w1 & 63 bytewise; sc[4..7] = (w2 & 15) | (w0 >> 6) << 4,
// m[4..7] = (w2 >> 4) | (w1 >> 6) << 4).
inline int K4Scale(uint32_t w0, uint32_t w2, int j) {
  if (j < 4) return static_cast<int>((w0 >> (8 * j)) & 63);
  const int i = 8 * (j - 4);
  return static_cast<int>(((w2 >> i) & 15) | (((w0 >> (i + 6)) & 3) << 4));
}
inline int K4Min(uint32_t w1, uint32_t w2, int j) {
  if (j < 4) return static_cast<int>((w1 >> (8 * j)) & 63);
  const int i = 8 * (j - 4);
  return static_cast<int>(((w2 >> (i + 4)) & 15) | (((w1 >> (i + 6)) & 3) << 4));
}

// Q4_K and Q5_K (kFive: the fifth bits' 8 chunks, bit 2k + (0 | 1) of byte l for weight l of
// sub-block 2k | 2k + 1).
template <int kC, bool kFive>
inline void K4TileScalar(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  constexpr int64_t kRecord = kFive ? k5::kRecord : k4::kRecord;
  constexpr int64_t kQs = kFive ? k5::kQs : k4::kQs;
  for (int r = 0; r < kInterleave; ++r) {
    float acc[kC], mins[kC];
    for (int t = 0; t < kC; ++t) acc[t] = mins[t] = 0.0f;
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec = group + b * kRecord;
      const float d = qsimd::HalfAt(rec + k4::kD + 2 * r);
      const float negdmin = qsimd::HalfAt(rec + k4::kDmin + 2 * r) * -1.0f;
      uint32_t w[3];
      for (int k = 0; k < 3; ++k) std::memcpy(&w[k], rec + k4::kWords + 64 * k + 4 * r, 4);
      for (int t = 0; t < kC; ++t) {
        const int8_t* x = xs[t].q + b * 256;
        int32_t sum = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t dot = 0;
          for (int i = 0; i < 32; ++i) {
            const uint8_t v = rec[kQs + 64 * (8 * (j / 2) + i / 4) + 4 * r + i % 4];
            int u = j % 2 == 0 ? v & 0x0f : v >> 4;
            if constexpr (kFive) u |= ((rec[k5::kQh + 64 * (i / 4) + 4 * r + i % 4] >> j) & 1) << 4;
            dot += u * x[32 * j + i];
          }
          sum += dot * K4Scale(w[0], w[2], j);
        }
        acc[t] = std::fma(static_cast<float>(sum), d * xs[t].d[b], acc[t]);
        const float* c = xs[t].c + b * 16;
        for (int j = 0; j < 8; ++j) {
          const float m = static_cast<float>(K4Min(w[1], w[2], j)) * negdmin;
          mins[t] = std::fma(m, c[2 * j], mins[t]);
          mins[t] = std::fma(m, c[2 * j + 1], mins[t]);
        }
      }
    }
    for (int t = 0; t < kC; ++t) out[t * kInterleave + r] = acc[t] + mins[t];
  }
}

// Q6_K weight w (< 256) of row r: its 6-bit code (0 .. 63; the weight is d * sc * (code - 32)).
inline int K6Code(const uint8_t* rec, int r, int w) {
  const int n = w / 128, q = (w % 128) / 32, l = w % 32;
  const int p = 64 * n + 32 * (q & 1) + l, h = 32 * n + l;
  const uint8_t lo = rec[k6::kQl + 64 * (p / 4) + 4 * r + p % 4];
  const uint8_t hi = rec[k6::kQh + 64 * (h / 4) + 4 * r + h % 4];
  return (q < 2 ? lo & 0x0f : lo >> 4) | (((hi >> (2 * q)) & 3) << 4);
}

template <int kC>
inline void K6TileScalar(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  for (int r = 0; r < kInterleave; ++r) {
    float acc[kC], mins[kC];
    for (int t = 0; t < kC; ++t) acc[t] = mins[t] = 0.0f;
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec = group + b * k6::kRecord;
      const float d = qsimd::HalfAt(rec + k6::kD + 2 * r);
      const float dm = d * -32.0f;
      for (int t = 0; t < kC; ++t) {
        const int8_t* x = xs[t].q + b * 256;
        int32_t sum = 0;
        for (int g = 0; g < 16; ++g) {
          int32_t dot = 0;
          for (int w = 16 * g; w < 16 * g + 16; ++w) dot += K6Code(rec, r, w) * x[w];
          sum += dot * static_cast<int8_t>(rec[k6::kSc + 16 * g + r]);
        }
        acc[t] = std::fma(static_cast<float>(sum), d * xs[t].d[b], acc[t]);
        const float* c = xs[t].c + b * 16;
        for (int g = 0; g < 16; ++g) {
          const float m = static_cast<float>(static_cast<int8_t>(rec[k6::kSc + 16 * g + r])) * dm;
          mins[t] = std::fma(m, c[g], mins[t]);
        }
      }
    }
    for (int t = 0; t < kC; ++t) out[t * kInterleave + r] = acc[t] + mins[t];
  }
}

#if defined(PIJ_QSIMD_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define PIJ_INTERLEAVED_512 1
inline __m512i Broadcast4(const int8_t* p) { return _mm512_set1_epi32(Chunk4(p)); }
// Bits 0-3 of each lane to bit 4 of its bytes 0-3 (the multiply puts bit k at 8k: no carries).
inline __m512i FifthBits512(__m512i v) {
  const __m512i spread = _mm512_mullo_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)),
                                            _mm512_set1_epi32(0x00204081));
  return _mm512_slli_epi32(_mm512_and_si512(spread, _mm512_set1_epi32(0x01010101)), 4);
}

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
      if constexpr (StoredMin(F::kType)) {
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
      } else {
        m = _mm512_mul_ps(s, _mm512_set1_ps(FixedMin(F::kType)));
      }
      __m512i lo[4], hi[4];  // weights j and j + 16 of the chunk's bytes
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(q + 64 * c);
        lo[c] = _mm512_and_si512(v, low4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (FiveBit(F::kType)) {
        const __m512i qh = _mm512_loadu_si512(rec + kHead - 64);
        for (int c = 0; c < 4; ++c) {
          lo[c] = _mm512_or_si512(lo[c], FifthBits512(_mm512_srli_epi32(qh, 4 * c)));
          hi[c] = _mm512_or_si512(hi[c], FifthBits512(_mm512_srli_epi32(qh, 16 + 4 * c)));
        }
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
  for (int t = 0; t < kC; ++t) {
    _mm512_storeu_ps(out + t * kInterleave, _mm512_add_ps(acc[t], mins[t]));
  }
}
// The vector primitives the width-generic tiles below take (K4Tile): 16 rows a vector.
struct V512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16;
  static I Load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I Zero() { return _mm512_setzero_si512(); }
  static I Set8(char v) { return _mm512_set1_epi8(v); }
  static I Set32(int v) { return _mm512_set1_epi32(v); }
  static I And(I a, I b) { return _mm512_and_si512(a, b); }
  static I Or(I a, I b) { return _mm512_or_si512(a, b); }
  static I Srl16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I Sll16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I Srl32(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I Sll32(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I Add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I Mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I Dot(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }  // u unsigned
  static I Bcast4(const int8_t* p) { return Broadcast4(p); }
  static F ZeroF() { return _mm512_setzero_ps(); }
  static F SetF(float v) { return _mm512_set1_ps(v); }
  static F ToF(I a) { return _mm512_cvtepi32_ps(a); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Halves(const uint8_t* p) {  // kLanes float16
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I Int8s(const uint8_t* p) {  // kLanes int8, sign-extended to int32
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void Store(float* p, F a) { _mm512_storeu_ps(p, a); }
};

#elif defined(PIJ_QSIMD_AVX2)
inline __m256i Broadcast4(const int8_t* p) { return _mm256_set1_epi32(Chunk4(p)); }
inline __m256i FifthBits256(__m256i v) {  // as FifthBits512
  const __m256i spread = _mm256_mullo_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)),
                                            _mm256_set1_epi32(0x00204081));
  return _mm256_slli_epi32(_mm256_and_si256(spread, _mm256_set1_epi32(0x01010101)), 4);
}

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
        if constexpr (StoredMin(F::kType)) {
          m = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + 16 * h)));
        } else {
          m = _mm256_mul_ps(s, _mm256_set1_ps(FixedMin(F::kType)));
        }
        __m256i lo[4], hi[4];
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
          lo[c] = _mm256_and_si256(v, low4);
          hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        if constexpr (FiveBit(F::kType)) {
          const __m256i qh =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kHead - 64 + 32 * h));
          for (int c = 0; c < 4; ++c) {
            lo[c] = _mm256_or_si256(lo[c], FifthBits256(_mm256_srli_epi32(qh, 4 * c)));
            hi[c] = _mm256_or_si256(hi[c], FifthBits256(_mm256_srli_epi32(qh, 16 + 4 * c)));
          }
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
          // the 8 products' int16 pairs summed: |sum| <= 8 * 2 * 15 * 127 = 30480, no saturation;
          // 5-bit codes (<= 31) go to int32 every chunk (2 * 2 * 31 * 127 = 15748)
          __m256i pairs = _mm256_setzero_si256(), dot = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c) {
            pairs = _mm256_add_epi16(pairs, MulPairs(lo[c], Broadcast4(x + 4 * c)));
            pairs = _mm256_add_epi16(pairs, MulPairs(hi[c], Broadcast4(x + 16 + 4 * c)));
            if constexpr (FiveBit(F::kType)) {
              dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones16));
              pairs = _mm256_setzero_si256();
            }
          }
          if constexpr (!FiveBit(F::kType)) dot = _mm256_madd_epi16(pairs, ones16);
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
// The K-quants on 8 lanes: each half of 8 rows in turn (lanes 8h .. 8h + 7), the planes' bytes of
// rows 8h .. at width * 8h.
inline __m256i KDot256(__m256i acc, __m256i u, __m256i x) {
#if defined(PIJ_QDOT_AVX512VNNI) || defined(PIJ_QDOT_AVXVNNI)
  return DotAccumulate(acc, u, x);
#else  // u <= 63: a pair of products fits int16 (2 * 63 * 127)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(MulPairs(u, x), _mm256_set1_epi16(1)));
#endif
}
inline __m256i Load8x32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256 Halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The vector primitives the width-generic tiles below take (K4Tile): 8 rows a vector, each half
// of a group in turn.
struct V256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8;
  static I Load(const uint8_t* p) { return Load8x32(p); }
  static I Zero() { return _mm256_setzero_si256(); }
  static I Set8(char v) { return _mm256_set1_epi8(v); }
  static I Set32(int v) { return _mm256_set1_epi32(v); }
  static I And(I a, I b) { return _mm256_and_si256(a, b); }
  static I Or(I a, I b) { return _mm256_or_si256(a, b); }
  static I Srl16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I Sll16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I Srl32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I Sll32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I Add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I Mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I Dot(I acc, I u, I x) { return KDot256(acc, u, x); }  // u unsigned, <= 63
  static I Bcast4(const int8_t* p) { return Broadcast4(p); }
  static F ZeroF() { return _mm256_setzero_ps(); }
  static F SetF(float v) { return _mm256_set1_ps(v); }
  static F ToF(I a) { return _mm256_cvtepi32_ps(a); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Halves(const uint8_t* p) { return Halves8(p); }  // kLanes float16
  static I Int8s(const uint8_t* p) {  // kLanes int8, sign-extended to int32
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void Store(float* p, F a) { _mm256_storeu_ps(p, a); }
};

#endif

#if defined(PIJ_INTERLEAVED_512) || defined(PIJ_QSIMD_AVX2)
// Q4_K / Q5_K, written once for a vector width V (V512: the group's 16 rows in one vector; V256:
// each half of 8 rows in turn, lanes kLanes * h ..). Per sub-block pair (32 quant bytes a row:
// 8 chunks) the low nibbles are sub-block 2k, the high ones 2k + 1; the 6-bit scales and mins
// of sub-block j unpacked from the scale words w0 w1 w2 (as llama.cpp's get_scale_min_k4).
template <class V>
inline typename V::I K4Scale(typename V::I w0, typename V::I w2, int j) {
  const auto k63 = V::Set32(63), k15 = V::Set32(15), k3 = V::Set32(3);
  if (j < 4) return V::And(V::Srl32(w0, 8 * j), k63);
  const int i = 8 * (j - 4);
  return V::Or(V::And(V::Srl32(w2, i), k15), V::Sll32(V::And(V::Srl32(w0, i + 6), k3), 4));
}
template <class V>
inline typename V::I K4Min(typename V::I w1, typename V::I w2, int j) {
  const auto k63 = V::Set32(63), k15 = V::Set32(15), k3 = V::Set32(3);
  if (j < 4) return V::And(V::Srl32(w1, 8 * j), k63);
  const int i = 8 * (j - 4);
  return V::Or(V::And(V::Srl32(w2, i + 4), k15), V::Sll32(V::And(V::Srl32(w1, i + 6), k3), 4));
}
// Bit `bit` of each byte to bit 4 (its fifth bit).
template <class V>
inline typename V::I BitTo4(typename V::I v, int bit) {
  return V::And(bit <= 4 ? V::Sll16(v, 4 - bit) : V::Srl16(v, bit - 4), V::Set8(0x10));
}

template <class V, int kC, int64_t kAhead, bool kFive>
inline void K4Tile(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t kRecord = kFive ? k5::kRecord : k4::kRecord;
  constexpr int64_t kQs = kFive ? k5::kQs : k4::kQs;
  const I low4 = V::Set8(0x0f);
  for (int h = 0; h < kInterleave / V::kLanes; ++h) {
    const int64_t lane4 = 4 * V::kLanes * h, lane2 = 2 * V::kLanes * h;  // this half's bytes
    F acc[kC], mins[kC];
    for (int t = 0; t < kC; ++t) acc[t] = mins[t] = V::ZeroF();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec = group + b * kRecord;
      if constexpr (kAhead > 0) {
        if (h == 0) {
          for (int64_t off = 0; off < kRecord; off += 64) {
            __builtin_prefetch(rec + kAhead + off, 0, 2);
          }
        }
      }
      const I w0 = V::Load(rec + k4::kWords + lane4);
      const I w1 = V::Load(rec + k4::kWords + 64 + lane4);
      const I w2 = V::Load(rec + k4::kWords + 128 + lane4);
      I sum[kC];
      for (int t = 0; t < kC; ++t) sum[t] = V::Zero();
      for (int k = 0; k < 4; ++k) {
        I lo[8], hi[8];
        for (int c = 0; c < 8; ++c) {
          const I v = V::Load(rec + kQs + 64 * (8 * k + c) + lane4);
          lo[c] = V::And(v, low4);
          hi[c] = V::And(V::Srl16(v, 4), low4);
          if constexpr (kFive) {
            const I hb = V::Load(rec + k5::kQh + 64 * c + lane4);
            lo[c] = V::Or(lo[c], BitTo4<V>(hb, 2 * k));
            hi[c] = V::Or(hi[c], BitTo4<V>(hb, 2 * k + 1));
          }
        }
        const I s_lo = K4Scale<V>(w0, w2, 2 * k), s_hi = K4Scale<V>(w0, w2, 2 * k + 1);
        for (int t = 0; t < kC; ++t) {
          const int8_t* x = xs[t].q + b * 256 + 64 * k;
          I d0 = V::Zero(), d1 = V::Zero();
          for (int c = 0; c < 8; ++c) {
            d0 = V::Dot(d0, lo[c], V::Bcast4(x + 4 * c));
            d1 = V::Dot(d1, hi[c], V::Bcast4(x + 32 + 4 * c));
          }
          sum[t] = V::Add32(sum[t], V::Add32(V::Mul32(d0, s_lo), V::Mul32(d1, s_hi)));
        }
      }
      const F d = V::Halves(rec + k4::kD + lane2);
      const F negdmin = V::Mul(V::Halves(rec + k4::kDmin + lane2), V::SetF(-1.0f));
      for (int t = 0; t < kC; ++t) {
        acc[t] = V::Fma(V::ToF(sum[t]), V::Mul(d, V::SetF(xs[t].d[b])), acc[t]);
      }
      for (int j = 0; j < 8; ++j) {
        const F m = V::Mul(V::ToF(K4Min<V>(w1, w2, j)), negdmin);
        for (int t = 0; t < kC; ++t) {
          const float* c = xs[t].c + b * 16 + 2 * j;
          mins[t] = V::Fma(m, V::SetF(c[0]), mins[t]);
          mins[t] = V::Fma(m, V::SetF(c[1]), mins[t]);
        }
      }
    }
    for (int t = 0; t < kC; ++t) {
      V::Store(out + t * kInterleave + V::kLanes * h, V::Add(acc[t], mins[t]));
    }
  }
}

// Q6_K (written once for both widths, as K4Tile): per half n and quarter kk, chunks i < 4 of
// the low nibbles A (bytes 64n + 16kk + 4i), B (+ 32) and the high bits H (32n + 16kk + 4i)
// give the codes of four 16-weight groups:
// q0 = A lo | H bits 0-1, q1 = B lo | bits 2-3, q2 = A hi | bits 4-5, q3 = B hi | bits 6-7
// (weights 128n + 32q + 16kk + 4i ..; group 8n + 2q + kk).
template <class V, int kC, int64_t kAhead>
inline void K6Tile(const uint8_t* group, int64_t nblocks, const QActView* xs, float* out) {
  using I = typename V::I;
  using F = typename V::F;
  const I low4 = V::Set8(0x0f), bits45 = V::Set8(0x30);
  for (int h = 0; h < kInterleave / V::kLanes; ++h) {
    const int64_t lane4 = 4 * V::kLanes * h, lane2 = 2 * V::kLanes * h, lane1 = V::kLanes * h;
    F acc[kC], mins[kC];
    for (int t = 0; t < kC; ++t) acc[t] = mins[t] = V::ZeroF();
    for (int64_t b = 0; b < nblocks; ++b) {
      const uint8_t* rec = group + b * k6::kRecord;
      if constexpr (kAhead > 0) {
        if (h == 0) {
          for (int64_t off = 0; off < k6::kRecord; off += 64) {
            __builtin_prefetch(rec + kAhead + off, 0, 2);
          }
        }
      }
      I sum[kC];
      for (int t = 0; t < kC; ++t) sum[t] = V::Zero();
      for (int n = 0; n < 2; ++n) {
        for (int kk = 0; kk < 2; ++kk) {
          I u[4][4];
          for (int i = 0; i < 4; ++i) {
            const I A = V::Load(rec + k6::kQl + 64 * (16 * n + 4 * kk + i) + lane4);
            const I B = V::Load(rec + k6::kQl + 64 * (16 * n + 8 + 4 * kk + i) + lane4);
            const I H = V::Load(rec + k6::kQh + 64 * (8 * n + 4 * kk + i) + lane4);
            u[0][i] = V::Or(V::And(A, low4), V::And(V::Sll16(H, 4), bits45));
            u[1][i] = V::Or(V::And(B, low4), V::And(V::Sll16(H, 2), bits45));
            u[2][i] = V::Or(V::And(V::Srl16(A, 4), low4), V::And(H, bits45));
            u[3][i] = V::Or(V::And(V::Srl16(B, 4), low4), V::And(V::Srl16(H, 2), bits45));
          }
          I sc[4];
          for (int q = 0; q < 4; ++q) {
            sc[q] = V::Int8s(rec + k6::kSc + 16 * (8 * n + 2 * q + kk) + lane1);
          }
          for (int t = 0; t < kC; ++t) {
            const int8_t* x = xs[t].q + b * 256 + 128 * n + 16 * kk;
            for (int q = 0; q < 4; ++q) {
              I dot = V::Zero();
              for (int i = 0; i < 4; ++i) {
                dot = V::Dot(dot, u[q][i], V::Bcast4(x + 32 * q + 4 * i));
              }
              sum[t] = V::Add32(sum[t], V::Mul32(dot, sc[q]));
            }
          }
        }
      }
      const F d = V::Halves(rec + k6::kD + lane2);
      const F dm = V::Mul(d, V::SetF(-32.0f));
      for (int t = 0; t < kC; ++t) {
        acc[t] = V::Fma(V::ToF(sum[t]), V::Mul(d, V::SetF(xs[t].d[b])), acc[t]);
      }
      for (int g = 0; g < 16; ++g) {
        const F m = V::Mul(V::ToF(V::Int8s(rec + k6::kSc + 16 * g + lane1)), dm);
        for (int t = 0; t < kC; ++t) {
          mins[t] = V::Fma(m, V::SetF(xs[t].c[b * 16 + g]), mins[t]);
        }
      }
    }
    for (int t = 0; t < kC; ++t) {
      V::Store(out + t * kInterleave + V::kLanes * h, V::Add(acc[t], mins[t]));
    }
  }
}
#endif

}  // namespace interleaved_detail

// The portable path on every build (tests compare the vector paths' bits against it).
template <class F, int kC>
inline void InterleavedTileScalar(const uint8_t* group, int64_t nblocks, const QActView* xs,
                                  float* out) {
  if constexpr (F::kType == QType::kQ4_K || F::kType == QType::kQ5_K) {
    interleaved_detail::K4TileScalar<kC, F::kType == QType::kQ5_K>(group, nblocks, xs, out);
  } else if constexpr (F::kType == QType::kQ6_K) {
    interleaved_detail::K6TileScalar<kC>(group, nblocks, xs, out);
  } else {
    interleaved_detail::TileScalar<F, kC>(group, nblocks, xs, out);
  }
}

// out[t * 16 + r] = row r of the group . x_t, for kC tokens. group: the group's first record
// (nblocks records). kAhead > 0: each record's bytes kAhead further on are requested as it is
// read (groups read in order, as decode streams a matrix).
template <class F, int kC, int64_t kAhead = 0>
inline void InterleavedTile(const uint8_t* group, int64_t nblocks, const QActView* xs,
                            float* out) {
  static_assert(Interleavable(F::kType), "rows interleaved by 16: not in this format");
  namespace d = interleaved_detail;
#if defined(PIJ_INTERLEAVED_512)
  if constexpr (F::kType == QType::kQ4_K || F::kType == QType::kQ5_K) {
    d::K4Tile<d::V512, kC, kAhead, F::kType == QType::kQ5_K>(group, nblocks, xs, out);
  } else if constexpr (F::kType == QType::kQ6_K) {
    d::K6Tile<d::V512, kC, kAhead>(group, nblocks, xs, out);
  } else {
    d::Tile512<F, kC, kAhead>(group, nblocks, xs, out);
  }
#elif defined(PIJ_QSIMD_AVX2)
  if constexpr (F::kType == QType::kQ4_K || F::kType == QType::kQ5_K) {
    d::K4Tile<d::V256, kC, kAhead, F::kType == QType::kQ5_K>(group, nblocks, xs, out);
  } else if constexpr (F::kType == QType::kQ6_K) {
    d::K6Tile<d::V256, kC, kAhead>(group, nblocks, xs, out);
  } else {
    d::Tile256<F, kC, kAhead>(group, nblocks, xs, out);
  }
#else
  InterleavedTileScalar<F, kC>(group, nblocks, xs, out);
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


}  // namespace pij::qkern

#endif  // PIJ_CPU_BACKEND_QUANT_INTERLEAVED_H_
