#include "cpu_backend/qcolumns.h"

#include <cstdint>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "cpu_backend/quant_simd.h"
#include "cpu_backend/quant_simd512.h"

namespace pij {
namespace {

// What the layout stores per format (qcolumns.h): channels per block, channels per scale group,
// head bytes per row per block, and whether a code takes a byte (else a nibble).
struct ColFmt {
  int64_t block, sub, head;
  bool wide;
};

constexpr ColFmt Fmt(QType t) {
  switch (t) {
    case QType::kQ4_0: return {32, 32, 2, false};
    case QType::kQ4_1: return {32, 32, 4, false};
    case QType::kQ8_0: return {32, 32, 2, true};
    case QType::kQ4_K: return {256, 32, 20, false};
    case QType::kQ6_K: return {256, 16, 18, true};
    default: return {0, 0, 0, false};
  }
}

// Bytes from one channel's codes to the next's: the codes of `rows` rows rounded up to an odd
// number of 64-byte lines. A block's channels are read as concurrent streams; at a stride of a
// power-of-two multiple of 2 KiB (a 28672-row matrix: 14 KiB) their lines all fall in 2 of the
// L1's 64 sets and evict each other (the dense product ran 6x slower than at half the
// channels), while an odd number of lines puts 64 consecutive channels in 64 different sets.
int64_t ChannelStride(const ColFmt& f, int64_t rows) {
  const int64_t lines = ((f.wide ? rows : rows / 2) + 63) / 64;
  return 64 * (lines % 2 == 0 ? lines + 1 : lines);
}
// Bytes of a block's head planes (rounded up to whole lines: the codes start on a line), and of
// a whole block.
int64_t HeadBytes(const ColFmt& f, int64_t rows) { return (f.head * rows + 63) / 64 * 64; }
int64_t BlockBytes(const ColFmt& f, int64_t rows) {
  return HeadBytes(f, rows) + f.block * ChannelStride(f, rows);
}

// The row a tile byte holds (qcolumns.h): s for 4-bit tiles (the low nibble; the high one is
// row + 32), s8 for 8-bit tiles.
constexpr int TileRow(int k) {
  const int l = (k >> 4) & 1, q = (k >> 2) & 3, m = k & 3;
  return 8 * q + 4 * l + m;
}
constexpr int TileRow8(int k) { return 32 * (k >> 5) + TileRow(k & 31); }

// The integer dot of the SIMD paths: u unsigned codes, s signed activations. Q8_0's codes are
// stored as q ^ 0x80 (q + 128): vpdpbusd takes them as they are (the +128 comes back out through
// the activations' sum); without VNNI the pair sums of vpmaddubsw would saturate, so they are
// turned back to signed and taken with the sign trick. kQ8Offset: what the sums carry.
#if defined(PIJ_QDOT_AVX512VNNI) || defined(PIJ_QDOT_AVXVNNI)
constexpr int32_t kQ8Offset = 128;
#else
constexpr int32_t kQ8Offset = 0;
#endif

// Per sub-block of the block being computed, for the token group: its nonzero channels in
// groups of four (padded with a channel that is zero for every token of the group), each
// group's four 8-bit activations packed in an int32 per token, and per token the sub-block's
// sum of activations.
struct SubList {
  int32_t n_groups = 0;
  uint16_t chan[64];         // [4 * n_groups] channel index within the block
  int32_t mult[4][16];       // [token][group]
  int32_t qsum[4];           // [token]
};

constexpr int kMaxTok = 4;  // tokens that share a pass over a tile's codes

// Eight int32 sums as floats.
inline qsimd::F32x8 IntsToF32(const int32_t* p) {
#if defined(PIJ_QSIMD_AVX2)
  return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  qsimd::F32x8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
#endif
}

// The epilogue's float lanes: 16 on AVX-512, else 8 (qsimd). Every operation is lane-wise, so a
// row's value does not depend on the width (the portable sums go through the same epilogue).
#if defined(PIJ_QSIMD_AVX512)
struct V {
  __m512 v;
  static constexpr int kW = 16;
};
inline V VSet(float a) { return {_mm512_set1_ps(a)}; }
inline V VLoad(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void VStore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V VHalves(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V VInts(const int32_t* p) { return {_mm512_cvtepi32_ps(_mm512_loadu_si512(p))}; }
inline V VBytes(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline V VMulAdd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V VMul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
#else
struct V {
  qsimd::F32x8 v;
  static constexpr int kW = 8;
};
inline V VSet(float a) { return {qsimd::Set1(a)}; }
inline V VLoad(const float* p) { return {qsimd::Load(p)}; }
inline void VStore(float* p, V a) { qsimd::Store(p, a.v); }
inline V VHalves(const uint8_t* p) { return {qsimd::HalvesToF32(p)}; }
inline V VInts(const int32_t* p) { return {IntsToF32(p)}; }
inline V VBytes(const uint8_t* p) { return {qsimd::U8ToF32(p)}; }
inline V VMulAdd(V a, V b, V c) { return {qsimd::MulAdd(a.v, b.v, c.v)}; }
inline V VMul(V a, V b) { return {qsimd::Mul(a.v, b.v)}; }
#endif

// Builds the lists of block b's sub-blocks for tokens xs[0, nt).
void BuildLists(const ColFmt& f, int64_t b, const QActView* xs, int nt, SubList* lists) {
  const int64_t nsub = f.block / f.sub;
  for (int64_t s = 0; s < nsub; ++s) {
    SubList& L = lists[s];
    const int64_t c0 = b * f.block + s * f.sub;
    int n = 0, pad = -1;
    for (int t = 0; t < nt; ++t) L.qsum[t] = 0;
    for (int64_t j = 0; j < f.sub; ++j) {
      bool any = false;
      for (int t = 0; t < nt; ++t) {
        const int8_t v = xs[t].q[c0 + j];
        L.qsum[t] += v;
        any = any || v != 0;
      }
      if (any) {
        L.chan[n++] = static_cast<uint16_t>(s * f.sub + j);
      } else if (pad < 0) {
        pad = static_cast<int>(s * f.sub + j);
      }
    }
    while (n % 4 != 0) L.chan[n++] = static_cast<uint16_t>(pad);  // n < sub: a zero exists
    L.n_groups = n / 4;
    for (int t = 0; t < nt; ++t) {
      for (int g = 0; g < L.n_groups; ++g) {
        uint32_t packed = 0;
        for (int k = 0; k < 4; ++k) {
          const int8_t v = xs[t].q[b * f.block + L.chan[4 * g + k]];
          packed |= static_cast<uint32_t>(static_cast<uint8_t>(v)) << (8 * k);
        }
        L.mult[t][g] = static_cast<int32_t>(packed);
      }
    }
  }
}

// The lists of one token's blocks, kept per thread for the token its id names (QActView::id).
struct ListCache {
  uint64_t id = 0;
  int64_t block = 0, sub = 0, nblocks = 0;
  std::vector<SubList> lists;  // [nblocks * (block / sub)]
  std::vector<uint8_t> built;  // [nblocks]
};

ListCache& Cached(const QActView& x, const ColFmt& f, int64_t nblocks) {
  thread_local ListCache cache;
  if (cache.id != x.id || cache.block != f.block || cache.sub != f.sub ||
      cache.nblocks != nblocks) {
    cache.id = x.id;
    cache.block = f.block;
    cache.sub = f.sub;
    cache.nblocks = nblocks;
    cache.lists.resize(nblocks * (f.block / f.sub));
    cache.built.assign(nblocks, 0);
  }
  return cache;
}

// ---------------------------------------------------------------------------------------------
// The integer sums of one sub-block over one 64-row tile: S[t][r] = sum over the list's channels
// of code[r] * q_t (codes as stored). `tile` points at the block's codes shifted to this tile;
// channel c's tile at tile + c * chan_bytes.

template <bool kWide, bool kQ8>
void TileSumsPortable(const uint8_t* tile, int64_t chan_bytes, const SubList& L, int nt,
                      int32_t S[kMaxTok][2 * kColTile]) {
  for (int t = 0; t < nt; ++t) std::fill_n(S[t], kColTile, 0);
  for (int g = 0; g < L.n_groups; ++g) {
    for (int k = 0; k < 4; ++k) {
      const uint8_t* p = tile + L.chan[4 * g + k] * chan_bytes;
      int32_t code[kColTile];
      if constexpr (kWide) {
        for (int i = 0; i < 64; ++i) code[TileRow8(i)] = p[i];
        if constexpr (kQ8 && kQ8Offset == 0) {
          for (int r = 0; r < 64; ++r) code[r] = static_cast<int8_t>(code[r] ^ 0x80);
        }
      } else {
        for (int i = 0; i < 32; ++i) {
          code[TileRow(i)] = p[i] & 15;
          code[TileRow(i) + 32] = p[i] >> 4;
        }
      }
      for (int t = 0; t < nt; ++t) {
        const int32_t q = static_cast<int8_t>(static_cast<uint32_t>(L.mult[t][g]) >> (8 * k));
        for (int r = 0; r < kColTile; ++r) S[t][r] += code[r] * q;
      }
    }
  }
}

#if defined(PIJ_QSIMD_AVX2)
// Each group requests its channels' codes kAheadBytes ahead of the tile it reads: a block's
// nonzero channels are 16-32 streams read a line at a time in turn, which the hardware
// prefetchers do not follow (without it the dense product ran 6x slower than the rows kernel).
// Non-temporal (the codes are read once) and ~6 lines ahead were the fastest of the hints and
// distances tried on a 66 MB Q4_0 matrix (0.5-4 KiB; T0, T1, T2, NTA): at half the channels
// 1.4-1.5x the rows kernel, 1.15-1.3x at 1 KiB.
constexpr int64_t kAheadBytes = 384;
inline void Ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kAheadBytes), _MM_HINT_NTA);
}

// The first kStartBytes of each listed channel's codes from `offset` (a block's next streams).
constexpr int64_t kStartBytes = 256;
inline void PrefetchStarts(const uint8_t* codes, int64_t chan_bytes, int64_t offset,
                           const SubList* lists, int64_t nsub) {
  for (int64_t s = 0; s < nsub; ++s) {
    for (int i = 0; i < 4 * lists[s].n_groups; ++i) {
      const uint8_t* p = codes + lists[s].chan[i] * chan_bytes + offset;
      for (int64_t k = 0; k < kStartBytes; k += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + k), _MM_HINT_NTA);
      }
    }
  }
}

