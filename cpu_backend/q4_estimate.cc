#include "cpu_backend/q4_estimate.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_backend/quant_act.h"
#include "cpu_backend/quant_simd.h"
#include "cpu_backend/simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PIJ_Q4_VNNI 1
#include <immintrin.h>
#endif

namespace pij {
namespace {

// Below this many weights one thread finishes before a wake-up would pay off.
constexpr int64_t kParallelMinWeights = 1 << 15;
constexpr int64_t kTasksPerThread = 4;  // as in linear.cc: evens out unequal cores

}  // namespace

void QuantizeQ8(const float* x, int64_t dim, Q8Row& out) {
  const int64_t pairs = Q4Pairs(dim);
  const int64_t blocks = 2 * pairs;
  out.q.assign(static_cast<size_t>(blocks * kQ4Block), 0);
  out.d.resize(static_cast<size_t>(blocks));
  out.c.resize(static_cast<size_t>(blocks));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kQ4Block;
    const int64_t hi = std::min(dim, lo + kQ4Block);
    if (hi - lo == kQ4Block) {  // a whole block: the quantized kernels' vector code, same result
      int32_t sums[2];
      const float d = QuantizeBlock(x + lo, kQ4Block, out.q.data() + lo, sums);
      out.d[static_cast<size_t>(b)] = d;
      out.c[static_cast<size_t>(b)] = d * static_cast<float>(sums[0] + sums[1]);
      continue;
    }
    float amax = 0.0f;
    bool finite = true;
    for (int64_t j = lo; j < hi; ++j) {
      amax = std::max(amax, std::fabs(x[j]));
      finite = finite && std::isfinite(x[j]);
    }
    if (!finite) {  // NaN/inf: the block's dots become NaN (as the reference's), never garbage
      std::fill(out.q.begin() + lo, out.q.begin() + hi, int8_t{0});
      out.d[static_cast<size_t>(b)] = out.c[static_cast<size_t>(b)] =
          std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float d = amax / 127.0f;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t j = lo; j < hi; ++j) {
      const float v = std::nearbyint(x[j] * id);  // round half to even, like numpy
      const int32_t qj = static_cast<int32_t>(std::clamp(v, -127.0f, 127.0f));
      out.q[static_cast<size_t>(j)] = static_cast<int8_t>(qj);
      sum += qj;
    }
    out.d[static_cast<size_t>(b)] = d;
    out.c[static_cast<size_t>(b)] = d * static_cast<float>(sum);
  }
}

#if defined(PIJ_Q4_VNNI)

namespace {

// Per pair of blocks: one 32-byte load yields 64 nibbles (low nibbles = first block, high =
// second), vpdpbusd sums them against the Q8 activations into 16 int32 lanes (lanes 0-7: first
// block, 8-15: second), and one permute picks the two blocks' combined scales d_w * d_x from a
// register filled once per 8 pairs. About 10 instructions per 64 weights; `kRows` rows share the
// activation loads, and two accumulators per row keep the FMA chains independent.
template <int kRows>
inline void Q4DotsQ8(const uint8_t* const* q, const F16* const* dm, const Q8Row& x, int64_t pairs,
                     float* out) {
  const int64_t blocks = 2 * pairs;
  const int8_t* xq = x.q.data();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i two = _mm512_set1_epi32(2);
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, blocks - b0);
    const __mmask16 k = static_cast<__mmask16>(nb == 16 ? 0xffff : (1u << nb) - 1u);
    const __m512 xd = _mm512_maskz_loadu_ps(k, x.d.data() + b0);
    const __m512 xc = _mm512_maskz_loadu_ps(k, x.c.data() + b0);
    __m512 scale[kRows];
    for (int r = 0; r < kRows; ++r) {
      scale[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dm[r] + b0)), xd);
      // The minimums' term: sum_b m_b * d_x,b * sum(x_q,b).
      acc[r][1] = _mm512_fmadd_ps(
          _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dm[r] + blocks + b0)), xc, acc[r][1]);
    }
    // Lanes 0-7 select scale[2j], lanes 8-15 scale[2j + 1], for pair j of this group.
    __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t p = b0 / 2; p < (b0 + nb) / 2; ++p) {
      const __m512i xv = _mm512_loadu_si512(xq + p * 64);
      for (int r = 0; r < kRows; ++r) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + p * 32));
        const __m512i w = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1),
            low4);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);  // u8 x s8
        __m512& a = acc[r][p & 1];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, scale[r]), a);
      }
      idx = _mm512_add_epi32(idx, two);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

}  // namespace

float Q4DotQ8(const uint8_t* q, const F16* dm, const Q8Row& x, int64_t pairs) {
  float out;
  Q4DotsQ8<1>(&q, &dm, x, pairs, &out);
  return out;
}

