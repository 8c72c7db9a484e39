// XLA FFI handler for products with a weight kept in GGUF's quantized blocks (llama.cpp's layout):
//   y[n, f] = sum_k x[n, k] * w[f, k]     (x [N, K] float32, w [F, K / E, B] bytes, y [N, F] float32)
// where each row of w is K / E blocks of B bytes holding E values each. The block's byte count names
// its kind:
//   Q4_0 (18 bytes, 32 values): float16 d, 16 bytes of nibbles;       w = d * (q - 8)
//   Q4_1 (20 bytes, 32 values): float16 d and m, 16 bytes of nibbles; w = d * q + m
//   Q8_0 (34 bytes, 32 values): float16 d, 32 int8;                   w = d * q
//   Q4_K (144 bytes, 256 values): float16 d and dmin, 12 bytes of 6-bit sub-scales and sub-mins for
//     8 sub-blocks of 32, 128 bytes of nibbles;                       w = d * sc_j * q - dmin * m_j
// Every kind is read as sub-blocks of 32 values in two halves of 16 (a half is 16 bytes, its nibbles
// at one shift, or 16 int8): in Q4_0/Q4_1 the low nibbles of the 16 bytes are values 0-15 and the high
// ones 16-31; in Q4_K each 32 bytes hold sub-block 2i in their low nibbles and 2i+1 in their high ones.
//
// Two paths. The exact one (handler "product") takes x in float32. The integer one ("rounded_product";
// every kind; below) first rounds x to two layers of 8-bit integers a sub-block and multiplies
// integers, about twice as fast; dew.kernels.blocks says which one a product takes.
//
// Decoding reads every weight once per token, so the speed is the speed of streaming the blocks: they
// are widened to float32 in registers and never written back as floats. Each sub-block's products with
// x sum in float32 and its scale multiplies that partial sum; an offset (Q4_1's m, Q4_K's mins) times
// the sub-block's sum of x (summed once per call) is added beside it. Q4_0 subtracts its 8 from the
// integers before widening, so no offset term is needed.
//
// One binary runs on every x86-64: the AVX-512 and AVX2 bodies are compiled for their targets only and
// chosen at run time by what the CPU reports; other machines run the portable body. The rows of w split
// into pieces claimed from a counter by XLA's intra-op threads (the FFI's ThreadPool), each piece
// writing its own columns of y, so the result does not depend on the threads.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"
#include "module.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Kind { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kUnknown };

// (kind, values per block) of a block of `bytes` bytes.
Kind KindOf(int64_t bytes) {
  switch (bytes) {
    case 18: return kQ4_0;
    case 20: return kQ4_1;
    case 34: return kQ8_0;
    case 144: return kQ4_K;
    default: return kUnknown;
  }
}

int64_t ValuesOf(Kind kind) { return kind == kQ4_K ? 256 : 32; }

constexpr int64_t kSub = 32;  // values per sub-block

// IEEE half to float, exact for every value, in integer arithmetic only: XLA's threads flush float
// denormals to zero, so a subnormal half must not pass through a denormal float. A normal half's
// exponent is rebiased (15 to 127), a subnormal one is its mantissa times 2^-24 (a normal float), and
// infinities and NaNs keep an all-ones exponent.
inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// One sub-block of 32 values as the bodies read it: the bytes of its two halves, the shift of their
// nibbles (0 or 4; -1: int8 values), whether 8 is subtracted (Q4_0), its scale and its offset.
struct Sub {
  const uint8_t* half[2];
  int shift[2];
  bool minus8;
  float scale, offset;
};

// Q4_K's 6-bit sub-scale and sub-min j of its 12 packed bytes.
inline void ScaleMinK(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The sub-blocks of one block, in value order; returns how many (1, or 8 for Q4_K).
inline int SubBlocks(Kind kind, const uint8_t* b, Sub* out) {
  switch (kind) {
    case kQ4_0:
      out[0] = Sub{{b + 2, b + 2}, {0, 4}, true, HalfToFloat(b), 0.0f};
      return 1;
    case kQ4_1:
      out[0] = Sub{{b + 4, b + 4}, {0, 4}, false, HalfToFloat(b), HalfToFloat(b + 2)};
      return 1;
    case kQ8_0:
      out[0] = Sub{{b + 2, b + 18}, {-1, -1}, false, HalfToFloat(b), 0.0f};
      return 1;
    case kQ4_K: {
      float d = HalfToFloat(b), dmin = HalfToFloat(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qs = b + 16;
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        ScaleMinK(scales, j, sc, m);
        const uint8_t* chunk = qs + 32 * (j / 2);
        int shift = 4 * (j % 2);
        // As gguf's dequantization rounds them: d * sc and dmin * m each once in float32.
        out[j] = Sub{{chunk, chunk + 16}, {shift, shift}, false, d * static_cast<float>(sc),
                     -(dmin * static_cast<float>(m))};
      }
      return 8;
    }
    default: return 0;
  }
}

struct Rounded {
  const int8_t* q1;     // [n, padded * 32] in the body's layout (layered scheme)
  const int8_t* q2;     // [n, padded * 32] likewise
  const int16_t* x16;   // [n, padded * 32]: 254 q1 + q2, natural layout (combined scheme)
  const float* d;       // [n, padded]
  const float* d2;      // [n, padded]: d / 254
  const float* dsum;    // [n, padded]: d sum q1 + d2 sum q2 (layered), d2 sum x16 (combined)
  int64_t padded;       // sub-blocks a row, rounded up to a multiple of 4 (the extra ones zero)
};

struct Product {
  const float* x;      // [n, k]
  const float* xsum;   // [n, k / 32]: each sub-block's sum of x
  const uint8_t* w;    // [f, blocks, bytes]
  float* y;            // [n, f]
  int64_t n, k, f, blocks, bytes;
  Kind kind;
  Rounded rounded;  // x rounded to two layers of 8-bit integers, for the integer path
};

// The finished columns [c_begin, c_end) of y.
using Body = void (*)(const Product&, int64_t c_begin, int64_t c_end);

// ---- portable body: each sub-block widened to 32 floats, then its dot with each row of x ----

void Portable(const Product& p, int64_t c_begin, int64_t c_end) {
  int64_t per_block = ValuesOf(p.kind) / kSub, subs_per_row = p.k / kSub;
  Sub subs[8];
  float values[kSub];
  std::vector<float> total(p.n), rest(p.n);
  for (int64_t c = c_begin; c < c_end; ++c) {
    std::fill(total.begin(), total.end(), 0.0f);
    std::fill(rest.begin(), rest.end(), 0.0f);
    const uint8_t* row = p.w + c * p.blocks * p.bytes;
    for (int64_t b = 0; b < p.blocks; ++b) {
      int count = SubBlocks(p.kind, row + b * p.bytes, subs);
      for (int j = 0; j < count; ++j) {
        const Sub& s = subs[j];
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < 16; ++i) {
            int v = s.shift[h] < 0 ? static_cast<int8_t>(s.half[h][i]) : (s.half[h][i] >> s.shift[h]) & 0xF;
            values[16 * h + i] = static_cast<float>(s.minus8 ? v - 8 : v);
          }
        int64_t sub = b * per_block + j;
        for (int64_t r = 0; r < p.n; ++r) {
          const float* x = p.x + r * p.k + sub * kSub;
          float sum = 0.0f;
          for (int i = 0; i < kSub; ++i) sum += x[i] * values[i];
          total[r] += sum * s.scale;
          if (s.offset != 0.0f) rest[r] += s.offset * p.xsum[r * subs_per_row + sub];
        }
      }
    }
    for (int64_t r = 0; r < p.n; ++r) p.y[r * p.f + c] = total[r] + rest[r];
  }
}