// Four channels' 32-byte tiles -> R[q] (q < 4): int32 lane i holds row 8q + i's four codes
// (one byte each, channel order), rows as TileRow lays them out.
inline void Interleave4(__m256i A, __m256i B, __m256i C, __m256i D, __m256i R[4]) {
  const __m256i ab_lo = _mm256_unpacklo_epi8(A, B), ab_hi = _mm256_unpackhi_epi8(A, B);
  const __m256i cd_lo = _mm256_unpacklo_epi8(C, D), cd_hi = _mm256_unpackhi_epi8(C, D);
  R[0] = _mm256_unpacklo_epi16(ab_lo, cd_lo);
  R[1] = _mm256_unpackhi_epi16(ab_lo, cd_lo);
  R[2] = _mm256_unpacklo_epi16(ab_hi, cd_hi);
  R[3] = _mm256_unpackhi_epi16(ab_hi, cd_hi);
}
inline __m256i Load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
#endif

#if defined(PIJ_QSIMD_AVX512)
// Four channels' 64-byte lines -> their bytes interleaved per row (TilePairSums4 / TileSumsN).
inline void Unpack4(const uint8_t* const p[4], int64_t off, __m512i R[4]) {
  const __m512i A = _mm512_loadu_si512(p[0] + off), B = _mm512_loadu_si512(p[1] + off);
  const __m512i C = _mm512_loadu_si512(p[2] + off), D = _mm512_loadu_si512(p[3] + off);
  const __m512i ab_lo = _mm512_unpacklo_epi8(A, B), ab_hi = _mm512_unpackhi_epi8(A, B);
  const __m512i cd_lo = _mm512_unpacklo_epi8(C, D), cd_hi = _mm512_unpackhi_epi8(C, D);
  R[0] = _mm512_unpacklo_epi16(ab_lo, cd_lo);
  R[1] = _mm512_unpackhi_epi16(ab_lo, cd_lo);
  R[2] = _mm512_unpacklo_epi16(ab_hi, cd_hi);
  R[3] = _mm512_unpackhi_epi16(ab_hi, cd_hi);
}

inline __m512i Dot512(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, qsimd512::DotU8S8(u, s));
#endif
}



