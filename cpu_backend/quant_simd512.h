// The 512-bit operations of the legacy formats' decode dots (quant_kernels.h `LegacyDotTile`):
// two 32-weight blocks per vector, where the 256-bit path takes one. Only built where the
// compiler targets AVX-512 (F, BW, VL, DQ); vpdpbusd with VNNI, vpmaddubsw + vpmaddwd without.
#ifndef PIJ_CPU_BACKEND_QUANT_SIMD512_H_
#define PIJ_CPU_BACKEND_QUANT_SIMD512_H_

#include "cpu_backend/quant_simd.h"

#if defined(PIJ_QSIMD_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PIJ_QSIMD_AVX512 1

namespace pij::qsimd512 {

using I8x64 = __m512i;
using F32x16 = __m512;

// [a, b]: a in bytes 0-31, b in bytes 32-63.
inline I8x64 Pair(__m256i a, __m256i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// Sum of u[4i + k] * s[4i + k] over k in every int32 lane i; u unsigned, s signed.
inline __m512i DotU8S8(I8x64 u, I8x64 s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
// The same for signed w: |w| times s negated where w < 0 (AVX-512 has no vpsignb).
inline __m512i DotS8S8(I8x64 w, I8x64 s) {
  const __mmask64 negative = _mm512_movepi8_mask(w);
  return DotU8S8(_mm512_abs_epi8(w),
                 _mm512_mask_sub_epi8(s, negative, _mm512_setzero_si512(), s));
}

// Two blocks' 16 packed bytes -> 64 values in the legacy 4-bit order: block a's 16 low nibbles,
// its 16 high nibbles, then block b's (what Nibbles16 gives for each, side by side).
inline I8x64 Nibbles16x2(const uint8_t* a, const uint8_t* b) {
  const __m256i ab = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  const __m512i twice = _mm512_broadcast_i64x4(ab);  // [a, b, a, b]
  const __m512i by4_high = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i n = _mm512_and_si512(_mm512_srlv_epi16(twice, by4_high),
                                     _mm512_set1_epi8(0x0f));  // [lo a, lo b, hi a, hi b]
  return _mm512_shuffle_i64x2(n, n, _MM_SHUFFLE(3, 1, 2, 0));  // [lo a, hi a, lo b, hi b]
}

#if defined(__AVX512VBMI__)
#define PIJ_QSIMD_VBMI 1
// Four consecutive 4-bit blocks of kBytes bytes each (f16 scale, for Q4_1 an f16 minimum, then
// 16 packed bytes) at p, gathered with byte permutes (VBMI) instead of a load and an insert per
// block: u[0] and u[1] are Nibbles16x2 of blocks (0, 1) and (2, 3), and sm[0], sm[1] what
// ScaleMin2 gives for the same pairs (the same values, so the same bits downstream). The bytes
// past the four blocks are not read (a masked load), so the last blocks of an array are safe.
template <int kBytes, bool kSeparateMin>
inline void Blocks4(const uint8_t* p, I8x64 u[2], __m128 sm[2], float min_per_scale) {
  static_assert(4 * kBytes > 64 && 4 * kBytes <= 128, "four blocks in two vectors");
  constexpr int kNibbles = kBytes - 16;
  const __m512i lo = _mm512_loadu_si512(p);
  const __m512i hi = _mm512_maskz_loadu_epi8((__mmask64{1} << (4 * kBytes - 64)) - 1, p + 64);
  alignas(64) static constexpr auto kPairIdx = [] {
    struct { uint8_t b[2][64]; } idx{};
    for (int pair = 0; pair < 2; ++pair) {
      for (int j = 0; j < 64; ++j) {  // 128-bit lanes [a, a, b, b]: each block's bytes twice
        idx.b[pair][j] = static_cast<uint8_t>((2 * pair + j / 32) * kBytes + kNibbles + j % 16);
      }
    }
    return idx;
  }();
  // [a, a, b, b] >> [0, 4, 0, 4] per 128-bit lane, low nibbles: [lo a, hi a, lo b, hi b]
  const __m512i by4_odd = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                            0x0004000400040004, 0x0004000400040004);
  for (int pair = 0; pair < 2; ++pair) {
    const __m512i twice = _mm512_permutex2var_epi8(
        lo, _mm512_load_si512(reinterpret_cast<const void*>(kPairIdx.b[pair])), hi);
    u[pair] = _mm512_and_si512(_mm512_srlv_epi16(twice, by4_odd), _mm512_set1_epi8(0x0f));
  }
  // f16 [s_a, x_a, s_b, x_b, s_c, x_c, s_d, x_d]: x the minimum (Q4_1) or the scale again
  alignas(64) static constexpr auto kScaleIdx = [] {
    struct { uint8_t b[64]; } idx{};
    for (int k = 0; k < 8; ++k) {
      const int at = (k / 2) * kBytes + (kSeparateMin && k % 2 == 1 ? 2 : 0);
      idx.b[2 * k] = static_cast<uint8_t>(at);
      idx.b[2 * k + 1] = static_cast<uint8_t>(at + 1);
    }
    return idx;
  }();
  __m256 f = _mm256_cvtph_ps(_mm512_castsi512_si128(
      _mm512_permutexvar_epi8(_mm512_load_si512(reinterpret_cast<const void*>(kScaleIdx.b)), lo)));
  if (!kSeparateMin) {
    f = _mm256_mul_ps(f, _mm256_setr_ps(1.0f, min_per_scale, 1.0f, min_per_scale, 1.0f,
                                        min_per_scale, 1.0f, min_per_scale));
  }
  sm[0] = _mm256_castps256_ps128(f);
  sm[1] = _mm256_extractf128_ps(f, 1);
}
#endif

// Lanes 0-7 = lane 0 of v, lanes 8-15 = lane 2 of v.
inline F32x16 SpreadLanes02(__m128 v) {
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), _mm512_castps128_ps512(v));
}

}  // namespace pij::qsimd512

#endif
#endif  // PIJ_CPU_BACKEND_QUANT_SIMD512_H_
