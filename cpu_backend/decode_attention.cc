#include "cpu_backend/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_backend/pij_math.h"
#include "cpu_backend/simd.h"

namespace pij {
namespace {

// Below this much work (slots x heads x head_dim) the heads run on the caller: a wake-up costs
// more than they do.
constexpr int64_t kParallelMinWork = 1 << 16;

inline float Load(float v) { return v; }
inline float Load(uint16_t bits) { return ToF32(Bf16{bits}); }
inline void Store(float v, float* dst) { *dst = v; }
inline void Store(float v, uint16_t* dst) { *dst = ToBf16(v).bits; }
inline simd::Vec LoadVec(const float* p) { return simd::Load(p); }
inline simd::Vec LoadVec(const uint16_t* p) { return simd::Load(reinterpret_cast<const Bf16*>(p)); }

// sum_i a[i] * b[i] over n floats (a) and n cache elements (b): whole vectors, then a scalar tail.
template <typename C>
inline float Dot(const float* a, const C* b, int64_t n) {
  simd::Vec acc = simd::Zero();
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) {
    acc = simd::MulAdd(simd::Load(a + i), LoadVec(b + i), acc);
  }
  float sum = simd::ReduceSum(acc);
  for (; i < n; ++i) sum += a[i] * Load(b[i]);
  return sum;
}

// o[i] += p * v[i].
template <typename C>
inline void Axpy(float p, const C* v, int64_t n, float* o) {
  const simd::Vec pv = simd::Set1(p);
  int64_t i = 0;
  for (; i + simd::kLanes <= n; i += simd::kLanes) {
    simd::Store(o + i, simd::MulAdd(pv, LoadVec(v + i), simd::Load(o + i)));
  }
  for (; i < n; ++i) o[i] += p * Load(v[i]);
}

// HF's "rotate half": pairs (i, i + H/2) rotated by position * inv_freq[i] (the caller's
// frequencies: plain RoPE is theta^(-2i / H), scaled variants change them). The angles depend
// only on the position, so one table serves every head of the token: the transcendental
// functions ran once per head before (12 heads x 32 x pow/cos/sin, ~20 us of a ~30 us call).
struct RopeTable {
  std::vector<float> cos, sin;
  void Fill(int64_t dim, int64_t position, const float* inv_freq, float factor) {
    const int64_t half = dim / 2;
    cos.resize(static_cast<size_t>(half));
    sin.resize(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(position) * inv_freq[i];
      cos[i] = std::cos(angle) * factor;
      sin[i] = std::sin(angle) * factor;
    }
  }
  void Apply(const float* x, int64_t dim, float* y) const {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      y[i] = x1 * cos[i] - x2 * sin[i];
      y[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  }
};

// y = x / sqrt(mean(x^2) + eps) * w over one head (w nullptr: y = x), float32 as
// models/layers.py's Norm: the squares summed in order, then one division by H.
inline void HeadNorm(const float* x, const float* w, float eps, int64_t h, float* y) {
  if (w == nullptr) {
    std::copy_n(x, h, y);
    return;
  }
  float ss = 0.0f;
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) y[i] = x[i] * inv * w[i];
}

// One head's query (or key) as attention reads it: normed, rotated, scaled.
inline void PrepareHead(const float* src, const float* norm_w, float eps, const RopeTable* rope,
                        float scale, int64_t h, float* tmp, float* dst) {
  HeadNorm(src, norm_w, eps, h, tmp);
  if (rope != nullptr) {
    rope->Apply(tmp, h, dst);
  } else {
    std::copy_n(tmp, h, dst);
  }
  if (scale != 1.0f) {
    for (int64_t i = 0; i < h; ++i) dst[i] *= scale;
  }
}

// Gemma-2's attention logit soft-cap: c * tanh(s / c) (c = 0: s unchanged).
inline float SoftCap(float s, float cap) { return cap > 0.0f ? cap * std::tanh(s / cap) : s; }

// scores[s] = exp(scores[s] - mx) over whole vectors up to `padded` (the padding is scratch),
// returning their sum over the first `visible` in slot order. Vector exponentials: scalar expf
// was ~4% of a decode step together with the FFN's SiLU.
inline float SoftmaxNumerators(float* scores, int64_t visible, int64_t padded, float mx) {
  const simd::Vec neg_mx = simd::Set1(-mx);
  for (int64_t s = 0; s < padded; s += simd::kLanes) {
    simd::Store(scores + s, simd::Exp(simd::Add(simd::Load(scores + s), neg_mx)));
  }
  float sum = 0.0f;
  for (int64_t s = 0; s < visible; ++s) sum += scores[s];
  return sum;
}

// One KV head and its kGroup query heads (q: kGroup rows of head_dim, roped and scaled), head_dim
// = kChunks vectors: every cached key and value row is widened once for the whole group and the
// outputs stay in registers (the per-head path loads and stores each output for every slot).
// Same operations in the same order per head as that path, so the result is bitwise the same.
template <int kChunks, int kGroup, typename C>
void KvHeadGroup(const float* q, const C* k_head, const C* v_head, int64_t kv_stride,
                 int64_t visible, int64_t padded, float softcap, float* scores, float* out) {
  constexpr int64_t h = kChunks * simd::kLanes;
  float mx[kGroup];
  for (int g = 0; g < kGroup; ++g) mx[g] = -INFINITY;
  for (int64_t s = 0; s < visible; ++s) {
    simd::Vec k[kChunks];
    for (int c = 0; c < kChunks; ++c) k[c] = LoadVec(k_head + s * kv_stride + c * simd::kLanes);
    for (int g = 0; g < kGroup; ++g) {
      simd::Vec acc = simd::Zero();
      for (int c = 0; c < kChunks; ++c) {
        acc = simd::MulAdd(simd::Load(q + g * h + c * simd::kLanes), k[c], acc);
      }
      const float dot = SoftCap(simd::ReduceSum(acc), softcap);
      scores[g * padded + s] = dot;
      mx[g] = std::max(mx[g], dot);
    }
  }
  float inv[kGroup];
  for (int g = 0; g < kGroup; ++g) inv[g] = 1.0f / SoftmaxNumerators(scores + g * padded, visible,
                                                                     padded, mx[g]);
  simd::Vec o[kGroup][kChunks];
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) o[g][c] = simd::Zero();
  }
  for (int64_t s = 0; s < visible; ++s) {
    simd::Vec v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = LoadVec(v_head + s * kv_stride + c * simd::kLanes);
    for (int g = 0; g < kGroup; ++g) {
      const simd::Vec p = simd::Set1(scores[g * padded + s] * inv[g]);
      for (int c = 0; c < kChunks; ++c) o[g][c] = simd::MulAdd(p, v[c], o[g][c]);
    }
  }
  for (int g = 0; g < kGroup; ++g) {
    for (int c = 0; c < kChunks; ++c) simd::Store(out + g * h + c * simd::kLanes, o[g][c]);
  }
}