template <bool kWide, bool kQ8, int kNt>
inline void TileSumsN(const uint8_t* tile, int64_t chan_bytes, const SubList& L,
                      int32_t S[kMaxTok][2 * kColTile]) {
  __m512i acc[kNt][4];
  for (int t = 0; t < kNt; ++t) {
    for (int i = 0; i < 4; ++i) acc[t][i] = _mm512_setzero_si512();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int g = 0; g < L.n_groups; ++g) {
    const uint8_t* p0 = tile + L.chan[4 * g] * chan_bytes;
    const uint8_t* p1 = tile + L.chan[4 * g + 1] * chan_bytes;
    const uint8_t* p2 = tile + L.chan[4 * g + 2] * chan_bytes;
    const uint8_t* p3 = tile + L.chan[4 * g + 3] * chan_bytes;
    Ahead(p0);
    Ahead(p1);
    Ahead(p2);
    Ahead(p3);
    __m512i u[4];
    if constexpr (kWide) {  // 64 bytes a channel: the unpacks per 128-bit lane
      // u[q]: rows 8q .. 8q + 7 and 32 + 8q .. (TileRow8 order)
      const uint8_t* const p[4] = {p0, p1, p2, p3};
      Unpack4(p, 0, u);
      if constexpr (kQ8 && kQ8Offset == 0) {
        for (int i = 0; i < 4; ++i) u[i] = _mm512_xor_si512(u[i], _mm512_set1_epi8(-128));
      }
    } else {
      __m256i R[4];
      Interleave4(Load256(p0), Load256(p1), Load256(p2), Load256(p3), R);
      const __m512i z0 = qsimd512::Pair(R[0], R[1]), z1 = qsimd512::Pair(R[2], R[3]);
      u[0] = _mm512_and_si512(z0, low4);                          // rows 0-15
      u[1] = _mm512_and_si512(z1, low4);                          // rows 16-31
      u[2] = _mm512_and_si512(_mm512_srli_epi16(z0, 4), low4);    // rows 32-47
      u[3] = _mm512_and_si512(_mm512_srli_epi16(z1, 4), low4);    // rows 48-63
    }
    for (int t = 0; t < kNt; ++t) {
      const __m512i x = _mm512_set1_epi32(L.mult[t][g]);
      for (int i = 0; i < 4; ++i) {
        if constexpr (kQ8 && kQ8Offset == 0) {
          acc[t][i] = _mm512_add_epi32(acc[t][i], qsimd512::DotS8S8(u[i], x));
        } else {
          acc[t][i] = Dot512(acc[t][i], u[i], x);
        }
      }
    }
  }
  for (int t = 0; t < kNt; ++t) {
    __m512i n[4];
    if constexpr (kWide) {  // back to row order: 128-bit lanes (0, 1 | 2, 3) of two vectors
      n[0] = _mm512_shuffle_i64x2(acc[t][0], acc[t][1], 0x44);
      n[1] = _mm512_shuffle_i64x2(acc[t][2], acc[t][3], 0x44);
      n[2] = _mm512_shuffle_i64x2(acc[t][0], acc[t][1], 0xee);
      n[3] = _mm512_shuffle_i64x2(acc[t][2], acc[t][3], 0xee);
    } else {
      for (int i = 0; i < 4; ++i) n[i] = acc[t][i];
    }
    for (int i = 0; i < 4; ++i) _mm512_storeu_si512(S[t] + 16 * i, n[i]);
  }
}

// Two tiles (128 rows) of a 4-bit format per group: one 64-byte load per channel (a whole line:
// the channel's two consecutive tiles), the unpacks on 512 bits, half the shuffles per weight of
// the one-tile path. Accumulator q (low nibbles; high: + 32 rows) holds rows 8q .. 8q + 7 of the
// first tile in its 128-bit lanes 0-1 and of the second in lanes 2-3.
template <int kNt>
inline void TilePairSums4(const uint8_t* tile, int64_t chan_bytes, const SubList& L,
                          int32_t S[kMaxTok][2 * kColTile]) {
  __m512i lo[kNt][4], hi[kNt][4];
  for (int t = 0; t < kNt; ++t) {
    for (int i = 0; i < 4; ++i) lo[t][i] = hi[t][i] = _mm512_setzero_si512();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int g = 0; g < L.n_groups; ++g) {
    const uint8_t* p[4];
    for (int k = 0; k < 4; ++k) {
      p[k] = tile + L.chan[4 * g + k] * chan_bytes;
      Ahead(p[k]);
    }
    __m512i R[4];
    Unpack4(p, 0, R);
    __m512i u[4], v[4];
    for (int q = 0; q < 4; ++q) {
      u[q] = _mm512_and_si512(R[q], low4);
      v[q] = _mm512_and_si512(_mm512_srli_epi16(R[q], 4), low4);
    }
    for (int t = 0; t < kNt; ++t) {
      const __m512i x = _mm512_set1_epi32(L.mult[t][g]);
      for (int q = 0; q < 4; ++q) {
        lo[t][q] = Dot512(lo[t][q], u[q], x);
        hi[t][q] = Dot512(hi[t][q], v[q], x);
      }
    }
  }
  for (int t = 0; t < kNt; ++t) {
    int32_t* s = S[t];
    for (int half = 0; half < 2; ++half) {  // 0x44: lanes 0-1 of both (first tile); 0xee: 2-3
      const int imm_rows = 64 * half;
      const auto pick = [&](__m512i a, __m512i b) {
        return half == 0 ? _mm512_shuffle_i64x2(a, b, 0x44) : _mm512_shuffle_i64x2(a, b, 0xee);
      };
      _mm512_storeu_si512(s + imm_rows + 0, pick(lo[t][0], lo[t][1]));
      _mm512_storeu_si512(s + imm_rows + 16, pick(lo[t][2], lo[t][3]));
      _mm512_storeu_si512(s + imm_rows + 32, pick(hi[t][0], hi[t][1]));
      _mm512_storeu_si512(s + imm_rows + 48, pick(hi[t][2], hi[t][3]));
    }
  }
}

