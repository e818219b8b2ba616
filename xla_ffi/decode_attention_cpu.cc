// CPU FFI handler of decode attention (cpu_backend/decode_attention.h), one token per sequence:
//   q f32 [B, ..., NH * H]; k_new, v_new f32 [B, ..., NK * H];
//   k_cache, v_cache [R, S, NK, H] float32 or uint16 (bfloat16 bits), R >= B cache rows (a batched
//   engine's slots: sequence b uses row b), aliased to results 1 and 2;
//   where s32 [B, 2] = per sequence (slot, position);
//   inv_freq f32 [H / 2] (the rotary frequencies; [0]: no rotation), q_norm / k_norm f32 [H]
//   (per-head RMSNorm weights; [0]: none);
//   attributes kv_len, rope_factor, scale (0: 1/sqrt(H)), softcap (0: off), window (0: all),
//   norm_eps; results out f32 like q, then the updated caches.
// One sequence runs its heads on the pool; several run one task per sequence (each sequence's
// result is computed by one thread in a fixed order, so outputs do not depend on the split).
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

#include "cpu_backend/decode_attention.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/cpu_targets.h"
#include "xla_ffi/cpu_runtime.h"
#include "xla_ffi/ffi_util.h"

namespace pij {
namespace {

constexpr std::string_view kOp = "decode_attention";

// q, k_new, v_new, where and out have one dtype each (typed: XLA checks it); the caches are
// float32 or bfloat16 bits (uint16), checked here.
ffi::Error DecodeAttentionCpuImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                                  ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_cache,
                                  ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> where,
                                  ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::F32> q_norm,
                                  ffi::Buffer<ffi::F32> k_norm, ffi::ResultBuffer<ffi::F32> out,
                                  ffi::Result<ffi::AnyBuffer> k_out,
                                  ffi::Result<ffi::AnyBuffer> v_out, int64_t kv_len,
                                  float rope_factor, float scale, float softcap, int64_t window,
                                  float norm_eps) {
  const auto c_dims = k_cache.dimensions();
  const ffi::DataType ct = k_cache.element_type();
  if ((ct != ffi::DataType::F32 && ct != ffi::DataType::U16) || c_dims.size() != 4 ||
      c_dims[0] < 1) {
    return InvalidArg(kOp, "k_cache", "float32 or uint16 [R, S, NK, H]",
                      std::string(DtypeName(ct)) + " " + ShapeString(c_dims));
  }
  const int64_t rows = c_dims[0], s_len = c_dims[1], nk = c_dims[2], h = c_dims[3];
  if (where.element_count() % 2 != 0 ||
      where.element_count() == 0 || static_cast<int64_t>(where.element_count()) / 2 > rows) {
    return InvalidArg(kOp, "where", "int32 [B, 2] (slot, position per sequence), B <= " +
                                        std::to_string(rows) + " cache rows",
                      "int32 " + ShapeString(where.dimensions()));
  }
  const int64_t batch = static_cast<int64_t>(where.element_count()) / 2;
  const auto v_dims = v_cache.dimensions();
  if (v_cache.element_type() != ct || v_dims.size() != 4 ||
      !std::equal(v_dims.begin(), v_dims.end(), c_dims.begin())) {
    return InvalidArg(kOp, "v_cache", "the dtype and shape of k_cache " + ShapeString(c_dims),
                      std::string(DtypeName(v_cache.element_type())) + " " +
                          ShapeString(v_dims));
  }
  if (h == 0 ||
      static_cast<int64_t>(q.element_count()) % (batch * h) != 0 ||
      static_cast<int64_t>(q.element_count()) / (batch * h) % nk != 0) {
    return InvalidArg(kOp, "q", "float32 [" + std::to_string(batch) + ", NH * " +
                                    std::to_string(h) + "], NH a multiple of " + std::to_string(nk),
                      "float32 " + ShapeString(q.dimensions()));
  }
  for (auto [name, buf] : {std::pair{"k_new", &k_new}, std::pair{"v_new", &v_new}}) {
    if (static_cast<int64_t>(buf->element_count()) != batch * nk * h) {
      return InvalidArg(kOp, name, "float32 with " + std::to_string(batch * nk * h) +
                                       " elements (one token per sequence)",
                        "float32 " + ShapeString(buf->dimensions()));
    }
  }
  if (inv_freq.element_count() != 0 && h % 2 != 0) {  // rope rotates pairs (i, i + H/2)
    return InvalidArg(kOp, "inv_freq", "absent for an odd head dim H",
                      "frequencies for H = " + std::to_string(h));
  }
  const float* inv_freq_data = nullptr;
  const float* q_norm_data = nullptr;
  const float* k_norm_data = nullptr;
  if (ffi::Error e = DecodeOptionalF32(kOp, "inv_freq", inv_freq, h / 2, inv_freq_data);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = DecodeOptionalF32(kOp, "q_norm", q_norm, h, q_norm_data); e.failure()) {
    return e;
  }
  if (ffi::Error e = DecodeOptionalF32(kOp, "k_norm", k_norm, h, k_norm_data); e.failure()) {
    return e;
  }
  if ((q_norm_data == nullptr) != (k_norm_data == nullptr)) {
    return InvalidArg(kOp, "q_norm, k_norm", "both present or both absent",
                      ShapeString(q_norm.dimensions()) + ", " + ShapeString(k_norm.dimensions()));
  }
  if (!(scale >= 0.0f) || !(softcap >= 0.0f) || window < 0 || !(norm_eps > 0.0f) ||
      !(rope_factor > 0.0f)) {
    return InvalidArg(kOp, "scale, softcap, window, norm_eps, rope_factor",
                      ">= 0, >= 0, >= 0, > 0, > 0",
                      std::to_string(scale) + ", " + std::to_string(softcap) + ", " +
                          std::to_string(window) + ", " + std::to_string(norm_eps) + ", " +
                          std::to_string(rope_factor));
  }
  if (kv_len < 1 || kv_len > s_len) {
    return InvalidArg(kOp, "kv_len", "in [1, S = " + std::to_string(s_len) + "]",
                      std::to_string(kv_len));
  }
  const int32_t* w = where.typed_data();
  for (int64_t b = 0; b < batch; ++b) {
    if (w[2 * b] < 0 || w[2 * b] >= kv_len || w[2 * b + 1] < 0) {
      return InvalidArg(kOp, "slot, position",
                        "0 <= slot < kv_len = " + std::to_string(kv_len) + ", position >= 0",
                        std::to_string(w[2 * b]) + ", " + std::to_string(w[2 * b + 1]) +
                            " (sequence " + std::to_string(b) + ")");
    }
  }
  if (out->element_count() != q.element_count() ||
      k_out->size_bytes() != k_cache.size_bytes() || v_out->size_bytes() != v_cache.size_bytes()) {
    return InvalidArg(kOp, "results", "out like q, caches like the inputs",
                      ShapeString(out->dimensions()));
  }
  DecodeAttentionArgs a;
  a.n_kv_heads = nk;
  a.head_dim = h;
  a.n_heads = static_cast<int64_t>(q.element_count()) / (batch * h);
  a.max_len = s_len;
  a.kv_len = kv_len;
  a.inv_freq = inv_freq_data;
  a.rope_factor = rope_factor;
  a.scale = scale;
  a.softcap = softcap;
  a.window = window;
  a.q_norm = q_norm_data;
  a.k_norm = k_norm_data;
  a.norm_eps = norm_eps;
  // The caches are aliased to the results; if XLA gave separate buffers, start from the inputs.
  if (k_out->untyped_data() != k_cache.untyped_data()) {
    std::memcpy(k_out->untyped_data(), k_cache.untyped_data(), k_cache.size_bytes());
  }
  if (v_out->untyped_data() != v_cache.untyped_data()) {
    std::memcpy(v_out->untyped_data(), v_cache.untyped_data(), v_cache.size_bytes());
  }
  const float* qp = q.typed_data();
  const float* kp = k_new.typed_data();
  const float* vp = v_new.typed_data();
  float* op = out->typed_data();
  const int64_t q_row = a.n_heads * h, kv_row = nk * h, cache_row = s_len * nk * h;
  auto run = [&](auto* k_c, auto* v_c) {
    CpuRuntime& rt = GetCpuRuntime();
    std::lock_guard<std::mutex> lock(rt.mutex);
    auto sequence = [&](int64_t b, ThreadPool& pool) {
      DecodeAttentionArgs ab = a;
      ab.slot = w[2 * b];
      ab.position = w[2 * b + 1];
      DecodeAttention(ab, qp + b * q_row, kp + b * kv_row, vp + b * kv_row, k_c + b * cache_row,
                      v_c + b * cache_row, op + b * q_row, pool);
    };
    if (batch == 1) {
      sequence(0, rt.pool);
    } else {
      rt.pool.Run(0, batch, [&](int64_t b, int /*worker*/) {
        thread_local ThreadPool serial(1);  // this task computes the whole sequence itself
        sequence(b, serial);
      });
    }
  };
  try {
    if (ct == ffi::DataType::F32) {
      run(static_cast<float*>(k_out->untyped_data()), static_cast<float*>(v_out->untyped_data()));
    } else {
      run(static_cast<uint16_t*>(k_out->untyped_data()),
          static_cast<uint16_t*>(v_out->untyped_data()));
    }
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // bad_alloc growing scratch: report, never abort
    return ffi::Error::Internal(std::string("decode_attention: ") + e.what());
  }
}

}  // namespace
}  // namespace pij

XLA_FFI_DEFINE_HANDLER_SYMBOL(PijDecodeAttentionCpu, pij::DecodeAttentionCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // k_new
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // v_new
                                  .Arg<xla::ffi::AnyBuffer>()  // k_cache: f32 or u16 (bf16)
                                  .Arg<xla::ffi::AnyBuffer>()  // v_cache: as k_cache
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // where
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // inv_freq
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // q_norm
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // k_norm
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // out
                                  .Ret<xla::ffi::AnyBuffer>()  // k_cache (aliased)
                                  .Ret<xla::ffi::AnyBuffer>()  // v_cache (aliased)
                                  .Attr<int64_t>("kv_len")
                                  .Attr<float>("rope_factor")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("norm_eps"));
PIJ_CPU_TARGET("pij_decode_attention", PijDecodeAttentionCpu);
