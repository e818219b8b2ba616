// The 256-bit integer and float operations the quantized kernels are written in (quant_*.h).
//
// Every quantized format unpacks 32 weights at a time into one vector of 32 bytes (`I8x32`),
// multiplies them with 32 int8 activations into 8 int32 lanes (lane i: bytes 4i .. 4i + 3, so
// lanes 0-3 cover the first 16 weights and lanes 4-7 the last 16), and scales in float (`F32x8`).
// One width for every x86 build: AVX-512 machines run the same 256-bit code, only the integer dot
// instruction differs, except the legacy formats' dots, which take two blocks per 512-bit vector
// there (quant_simd512.h, quant_kernels.h `LegacyDotTile`). Chosen at compile time, like simd.h:
//   AVX-512 VNNI + VL  vpdpbusd on ymm (EVEX)            "avx512vnni"
//   AVX-VNNI           vpdpbusd on ymm (VEX)             "avxvnni"
//   AVX2 + FMA + F16C  vpmaddubsw + vpmaddwd             "avx2"
//   otherwise          portable loops (non-x86 only)     "scalar"
// Unsigned x signed products: the weights are unpacked to u8 (a format's offset, e.g. Q4_0's -8,
// is applied through the activations' block sums), so vpmaddubsw's int16 pair sums cannot
// saturate: every unpacked weight is < 64 (2 * 63 * 127 < 32767) except Q8_0's, which use the
// sign trick (|w| times x with w's sign), at most 2 * 128 * 127. Activations are in [-127, 127].
#ifndef PIJ_CPU_BACKEND_QUANT_SIMD_H_
#define PIJ_CPU_BACKEND_QUANT_SIMD_H_

#include <cstdint>
#include <cstring>

#include "cpu_backend/pij_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PIJ_QSIMD_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PIJ_QDOT_AVX512VNNI 1
#elif defined(__AVXVNNI__)
#define PIJ_QDOT_AVXVNNI 1
#endif
#endif

namespace pij::qsimd {

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(PIJ_QSIMD_AVX2)

using I8x32 = __m256i;  // 32 bytes (u8 or s8)
using I32x8 = __m256i;
using F32x8 = __m256;

inline const char* DotName() {
#if defined(PIJ_QDOT_AVX512VNNI)
  return "avx512vnni";
#elif defined(PIJ_QDOT_AVXVNNI)
  return "avxvnni";
#else
  return "avx2";
#endif
}

inline float HalfToF32(uint16_t bits) { return _cvtsh_ss(bits); }
inline float HalfAt(const uint8_t* p) { return HalfToF32(LoadU16(p)); }

inline I8x32 Load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// [x[0], y[0], x[1], y[1]] from two pairs of floats.
inline __m128 Interleave2(const float* x, const float* y) {
  const __m128 xs = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x)));
  const __m128 ys = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(y)));
  return _mm_unpacklo_ps(xs, ys);
}
inline I8x32 Or(I8x32 a, I8x32 b) { return _mm256_or_si256(a, b); }

// 16 bytes -> 32 values: the 16 low nibbles, then the 16 high nibbles (the legacy 4-bit order).
inline I8x32 Nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

// (b >> shift) & mask in every byte; mask must fit in 8 - shift bits (the 16-bit shift brings
// the neighbouring byte's bits into the top `shift` bits, which the mask clears).
inline I8x32 Field(I8x32 b, int shift, uint8_t mask) {
  return _mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(shift)),
                          _mm256_set1_epi8(static_cast<char>(mask)));
}

// Every byte shifted left by `shift`; its value must stay below 256 (no carry into the next).
inline I8x32 ShiftLeft(I8x32 b, int shift) { return _mm256_sll_epi16(b, _mm_cvtsi32_si128(shift)); }

// Byte j = bit j of `bits` (0 or 1), j in [0, 32).
inline I8x32 Bits32(uint32_t bits) {
  const __m256i v = _mm256_set1_epi32(static_cast<int>(bits));
  // Byte j takes byte j / 8 of the 32-bit value (shuffles stay within 128-bit halves; every half
  // holds the broadcast value, so the upper half reads bytes 2 and 3 at indices 2 and 3).
  const __m256i spread = _mm256_shuffle_epi8(
      v, _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(1));
}