template <bool kWide, bool kQ8>
inline void TileSums(const uint8_t* tile, int64_t chan_bytes, const SubList& L, int nt,
                     int32_t S[kMaxTok][2 * kColTile]) {
  switch (nt) {
    case 1: TileSumsN<kWide, kQ8, 1>(tile, chan_bytes, L, S); break;
    case 2: TileSumsN<kWide, kQ8, 2>(tile, chan_bytes, L, S); break;
    case 3: TileSumsN<kWide, kQ8, 3>(tile, chan_bytes, L, S); break;
    default: TileSumsN<kWide, kQ8, 4>(tile, chan_bytes, L, S); break;
  }
}
#elif defined(PIJ_QSIMD_AVX2)
template <bool kWide, bool kQ8>
void TileSums(const uint8_t* tile, int64_t chan_bytes, const SubList& L, int nt,
              int32_t S[kMaxTok][2 * kColTile]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int t = 0; t < nt; ++t) {  // one token at a time: 8 accumulators fill the registers
    __m256i acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
    for (int g = 0; g < L.n_groups; ++g) {
      const uint8_t* p[4];
      for (int k = 0; k < 4; ++k) {
        p[k] = tile + L.chan[4 * g + k] * chan_bytes;
        if (t == 0) Ahead(p[k]);
      }
      const __m256i x = _mm256_set1_epi32(L.mult[t][g]);
      for (int h = 0; h < (kWide ? 2 : 1); ++h) {
        __m256i R[4];
        Interleave4(Load256(p[0] + 32 * h), Load256(p[1] + 32 * h), Load256(p[2] + 32 * h),
                    Load256(p[3] + 32 * h), R);
        for (int q = 0; q < 4; ++q) {
          if constexpr (kWide) {  // rows 32h + 8q ..
            const __m256i d = kQ8 && kQ8Offset == 0
                                  ? qsimd::DotS8S8(_mm256_xor_si256(R[q], _mm256_set1_epi8(-128)), x)
                                  : qsimd::DotU8S8(R[q], x);
            acc[4 * h + q] = _mm256_add_epi32(acc[4 * h + q], d);
          } else {  // rows 8q .. (low nibbles), 32 + 8q .. (high)
            acc[q] = _mm256_add_epi32(acc[q], qsimd::DotU8S8(_mm256_and_si256(R[q], low4), x));
            acc[4 + q] = _mm256_add_epi32(
                acc[4 + q],
                qsimd::DotU8S8(_mm256_and_si256(_mm256_srli_epi16(R[q], 4), low4), x));
          }
        }
      }
    }
    for (int i = 0; i < 8; ++i) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(S[t] + 8 * i), acc[i]);
    }
  }
}
#else
template <bool kWide, bool kQ8>
void TileSums(const uint8_t* tile, int64_t chan_bytes, const SubList& L, int nt,
              int32_t S[kMaxTok][2 * kColTile]) {
  TileSumsPortable<kWide, kQ8>(tile, chan_bytes, L, nt, S);
}
inline void PrefetchStarts(const uint8_t*, int64_t, int64_t, const SubList*, int64_t) {}
#endif

// ---------------------------------------------------------------------------------------------
// One token, channel after channel: acc[r] (r < 64 * ntiles, rows in order) = the sub-block's
// integer sums over ntiles tiles from `tile`, each listed channel's codes read as one run of
// consecutive lines before the next channel's. Short matrices' channels are only a few lines
// (a 768-row expert: 6), and reading a line of every channel in turn (TileSums) left the memory
// system half idle: on 768-row Q4_0 experts at 60% of the channels, 2 threads, the same lines
// read channel after channel took 0.66x the time of line after line. The accumulators live in
// acc (L1) between channel groups; integer sums, so the order changes no bit. Taken for row
// ranges of at most kChannelRows: on longer ones (a 7B model's 4096- and 14336-row matrices)
// line after line with its prefetches ahead in each channel stayed faster (0.9x and 0.77x).
constexpr int64_t kChannelRows = 2048;  // acc: 8 KiB

#if defined(PIJ_QSIMD_AVX2)
// The next block's runs, requested spread over this block's channel groups (ChannelSums):
// after `done` of this block's n groups, the first done / n of the next block's channels.
struct RunsAhead {
  const uint8_t* base;  // the next block's codes at this range's first tile; nullptr: none
  const SubList* list;  // its channels
  int64_t chan_bytes, run;
  int issued = 0;
  void After(int done, int n) {
    if (base == nullptr) return;
    for (const int until = 4 * list->n_groups * done / n; issued < until; ++issued) {
      const uint8_t* q = base + list->chan[issued] * chan_bytes;
      for (int64_t k = 0; k < run; k += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(q + k), _MM_HINT_T0);
      }
    }
  }
};
#endif