// The columns [c_begin, c_end) in tiles of C = 4 rows of w (then single ones) by R = kRows rows of x
// (then, for kRows 3, a tile of 2 or 1; for kRows 2, of 1): tile(R, C, r0, c0) with R and C as integral
// constants.
template <int kRows, typename Tile>
inline void InTiles(const Product& p, int64_t c_begin, int64_t c_end, Tile tile) {
  auto rows = [&](auto C, int64_t c) {
    int64_t r = 0;
    for (; r + kRows <= p.n; r += kRows) tile(std::integral_constant<int, kRows>(), C, r, c);
    if constexpr (kRows == 3) {
      if (p.n - r == 2) tile(std::integral_constant<int, 2>(), C, r, c);
      if (p.n - r == 1) tile(std::integral_constant<int, 1>(), C, r, c);
    } else if constexpr (kRows == 2) {
      if (p.n - r == 1) tile(std::integral_constant<int, 1>(), C, r, c);
    }
  };
  int64_t c = c_begin;
  for (; c + 4 <= c_end; c += 4) rows(std::integral_constant<int, 4>(), c);
  for (; c < c_end; ++c) rows(std::integral_constant<int, 1>(), c);
}

#ifdef DEW_X86

// The loops' prefetch (every one but AVX2's integer loop of Q4_K): a tile's C rows of w are contiguous and
// read at the same pace, so its blocks are one stream, asked for `kAheadBytes` ahead of the point `at` the
// loop has reached in it, a cache line for every 64 of the `bytes` the loop takes a step. That, not 8
// blocks ahead in each row, made the integer path's products a quarter faster on the AVX2 EPYC and a third
// faster on the Zen 4 (docs/performance.md); AVX2's Q4_K integer loop was slower with it there and keeps its
// own, 4 blocks ahead in each row.
constexpr int64_t kAheadBytes = 4096;

inline void AskAhead(const uint8_t* at, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes + line), _MM_HINT_T0);
}

// ---- AVX-512: C rows of w (output columns) against R rows of x; a sub-block's 32 values are two
// 16-float vectors, widened once and used by every row of x. ----

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 HalfAvx512(const uint8_t* bytes, int shift,
                                                                          bool minus8) {
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  if (shift < 0) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  if (shift) q = _mm_srli_epi16(q, 4);
  q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
  if (minus8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(q, _mm_set1_epi8(8))));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
}

template <Kind K, int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void TileAvx512(const Product& p, int64_t r0, int64_t c0) {
  constexpr int64_t kPerBlock = K == kQ4_K ? 8 : 1;
  __m512 acc[R][C];
  float rest[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps(), rest[r][c] = 0.0f;
  const int64_t row_bytes = p.blocks * p.bytes, subs_per_row = p.k / kSub;
  const uint8_t* w = p.w + c0 * row_bytes;
  Sub subs[C][8];
  for (int64_t b = 0; b < p.blocks; ++b) {
    AskAhead(w + b * C * p.bytes, C * p.bytes);
    for (int c = 0; c < C; ++c) {
      SubBlocks(K, w + c * row_bytes + b * p.bytes, subs[c]);
    }
    for (int j = 0; j < kPerBlock; ++j) {
      int64_t sub = b * kPerBlock + j;
      __m512 lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const Sub& s = subs[c][j];
        lo[c] = HalfAvx512(s.half[0], s.shift[0], K == kQ4_0);
        hi[c] = HalfAvx512(s.half[1], s.shift[1], K == kQ4_0);
      }
      for (int r = 0; r < R; ++r) {
        const float* x = p.x + (r0 + r) * p.k + sub * kSub;
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        float xs = (K == kQ4_1 || K == kQ4_K) ? p.xsum[(r0 + r) * subs_per_row + sub] : 0.0f;
        for (int c = 0; c < C; ++c) {
          __m512 t = _mm512_fmadd_ps(x1, hi[c], _mm512_mul_ps(x0, lo[c]));
          acc[r][c] = _mm512_fmadd_ps(t, _mm512_set1_ps(subs[c][j].scale), acc[r][c]);
          if constexpr (K == kQ4_1 || K == kQ4_K) rest[r][c] += subs[c][j].offset * xs;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) p.y[(r0 + r) * p.f + c0 + c] = _mm512_reduce_add_ps(acc[r][c]) + rest[r][c];
}

// The kinds of one sub-block a block (Q4_0, Q4_1, Q8_0) read straight from the block: the float16
// scale and offset converted by the CPU's F16C instruction (exact for subnormal halves too: it does not
// read the denormals-are-zero flag), the nibbles or bytes at their fixed places.
template <Kind K>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void WidenAvx512(const uint8_t* block, __m512& lo,
                                                                              __m512& hi) {
  if constexpr (K == kQ8_0) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))));
  } else {
    // Each byte widened to a 32-bit lane first: its low nibble is then the lane & 15 (values 0-15) and
    // its high one the lane >> 4 (values 16-31), with no masking before the widening.
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (K == kQ4_1 ? 4 : 2))));
    __m512i low = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), high = _mm512_srli_epi32(q, 4);
    if constexpr (K == kQ4_0) {
      low = _mm512_sub_epi32(low, _mm512_set1_epi32(8));
      high = _mm512_sub_epi32(high, _mm512_set1_epi32(8));
    }
    lo = _mm512_cvtepi32_ps(low);
    hi = _mm512_cvtepi32_ps(high);
  }
}

__attribute__((target("f16c"))) inline float HalfF16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <Kind K, int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void SmallTileAvx512(const Product& p, int64_t r0,
                                                                            int64_t c0) {
  __m512 acc[R][C];
  float rest[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps(), rest[r][c] = 0.0f;
  const int64_t row_bytes = p.blocks * p.bytes;
  const uint8_t* tile = p.w + c0 * row_bytes;
  const uint8_t* w = tile;
  const float* x = p.x + r0 * p.k;
  const float* xsum = p.xsum + r0 * p.blocks;
  for (int64_t b = 0; b < p.blocks; ++b, w += p.bytes, x += kSub, ++xsum) {
    __m512 lo[C], hi[C], scale[C];
    float offset[C];
    AskAhead(tile + b * C * p.bytes, C * p.bytes);
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = w + c * row_bytes;
      WidenAvx512<K>(block, lo[c], hi[c]);
      scale[c] = _mm512_set1_ps(HalfF16c(block));
      if constexpr (K == kQ4_1) offset[c] = HalfF16c(block + 2);
    }
    for (int r = 0; r < R; ++r) {
      __m512 x0 = _mm512_loadu_ps(x + r * p.k), x1 = _mm512_loadu_ps(x + r * p.k + 16);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_fmadd_ps(x1, hi[c], _mm512_mul_ps(x0, lo[c])), scale[c], acc[r][c]);
        if constexpr (K == kQ4_1) rest[r][c] += offset[c] * xsum[r * p.blocks];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) p.y[(r0 + r) * p.f + c0 + c] = _mm512_reduce_add_ps(acc[r][c]) + rest[r][c];
}

