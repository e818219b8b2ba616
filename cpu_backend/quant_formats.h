// The GGUF block formats the quantized kernels read, one traits struct per format, and the one
// place that turns a runtime type id into a format (`VisitQType`).
//
// Layouts (little endian; llama.cpp's ggml-common.h, which the `gguf` package mirrors). A "block"
// is what one scale of the activations covers: 32 weights for the legacy formats, a 256-weight
// super-block for the K-quants. Within a block the kernels walk 32-weight "chunks".
//   type  bytes of a block (in order)               value of weight j
//   Q4_0  d f16 | qs[16]                            d * (q - 8); q: 16 low, then 16 high nibbles
//   Q4_1  d f16 | m f16 | qs[16]                    d * q + m
//   Q5_0  d f16 | qh u32 | qs[16]                   d * (q - 16); q = nibble | (bit j of qh) << 4
//   Q5_1  d f16 | m f16 | qh u32 | qs[16]           d * q + m
//   Q8_0  d f16 | qs s8[32]                         d * q
//   Q2_K  scales[16] | qs[64] | d f16 | dmin f16    d * (sc & 15) * q - dmin * (sc >> 4), sc per 16
//   Q3_K  hmask[32] | qs[64] | scales[12] | d f16   d * (sc - 32) * (q2 + 4 hbit - 4), sc per 16
//   Q4_K  d f16 | dmin f16 | scales[12] | qs[128]   d * sc * q - dmin * m, 6-bit sc, m per 32
//   Q5_K  d | dmin | scales[12] | qh[32] | qs[128]  as Q4_K, with a fifth bit from qh
//   Q6_K  ql[128] | qh[64] | scales s8[16] | d f16  d * sc * (q - 32), sc per 16
// K-quant chunk c (weights 32c .. 32c + 31 of the super-block) reads: Q2_K/Q3_K bits 2(c % 4) of
// qs[32 (c / 4) + l] (and bit c of hmask[l]); Q4_K/Q5_K the low (c even) or high nibbles of
// qs[32 (c / 2) + l] (and bit c of qh[l]); Q6_K nibble c % 4 / 2 of ql[64 (c / 4) + 32 (c % 2) + l]
// and bits 2(c % 4) of qh[32 (c / 4) + l].
//
// Every format unpacks a chunk to unsigned bytes u (signed for Q8_0) with w = s * u + m, s and m
// one pair per 16 weights. `Prep` holds a block's s and m: two floats for the legacy formats, for
// the K-quants 16 of each in two F32x8 (16-weight halves 0-7, then 8-15).
#ifndef PIJ_CPU_BACKEND_QUANT_FORMATS_H_
#define PIJ_CPU_BACKEND_QUANT_FORMATS_H_

#include <cstdint>
#include <utility>

#include "cpu_backend/quant_simd.h"