// Sum of u[4i + k] * s[4i + k] over k in every int32 lane i; u unsigned, s signed.
inline I32x8 DotU8S8(I8x32 u, I8x32 s) {
#if defined(PIJ_QDOT_AVX512VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(PIJ_QDOT_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// The same for signed w: |w| times s with w's sign.
inline I32x8 DotS8S8(I8x32 w, I8x32 s) {
  return DotU8S8(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}

inline F32x8 Zero() { return _mm256_setzero_ps(); }
inline F32x8 Set1(float v) { return _mm256_set1_ps(v); }
inline F32x8 Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, F32x8 v) { _mm256_storeu_ps(p, v); }
inline F32x8 Add(F32x8 a, F32x8 b) { return _mm256_add_ps(a, b); }
inline F32x8 Mul(F32x8 a, F32x8 b) { return _mm256_mul_ps(a, b); }
inline F32x8 MulAdd(F32x8 a, F32x8 b, F32x8 c) { return _mm256_fmadd_ps(a, b, c); }
inline F32x8 ToF32(I32x8 v) { return _mm256_cvtepi32_ps(v); }
inline float ReduceSum(F32x8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Lane i of the result = lane idx[i] of v.
inline F32x8 Permute(F32x8 v, I32x8 idx) { return _mm256_permutevar8x32_ps(v, idx); }
// Lanes 0-3 = lane 2j of v, lanes 4-7 = lane 2j + 1: chunk j's two 16-weight scales.
inline F32x8 PairSpread(F32x8 v, int j) {
  return Permute(v, _mm256_add_epi32(_mm256_set1_epi32(2 * j),
                                     _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
}
// Lanes 2i and 2i + 1 = lane i + 4 * hi of v (8 values spread over 16 halves).
inline F32x8 Duplicate(F32x8 v, int hi) {
  return Permute(v, _mm256_add_epi32(_mm256_set1_epi32(4 * hi),
                                     _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
}
// 8 bytes at p as floats.
inline F32x8 U8ToF32(const uint8_t* p) {
  return ToF32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 f16 values at p as floats.
inline F32x8 HalvesToF32(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline F32x8 S8ToF32(const int8_t* p) {
  return ToF32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Bytes 8 * part .. 8 * part + 7 of v (unsigned, or signed if kSigned) as floats.
template <bool kSigned>
inline F32x8 BytesToF32(I8x32 v, int part) {
  __m128i h = part < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  if (part & 1) h = _mm_srli_si128(h, 8);
  return ToF32(kSigned ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
}

#else  // portable loops: the same operations, lane by lane

struct I8x32 {
  uint8_t v[32];
};
struct I32x8 {
  int32_t v[8];
};
struct F32x8 {
  float v[8];
};

inline const char* DotName() { return "scalar"; }

inline float HalfToF32(uint16_t bits) { return ToF32(F16{bits}); }
inline float HalfAt(const uint8_t* p) { return HalfToF32(LoadU16(p)); }

inline I8x32 Load32(const uint8_t* p) {
  I8x32 r;
  std::memcpy(r.v, p, 32);
  return r;
}
inline I8x32 Load32(const int8_t* p) { return Load32(reinterpret_cast<const uint8_t*>(p)); }
inline I8x32 Or(I8x32 a, I8x32 b) {
  for (int i = 0; i < 32; ++i) a.v[i] |= b.v[i];
  return a;
}
inline I8x32 Nibbles16(const uint8_t* p) {
  I8x32 r;
  for (int i = 0; i < 16; ++i) {
    r.v[i] = p[i] & 0x0f;
    r.v[i + 16] = p[i] >> 4;
  }
  return r;
}
inline I8x32 Field(I8x32 b, int shift, uint8_t mask) {
  for (uint8_t& e : b.v) e = static_cast<uint8_t>((e >> shift) & mask);
  return b;
}
inline I8x32 ShiftLeft(I8x32 b, int shift) {
  for (uint8_t& e : b.v) e = static_cast<uint8_t>(e << shift);
  return b;
}
inline I8x32 Bits32(uint32_t bits) {
  I8x32 r;
  for (int i = 0; i < 32; ++i) r.v[i] = static_cast<uint8_t>((bits >> i) & 1u);
  return r;
}
inline I32x8 DotU8S8(I8x32 u, I8x32 s) {
  I32x8 r;
  for (int i = 0; i < 8; ++i) {
    int32_t acc = 0;
    for (int k = 0; k < 4; ++k) {
      acc += int32_t{u.v[4 * i + k]} * static_cast<int8_t>(s.v[4 * i + k]);
    }
    r.v[i] = acc;
  }
  return r;
}
inline I32x8 DotS8S8(I8x32 w, I8x32 s) {
  I32x8 r;
  for (int i = 0; i < 8; ++i) {
    int32_t acc = 0;
    for (int k = 0; k < 4; ++k) {
      acc += int32_t{static_cast<int8_t>(w.v[4 * i + k])} * static_cast<int8_t>(s.v[4 * i + k]);
    }
    r.v[i] = acc;
  }
  return r;
}

inline F32x8 Zero() { return F32x8{}; }
inline F32x8 Set1(float v) {
  F32x8 r;
  for (float& e : r.v) e = v;
  return r;
}
inline F32x8 Load(const float* p) {
  F32x8 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void Store(float* p, F32x8 v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline F32x8 Add(F32x8 a, F32x8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline F32x8 Mul(F32x8 a, F32x8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F32x8 MulAdd(F32x8 a, F32x8 b, F32x8 c) {
  for (int i = 0; i < 8; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i];
  return c;
}
inline F32x8 ToF32(I32x8 v) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(v.v[i]);
  return r;
}
inline float ReduceSum(F32x8 v) {
  return ((v.v[0] + v.v[4]) + (v.v[2] + v.v[6])) + ((v.v[1] + v.v[5]) + (v.v[3] + v.v[7]));
}
inline F32x8 PairSpread(F32x8 v, int j) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = v.v[2 * j + i / 4];
  return r;
}
inline F32x8 Duplicate(F32x8 v, int hi) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = v.v[4 * hi + i / 2];
  return r;
}
inline F32x8 U8ToF32(const uint8_t* p) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
inline F32x8 HalvesToF32(const uint8_t* p) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = HalfAt(p + 2 * i);
  return r;
}
inline F32x8 S8ToF32(const int8_t* p) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
template <bool kSigned>
inline F32x8 BytesToF32(I8x32 v, int part) {
  F32x8 r;
  for (int i = 0; i < 8; ++i) {
    const uint8_t b = v.v[8 * part + i];
    r.v[i] = kSigned ? static_cast<float>(static_cast<int8_t>(b)) : static_cast<float>(b);
  }
  return r;
}

#endif

}  // namespace pij::qsimd

#endif  // PIJ_CPU_BACKEND_QUANT_SIMD_H_