template <Kind K, int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void AnyTileAvx512(const Product& p, int64_t r0,
                                                                                int64_t c0) {
  if constexpr (K == kQ4_K)
    TileAvx512<K, R, C>(p, r0, c0);
  else
    SmallTileAvx512<K, R, C>(p, r0, c0);
}

template <Kind K>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void ColumnsAvx512(const Product& p, int64_t c_begin,
                                                                     int64_t c_end) {
  InTiles<3>(p, c_begin, c_end, [&p](auto R, auto C, int64_t r, int64_t c) {
    AnyTileAvx512<K, decltype(R)::value, decltype(C)::value>(p, r, c);
  });
}

// ---- AVX2 + FMA: the same with 8-float vectors, a sub-block's 32 values in four. ----

__attribute__((target("avx2,fma"))) inline void HalfAvx2(const uint8_t* bytes, int shift, bool minus8, __m256* out) {
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  if (shift >= 0) {
    if (shift) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
    if (minus8) q = _mm_sub_epi8(q, _mm_set1_epi8(8));
  }
  // Nibbles are 0-15 (or -8-7 after the subtraction), so a signed widening reads them too.
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
}

__attribute__((target("avx2,fma"))) inline float Sum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <Kind K, int C>
__attribute__((target("avx2,fma"))) void TileAvx2(const Product& p, int64_t r0, int64_t c0) {
  constexpr int64_t kPerBlock = K == kQ4_K ? 8 : 1;
  __m256 acc[C];
  float rest[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps(), rest[c] = 0.0f;
  const int64_t row_bytes = p.blocks * p.bytes, subs_per_row = p.k / kSub;
  const uint8_t* w = p.w + c0 * row_bytes;
  const float* xrow = p.x + r0 * p.k;
  Sub subs[C][8];
  for (int64_t b = 0; b < p.blocks; ++b) {
    AskAhead(w + b * C * p.bytes, C * p.bytes);
    for (int c = 0; c < C; ++c) SubBlocks(K, w + c * row_bytes + b * p.bytes, subs[c]);
    for (int j = 0; j < kPerBlock; ++j) {
      int64_t sub = b * kPerBlock + j;
      const float* x = xrow + sub * kSub;
      __m256 xv[4] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24)};
      float xs = (K == kQ4_1 || K == kQ4_K) ? p.xsum[r0 * subs_per_row + sub] : 0.0f;
      for (int c = 0; c < C; ++c) {
        const Sub& s = subs[c][j];
        __m256 v[4];
        HalfAvx2(s.half[0], s.shift[0], K == kQ4_0, v);
        HalfAvx2(s.half[1], s.shift[1], K == kQ4_0, v + 2);
        __m256 t = _mm256_mul_ps(xv[0], v[0]);
        for (int i = 1; i < 4; ++i) t = _mm256_fmadd_ps(xv[i], v[i], t);
        acc[c] = _mm256_fmadd_ps(t, _mm256_set1_ps(s.scale), acc[c]);
        if constexpr (K == kQ4_1 || K == kQ4_K) rest[c] += s.offset * xs;
      }
    }
  }
  for (int c = 0; c < C; ++c) p.y[r0 * p.f + c0 + c] = Sum256(acc[c]) + rest[c];
}

template <Kind K>
__attribute__((target("avx2,fma"))) void ColumnsAvx2(const Product& p, int64_t c_begin, int64_t c_end) {
  InTiles<1>(p, c_begin, c_end, [&p](auto, auto C, int64_t r, int64_t c) { TileAvx2<K, decltype(C)::value>(p, r, c); });
}

#endif  // DEW_X86

// ---- The integer path: x rounded to two layers of 8-bit integers, integer dot products (every kind;
// Q4_K's sub-blocks of 32 each with their own scale and offset) ----
//
// Each row of x is rounded in sub-blocks of 32: d = max |x| / 127, s = x * (1 / d), q1 = s rounded to
// the nearest integer (ties to even: llama.cpp's rounding of activations), then the remainder once more,
// q2 = (s - q1) * 254 rounded, so the sub-block is taken as d * q1 + d2 * q2 with d2 = d / 254: within
// d / 508 of x a value, where one layer alone leaves d / 2 (that layer alone changes SmolLM2's greedy
// text; docs/performance.md). Two schemes multiply them. The layered one (the AVX-512 VNNI loops)
// takes each layer's products with the weight's integers, exact in int32:
//   y = sum over sub-blocks of (d_w d) (q_w . q1 - z sum q1) + (d_w d2) (q_w . q2 - z sum q2)
//       + m_w (d sum q1 + d2 sum q2)
// where z is a zero point kept in the integers (Q4_0's 8; Q8_0's 128 in the AVX-512 loops, which read
// its int8 values as unsigned bytes biased by 128) and m_w the offset (Q4_1's m). The vector loops split
// each sub-block's products over several int32 lanes and take z's term lane by lane (z times the lane's
// own q), so every lane holds its exact share of the products and no float sum cancels large lanes.
// The result is the float32 product of the dequantized weights with the rounded x, up to the order of
// float32 roundings: only x's rounding separates it from the exact path above.
//
// The combined one (AVX2 and portable loops) joins the layers into one int16 a value, x16 = 254 q1 + q2
// (|q1|, |q2| <= 127, so |x16| <= 32385), x taken as d2 x16: the same integers, scaled by d2 where the
// layered scheme scales q1 by d, and 254 d2 differs from d by d2's one rounding (relative 2^-24). Each
// int32 lane sums 4 products w x16 exactly (|w| <= 15, or 128 for Q8_0: at most 16,581,120 < 2^24), so
// its conversion to float32 is exact too, and one multiply-add by the sub-block's d_w d2 (one rounding)
// adds it to the lane's float sum; m_w's term takes d2 sum x16. The portable loops keep the same 8 lanes
// and sums, so the two agree bit for bit.
//
// A sub-block holding a NaN or an infinity gets d = NaN, so the outputs it reaches are NaN rather than
// a silent number.

// Where value t (0-31) of sub-block j sits in a row of q1 or q2. Natural: j * 32 + t. Grouped (the
// AVX-512 loops of Q4_0 and Q4_1): sub-blocks in groups of 4, each group's values 0-15 first
// (sub-block by sub-block), then its values 16-31, matching a register of 4 blocks' 16 nibble bytes.
// Paired (the AVX-512 loops of Q4_K): sub-blocks in groups of 4 in the order 0, 2, 1, 3, matching a
// register of 64 nibble bytes, whose low nibbles are sub-blocks 0 and 2 and high ones 1 and 3.
enum Layout { kNatural, kGrouped, kPaired };

inline int64_t Place(Layout layout, int64_t j, int t) {
  if (layout == kGrouped) return (j / 4) * 128 + (t < 16 ? 0 : 64) + 16 * (j % 4) + (t & 15);
  if (layout == kPaired) return ((j / 4) * 4 + (j % 2) * 2 + (j % 4) / 2) * kSub + t;
  return j * kSub + t;
}