// The KvHeadGroup instance for (head_dim / lanes, group), or nullptr (the per-head path then).
template <typename C>
using KvHeadFn = void (*)(const float*, const C*, const C*, int64_t, int64_t, int64_t, float,
                          float*, float*);
template <int kChunks, typename C>
KvHeadFn<C> PickGroup(int64_t group) {
  switch (group) {
    case 1: return &KvHeadGroup<kChunks, 1, C>;
    case 2: return &KvHeadGroup<kChunks, 2, C>;
    case 3: return &KvHeadGroup<kChunks, 3, C>;
    case 4: return &KvHeadGroup<kChunks, 4, C>;
    default: return nullptr;
  }
}
template <typename C>
KvHeadFn<C> PickKvHeadKernel(int64_t head_dim, int64_t group) {
  if (head_dim % simd::kLanes != 0) return nullptr;
  switch (head_dim / simd::kLanes) {
    case 4: return PickGroup<4, C>(group);
    case 8: return PickGroup<8, C>(group);
    default: return nullptr;
  }
}

}  // namespace

template <typename C>
void DecodeAttention(const DecodeAttentionArgs& a, const float* q, const float* k_new,
                     const float* v_new, C* k_cache, C* v_cache, float* out, ThreadPool& pool) {
  const int64_t h = a.head_dim;
  const int64_t kv_stride = a.n_kv_heads * h;  // one cache slot
  // The new key (normed, roped) and value go to their slot first: the token attends to itself
  // through the cache, at the cache's precision, exactly like the XLA path.
  thread_local std::vector<float> tmp, key;
  thread_local RopeTable rope;
  tmp.resize(static_cast<size_t>(h));
  key.resize(static_cast<size_t>(h));
  if (a.inv_freq != nullptr) rope.Fill(h, a.position, a.inv_freq, a.rope_factor);
  const RopeTable* rope_used = a.inv_freq != nullptr ? &rope : nullptr;  // the caller's table
  for (int64_t k = 0; k < a.n_kv_heads; ++k) {
    PrepareHead(k_new + k * h, a.k_norm, a.norm_eps, rope_used, 1.0f, h, tmp.data(), key.data());
    C* kd = k_cache + a.slot * kv_stride + k * h;
    C* vd = v_cache + a.slot * kv_stride + k * h;
    for (int64_t i = 0; i < h; ++i) {
      Store(key[i], kd + i);
      Store(v_new[k * h + i], vd + i);
    }
  }
  const int64_t group = a.n_heads / a.n_kv_heads;
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(h));
  // Slot s holds position s: slots <= position are visible, and with a window only the last
  // `window` of them (the earlier ones are not read at all).
  const int64_t end = std::min<int64_t>(a.kv_len, a.position + 1);
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.position + 1 - a.window) : 0;
  const int64_t visible = std::max<int64_t>(end - first, 0);
  const C* k_first = k_cache + first * kv_stride;
  const C* v_first = v_cache + first * kv_stride;
  auto head = [&](int64_t hq, int /*worker*/) {
    thread_local std::vector<float> qh, qtmp, scores;  // per thread: no heap work once sized
    qh.resize(static_cast<size_t>(h));
    qtmp.resize(static_cast<size_t>(h));
    // Padded to whole vectors for the exponentials below; the padding's values are never used.
    const int64_t padded = (visible + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
    scores.resize(static_cast<size_t>(padded));
    PrepareHead(q + hq * h, a.q_norm, a.norm_eps, rope_used, scale, h, qtmp.data(), qh.data());
    const int64_t kvh = hq / group;
    float mx = -INFINITY;
    for (int64_t s = 0; s < visible; ++s) {
      const float dot = SoftCap(Dot(qh.data(), k_first + s * kv_stride + kvh * h, h), a.softcap);
      scores[s] = dot;
      mx = std::max(mx, dot);
    }
    float* o = out + hq * h;
    std::fill_n(o, h, 0.0f);
    if (visible == 0) return;
    const float inv = 1.0f / SoftmaxNumerators(scores.data(), visible, padded, mx);
    for (int64_t s = 0; s < visible; ++s) {
      Axpy(scores[s] * inv, v_first + s * kv_stride + kvh * h, h, o);
    }
  };
  const bool parallel = visible * a.n_heads * h >= kParallelMinWork && pool.NumThreads() > 1;
  const KvHeadFn<C> grouped = visible > 0 ? PickKvHeadKernel<C>(h, group) : nullptr;
  // Grouped query heads share their KV head's rows, one task per KV head; the per-head tasks
  // only when the shape has no grouped kernel, or a pool has more threads than KV heads.
  // Measured (SmolLM2: 9 heads, 3 KV heads, bf16 cache, 30 layers,
  // benchmarks/cpp/decode_attention_layers.cc): 1 thread 508 -> 189 us per
  // token at 128 slots and 4985 -> 2479 us at 1024; 2 threads (3 tasks) 334 -> 145 and
  // 3749 -> 1650 us.
  const bool use_grouped =
      grouped != nullptr && (!parallel || a.n_kv_heads >= pool.NumThreads());
  auto kv_head = [&](int64_t kvh, int /*worker*/) {
    thread_local std::vector<float> qs, qtmp, scores;
    qs.resize(static_cast<size_t>(group * h));
    qtmp.resize(static_cast<size_t>(h));
    const int64_t padded = (visible + simd::kLanes - 1) / simd::kLanes * simd::kLanes;
    scores.resize(static_cast<size_t>(group * padded));
    for (int64_t g = 0; g < group; ++g) {
      PrepareHead(q + (kvh * group + g) * h, a.q_norm, a.norm_eps, rope_used, scale, h,
                  qtmp.data(), qs.data() + g * h);
    }
    grouped(qs.data(), k_first + kvh * h, v_first + kvh * h, kv_stride, visible, padded,
            a.softcap, scores.data(), out + kvh * group * h);
  };
  if (use_grouped) {
    if (parallel) {
      pool.Run(0, a.n_kv_heads, kv_head);
    } else {
      for (int64_t kvh = 0; kvh < a.n_kv_heads; ++kvh) kv_head(kvh, 0);
    }
  } else if (parallel) {
    pool.Run(0, a.n_heads, head);
  } else {
    for (int64_t hq = 0; hq < a.n_heads; ++hq) head(hq, 0);
  }
}

template void DecodeAttention<float>(const DecodeAttentionArgs&, const float*, const float*,
                                     const float*, float*, float*, float*, ThreadPool&);
template void DecodeAttention<uint16_t>(const DecodeAttentionArgs&, const float*, const float*,
                                        const float*, uint16_t*, uint16_t*, float*, ThreadPool&);

}  // namespace pij