void Q4GateUpDotsQ8(const uint8_t* q_gate, const F16* dm_gate, const uint8_t* q_up,
                    const F16* dm_up, const Q8Row& x, int64_t pairs, float* gate, float* up) {
  const uint8_t* q[2] = {q_gate, q_up};
  const F16* dm[2] = {dm_gate, dm_up};
  float out[2];
  Q4DotsQ8<2>(q, dm, x, pairs, out);
  *gate = out[0];
  *up = out[1];
}

#elif defined(PIJ_QSIMD_AVX2)

namespace {

// The same per pair of blocks on 256-bit vectors (AVX2, or AVX-VNNI's vpdpbusd through
// qsimd::DotU8S8): the 32 bytes of a pair give the first block's 32 low nibbles and the second's
// 32 high nibbles, each dotted with its 32 Q8 activations into 8 int32 lanes; the combined scales
// d_w * d_x of 8 blocks sit in one register and a permute picks a block's. A last group of fewer
// than 8 blocks reads its scales from zero-padded copies.
template <int kRows>
inline void Q4DotsQ8(const uint8_t* const* q, const F16* const* dm, const Q8Row& x, int64_t pairs,
                     float* out) {
  const int64_t blocks = 2 * pairs;
  const int8_t* xq = x.q.data();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256 acc[kRows][2];
  __m256 macc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = macc[r] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
    const int64_t nb = std::min<int64_t>(8, blocks - b0);
    float xd_pad[8] = {}, xc_pad[8] = {};
    uint16_t d_pad[kRows][8] = {}, m_pad[kRows][8] = {};
    const float* xd_p = x.d.data() + b0;
    const float* xc_p = x.c.data() + b0;
    const uint16_t* d_p[kRows];
    const uint16_t* m_p[kRows];
    for (int r = 0; r < kRows; ++r) {
      d_p[r] = &dm[r][b0].bits;
      m_p[r] = &dm[r][blocks + b0].bits;
    }
    if (nb < 8) {
      std::copy_n(xd_p, nb, xd_pad);
      std::copy_n(xc_p, nb, xc_pad);
      xd_p = xd_pad;
      xc_p = xc_pad;
      for (int r = 0; r < kRows; ++r) {
        std::copy_n(d_p[r], nb, d_pad[r]);
        std::copy_n(m_p[r], nb, m_pad[r]);
        d_p[r] = d_pad[r];
        m_p[r] = m_pad[r];
      }
    }
    const __m256 xd = _mm256_loadu_ps(xd_p);
    const __m256 xc = _mm256_loadu_ps(xc_p);
    __m256 scale[kRows];
    for (int r = 0; r < kRows; ++r) {
      const auto half8 = [](const uint16_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      };
      scale[r] = _mm256_mul_ps(half8(d_p[r]), xd);
      macc[r] = _mm256_fmadd_ps(half8(m_p[r]), xc, macc[r]);  // sum_b m_b * d_x,b * sum(x_q,b)
    }
    for (int64_t p = b0 / 2; p < (b0 + nb) / 2; ++p) {
      const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + p * 64));
      const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + p * 64 + 32));
      const int j = static_cast<int>(p - b0 / 2);
      for (int r = 0; r < kRows; ++r) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + p * 32));
        const __m256i lo = _mm256_and_si256(bytes, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        const __m256 s_lo = _mm256_permutevar8x32_ps(scale[r], _mm256_set1_epi32(2 * j));
        const __m256 s_hi = _mm256_permutevar8x32_ps(scale[r], _mm256_set1_epi32(2 * j + 1));
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qsimd::DotU8S8(lo, x_lo)), s_lo, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qsimd::DotU8S8(hi, x_hi)), s_hi, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    out[r] = qsimd::ReduceSum(_mm256_add_ps(acc[r][0], acc[r][1])) + qsimd::ReduceSum(macc[r]);
  }
}

}  // namespace

float Q4DotQ8(const uint8_t* q, const F16* dm, const Q8Row& x, int64_t pairs) {
  float out;
  Q4DotsQ8<1>(&q, &dm, x, pairs, &out);
  return out;
}

void Q4GateUpDotsQ8(const uint8_t* q_gate, const F16* dm_gate, const uint8_t* q_up,
                    const F16* dm_up, const Q8Row& x, int64_t pairs, float* gate, float* up) {
  const uint8_t* q[2] = {q_gate, q_up};
  const F16* dm[2] = {dm_gate, dm_up};
  float out[2];
  Q4DotsQ8<2>(q, dm, x, pairs, out);
  *gate = out[0];
  *up = out[1];
}

#else  // portable loops (non-x86)

float Q4DotQ8(const uint8_t* q, const F16* dm, const Q8Row& x, int64_t pairs) {
  const F16* m = dm + 2 * pairs;
  float acc = 0.0f;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int half = 0; half < 2; ++half) {
      const int8_t* xq = x.q.data() + p * 64 + half * 32;
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) {
        const uint8_t byte = q[p * 32 + j];
        s += static_cast<int32_t>(half ? byte >> 4 : byte & 0x0f) * xq[j];
      }
      const int64_t b = 2 * p + half;
      acc += ToF32(dm[b]) * x.d[b] * static_cast<float>(s) + ToF32(m[b]) * x.c[b];
    }
  }
  return acc;
}