constexpr float kSecond = 254.0f;  // d / d2: the second layer's steps within one of the first's

inline float SubScale(float amax, bool finite) {
  return finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
}

// One sub-block rounded: its 32 values of q1 and q2, d and the sums of q1 and q2.
struct RoundedSub {
  int8_t q1[kSub], q2[kSub];
  float d;
  int32_t sum1, sum2;
};

void RoundPortable(const float* x, RoundedSub& out) {
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < kSub; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  out.d = SubScale(amax, finite);
  float inverse = finite && out.d != 0.0f ? 1.0f / out.d : 0.0f;
  out.sum1 = out.sum2 = 0;
  for (int i = 0; i < kSub; ++i) {
    float s = x[i] * inverse, first = std::nearbyint(s);
    int v1 = static_cast<int>(first), v2 = static_cast<int>(std::nearbyint((s - first) * kSecond));
    out.q1[i] = static_cast<int8_t>(v1), out.q2[i] = static_cast<int8_t>(v2);
    out.sum1 += v1, out.sum2 += v2;
  }
}

#ifdef DEW_X86
// 4 vectors of 8 int32 (each within int8) as 32 bytes in order, and their sum.
__attribute__((target("avx2,fma"))) inline int32_t PackAvx2(const __m256i* n, int8_t* q) {
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  // The packs interleave 4-value pieces across the two 128-bit lanes; the permutation puts them back.
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  return _mm_cvtsi128_si32(s);
}

// The same with 8-float vectors; the conversions round by MXCSR's mode, nearest-even as nearbyint does.
__attribute__((target("avx2,fma"))) void RoundAvx2(const float* x, RoundedSub& out) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    __m256 a = _mm256_and_ps(v[i], magnitude);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
    amax = _mm256_max_ps(amax, a);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  bool all_finite = _mm256_movemask_ps(finite) == 0xFF;
  out.d = SubScale(_mm_cvtss_f32(m), all_finite);
  __m256 inverse = _mm256_set1_ps(all_finite && out.d != 0.0f ? 1.0f / out.d : 0.0f);
  __m256i n1[4], n2[4];
  for (int i = 0; i < 4; ++i) {
    __m256 s = _mm256_mul_ps(v[i], inverse);
    n1[i] = _mm256_cvtps_epi32(s);
    n2[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(s, _mm256_cvtepi32_ps(n1[i])), _mm256_set1_ps(kSecond)));
  }
  out.sum1 = PackAvx2(n1, out.q1);
  out.sum2 = PackAvx2(n2, out.q2);
}
#endif

// Every row of x rounded into `rounded`'s buffers, in the natural or the grouped layout.
struct RoundedBuffers {
  std::vector<int8_t> q1, q2;
  std::vector<int16_t> x16;
  std::vector<float> d, d2, dsum;

  // `combined`: the combined scheme's x16 (natural layout), else the layered one's q1 and q2.
  Rounded Fill(const float* x, int64_t n, int64_t k, Layout layout, bool vectors, bool combined) {
    int64_t subs = k / kSub, padded = (subs + 3) / 4 * 4;
    size_t values = static_cast<size_t>(n * padded * kSub);
    q1.assign(combined ? 0 : values, 0);
    q2.assign(q1.size(), 0);
    x16.assign(combined ? values : 0, 0);
    // 4 more than the rows need: the AVX-512 loops read 4 entries from a group's first sub-block.
    d.assign(static_cast<size_t>(n * padded + 4), 0.0f);
    d2.assign(d.size(), 0.0f);
    dsum.assign(d.size(), 0.0f);
    RoundedSub sub;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < subs; ++j) {
#ifdef DEW_X86
        if (vectors)
          RoundAvx2(x + r * k + j * kSub, sub);
        else
#endif
          RoundPortable(x + r * k + j * kSub, sub);
        int64_t e = r * padded + j;
        d[e] = sub.d, d2[e] = sub.d / kSecond;
        if (combined) {
          int16_t* row = x16.data() + (r * padded + j) * kSub;
          for (int i = 0; i < kSub; ++i) row[i] = static_cast<int16_t>(254 * sub.q1[i] + sub.q2[i]);
          // |sum x16| <= 32 * 32385 < 2^24: exact in float32.
          dsum[e] = d2[e] * static_cast<float>(254 * sub.sum1 + sub.sum2);
          continue;
        }
        dsum[e] = sub.d * static_cast<float>(sub.sum1) + d2[e] * static_cast<float>(sub.sum2);
        for (auto [from, to] : {std::pair{sub.q1, q1.data()}, std::pair{sub.q2, q2.data()}}) {
          int8_t* row = to + r * padded * kSub;
          std::memcpy(row + Place(layout, j, 0), from, 16);
          std::memcpy(row + Place(layout, j, 16), from + 16, 16);
        }
      }
    return Rounded{q1.data(), q2.data(), x16.data(), d.data(), d2.data(), dsum.data(), padded};
  }
};

// The 8 float lanes of the combined scheme's vector loops summed as Sum256 sums a register: lanes l and
// l + 4, then those pairs 2 apart, then the last two.
inline float SumLanes(const float* a) {
  float s[4];
  for (int l = 0; l < 4; ++l) s[l] = a[l] + a[l + 4];
  float t0 = s[0] + s[2], t1 = s[1] + s[3];
  return t0 + t1;
}

// The portable body, the combined scheme as the AVX2 loops take it: value t of a sub-block lands in
// int32 lane ((t mod 16) / 2) (where vpmaddwd puts it), each lane's sum converted and multiplied-added
// by the sub-block's d_w d2 into the lane's float sum; the offsets' terms are multiply-added into one
// float (Q4_1) or one a sub-block of the block (Q4_K, 8 lanes as its vector loop keeps them).
void IntPortable(const Product& p, int64_t c_begin, int64_t c_end) {
  const Rounded& x = p.rounded;
  const int64_t per_block = ValuesOf(p.kind) / kSub;
  Sub subs[8];
  for (int64_t c = c_begin; c < c_end; ++c) {
    const uint8_t* row = p.w + c * p.blocks * p.bytes;
    for (int64_t r = 0; r < p.n; ++r) {
      const int16_t* x16 = x.x16 + r * x.padded * kSub;
      float acc[8] = {}, rest[8] = {};
      for (int64_t b = 0; b < p.blocks; ++b) {
        int count = SubBlocks(p.kind, row + b * p.bytes, subs);
        for (int j = 0; j < count; ++j) {
          const Sub& s = subs[j];
          const int64_t sub = b * per_block + j;
          int32_t lanes[8] = {};
          for (int t = 0; t < kSub; ++t) {
            const int h = t / 16, i = t % 16;
            int v = s.shift[h] < 0 ? static_cast<int8_t>(s.half[h][i]) : (s.half[h][i] >> s.shift[h]) & 0xF;
            lanes[i / 2] += (s.minus8 ? v - 8 : v) * x16[sub * kSub + t];
          }
          const int64_t e = r * x.padded + sub;
          const float scale = s.scale * x.d2[e];
          for (int l = 0; l < 8; ++l) acc[l] = std::fma(static_cast<float>(lanes[l]), scale, acc[l]);
          float& into = rest[p.kind == kQ4_K ? j : 0];
          if (p.kind == kQ4_1 || p.kind == kQ4_K) into = std::fma(s.offset, x.dsum[e], into);
        }
      }
      p.y[r * p.f + c] = SumLanes(acc) + (p.kind == kQ4_K ? SumLanes(rest) : rest[0]);
    }
  }
}