#if defined(PIJ_QSIMD_AVX512)
template <bool kWide, bool kQ8>
void ChannelSums(const uint8_t* tile, int64_t chan_bytes, const SubList& L, int64_t ntiles,
                 int32_t* acc, const uint8_t* ahead, const SubList* ahead_list) {
  std::fill_n(acc, 64 * ntiles, 0);
  RunsAhead runs_ahead{ahead, ahead_list, chan_bytes, ntiles * (kWide ? 64 : 32)};
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  // two groups (eight channels) per pass over the accumulators
  for (int g0 = 0; g0 < L.n_groups; g0 += 2) {
    const int ng = std::min(2, L.n_groups - g0);
    const uint8_t* p[2][4];
    __m512i x[2];
    for (int j = 0; j < ng; ++j) {
      for (int k = 0; k < 4; ++k) p[j][k] = tile + L.chan[4 * (g0 + j) + k] * chan_bytes;
      x[j] = _mm512_set1_epi32(L.mult[0][g0 + j]);
    }
    runs_ahead.After(g0 + ng, L.n_groups);
    int64_t i = 0;
    if constexpr (!kWide) {
      for (; i + 2 <= ntiles; i += 2) {  // a line per channel: two tiles (TilePairSums4's order)
        int32_t* a = acc + 64 * i;  // raw order: lo[q] at 16q, hi[q] at 64 + 16q
        __m512i lo[4], hi[4];
        for (int q = 0; q < 4; ++q) {
          lo[q] = _mm512_loadu_si512(a + 16 * q);
          hi[q] = _mm512_loadu_si512(a + 64 + 16 * q);
        }
        for (int j = 0; j < ng; ++j) {
          __m512i R[4];
          Unpack4(p[j], 32 * i, R);
          for (int q = 0; q < 4; ++q) {
            lo[q] = Dot512(lo[q], _mm512_and_si512(R[q], low4), x[j]);
            hi[q] = Dot512(hi[q], _mm512_and_si512(_mm512_srli_epi16(R[q], 4), low4), x[j]);
          }
        }
        for (int q = 0; q < 4; ++q) {
          _mm512_storeu_si512(a + 16 * q, lo[q]);
          _mm512_storeu_si512(a + 64 + 16 * q, hi[q]);
        }
      }
      if (i < ntiles) {  // a last single tile: rows in order
        int32_t* a = acc + 64 * i;
        for (int j = 0; j < ng; ++j) {
          __m256i R[4];
          Interleave4(Load256(p[j][0] + 32 * i), Load256(p[j][1] + 32 * i),
                      Load256(p[j][2] + 32 * i), Load256(p[j][3] + 32 * i), R);
          const __m512i z0 = qsimd512::Pair(R[0], R[1]), z1 = qsimd512::Pair(R[2], R[3]);
          const __m512i u[4] = {_mm512_and_si512(z0, low4), _mm512_and_si512(z1, low4),
                                _mm512_and_si512(_mm512_srli_epi16(z0, 4), low4),
                                _mm512_and_si512(_mm512_srli_epi16(z1, 4), low4)};
          for (int q = 0; q < 4; ++q) {
            _mm512_storeu_si512(a + 16 * q, Dot512(_mm512_loadu_si512(a + 16 * q), u[q], x[j]));
          }
        }
      }
    } else {
      for (; i < ntiles; ++i) {  // a line per channel and tile (TileSumsN's wide order)
        int32_t* a = acc + 64 * i;
        __m512i sum[4];
        for (int q = 0; q < 4; ++q) sum[q] = _mm512_loadu_si512(a + 16 * q);
        for (int j = 0; j < ng; ++j) {
          __m512i u[4];
          Unpack4(p[j], 64 * i, u);
          for (int q = 0; q < 4; ++q) {
            if constexpr (kQ8 && kQ8Offset == 0) {
              sum[q] = _mm512_add_epi32(
                  sum[q], qsimd512::DotS8S8(_mm512_xor_si512(u[q], _mm512_set1_epi8(-128)), x[j]));
            } else {
              sum[q] = Dot512(sum[q], u[q], x[j]);
            }
          }
        }
        for (int q = 0; q < 4; ++q) _mm512_storeu_si512(a + 16 * q, sum[q]);
      }
    }
  }
  // the raw orders back to rows
  for (int64_t i = 0; i < ntiles;) {
    int32_t* a = acc + 64 * i;
    if (!kWide && i + 2 > ntiles) break;  // the single tile is in order
    __m512i r[8];
    for (int k = 0; k < (kWide ? 4 : 8); ++k) r[k] = _mm512_loadu_si512(a + 16 * k);
    if constexpr (kWide) {  // 128-bit lanes (0, 1 | 2, 3) of two vectors
      _mm512_storeu_si512(a + 0, _mm512_shuffle_i64x2(r[0], r[1], 0x44));
      _mm512_storeu_si512(a + 16, _mm512_shuffle_i64x2(r[2], r[3], 0x44));
      _mm512_storeu_si512(a + 32, _mm512_shuffle_i64x2(r[0], r[1], 0xee));
      _mm512_storeu_si512(a + 48, _mm512_shuffle_i64x2(r[2], r[3], 0xee));
      i += 1;
    } else {  // lo[q] at 16q, hi[q] at 64 + 16q -> two tiles of rows
      _mm512_storeu_si512(a + 0, _mm512_shuffle_i64x2(r[0], r[1], 0x44));
      _mm512_storeu_si512(a + 16, _mm512_shuffle_i64x2(r[2], r[3], 0x44));
      _mm512_storeu_si512(a + 32, _mm512_shuffle_i64x2(r[4], r[5], 0x44));
      _mm512_storeu_si512(a + 48, _mm512_shuffle_i64x2(r[6], r[7], 0x44));
      _mm512_storeu_si512(a + 64, _mm512_shuffle_i64x2(r[0], r[1], 0xee));
      _mm512_storeu_si512(a + 80, _mm512_shuffle_i64x2(r[2], r[3], 0xee));
      _mm512_storeu_si512(a + 96, _mm512_shuffle_i64x2(r[4], r[5], 0xee));
      _mm512_storeu_si512(a + 112, _mm512_shuffle_i64x2(r[6], r[7], 0xee));
      i += 2;
    }
  }
}
#elif defined(PIJ_QSIMD_AVX2)
template <bool kWide, bool kQ8>
void ChannelSums(const uint8_t* tile, int64_t chan_bytes, const SubList& L, int64_t ntiles,
                 int32_t* acc, const uint8_t* ahead, const SubList* ahead_list) {
  std::fill_n(acc, 64 * ntiles, 0);
  RunsAhead runs_ahead{ahead, ahead_list, chan_bytes, ntiles * (kWide ? 64 : 32)};
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int g = 0; g < L.n_groups; ++g) {
    const uint8_t* p[4];
    for (int k = 0; k < 4; ++k) p[k] = tile + L.chan[4 * g + k] * chan_bytes;
    runs_ahead.After(g + 1, L.n_groups);
    const __m256i x = _mm256_set1_epi32(L.mult[0][g]);
    for (int64_t i = 0; i < ntiles; ++i) {
      __m256i* a = reinterpret_cast<__m256i*>(acc + 64 * i);  // rows in order (TileSums)
      constexpr int64_t kTile = kWide ? 64 : 32;
      for (int h = 0; h < (kWide ? 2 : 1); ++h) {
        __m256i R[4];
        Interleave4(Load256(p[0] + kTile * i + 32 * h), Load256(p[1] + kTile * i + 32 * h),
                    Load256(p[2] + kTile * i + 32 * h), Load256(p[3] + kTile * i + 32 * h), R);
        for (int q = 0; q < 4; ++q) {
          if constexpr (kWide) {
            const __m256i d = kQ8 && kQ8Offset == 0
                                  ? qsimd::DotS8S8(_mm256_xor_si256(R[q], _mm256_set1_epi8(-128)), x)
                                  : qsimd::DotU8S8(R[q], x);
            _mm256_storeu_si256(a + 4 * h + q,
                                _mm256_add_epi32(_mm256_loadu_si256(a + 4 * h + q), d));
          } else {
            const __m256i dl = qsimd::DotU8S8(_mm256_and_si256(R[q], low4), x);
            const __m256i dh =
                qsimd::DotU8S8(_mm256_and_si256(_mm256_srli_epi16(R[q], 4), low4), x);
            _mm256_storeu_si256(a + q, _mm256_add_epi32(_mm256_loadu_si256(a + q), dl));
            _mm256_storeu_si256(a + 4 + q, _mm256_add_epi32(_mm256_loadu_si256(a + 4 + q), dh));
          }
        }
      }
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// One format's product over rows [lo, hi) (whole tiles).
template <QType kT>
void Rows(const uint8_t* w, int64_t rows, int64_t cols, std::span<const QActView> xs,
          int64_t lo, int64_t hi, const float* bias, float* y, bool portable,
          int64_t b_lo = 0, int64_t b_hi = -1) {
  constexpr ColFmt f = Fmt(kT);
  constexpr bool kWide = f.wide, kQ8 = kT == QType::kQ8_0, kK = f.block == 256;
  constexpr int64_t kNsub = f.block / f.sub;
  constexpr int64_t kTileBytes = kWide ? 64 : 32;
  const int64_t nblocks = cols / f.block;
  const int64_t chan_bytes = ChannelStride(f, rows);
  const int64_t block_bytes = BlockBytes(f, rows);
  const int64_t n_tok = static_cast<int64_t>(xs.size());
  const int64_t span = hi - lo;
  for (int64_t t = 0; t < n_tok; ++t) std::fill_n(y + t * rows + lo, span, 0.0f);
  if (b_hi < 0) b_hi = nblocks;
  SubList lists_a[kNsub], lists_b[kNsub];
  SubList* lists = lists_a;
  SubList* next = lists_b;
  alignas(64) int32_t S[kMaxTok][2 * kColTile];
  // K-quants: per token and row, the super-block's integer sum and (Q4_K) its minimums' sum
  thread_local std::vector<int32_t> tot;
  thread_local std::vector<float> mins;
  if constexpr (kK) {
    tot.resize(kMaxTok * span);
    mins.resize(kMaxTok * span);
  }
  for (int64_t t0 = 0; t0 < n_tok; t0 += kMaxTok) {
    const int nt = static_cast<int>(std::min<int64_t>(kMaxTok, n_tok - t0));
#if defined(PIJ_QSIMD_AVX2)
    const bool channel_order = !portable && nt == 1 && span <= kChannelRows;
#else
    constexpr bool channel_order = false;
#endif
    const QActView* xg = xs.data() + t0;
    // One token whose view has an id: its lists from this thread's cache (an MoE token's
    // gate and up of every routed expert share them), else built into lists / next in turn.
    ListCache* cache = nt == 1 && xg[0].id != 0 ? &Cached(xg[0], f, nblocks) : nullptr;
    const auto build = [&](int64_t b, SubList*& out) {
      if (cache == nullptr) {
        BuildLists(f, b, xg, nt, out);
        return;
      }
      out = cache->lists.data() + b * kNsub;
      if (!cache->built[b]) {
        BuildLists(f, b, xg, 1, out);
        cache->built[b] = 1;
      }
    };
    if (b_lo < b_hi) build(b_lo, next);
    for (int64_t b = b_lo; b < b_hi; ++b) {
      const uint8_t* head = w + b * block_bytes;
      const uint8_t* codes = head + HeadBytes(f, rows);
      std::swap(lists, next);
      if (b + 1 < b_hi) {
        // The next block's channels: their first lines requested now, so its streams start
        // warm (a task's run of a channel can be only a few lines: a 4096-row matrix, 2 KiB).
        build(b + 1, next);
        if (!portable && !channel_order) {
          PrefetchStarts(w + (b + 1) * block_bytes + HeadBytes(f, rows), chan_bytes,
                         lo * kTileBytes / kColTile, next, kNsub);
        }
#if defined(PIJ_QSIMD_AVX2)
        if (channel_order && lo == 0 && hi == rows) {  // the next block's scales
          for (int64_t k = 0; k < HeadBytes(f, rows); k += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(w + (b + 1) * block_bytes + k),
                         _MM_HINT_T0);
          }
        }
#endif
      }
      float dx[kMaxTok];
      for (int t = 0; t < nt; ++t) dx[t] = xg[t].d[b];
      if constexpr (kK) {
        std::fill_n(tot.data(), nt * span, 0);
        std::fill_n(mins.data(), nt * span, 0.0f);
      }
      for (int64_t s = 0; s < kNsub; ++s) {
        const SubList& L = lists[s];
        if (L.n_groups == 0) continue;  // no channel of any token: nothing to add
        // per token t, rows [r0, r0 + n): y += the sub-block's sums st, scaled
        const auto scale = [&](int t, int64_t r0, int64_t n, const int32_t* st) {
          float* yt = y + (t0 + t) * rows + r0;
          if constexpr (kT == QType::kQ4_0 || kT == QType::kQ8_0) {
            // d * (dx * S + off * dx * sum q): Q4_0's -8, Q8_0's stored +128
            const float off = (kT == QType::kQ4_0 ? -8.0f : -static_cast<float>(kQ8Offset)) *
                              (dx[t] * static_cast<float>(L.qsum[t]));
            const V vdx = VSet(dx[t]), voff = VSet(off);
            for (int64_t i = 0; i < n; i += V::kW) {
              const V v = VMulAdd(VInts(st + i), vdx, voff);
              VStore(yt + i, VMulAdd(VHalves(head + 2 * (r0 + i)), v, VLoad(yt + i)));
            }
          } else if constexpr (kT == QType::kQ4_1) {
            const V vdx = VSet(dx[t]), vc = VSet(dx[t] * static_cast<float>(L.qsum[t]));
            for (int64_t i = 0; i < n; i += V::kW) {
              const V v = VMul(VInts(st + i), vdx);
              const V acc = VMulAdd(VHalves(head + 2 * (r0 + i)), v, VLoad(yt + i));
              VStore(yt + i, VMulAdd(VHalves(head + 2 * rows + 2 * (r0 + i)), vc, acc));
            }
          } else if constexpr (kT == QType::kQ4_K) {
            const uint8_t* sc = head + 4 * rows + s * rows + r0;
            const uint8_t* mn = head + 12 * rows + s * rows + r0;
            int32_t* tt = tot.data() + t * span + (r0 - lo);
            float* mt = mins.data() + t * span + (r0 - lo);
            for (int64_t i = 0; i < n; ++i) tt[i] += static_cast<int32_t>(sc[i]) * st[i];
            const V vc = VSet(dx[t] * static_cast<float>(L.qsum[t]));
            for (int64_t i = 0; i < n; i += V::kW) {
              VStore(mt + i, VMulAdd(VBytes(mn + i), vc, VLoad(mt + i)));
            }
          } else {  // Q6_K: sc * (S - 32 * sum q)
            const int8_t* sc = reinterpret_cast<const int8_t*>(head + 2 * rows + s * rows + r0);
            int32_t* tt = tot.data() + t * span + (r0 - lo);
            const int32_t off = 32 * L.qsum[t];
            for (int64_t i = 0; i < n; ++i) tt[i] += static_cast<int32_t>(sc[i]) * (st[i] - off);
          }
        };
#if defined(PIJ_QSIMD_AVX2)
        if (channel_order) {  // one token, a short range: channel after channel
          alignas(64) int32_t acc[kChannelRows];
          const bool last = b + 1 >= b_hi;
          ChannelSums<kWide, kQ8>(codes + (lo / kColTile) * kTileBytes, chan_bytes, L,
                                  span / kColTile, acc,
                                  last ? nullptr
                                       : w + (b + 1) * block_bytes + HeadBytes(f, rows) +
                                             (lo / kColTile) * kTileBytes,
                                  last ? nullptr : &next[s]);
          scale(0, lo, span, acc);
          continue;
        }
#endif
        for (int64_t r0 = lo; r0 < hi;) {
          const uint8_t* tile = codes + (r0 / kColTile) * kTileBytes;
          int64_t n = kColTile;
          if (portable) {
            TileSumsPortable<kWide, kQ8>(tile, chan_bytes, L, nt, S);
          } else {
#if defined(PIJ_QSIMD_AVX512)
            if (!kWide && nt <= 2 && r0 + 2 * kColTile <= hi) {  // two tiles a pass
              n = 2 * kColTile;
              if (nt == 1) {
                TilePairSums4<1>(tile, chan_bytes, L, S);
              } else {
                TilePairSums4<2>(tile, chan_bytes, L, S);
              }
            } else {
              TileSums<kWide, kQ8>(tile, chan_bytes, L, nt, S);
            }
#else
            TileSums<kWide, kQ8>(tile, chan_bytes, L, nt, S);
#endif
          }
          for (int t = 0; t < nt; ++t) scale(t, r0, n, S[t]);
          r0 += n;
        }
      }
      if constexpr (kK) {  // the super-block's scales
        for (int t = 0; t < nt; ++t) {
          float* yt = y + (t0 + t) * rows + lo;
          const int32_t* tt = tot.data() + t * span;
          const float* mt = mins.data() + t * span;
          const V vdx = VSet(dx[t]);
          for (int64_t i = 0; i < span; i += V::kW) {
            V acc = VMulAdd(VHalves(head + 2 * (lo + i)), VMul(VInts(tt + i), vdx), VLoad(yt + i));
            if constexpr (kT == QType::kQ4_K) {
              acc = VMulAdd(VMul(VHalves(head + 2 * rows + 2 * (lo + i)), VSet(-1.0f)),
                            VLoad(mt + i), acc);
            }
            VStore(yt + i, acc);
          }
        }
      }
    }
  }
  if (bias != nullptr) {
    for (int64_t t = 0; t < n_tok; ++t) {
      for (int64_t r = lo; r < hi; ++r) y[t * rows + r] += bias[r];
    }
  }
}

template <typename Fn>
void VisitColumns(QType t, Fn&& fn) {
  switch (t) {
    case QType::kQ4_0: fn.template operator()<QType::kQ4_0>(); break;
    case QType::kQ4_1: fn.template operator()<QType::kQ4_1>(); break;
    case QType::kQ8_0: fn.template operator()<QType::kQ8_0>(); break;
    case QType::kQ4_K: fn.template operator()<QType::kQ4_K>(); break;
    case QType::kQ6_K: fn.template operator()<QType::kQ6_K>(); break;
    default: break;  // callers check ColumnsType
  }
}

// ---------------------------------------------------------------------------------------------
// The file's values of one row's block: codes[block] (as the layout stores them) and the head
// fields, through the row kernels' own unpacking (quant_formats.h).
template <class F>
void DecodeBlock(const uint8_t* blk, uint8_t* codes, uint16_t* halves, uint8_t* sc, uint8_t* mn) {
  for (int c = 0; c < F::kChunks; ++c) {
    uint8_t bytes[32];
#if defined(PIJ_QSIMD_AVX2)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bytes), F::Unpack(blk, c));
#else
    std::memcpy(bytes, F::Unpack(blk, c).v, 32);
#endif
    for (int i = 0; i < 32; ++i) {
      codes[32 * c + i] = F::kType == QType::kQ8_0 ? static_cast<uint8_t>(bytes[i] ^ 0x80)
                                                   : bytes[i];
    }
  }
  if constexpr (F::kType == QType::kQ4_0 || F::kType == QType::kQ8_0) {
    halves[0] = qsimd::LoadU16(blk);
  } else if constexpr (F::kType == QType::kQ4_1) {
    halves[0] = qsimd::LoadU16(blk);
    halves[1] = qsimd::LoadU16(blk + 2);
  } else if constexpr (F::kType == QType::kQ4_K) {
    halves[0] = qsimd::LoadU16(blk);
    halves[1] = qsimd::LoadU16(blk + 2);
    const uint8_t* q = blk + 4;  // 6-bit scale and min of sub-block j (llama.cpp's layout)
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
      } else {
        sc[j] = static_cast<uint8_t>((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        mn[j] = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
      }
    }
  } else if constexpr (F::kType == QType::kQ6_K) {
    halves[0] = qsimd::LoadU16(blk + 208);
    std::memcpy(sc, blk + 192, 16);
  }
}

template <class F>
void ArrangeRowRange(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst, int64_t lo,
                     int64_t hi) {
  constexpr ColFmt f = Fmt(F::kType);
  const int64_t nblocks = cols / f.block;
  const int64_t row_bytes = QRowBytes(F::kType, cols);
  const int64_t chan_bytes = ChannelStride(f, rows);
  const int64_t block_bytes = BlockBytes(f, rows);
  static constexpr auto kRowOf4 = [] {  // byte k of a 4-bit tile: its low nibble's row
    std::array<uint8_t, 32> a{};
    for (int k = 0; k < 32; ++k) a[k] = static_cast<uint8_t>(TileRow(k));
    return a;
  }();
  static constexpr auto kRowOf8 = [] {
    std::array<uint8_t, 64> a{};
    for (int k = 0; k < 64; ++k) a[k] = static_cast<uint8_t>(TileRow8(k));
    return a;
  }();
  // one tile's rows of one block at a time: the rows' blocks decoded, then each channel's
  // tile bytes written whole (a row at a time wrote one nibble per channel, ~75 MB/s)
  std::vector<uint8_t> codes(kColTile * f.block);
  uint8_t sc[16], mn[8];
  uint16_t halves[2];
  for (int64_t r0 = lo; r0 < hi; r0 += kColTile) {
    const int64_t tile = r0 / kColTile;
    for (int64_t b = 0; b < nblocks; ++b) {
      uint8_t* head = dst + b * block_bytes;
      for (int64_t i = 0; i < kColTile; ++i) {
        const int64_t r = r0 + i;
        DecodeBlock<F>(src + r * row_bytes + b * F::kBytes, codes.data() + i * f.block, halves,
                       sc, mn);
        std::memcpy(head + 2 * r, &halves[0], 2);
        if constexpr (F::kType == QType::kQ4_1 || F::kType == QType::kQ4_K) {
          std::memcpy(head + 2 * rows + 2 * r, &halves[1], 2);
        }
        if constexpr (F::kType == QType::kQ4_K) {
          for (int j = 0; j < 8; ++j) {
            head[4 * rows + j * rows + r] = sc[j];
            head[12 * rows + j * rows + r] = mn[j];
          }
        }
        if constexpr (F::kType == QType::kQ6_K) {
          for (int j = 0; j < 16; ++j) head[2 * rows + j * rows + r] = sc[j];
        }
      }
      uint8_t* cbase = head + HeadBytes(f, rows);
      for (int64_t j = 0; j < f.block; ++j) {
        uint8_t* t = cbase + j * chan_bytes + tile * (f.wide ? 64 : 32);
        if constexpr (f.wide) {
          for (int k = 0; k < 64; ++k) t[k] = codes[kRowOf8[k] * f.block + j];
        } else {
          for (int k = 0; k < 32; ++k) {
            t[k] = static_cast<uint8_t>(codes[kRowOf4[k] * f.block + j] |
                                        (codes[(kRowOf4[k] + 32) * f.block + j] << 4));
          }
        }
      }
    }
  }
}

}  // namespace

