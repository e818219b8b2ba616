#include "cpu_backend/quant_act.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu_backend/quant_simd.h"

namespace pij {
namespace {

// Below this many values one thread quantizes before a wake-up would pay off.
constexpr int64_t kParallelMinValues = 1 << 16;

}  // namespace

float QuantizeBlock(const float* x, int64_t n, int8_t* q, int32_t* sums16) {
  // `poison` sums x * 0: zero, or NaN when the block holds a NaN or an infinity.
#if defined(PIJ_QSIMD_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps(), poison = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
    poison = _mm256_fmadd_ps(v, _mm256_setzero_ps(), poison);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const bool finite = qsimd::ReduceSum(poison) == 0.0f;
#else
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    finite = finite && std::isfinite(x[i]);
  }
#endif
  if (!finite) {  // NaN/inf: a NaN scale makes every dot with the block NaN (as the reference)
    std::fill_n(q, n, int8_t{0});
    std::fill_n(sums16, n / 16, 0);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
#if defined(PIJ_QSIMD_AVX2)
  const __m256 vid = _mm256_set1_ps(id);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), vid),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i s = _mm256_add_epi32(v[2 * h], v[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
      sums16[i / 16 + h] = _mm_cvtsi128_si32(s4);
    }
    // int32 -> int8 in order: the packs interleave 128-bit halves, the permute undoes it.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                              _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
#else
  for (int64_t g = 0; g < n / 16; ++g) {
    int32_t sum = 0;
    for (int64_t i = 16 * g; i < 16 * (g + 1); ++i) {
      const float r = std::nearbyint(x[i] * id);  // round half to even
      const int32_t v = static_cast<int32_t>(std::clamp(r, -127.0f, 127.0f));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    sums16[g] = sum;
  }
#endif
  return d;
}

void QuantizeActs(std::span<const float* const> x_rows, int64_t dim, int64_t block, QActs& out,
                  ThreadPool& pool) {
  const int64_t rows = static_cast<int64_t>(x_rows.size());
  const int64_t nb = dim / block;
  out.block = block;
  out.dim = dim;
  out.rows = rows;
  if (static_cast<int64_t>(out.q.size()) < rows * dim) out.q.resize(rows * dim);
  if (static_cast<int64_t>(out.d.size()) < rows * nb) out.d.resize(rows * nb);
  if (static_cast<int64_t>(out.c16.size()) < rows * (dim / 16)) out.c16.resize(rows * (dim / 16));
  if (static_cast<int64_t>(out.c32.size()) < rows * (dim / 32)) out.c32.resize(rows * (dim / 32));
  auto row = [&](int64_t t) {
    int32_t sums[256 / 16];
    for (int64_t b = 0; b < nb; ++b) {
      int8_t* q = out.q.data() + t * dim + b * block;
      const float d = QuantizeBlock(x_rows[t] + b * block, block, q, sums);
      out.d[t * nb + b] = d;
      const int64_t groups = block / 16;
      float* c16 = out.c16.data() + t * (dim / 16) + b * groups;
      float* c32 = out.c32.data() + t * (dim / 32) + b * groups / 2;
      for (int64_t g = 0; g < groups; ++g) c16[g] = d * static_cast<float>(sums[g]);
      for (int64_t g = 0; g < groups / 2; ++g) {
        c32[g] = d * static_cast<float>(sums[2 * g] + sums[2 * g + 1]);
      }
    }
  };
  if (rows * dim < kParallelMinValues || pool.NumThreads() == 1 || rows == 1) {
    for (int64_t t = 0; t < rows; ++t) row(t);
    return;
  }
  const int64_t tasks = std::min<int64_t>(rows, 4 * pool.NumThreads());
  pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
    for (int64_t t = rows * task / tasks; t < rows * (task + 1) / tasks; ++t) row(t);
  });
}

}  // namespace pij
