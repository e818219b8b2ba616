// The few vector operations the CPU kernels need, chosen at compile time: AVX-512 (16 lanes),
// AVX2+FMA+F16C (8 lanes) or portable scalar code (1 lane). Every weight type widens to float32
// on load, so kernels are written once over `Vec` and accumulate in float32.
#ifndef PIJ_CPU_BACKEND_SIMD_H_
#define PIJ_CPU_BACKEND_SIMD_H_

#include <cmath>
#include <cstdint>

#include "cpu_backend/pij_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PIJ_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PIJ_SIMD_AVX2 1
#include <immintrin.h>
#endif

namespace pij::simd {

#if defined(PIJ_SIMD_AVX512)

constexpr int kLanes = 16;
using Vec = __m512;
inline const char* Name() { return "avx512"; }
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float v) { return _mm512_set1_ps(v); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
// bf16 -> f32 is a 16-bit left shift of the zero-extended bits.
inline Vec Load(const Bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline Vec Load(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float ReduceSum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
// e^x, Cephes' expf polynomial on the range-reduced argument, scaled by 2^n with vscalefps
// (which also takes care of overflow and underflow); within 2 ulp of expf over [-103, 88].
inline Vec Exp(Vec x) {
  x = _mm512_max_ps(_mm512_min_ps(x, Set1(88.72f)), Set1(-103.9f));
  const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, Set1(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(n, Set1(0.693359375f), x);  // ln 2 in two parts: exact n * hi
  r = _mm512_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
  Vec p = Set1(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, Set1(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, Set1(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, Set1(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, Set1(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, Set1(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, Set1(1.0f)));
  return _mm512_scalef_ps(p, n);
}

#elif defined(PIJ_SIMD_AVX2)

constexpr int kLanes = 8;
using Vec = __m256;
inline const char* Name() { return "avx2"; }
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float v) { return _mm256_set1_ps(v); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const Bf16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline Vec Load(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float ReduceSum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
// e^x with the same range reduction and polynomial as the AVX-512 Exp; AVX2 has no vscalefps, so
// 2^n is built in the exponent bits, in two factors 2^(n/2) * 2^(n - n/2): each stays a normal
// float over the clamped range, where 2^n alone would not (n reaches -150).
inline Vec Exp(Vec x) {
  x = _mm256_max_ps(_mm256_min_ps(x, Set1(88.72f)), Set1(-103.9f));
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, Set1(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(n, Set1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, Set1(-2.12194440e-4f), r);
  Vec p = Set1(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, Set1(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, Set1(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, Set1(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, Set1(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, Set1(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, Set1(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const Vec s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const Vec s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

#else

constexpr int kLanes = 1;
using Vec = float;
inline const char* Name() { return "scalar"; }
inline Vec Zero() { return 0.0f; }
inline Vec Set1(float v) { return v; }
template <typename W>
inline Vec Load(const W* p) { return ToF32(*p); }
inline void Store(float* p, Vec v) { *p = v; }
inline Vec MulAdd(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline Vec Div(Vec a, Vec b) { return a / b; }
inline Vec Mul(Vec a, Vec b) { return a * b; }
inline float ReduceSum(Vec v) { return v; }
inline Vec Max(Vec a, Vec b) { return a > b ? a : b; }
inline Vec Exp(Vec x) { return std::exp(x); }

#endif

// x * sigmoid(x) on a vector, as Silu in pij_math.h but with Exp above.
inline Vec Silu(Vec x) {
  const Vec e = Exp(Mul(x, Set1(-1.0f)));
  return Div(x, Add(Set1(1.0f), e));
}

inline Vec Relu(Vec x) { return Max(x, Zero()); }

// The tanh GELU of pij_math.h on a vector, tanh(z) = 1 - 2 / (e^(2z) + 1) with Exp above (which
// saturates to +-1 correctly: e^(2z) -> inf or 0).
inline Vec Gelu(Vec x) {
  const Vec z = Mul(Set1(0.7978845608028654f), MulAdd(Mul(Set1(0.044715f), Mul(x, x)), x, x));
  const Vec e = Exp(Add(z, z));
  const Vec tanh_z = Add(Set1(1.0f), Div(Set1(-2.0f), Add(e, Set1(1.0f))));
  return Mul(Mul(Set1(0.5f), x), Add(Set1(1.0f), tanh_z));
}

inline Vec Activate(Activation act, Vec x) {
  switch (act) {
    case Activation::kRelu:
    case Activation::kDrelu: return Relu(x);  // dReLU on one projection (pij_math.h)
    case Activation::kGelu: return Gelu(x);
    case Activation::kSilu:
    default: return Silu(x);
  }
}

// A gated FFN's a_i from its gate and up projections, as pij_math.h's GatedActivate.
inline Vec GatedActivate(Activation act, Vec gate, Vec up) {
  return Mul(simd::Activate(act, gate), act == Activation::kDrelu ? simd::Relu(up) : up);
}

}  // namespace pij::simd

#endif  // PIJ_CPU_BACKEND_SIMD_H_