bool CanArrangeColumns(QType t, int64_t rows, int64_t cols) {
  const ColFmt f = Fmt(t);
  return ColumnsType(t) && rows > 0 && rows % kColTile == 0 && cols > 0 && cols % f.block == 0;
}

int64_t ColumnsRowBytes(QType t, int64_t rows, int64_t cols) {
  const ColFmt f = Fmt(t);
  const int64_t total = cols / f.block * BlockBytes(f, rows);
  return (total + rows - 1) / rows;
}

void ArrangeColumns(const uint8_t* src, QType t, int64_t rows, int64_t cols, uint8_t* dst,
                    ThreadPool& pool) {
  VisitQType(t, [&]<class F>(F) {
    if constexpr (ColumnsType(F::kType)) {
      // whole tiles per task: a tile's bytes are written by one task (nibbles share bytes)
      const int64_t tiles = rows / kColTile;
      const int64_t tasks = std::min<int64_t>(tiles, 4 * pool.NumThreads());
      pool.Run(0, tasks, [&](int64_t task, int /*worker*/) {
        ArrangeRowRange<F>(src, rows, cols, dst, tiles * task / tasks * kColTile,
                           tiles * (task + 1) / tasks * kColTile);
      });
    }
  });
}

void DequantizeColumns(const uint8_t* w, QType t, int64_t rows, int64_t cols, float* out) {
  const ColFmt f = Fmt(t);
  const int64_t nblocks = cols / f.block;
  const int64_t chan_bytes = ChannelStride(f, rows);
  const int64_t block_bytes = BlockBytes(f, rows);
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* head = w + b * block_bytes;
    const uint8_t* codes = head + HeadBytes(f, rows);
    for (int64_t r = 0; r < rows; ++r) {
      const float d = qsimd::HalfAt(head + 2 * r);
      for (int64_t j = 0; j < f.block; ++j) {
        const uint8_t* tile = codes + j * chan_bytes + (r / kColTile) * (f.wide ? 64 : 32);
        const int in_tile = static_cast<int>(r % kColTile);
        int32_t code = 0;
        if (f.wide) {
          for (int k = 0; k < 64; ++k) {
            if (TileRow8(k) == in_tile) code = tile[k];
          }
        } else {
          for (int k = 0; k < 32; ++k) {
            if (TileRow(k) == in_tile % 32) code = in_tile < 32 ? tile[k] & 15 : tile[k] >> 4;
          }
        }
        float v = 0.0f;
        switch (t) {
          case QType::kQ4_0: v = d * static_cast<float>(code - 8); break;
          case QType::kQ4_1: v = d * static_cast<float>(code) + qsimd::HalfAt(head + 2 * rows + 2 * r); break;
          case QType::kQ8_0: v = d * static_cast<float>(static_cast<int8_t>(code ^ 0x80)); break;
          case QType::kQ4_K: {
            const int64_t s = j / 32;
            const float dmin = qsimd::HalfAt(head + 2 * rows + 2 * r);
            v = d * static_cast<float>(head[4 * rows + s * rows + r]) * static_cast<float>(code) -
                dmin * static_cast<float>(head[12 * rows + s * rows + r]);
            break;
          }
          case QType::kQ6_K: {
            const int64_t s = j / 16;
            const auto sc = static_cast<int8_t>(head[2 * rows + s * rows + r]);
            v = d * static_cast<float>(sc) * static_cast<float>(code - 32);
            break;
          }
          default: break;
        }
        out[r * cols + b * f.block + j] = v;
      }
    }
  }
}