namespace pij {

// GGML's type ids (the numbers in a GGUF tensor header), for the block formats only.
enum class QType : int32_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

struct QTypeInfo {
  const char* name;
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

// Whether `id` is one of the formats above (F32/F16/BF16 and IQ types are not).
bool IsQType(int32_t id);
QTypeInfo GetQTypeInfo(QType t);
inline int64_t QRowBytes(QType t, int64_t cols) {
  const QTypeInfo info = GetQTypeInfo(t);
  return cols / info.block * info.bytes;
}
// Bytes of a block's scale fields, which down groups (quant_kernels.h AxpyGroup) keep as planes:
// 2 (d) or 4 (d, m) for the 32-weight formats; 0 for the others, which have no down groups.
constexpr int64_t DownGroupScaleBytes(QType t) {
  switch (t) {
    case QType::kQ4_0: case QType::kQ5_0: case QType::kQ8_0: return 2;
    case QType::kQ4_1: case QType::kQ5_1: return 4;
    default: return 0;
  }
}

// Whether a format's down groups hold neuron pairs (AxpyPairs) rather than neuron rows
// (AxpyGroup): the 4-bit formats, whose codes fit an int16 sum of 8-bit products.
constexpr bool DownGroupPairs(QType t) { return t == QType::kQ4_0 || t == QType::kQ4_1; }

// How a matrix handed to a custom call is arranged: the file's rows, or one of the layouts the
// build makes from them (models/qweights.py). The type id a call takes is the format's id with
// at most one of these bits, the one encoding of the arrangement from Python to here
// (checkpoint/quants.py `type_id`: the bit of a type name's suffix).
enum class Arrangement : int32_t {
  kRows = 0,               // the file's rows ("Q4_0")
  kInterleaved = 0x100,    // rows interleaved by 16, quant_interleaved.h ("Q4_0x16")
  kColumns = 0x200,        // input-channel-major, qcolumns.h ("Q4_0c64")
  kDownGroups = 0x400,     // ffn_down's blocks per 32 neurons, quant_kernels.h AxpyGroup ("Q4_0g32")
};
constexpr int32_t kArrangementBits = 0x700;

struct KernelType {
  int32_t format;  // the id without its arrangement bit (IsQType says whether it is a format)
  Arrangement arrangement;
};

// `id` split into its format and arrangement; false where it sets more than one arrangement bit
// or any bit above them.
constexpr bool SplitKernelType(int32_t id, KernelType& out) {
  const int32_t bits = id & kArrangementBits;
  if (id < 0 || id > 0x7ff || (bits & (bits - 1)) != 0) return false;
  out = {id & ~kArrangementBits, static_cast<Arrangement>(bits)};
  return true;
}

// "rows", "interleaved by 16", "columns" or "down groups": for messages.
const char* ArrangementName(Arrangement a);

namespace qfmt {

using qsimd::F32x8;
using qsimd::I8x32;

struct LegacyPrep {
  float s, m;
};
struct KPrep {
  F32x8 s[2], m[2];
};

// Shared by the 32-weight formats: one chunk per block, one (s, m) pair for all of it.
template <QType kT, int kBytesT, bool kSignedT, bool kHasMinT>
struct Legacy {
  static constexpr QType kType = kT;
  static constexpr int kBlock = 32;
  static constexpr int kBytes = kBytesT;
  static constexpr int kChunks = 1;
  static constexpr bool kSigned = kSignedT;
  static constexpr bool kHasMin = kHasMinT;
  using Prep = LegacyPrep;
  // m / s where the minimum is a fixed multiple of the scale (Q4_0, Q5_0); 0 where it is stored
  // (Q4_1, Q5_1) or absent (Q8_0).
  static constexpr float kMinPerScale = 0.0f;
  static const int8_t* PlainQuants(const uint8_t*) { return nullptr; }
};

struct Q4_0 : Legacy<QType::kQ4_0, 18, false, true> {
  static constexpr float kMinPerScale = -8.0f;
  static void Prepare(const uint8_t* b, Prep& p) {
    p.s = qsimd::HalfAt(b);
    p.m = kMinPerScale * p.s;
  }
  static I8x32 Unpack(const uint8_t* b, int) { return qsimd::Nibbles16(b + 2); }
};

struct Q4_1 : Legacy<QType::kQ4_1, 20, false, true> {
  static void Prepare(const uint8_t* b, Prep& p) {
    p.s = qsimd::HalfAt(b);
    p.m = qsimd::HalfAt(b + 2);
  }
  static I8x32 Unpack(const uint8_t* b, int) { return qsimd::Nibbles16(b + 4); }
};

struct Q5_0 : Legacy<QType::kQ5_0, 22, false, true> {
  static constexpr float kMinPerScale = -16.0f;
  static void Prepare(const uint8_t* b, Prep& p) {
    p.s = qsimd::HalfAt(b);
    p.m = kMinPerScale * p.s;
  }
  static I8x32 Unpack(const uint8_t* b, int) {
    const I8x32 high = qsimd::ShiftLeft(qsimd::Bits32(qsimd::LoadU32(b + 2)), 4);
    return qsimd::Or(qsimd::Nibbles16(b + 6), high);
  }
};

struct Q5_1 : Legacy<QType::kQ5_1, 24, false, true> {
  static void Prepare(const uint8_t* b, Prep& p) {
    p.s = qsimd::HalfAt(b);
    p.m = qsimd::HalfAt(b + 2);
  }
  static I8x32 Unpack(const uint8_t* b, int) {
    const I8x32 high = qsimd::ShiftLeft(qsimd::Bits32(qsimd::LoadU32(b + 4)), 4);
    return qsimd::Or(qsimd::Nibbles16(b + 8), high);
  }
};

struct Q8_0 : Legacy<QType::kQ8_0, 34, true, false> {
  static void Prepare(const uint8_t* b, Prep& p) {
    p.s = qsimd::HalfAt(b);
    p.m = 0.0f;
  }
  static I8x32 Unpack(const uint8_t* b, int) { return qsimd::Load32(b + 2); }
  // The weights are stored as plain int8: the float paths widen them straight from memory.
  static const int8_t* PlainQuants(const uint8_t* b) {
    return reinterpret_cast<const int8_t*>(b + 2);
  }
};

// Shared by the 256-weight K-quants: 8 chunks, per-16 (s, m).
template <QType kT, int kBytesT>
struct KQuant {
  static constexpr QType kType = kT;
  static constexpr int kBlock = 256;
  static constexpr int kBytes = kBytesT;
  static constexpr int kChunks = 8;
  static constexpr bool kSigned = false;
  static constexpr bool kHasMin = true;
  using Prep = KPrep;
  static const int8_t* PlainQuants(const uint8_t*) { return nullptr; }
  // The lane-wise scale of chunk c's int32 dot lanes (lanes 0-3: its first 16 weights).
  static F32x8 ChunkScale(const Prep& p, int c) { return qsimd::PairSpread(p.s[c / 4], c % 4); }
};

// Bytes 0-3 of a uint32 in lanes of floats: helpers for the K-quants' packed scales.
inline F32x8 ScaleBytes(uint32_t lo, uint32_t hi) {
  uint8_t bytes[8];
  std::memcpy(bytes, &lo, 4);
  std::memcpy(bytes + 4, &hi, 4);
  return qsimd::U8ToF32(bytes);
}

// The 6-bit scales and mins of Q4_K / Q5_K (12 bytes at p): words w0, w1, w2 hold
//   sc[0..3] = w0 & 63,   m[0..3] = w1 & 63 (bytewise),
//   sc[4..7] = (w2 & 15) | (w0 >> 6) << 4,   m[4..7] = (w2 >> 4) | (w1 >> 6) << 4.
inline void K4Scales(const uint8_t* p, float d, float dmin, KPrep& prep) {
  const uint32_t w0 = qsimd::LoadU32(p), w1 = qsimd::LoadU32(p + 4), w2 = qsimd::LoadU32(p + 8);
  constexpr uint32_t k6 = 0x3f3f3f3fu, k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
  const F32x8 sc = ScaleBytes(w0 & k6, (w2 & k4) | (((w0 >> 6) & k2) << 4));
  const F32x8 m = ScaleBytes(w1 & k6, ((w2 >> 4) & k4) | (((w1 >> 6) & k2) << 4));
  const F32x8 s8 = qsimd::Mul(sc, qsimd::Set1(d));
  const F32x8 m8 = qsimd::Mul(m, qsimd::Set1(-dmin));
  for (int h = 0; h < 2; ++h) {
    prep.s[h] = qsimd::Duplicate(s8, h);
    prep.m[h] = qsimd::Duplicate(m8, h);
  }
}

struct Q2_K : KQuant<QType::kQ2_K, 84> {
  static void Prepare(const uint8_t* b, Prep& p) {
    const float d = qsimd::HalfAt(b + 80), dmin = qsimd::HalfAt(b + 82);
    for (int h = 0; h < 2; ++h) {
      const uint32_t w0 = qsimd::LoadU32(b + 8 * h), w1 = qsimd::LoadU32(b + 8 * h + 4);
      constexpr uint32_t k4 = 0x0f0f0f0fu;
      p.s[h] = qsimd::Mul(ScaleBytes(w0 & k4, w1 & k4), qsimd::Set1(d));
      p.m[h] = qsimd::Mul(ScaleBytes((w0 >> 4) & k4, (w1 >> 4) & k4), qsimd::Set1(-dmin));
    }
  }
  static I8x32 Unpack(const uint8_t* b, int c) {
    return qsimd::Field(qsimd::Load32(b + 16 + 32 * (c / 4)), 2 * (c % 4), 3);
  }
};

struct Q3_K : KQuant<QType::kQ3_K, 110> {
  // 16 6-bit scales in 12 bytes (at b + 96): scale i has low 4 bits from byte i % 8 (low nibble
  // for i < 8, high for i >= 8) and high 2 bits from byte 8 + i % 4, bits 2 (i / 4).
  static void Prepare(const uint8_t* b, Prep& p) {
    const uint8_t* sp = b + 96;
    const uint32_t w0 = qsimd::LoadU32(sp), w1 = qsimd::LoadU32(sp + 4);
    const uint32_t w2 = qsimd::LoadU32(sp + 8);
    constexpr uint32_t k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
    const uint32_t words[4] = {(w0 & k4) | ((w2 & k2) << 4), (w1 & k4) | (((w2 >> 2) & k2) << 4),
                               ((w0 >> 4) & k4) | (((w2 >> 4) & k2) << 4),
                               ((w1 >> 4) & k4) | (((w2 >> 6) & k2) << 4)};
    const float d = qsimd::HalfAt(b + 108);
    for (int h = 0; h < 2; ++h) {
      const F32x8 sc = qsimd::Add(ScaleBytes(words[2 * h], words[2 * h + 1]), qsimd::Set1(-32.0f));
      p.s[h] = qsimd::Mul(sc, qsimd::Set1(d));
      p.m[h] = qsimd::Mul(p.s[h], qsimd::Set1(-4.0f));
    }
  }
  static I8x32 Unpack(const uint8_t* b, int c) {
    const I8x32 low = qsimd::Field(qsimd::Load32(b + 32 + 32 * (c / 4)), 2 * (c % 4), 3);
    return qsimd::Or(low, qsimd::ShiftLeft(qsimd::Field(qsimd::Load32(b), c, 1), 2));
  }
};

struct Q4_K : KQuant<QType::kQ4_K, 144> {
  static void Prepare(const uint8_t* b, Prep& p) {
    K4Scales(b + 4, qsimd::HalfAt(b), qsimd::HalfAt(b + 2), p);
  }
  static I8x32 Unpack(const uint8_t* b, int c) {
    return qsimd::Field(qsimd::Load32(b + 16 + 32 * (c / 2)), 4 * (c % 2), 0x0f);
  }
};

struct Q5_K : KQuant<QType::kQ5_K, 176> {
  static void Prepare(const uint8_t* b, Prep& p) {
    K4Scales(b + 4, qsimd::HalfAt(b), qsimd::HalfAt(b + 2), p);
  }
  static I8x32 Unpack(const uint8_t* b, int c) {
    const I8x32 low = qsimd::Field(qsimd::Load32(b + 48 + 32 * (c / 2)), 4 * (c % 2), 0x0f);
    return qsimd::Or(low, qsimd::ShiftLeft(qsimd::Field(qsimd::Load32(b + 16), c, 1), 4));
  }
};

struct Q6_K : KQuant<QType::kQ6_K, 210> {
  static void Prepare(const uint8_t* b, Prep& p) {
    const float d = qsimd::HalfAt(b + 208);
    for (int h = 0; h < 2; ++h) {
      p.s[h] = qsimd::Mul(qsimd::S8ToF32(reinterpret_cast<const int8_t*>(b + 192 + 8 * h)),
                          qsimd::Set1(d));
      p.m[h] = qsimd::Mul(p.s[h], qsimd::Set1(-32.0f));
    }
  }
  static I8x32 Unpack(const uint8_t* b, int c) {
    const int half = c / 4, j = c % 4;
    const I8x32 low = qsimd::Field(qsimd::Load32(b + 64 * half + 32 * (j % 2)), 4 * (j / 2), 0x0f);
    const I8x32 high = qsimd::Field(qsimd::Load32(b + 128 + 32 * half), 2 * j, 3);
    return qsimd::Or(low, qsimd::ShiftLeft(high, 4));
  }
};

}  // namespace qfmt

// Calls fn(F{}) with the traits struct of `t`: the one format dispatch of the quantized kernels.
template <typename Fn>
decltype(auto) VisitQType(QType t, Fn&& fn) {
  switch (t) {
    case QType::kQ4_0: return std::forward<Fn>(fn)(qfmt::Q4_0{});
    case QType::kQ4_1: return std::forward<Fn>(fn)(qfmt::Q4_1{});
    case QType::kQ5_0: return std::forward<Fn>(fn)(qfmt::Q5_0{});
    case QType::kQ5_1: return std::forward<Fn>(fn)(qfmt::Q5_1{});
    case QType::kQ8_0: return std::forward<Fn>(fn)(qfmt::Q8_0{});
    case QType::kQ2_K: return std::forward<Fn>(fn)(qfmt::Q2_K{});
    case QType::kQ3_K: return std::forward<Fn>(fn)(qfmt::Q3_K{});
    case QType::kQ4_K: return std::forward<Fn>(fn)(qfmt::Q4_K{});
    case QType::kQ5_K: return std::forward<Fn>(fn)(qfmt::Q5_K{});
    case QType::kQ6_K:
    default: return std::forward<Fn>(fn)(qfmt::Q6_K{});  // callers validate with IsQType first
  }
}

}  // namespace pij

#endif  // PIJ_CPU_BACKEND_QUANT_FORMATS_H_
