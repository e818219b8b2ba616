// Attention for one decode token against a fixed-size KV cache, in one call: rotary embedding of
// the new query and key, the in-place cache write, scores over the first kv_len slots (slots after
// the token's position masked), softmax and the weighted sum of values. XLA runs the same steps as
// ~20 small thunks per layer, whose dispatch dominated decode attention (models/layers.py keeps
// that path for prefill and as the reference).
// Cache layout [S, K, H] per layer (batch 1); storage float32 or bfloat16 bits (uint16), read
// widened to float32 and written with round-to-nearest-even, as models/layers.py's to_cache.
// Deterministic: each query head is computed by one task in a fixed order, and the grouped path
// (a KV head's query heads together) does the same operations in the same order per head.
// Family features (models/layers.py Attention has the same steps in XLA): a per-head RMSNorm of
// the new q and k before the rotation (Qwen3, Gemma-3), any rotary frequencies (scaled RoPE:
// the caller computes them, models/rope.py) with a factor on cos/sin (YaRN), a query scale,
// soft-capped scores c * tanh(s / c) (Gemma-2) and a sliding window (only the last `window`
// positions are read: Mistral, Gemma's local layers).
// Knows nothing of XLA or Python.
#ifndef PIJ_CPU_BACKEND_DECODE_ATTENTION_H_
#define PIJ_CPU_BACKEND_DECODE_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "cpu_backend/thread_pool.h"

namespace pij {

struct DecodeAttentionArgs {
  int64_t n_heads = 0, n_kv_heads = 0, head_dim = 0;  // head_dim even with a rotation
  int64_t max_len = 0;   // S, cache slots
  int64_t kv_len = 0;    // slots attended, <= S
  int64_t slot = 0;      // where the new key/value go, < kv_len
  int64_t position = 0;  // the token's position (rope angle; keys after it are masked)
  // [head_dim / 2] inverse frequencies of pairs (i, i + H/2); nullptr: no rotation
  const float* inv_freq = nullptr;
  float rope_factor = 1.0f;  // cos and sin times this
  float scale = 0.0f;        // q.k times this; 0: 1 / sqrt(head_dim)
  float softcap = 0.0f;      // scores -> softcap * tanh(score / softcap); 0: off
  int64_t window = 0;        // attend to positions > position - window only; 0: all
  // [head_dim] RMSNorm weights applied to each head of q / k before the rotation; nullptr: none
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f;
};

// q [n_heads * head_dim], k_new / v_new [n_kv_heads * head_dim] (projections, before rope);
// k_cache / v_cache [S, n_kv_heads, head_dim] updated in place at `slot`; out [n_heads * head_dim].
// Cache element C: float or uint16_t (bfloat16 bits). Preconditions checked by the caller.
template <typename C>
void DecodeAttention(const DecodeAttentionArgs& a, const float* q, const float* k_new,
                     const float* v_new, C* k_cache, C* v_cache, float* out, ThreadPool& pool);

extern template void DecodeAttention<float>(const DecodeAttentionArgs&, const float*,
                                            const float*, const float*, float*, float*, float*,
                                            ThreadPool&);
extern template void DecodeAttention<uint16_t>(const DecodeAttentionArgs&, const float*,
                                               const float*, const float*, uint16_t*, uint16_t*,
                                               float*, ThreadPool&);

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_DECODE_ATTENTION_H_