void QLinearColumnsRows(const uint8_t* w, QType t, int64_t rows, int64_t cols,
                        std::span<const QActView> xs, int64_t lo, int64_t hi, const float* bias,
                        float* y, bool portable) {
  if (lo >= hi || xs.empty()) return;
  VisitColumns(t, [&]<QType kT>() { Rows<kT>(w, rows, cols, xs, lo, hi, bias, y, portable); });
}

void QLinearColumnsBlocks(const uint8_t* w, QType t, int64_t rows, int64_t cols,
                          std::span<const QActView> xs, int64_t b_lo, int64_t b_hi, float* y) {
  if (b_lo >= b_hi || xs.empty()) return;
  VisitColumns(t, [&]<QType kT>() {
    Rows<kT>(w, rows, cols, xs, 0, rows, nullptr, y, false, b_lo, b_hi);
  });
}

int64_t ColumnsBlocks(QType t, int64_t cols) { return cols / Fmt(t).block; }

void QLinearColumnsDecode(std::span<const QLinearOut> outs, int64_t dim, const QActView& x32,
                          const QActView& x256, std::vector<float>& scratch, ThreadPool& pool) {
  // Each matrix split along its input into one block range per thread, every row in each: a
  // task's stream of a channel is the whole column (14 KiB for a 28672-row Q4_0 gate/up).
  // Range 0 writes y, the others partial sums added in range order after.
  struct Task {
    int out;
    int64_t b_lo, b_hi;
    float* y;
  };
  const int64_t threads = std::max(1, pool.NumThreads());
  std::vector<Task> tasks;
  int64_t scratch_size = 0;
  for (const QLinearOut& o : outs) {
    const int64_t split = std::min<int64_t>(threads, dim / Fmt(o.qtype).block);
    scratch_size += (split - 1) * o.out_dim;
  }
  if (static_cast<int64_t>(scratch.size()) < scratch_size) scratch.resize(scratch_size);
  float* part = scratch.data();
  for (size_t i = 0; i < outs.size(); ++i) {
    const QLinearOut& o = outs[i];
    const int64_t nb = dim / Fmt(o.qtype).block;
    const int64_t split = std::min<int64_t>(threads, nb);
    for (int64_t k = 0; k < split; ++k) {
      tasks.push_back({static_cast<int>(i), nb * k / split, nb * (k + 1) / split,
                       k == 0 ? o.y : part});
      if (k > 0) part += o.out_dim;
    }
  }
  pool.Run(0, static_cast<int64_t>(tasks.size()), [&](int64_t i, int /*worker*/) {
    const Task& t = tasks[i];
    const QLinearOut& o = outs[t.out];
    const QActView& x = Fmt(o.qtype).block == 256 ? x256 : x32;
    VisitColumns(o.qtype, [&]<QType kT>() {
      Rows<kT>(o.w, o.out_dim, dim, {&x, 1}, 0, o.out_dim, nullptr, t.y, false, t.b_lo, t.b_hi);
    });
  });
  part = scratch.data();
  for (const QLinearOut& o : outs) {  // the partial sums in range order, then the bias
    const int64_t split = std::min<int64_t>(threads, dim / Fmt(o.qtype).block);
    for (int64_t k = 1; k < split; ++k, part += o.out_dim) {
      for (int64_t r = 0; r < o.out_dim; ++r) o.y[r] += part[r];
    }
    if (o.bias != nullptr) {
      for (int64_t r = 0; r < o.out_dim; ++r) o.y[r] += o.bias[r];
    }
  }
}

}  // namespace pij