// A Q4_K block's eight sub-block scales d * sc and offsets -(dmin * m), each rounded once in float32
// as gguf's dequantization rounds them.
inline void ScalesK(const uint8_t* b, float* scale, float* offset) {
  float d = HalfToFloat(b), dmin = HalfToFloat(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    ScaleMinK(b + 4, j, sc, m);
    scale[j] = d * static_cast<float>(sc);
    offset[j] = -(dmin * static_cast<float>(m));
  }
}

#ifdef DEW_X86

// ---- AVX2, the combined scheme: a sub-block's 32 weight integers widened to int16 in two registers
// (values 0-15 and 16-31), multiplied with x16 by vpmaddwd (pairs summed to int32) and the two added:
// each int32 lane holds 4 products, exact, converted exactly and multiply-added by d_w d2. F16C
// converts the scales (every AVX2 CPU has it). ----

// -8 times each lane's 4 values of x16 for Q4_0 (its zero point, shared by every column), 0 for the
// other kinds: |8 * 32385| is past int16, but vpmaddwd's products are 32-bit.
template <Kind K>
__attribute__((target("avx2,fma"))) inline __m256i ZeroPointAvx2(__m256i xa, __m256i xb) {
  if constexpr (K != kQ4_0) return _mm256_setzero_si256();
  const __m256i minus8 = _mm256_set1_epi16(-8);
  return _mm256_add_epi32(_mm256_madd_epi16(minus8, xa), _mm256_madd_epi16(minus8, xb));
}

// The 32 integers of a Q4_0, Q4_1 or Q8_0 block as int16: values 0-15 in `lo`, 16-31 in `hi`. A nibble
// byte widened first holds its low nibble (value i) under the mask and its high one (value 16 + i)
// after the shift.
template <Kind K>
__attribute__((target("avx2,fma"))) inline void WidenAvx2(const uint8_t* block, __m256i& lo, __m256i& hi) {
  if constexpr (K == kQ8_0) {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18)));
  } else {
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (K == kQ4_1 ? 4 : 2))));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(v, 4);
  }
}

// The first 4 bytes (d, then Q4_1's m; Q4_0's and Q8_0's first integers, unused) of block b of C <= 4
// rows of w as floats, F16C converting all at once: lane 2c holds row c's d, lane 2c + 1 its m.
template <int C>
__attribute__((target("avx2,fma,f16c"))) inline __m256 ScalesAvx2(const uint8_t* block, int64_t row_bytes) {
  int32_t h[4] = {};
  for (int c = 0; c < C; ++c) std::memcpy(&h[c], block + c * row_bytes, 4);
  return _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3]));
}

// R <= 2 rows of x against C <= 4 rows of w: each block's integers widened once for the R rows, each
// row's sums taken in the same order as a tile of one row takes them, so R does not change a bit.
template <Kind K, int R, int C>
__attribute__((target("avx2,fma,f16c"))) void IntTileAvx2(const Product& p, int64_t r, int64_t c0) {
  static_assert(C <= 4, "ScalesAvx2 reads 4 rows of w at most");
  const Rounded& x = p.rounded;
  __m256 acc[R][C];
  __m256 rest[R];  // lane 2c + 1: row c's sum of m times d2 sum x16 (other lanes unused)
  for (int i = 0; i < R; ++i) {
    rest[i] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps();
  }
  constexpr int64_t kBytes = K == kQ4_0 ? 18 : K == kQ4_1 ? 20 : 34;
  const int64_t row_bytes = p.blocks * kBytes;
  const uint8_t* tile = p.w + c0 * row_bytes;
  const uint8_t* w = tile;
  const int16_t* x16[R];  // each row's rounded x, its scales and its sums, held apart from `x` (stores of
  const float *d2[R], *dsum[R];  // vectors may alias it, which would reload its fields in the loop)
  for (int i = 0; i < R; ++i) {
    x16[i] = x.x16 + (r + i) * x.padded * kSub;
    d2[i] = x.d2 + (r + i) * x.padded, dsum[i] = x.dsum + (r + i) * x.padded;
  }
  for (int64_t b = 0; b < p.blocks; ++b, w += kBytes) {
    __m256i xa[R], xb[R], zero[R];
    // Each row's d_w d2 in lane 2c (each an exact product rounded once, as a scalar multiply rounds it),
    // read back by broadcasting loads.
    const __m256 halves = ScalesAvx2<C>(w, row_bytes);
    alignas(32) float scale[R][8];
    for (int i = 0; i < R; ++i) {
      xa[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16[i] + b * kSub));
      xb[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16[i] + b * kSub + 16));
      zero[i] = ZeroPointAvx2<K>(xa[i], xb[i]);
      _mm256_store_ps(scale[i], _mm256_mul_ps(halves, _mm256_set1_ps(d2[i][b])));
      if constexpr (K == kQ4_1) rest[i] = _mm256_fmadd_ps(halves, _mm256_set1_ps(dsum[i][b]), rest[i]);
    }
    AskAhead(tile + b * C * kBytes, C * kBytes);
    for (int c = 0; c < C; ++c) {
      __m256i lo, hi;
      WidenAvx2<K>(w + c * row_bytes, lo, hi);
      for (int i = 0; i < R; ++i) {
        __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, xa[i]), _mm256_madd_epi16(hi, xb[i]));
        if constexpr (K == kQ4_0) dot = _mm256_add_epi32(dot, zero[i]);
        acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(scale[i] + 2 * c), acc[i][c]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float rests[8];
    _mm256_store_ps(rests, rest[i]);
    for (int c = 0; c < C; ++c)
      p.y[(r + i) * p.f + c0 + c] = Sum256(acc[i][c]) + (K == kQ4_1 ? rests[2 * c + 1] : 0.0f);
  }
}

// A Q4_K block read: the block `ahead` blocks on asked for (144 bytes, three cache lines; none for 0), this
// one's sub-block scales written to `scale` and its offsets to `offset`.
inline void ReadBlockK(const uint8_t* block, int64_t ahead, float* scale, float* offset) {
  for (int line = 0; ahead > 0 && line < 3; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(block + ahead * 144 + 64 * line), _MM_HINT_T0);
  ScalesK(block, scale, offset);
}

// `ReadBlockK`, with the block's offsets times x's sums of the sub-blocks (`dsum`) added to `rest`.
__attribute__((target("avx2,fma"))) inline __m256 OpenBlockK(const uint8_t* block, int64_t ahead, __m256 dsum,
                                                           __m256 rest, float* scale) {
  alignas(32) float offset[8];
  ReadBlockK(block, ahead, scale, offset);
  return _mm256_fmadd_ps(_mm256_load_ps(offset), dsum, rest);
}