void Q4GateUpDotsQ8(const uint8_t* q_gate, const F16* dm_gate, const uint8_t* q_up,
                    const F16* dm_up, const Q8Row& x, int64_t pairs, float* gate, float* up) {
  *gate = Q4DotQ8(q_gate, dm_gate, x, pairs);
  *up = Q4DotQ8(q_up, dm_up, x, pairs);
}

#endif

void Q4EstimateRange(const Q4EstimateArgs& args, std::span<const Q8Row> q8, int64_t lo,
                     int64_t hi, float* out) {
  const int64_t f = args.num_neurons;
  const int64_t pairs = Q4Pairs(args.dim);
  const int64_t g = args.gated ? 2 : 1;
  const int64_t q_stride = g * pairs * kQ4PairBytes;
  const int64_t dm_stride = g * 4 * pairs;
  const int64_t num_tokens = static_cast<int64_t>(q8.size());
  if (args.gated && args.activation == Activation::kSilu) {
    // SwiGLU, the common case: the dots of up to kLanes neurons, then one vector SiLU for them
    // (scalar expf was ~4% of a decode step). Every neuron goes through the same vector code
    // (a short last group is zero padded), so a score does not depend on how neurons are split
    // over threads.
    constexpr int64_t kGroup = simd::kLanes;
    alignas(64) float gate[kGroup], up[kGroup], a[kGroup];
    for (int64_t i0 = lo; i0 < hi; i0 += kGroup) {
      const int64_t n = std::min(kGroup, hi - i0);
      for (int64_t t = 0; t < num_tokens; ++t) {
        std::fill_n(gate, kGroup, 0.0f);
        std::fill_n(up, kGroup, 0.0f);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t i = i0 + j;
          const uint8_t* qi = args.q + i * q_stride;
          const F16* dmi = args.dm + i * dm_stride;
          Q4GateUpDotsQ8(qi, dmi, qi + pairs * kQ4PairBytes, dmi + 4 * pairs, q8[t], pairs,
                         &gate[j], &up[j]);
          if (args.b_up != nullptr) up[j] += args.b_up[i];
        }
        for (int64_t j = 0; j < kGroup; j += simd::kLanes) {
          simd::Store(a + j, simd::Mul(simd::Silu(simd::Load(gate + j)), simd::Load(up + j)));
        }
        for (int64_t j = 0; j < n; ++j) {
          out[t * f + i0 + j] = args.signed_output ? a[j] : std::fabs(a[j]);
        }
      }
    }
    return;
  }
  for (int64_t i = lo; i < hi; ++i) {
    const uint8_t* qi = args.q + i * q_stride;
    const F16* dmi = args.dm + i * dm_stride;
    const float b = args.b_up != nullptr ? args.b_up[i] : 0.0f;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const Q8Row& x = q8[t];
      float a;
      if (args.gated) {
        float gate, up;
        Q4GateUpDotsQ8(qi, dmi, qi + pairs * kQ4PairBytes, dmi + 4 * pairs, x, pairs, &gate, &up);
        a = Activate(args.activation, gate) * (up + b);
      } else {
        a = Activate(args.activation, Q4DotQ8(qi, dmi, x, pairs) + b);
      }
      out[t * f + i] = args.signed_output ? a : std::fabs(a);
    }
  }
}

void QuantizeTokens(std::span<const float* const> x_rows, int64_t dim,
                    std::vector<Q8Row>& scratch) {
  if (scratch.size() < x_rows.size()) scratch.resize(x_rows.size());
  for (size_t t = 0; t < x_rows.size(); ++t) QuantizeQ8(x_rows[t], dim, scratch[t]);
}

void Q4Scores(const Q4EstimateArgs& args, std::span<const float* const> x_rows, float* scores,
              std::vector<Q8Row>& scratch, ThreadPool& pool) {
  const int64_t num_tokens = static_cast<int64_t>(x_rows.size());
  const int64_t f = args.num_neurons;
  if (num_tokens == 0 || f == 0) return;
  QuantizeTokens(x_rows, args.dim, scratch);
  const std::span<const Q8Row> q8(scratch.data(), static_cast<size_t>(num_tokens));
  const int64_t g = args.gated ? 2 : 1;
  if (f * args.dim * g < kParallelMinWeights || pool.NumThreads() == 1) {
    Q4EstimateRange(args, q8, 0, f, scores);
    return;
  }
  const int64_t tasks = std::min<int64_t>(f, pool.NumThreads() * kTasksPerThread);
  pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
    Q4EstimateRange(args, q8, f * task / tasks, f * (task + 1) / tasks, scores);
  });
}

}  // namespace pij