// Q4_K: each 32 bytes of nibbles hold sub-block 2i (low nibbles) and 2i + 1 (high), widened to int16 in
// two registers (bytes 0-15 and 16-31, the sub-blocks' values 0-15 and 16-31); the sub-blocks' offsets
// times their sums of x go in 8 lanes beside. R <= 2 rows of x share each block's scales and integers,
// each row's sums taken in the order a tile of one row takes them.
template <int R, int C>
__attribute__((target("avx2,fma,f16c"))) void IntTileAvx2K(const Product& p, int64_t r, int64_t c0) {
  const Rounded& x = p.rounded;
  __m256 acc[R][C], rest[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm256_setzero_ps(), rest[i][c] = _mm256_setzero_ps();
  const int64_t row_bytes = p.blocks * p.bytes;
  const uint8_t* w = p.w + c0 * row_bytes;
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  const int16_t* x16[R];  // each row's rounded x, its scales and its sums, held apart from `x` (stores of
  const float *d2s[R], *dsums[R];  // vectors may alias it, which would reload its fields in the loop)
  for (int i = 0; i < R; ++i) {
    x16[i] = x.x16 + (r + i) * x.padded * kSub;
    d2s[i] = x.d2 + (r + i) * x.padded, dsums[i] = x.dsum + (r + i) * x.padded;
  }
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256 d2[R], dsum[R];
    for (int i = 0; i < R; ++i) d2[i] = _mm256_loadu_ps(d2s[i] + b * 8), dsum[i] = _mm256_loadu_ps(dsums[i] + b * 8);
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = w + c * row_bytes + b * p.bytes;
      alignas(32) float scale[8], offset[8], s2[R][8];
      ReadBlockK(block, 2, scale, offset);
      for (int i = 0; i < R; ++i) {
        rest[i][c] = _mm256_fmadd_ps(_mm256_load_ps(offset), dsum[i], rest[i][c]);
        _mm256_store_ps(s2[i], _mm256_mul_ps(_mm256_load_ps(scale), d2[i]));
      }
      for (int q = 0; q < 4; ++q) {
        const __m128i* bytes = reinterpret_cast<const __m128i*>(block + 16 + 32 * q);
        __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes)), z = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes + 1));
        for (int high = 0; high < 2; ++high) {
          const int j = 2 * q + high;
          __m256i lo = high ? _mm256_srli_epi16(a, 4) : _mm256_and_si256(a, low4);
          __m256i hi = high ? _mm256_srli_epi16(z, 4) : _mm256_and_si256(z, low4);
          for (int i = 0; i < R; ++i) {
            const int16_t* at = x16[i] + (b * 8 + j) * kSub;
            __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
            __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16));
            __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(lo, xa), _mm256_madd_epi16(hi, xb));
            acc[i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s2[i][j]), acc[i][c]);
          }
        }
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) p.y[(r + i) * p.f + c0 + c] = Sum256(acc[i][c]) + Sum256(rest[i][c]);
}

template <Kind K>
__attribute__((target("avx2,fma,f16c"))) void IntColumnsAvx2(const Product& p, int64_t c_begin, int64_t c_end) {
  if constexpr (K == kQ4_K)
    InTiles<2>(p, c_begin, c_end, [&p](auto R, auto C, int64_t r, int64_t c) {
      IntTileAvx2K<decltype(R)::value, decltype(C)::value>(p, r, c);
    });
  else
    InTiles<2>(p, c_begin, c_end, [&p](auto R, auto C, int64_t r, int64_t c) {
      IntTileAvx2<K, decltype(R)::value, decltype(C)::value>(p, r, c);
    });
}

// ---- AVX-512 VNNI: a register holds 4 blocks' 16 nibble bytes (Q4_0, Q4_1) or 2 blocks' 32 int8
// (Q8_0, biased by 128 to unsigned), gathered from two loads by one byte permutation (VBMI), and
// vpdpbusd sums 4 products of unsigned and signed bytes into each int32 lane: a sub-block's products
// land in 4 lanes (or 8 for Q8_0), each scaled by its block's d, whose float16 bytes a second
// permutation spreads over the same lanes. Q4_1's m times d * sum q is added in the first lane of each
// sub-block. ----

constexpr __mmask16 FirstLanes(int lanes) { return lanes == 4 ? 0x1111 : 0x0101; }

struct Gathers {
  alignas(64) uint8_t values[64], scales[64];
  alignas(64) int32_t spread[16];  // lane -> the group's sub-block it belongs to
};

// The permutations for blocks of `bytes` bytes whose values start at `at`, `per` blocks a register.
Gathers MakeGathers(int bytes, int at, int per, bool offsets) {
  Gathers g{};
  for (int e = 0; e < 64; ++e) {
    int block = e / (64 / per), index = e % (64 / per);
    g.values[e] = static_cast<uint8_t>(block * bytes + at + index);
  }
  int lanes = 16 / per;
  for (int h = 0; h < 16; ++h) {  // d's two bytes into float16 lane h, m's into lane 16 + h
    int block = h / lanes;
    g.scales[2 * h] = static_cast<uint8_t>(block * bytes), g.scales[2 * h + 1] = static_cast<uint8_t>(block * bytes + 1);
    g.scales[32 + 2 * h] = static_cast<uint8_t>(block * bytes + (offsets ? 2 : 0));
    g.scales[33 + 2 * h] = static_cast<uint8_t>(block * bytes + (offsets ? 3 : 1));
    g.spread[h] = block;
  }
  return g;
}

template <Kind K, int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c"))) void IntTileAvx512(
    const Product& p, int64_t r0, int64_t c0) {
  constexpr int kPer = K == kQ8_0 ? 2 : 4;  // blocks a register
  constexpr int kBytes = K == kQ4_0 ? 18 : K == kQ4_1 ? 20 : 34;
  constexpr int kLanes = 16 / kPer;
  static const Gathers gathers = MakeGathers(kBytes, K == kQ4_1 ? 4 : 2, kPer, K == kQ4_1);
  const Rounded& x = p.rounded;
  const __m512i values_at = _mm512_load_si512(gathers.values), scales_at = _mm512_load_si512(gathers.scales);
  const __m512i spread = _mm512_load_si512(gathers.spread);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t row_bytes = p.blocks * kBytes, groups = (p.blocks + kPer - 1) / kPer;
  const uint8_t* w = p.w + c0 * row_bytes;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * kPer, bytes = std::min<int64_t>(kPer, p.blocks - first) * kBytes;
    // The second load reaches past the group (and at the last row past the weight): masked, it reads
    // only the group's bytes and cannot fault.
    const __mmask64 head = bytes >= 64 ? ~0ull : (1ull << bytes) - 1;
    const __mmask64 tail = bytes > 64 ? (1ull << (bytes - 64)) - 1 : 0;
    __m512i lo[C], hi[C];
    __m512 dw[C], mw[C];
    AskAhead(w + first * C * kBytes, C * bytes);
    for (int c = 0; c < C; ++c) {
      const uint8_t* at = w + c * row_bytes + first * kBytes;
      __m512i v0 = head == ~0ull ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(head, at);
      __m512i v1 = _mm512_maskz_loadu_epi8(tail, at + 64);
      __m512i picked = _mm512_permutex2var_epi8(v0, values_at, v1);
      __m512i halves = _mm512_permutex2var_epi8(v0, scales_at, v1);
      dw[c] = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
      if constexpr (K == kQ4_1) mw[c] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
      if constexpr (K == kQ8_0) {
        lo[c] = _mm512_xor_si512(picked, bias);
      } else {
        lo[c] = _mm512_and_si512(picked, low4);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(picked, 4), low4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t e = (r0 + r) * x.padded + first, at = (r0 + r) * x.padded * kSub + first * kSub;
      // x's two layers: values 0-15 and 16-31 of 4 sub-blocks (4-bit kinds), or 2 sub-blocks' 32 (Q8_0).
      __m512i q[2][2];
      for (int layer = 0; layer < 2; ++layer) {
        const int8_t* from = (layer ? x.q2 : x.q1) + at;
        q[layer][0] = _mm512_loadu_si512(from);
        q[layer][1] = K == kQ8_0 ? _mm512_setzero_si512() : _mm512_loadu_si512(from + 64);
      }
      __m512 d1 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(x.d + e)));
      __m512 d2 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(x.d2 + e)));
      __m512i zero_point[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // -z times each lane's q
      if constexpr (K != kQ4_1)
        for (int layer = 0; layer < 2; ++layer) {
          __m512i lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q[layer][0]);
          if constexpr (K == kQ4_0) lane_sums = _mm512_dpbusd_epi32(lane_sums, _mm512_set1_epi8(1), q[layer][1]);
          zero_point[layer] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(lane_sums, K == kQ4_0 ? 3 : 7));
        }
      __m512 dsum = _mm512_setzero_ps();
      if constexpr (K == kQ4_1)
        dsum = _mm512_maskz_permutexvar_ps(FirstLanes(kLanes), spread, _mm512_castps128_ps512(_mm_loadu_ps(x.dsum + e)));
      for (int c = 0; c < C; ++c) {
        __m512i dot1 = _mm512_dpbusd_epi32(zero_point[0], lo[c], q[0][0]);
        __m512i dot2 = _mm512_dpbusd_epi32(zero_point[1], lo[c], q[1][0]);
        if constexpr (K != kQ8_0) {
          dot1 = _mm512_dpbusd_epi32(dot1, hi[c], q[0][1]);
          dot2 = _mm512_dpbusd_epi32(dot2, hi[c], q[1][1]);
        }
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(dw[c], d1), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2), _mm512_mul_ps(dw[c], d2), acc[r][c]);
        if constexpr (K == kQ4_1) acc[r][c] = _mm512_fmadd_ps(mw[c], dsum, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) p.y[(r0 + r) * p.f + c0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// Q4_K: a register holds 64 of a block's 128 nibble bytes, whose low nibbles are sub-blocks 4h and 4h + 2
// and high ones 4h + 1 and 4h + 3, against x in the paired layout; each lane's sub-block scale (d sc
// times x's d or d2) comes from the block's 8 by one permutation.
template <int C>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"))) void IntTileAvx512K(const Product& p, int64_t r,
                                                                                       int64_t c0) {
  const Rounded& x = p.rounded;
  // lane -> sub-block of the block: the low nibbles' lanes (2h, 2h + 2 per half of 8 lanes), the high ones'
  static const __m512i kLanes[2][2] = {
      {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
       _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3)},
      {_mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
       _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)}};
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[C];
  __m256 rest[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps(), rest[c] = _mm256_setzero_ps();
  const int64_t row_bytes = p.blocks * p.bytes;
  const uint8_t* w = p.w + c0 * row_bytes;
  alignas(32) float scale[8];
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int64_t e = r * x.padded + b * 8, at = (r * x.padded + b * 8) * kSub;
    const __m256 d1 = _mm256_loadu_ps(x.d + e), d2 = _mm256_loadu_ps(x.d2 + e), dsum = _mm256_loadu_ps(x.dsum + e);
    __m512i q[2][4];  // x's two layers, slots of 2 sub-blocks: (0, 2), (1, 3), (4, 6), (5, 7)
    for (int layer = 0; layer < 2; ++layer)
      for (int i = 0; i < 4; ++i) q[layer][i] = _mm512_loadu_si512((layer ? x.q2 : x.q1) + at + 64 * i);
    AskAhead(w + b * C * p.bytes, C * p.bytes);
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = w + c * row_bytes + b * p.bytes;
      rest[c] = OpenBlockK(block, 0, dsum, rest[c], scale);
      const __m256 sc = _mm256_load_ps(scale);
      const __m512 s1 = _mm512_castps256_ps512(_mm256_mul_ps(sc, d1)), s2 = _mm512_castps256_ps512(_mm256_mul_ps(sc, d2));
      for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_loadu_si512(block + 16 + 64 * h);
        __m512i nibbles[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
        for (int high = 0; high < 2; ++high) {
          __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nibbles[high], q[0][2 * h + high]);
          __m512i dot2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nibbles[high], q[1][2 * h + high]);
          acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_permutexvar_ps(kLanes[h][high], s1), acc[c]);
          acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2), _mm512_permutexvar_ps(kLanes[h][high], s2), acc[c]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    __m128 r4 = _mm_add_ps(_mm256_castps256_ps128(rest[c]), _mm256_extractf128_ps(rest[c], 1));
    r4 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
    r4 = _mm_add_ss(r4, _mm_movehdup_ps(r4));
    p.y[r * p.f + c0 + c] = _mm512_reduce_add_ps(acc[c]) + _mm_cvtss_f32(r4);
  }
}

template <Kind K>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c"))) void IntColumnsAvx512(
    const Product& p, int64_t c_begin, int64_t c_end) {
  if constexpr (K == kQ4_K)
    InTiles<1>(p, c_begin, c_end, [&p](auto, auto C, int64_t r, int64_t c) { IntTileAvx512K<decltype(C)::value>(p, r, c); });
  else
    InTiles<3>(p, c_begin, c_end, [&p](auto R, auto C, int64_t r, int64_t c) {
      IntTileAvx512<K, decltype(R)::value, decltype(C)::value>(p, r, c);
    });
}

#endif  // DEW_X86

// The instruction set the bodies use (native/isa.h), the CPU's best at load unless set_isa lowered it.
using dew::Isa;
using dew::kAvx2;
using dew::kAvx512;

const Isa g_best_isa = dew::DetectIsa();
std::atomic<int> g_isa{static_cast<int>(g_best_isa)};

template <Kind K>
Body PickFor() {
  switch (static_cast<Isa>(g_isa.load(std::memory_order_relaxed))) {
#ifdef DEW_X86
    case kAvx512: return ColumnsAvx512<K>;
    case kAvx2: return ColumnsAvx2<K>;
#endif
    default: return Portable;
  }
}

Body Pick(Kind kind) {
  switch (kind) {
    case kQ4_0: return PickFor<kQ4_0>();
    case kQ4_1: return PickFor<kQ4_1>();
    case kQ8_0: return PickFor<kQ8_0>();
    default: return PickFor<kQ4_K>();
  }
}

// Whether the CPU has the AVX-512 integer loops' instructions (vpdpbusd, vpermt2b) beside AVX-512.
bool DetectVnni() {
#ifdef DEW_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

const bool g_vnni = DetectVnni();

// The integer path's loops under the set in use: AVX-512 VNNI where the CPU has it, else AVX2's.
enum IntIsa { kIntPortable, kIntAvx2, kIntAvx512Vnni };

IntIsa IntIsaInUse() {
  int isa = g_isa.load(std::memory_order_relaxed);
  return isa == kAvx512 && g_vnni ? kIntAvx512Vnni : isa >= kAvx2 ? kIntAvx2 : kIntPortable;
}

const char* IntIsaName(IntIsa isa) {
  return isa == kIntAvx512Vnni ? "avx512_vnni" : isa == kIntAvx2 ? "avx2" : "portable";
}

template <Kind K>
Body PickIntFor(IntIsa isa) {
  switch (isa) {
#ifdef DEW_X86
    case kIntAvx512Vnni: return IntColumnsAvx512<K>;
    case kIntAvx2: return IntColumnsAvx2<K>;
#endif
    default: return IntPortable;
  }
}

Body PickInt(Kind kind, IntIsa isa) {
  switch (kind) {
    case kQ4_0: return PickIntFor<kQ4_0>(isa);
    case kQ4_1: return PickIntFor<kQ4_1>(isa);
    case kQ4_K: return PickIntFor<kQ4_K>(isa);
    default: return PickIntFor<kQ8_0>(isa);
  }
}

// At least this many weight bytes a piece: a piece's fixed cost is a few hundred nanoseconds.
constexpr int64_t kPieceBytes = 32 << 10;
// A product streaming fewer weight bytes than this runs on the calling thread alone: waking a helper
// costs microseconds, about the time it takes to stream them, and a helper thread that is descheduled
// while it holds a piece stalls the whole product on a busy machine.
constexpr int64_t kHelpedBytes = 128 << 10;

// The columns split into `total` chunks, claimed from `next` by whichever thread is free; `done`
// counts the finished ones. Shared by pointer, since a pool task may start after the call has
// returned (it then finds nothing to claim).
struct Pieces {
  Product product;
  Body body;
  int64_t chunk_columns = 0, total = 0;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      int64_t begin = i * chunk_columns;
      body(product, begin, std::min(begin + chunk_columns, product.f));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y = x w[layer]^T with x as it is (`rounded` false: the exact path) or rounded to two 8-bit layers
// (true). `w` is a stack of weights [L, F, K / E, bytes]: a scanned decoder passes its layers' whole
// stack and the layer's index, so that XLA does not copy the layer's weight out of the stack first.
ffi::Error Multiply(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                    ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y, bool rounded) {
  auto dx = x.dimensions(), dw = w.dimensions(), dy = y->dimensions();
  if (dx.size() != 2 || dw.size() != 4 || dy.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("dew blocks product: x [N, K], w [L, F, K / E, bytes], layer [] and y [N, F]");
  int64_t n = dx[0], k = dx[1], f = dw[1], blocks = dw[2], bytes = dw[3];
  int64_t at = *layer.typed_data();
  if (at < 0 || at >= dw[0])
    return ffi::Error::InvalidArgument("dew blocks product: layer " + std::to_string(at) + " outside the stack of " +
                                       std::to_string(dw[0]));
  Kind kind = KindOf(bytes);
  if (kind == kUnknown)
    return ffi::Error::InvalidArgument("dew blocks product: blocks of " + std::to_string(bytes) +
                                       " bytes are none of Q4_0 (18), Q4_1 (20), Q8_0 (34), Q4_K (144)");
  if (blocks * ValuesOf(kind) != k || dy[0] != n || dy[1] != f)
    return ffi::Error::InvalidArgument("dew blocks product: operand shapes do not make a product");
  if (n == 0 || f == 0) return ffi::Error::Success();
  auto pieces = std::make_shared<Pieces>();
  const float* xs = x.typed_data();
  pieces->product = Product{xs, nullptr, w.typed_data() + at * f * blocks * bytes, y->typed_data(), n, k, f, blocks, bytes, kind, {}};
  // x's own buffers live in the calling thread, which outlives every piece (all have finished before
  // this call returns).
  if (rounded) {
    thread_local RoundedBuffers buffers;
    IntIsa isa = IntIsaInUse();
    Layout layout = isa != kIntAvx512Vnni || kind == kQ8_0 ? kNatural : kind == kQ4_K ? kPaired : kGrouped;
    pieces->product.rounded = buffers.Fill(xs, n, k, layout, isa != kIntPortable, isa != kIntAvx512Vnni);
    pieces->body = PickInt(kind, isa);
  } else {
    // Each sub-block's sum of x, for the offsets.
    thread_local std::vector<float> xsum;
    int64_t subs = k / kSub;
    xsum.resize(static_cast<size_t>(n * subs));
    for (int64_t e = 0; e < n * subs; ++e) {
      float sum = 0.0f;
      for (int i = 0; i < kSub; ++i) sum += xs[e * kSub + i];
      xsum[e] = sum;
    }
    pieces->product.xsum = xsum.data();
    pieces->body = Pick(kind);
  }
  int64_t threads = f * blocks * bytes < kHelpedBytes ? 1 : std::max<int64_t>(1, pool.num_threads());
  int64_t want = std::max<int64_t>(1, std::min<int64_t>(4 * threads, f * blocks * bytes / kPieceBytes));
  int64_t columns = (f + want - 1) / want;
  pieces->chunk_columns = (columns + 3) / 4 * 4;  // whole tiles of 4 rows of w
  pieces->total = (f + pieces->chunk_columns - 1) / pieces->chunk_columns;
  int64_t helpers = std::min<int64_t>(threads, pieces->total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([pieces] { pieces->Run(); });
  pieces->Run();
  dew::WaitForPieces(pieces->done, pieces->total);
  return ffi::Error::Success();
}

ffi::Error ExactProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                        ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Multiply(pool, x, w, layer, y, false);
}

ffi::Error RoundedProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return Multiply(pool, x, w, layer, y, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewBlocksRoundedProduct, RoundedProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewBlocksProduct, ExactProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Python module: handlers() -> {"product": capsule, "rounded_product": capsule}; isa() -> the body in
// use; rounded_isa() -> the integer path's; set_isa(name) lowers both.

static PyObject* Handlers(PyObject*, PyObject*) {
  static const dew::HandlerEntry entries[] = {{"product", reinterpret_cast<void*>(&DewBlocksProduct)},
                                              {"rounded_product", reinterpret_cast<void*>(&DewBlocksRoundedProduct)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyObject* GetIsa(PyObject*, PyObject*) { return dew::GetIsa(g_isa); }

static PyObject* GetRoundedIsa(PyObject*, PyObject*) { return PyUnicode_FromString(IntIsaName(IntIsaInUse())); }

static PyObject* SetIsa(PyObject*, PyObject* args) { return dew::SetIsa(args, g_best_isa, g_isa); }

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers: the exact product ('product') and the integer one ('rounded_product')."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the product's bodies use: avx512, avx2 or portable."},
    {"rounded_isa", GetRoundedIsa, METH_NOARGS,
     "The instruction set of the integer path (x rounded to 8-bit integers): avx512_vnni, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use a narrower instruction set than the CPU's best (for tests)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_blocks",
                              "Dew's XLA FFI product with GGUF's quantized blocks.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_blocks(void) { return PyModule_Create(&kModule); }
