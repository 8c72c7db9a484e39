// XLA FFI handlers for a prefill's attention over a run's cache, read in place: scores, masked softmax and
// weighted values in one call, float32 or bfloat16.
//
// Queries heads-major `[B, H, S, D]`; keys `[L, C, K, T, D]` and values `[L, C, K, T, Dv]` of a run's cache
// (layer `layer`, rows 0..B-1 of C; bfloat16 as its bits); the mask `[B, S, T]`. A task is one row's key/value
// head and a block of kBlock query rows: the G query heads sharing that key/value head score those rows
// together against the keys between the block's first and last allowed ones (a prefill at an offset reads only
// the filled keys, a fresh one only the keys up to the block's end), each query row's masked softmax is taken
// in float32 over its own first to last allowed keys, its probabilities rounded to the cache's dtype, and the
// values weighted in float32, each tile of rows over the keys its rows read.
//
// The products run on 32-bit units: float32 values through fused multiply-adds, or pairs of bfloat16 values
// through `vdpbf16ps` (AVX512_BF16), which adds both halves' products (exact in float32) to the float32 sum,
// reading denormals as zero, as XLA's CPU threads do. Keys are transposed into panels of kKeyTile keys, so
// a query unit broadcast meets 32 keys at a time; a bfloat16 cache's values are interleaved in pairs of keys,
// so a pair of probabilities broadcast meets 16 columns of two keys at a time. What differs from
// `dew.nn.attention.attend` is the order of the sums and the normalizer's reciprocal (a product where
// `attend` divides); a query whose mask allows no key gets zeros.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "module.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dew;  // Exp and ForEach of vectors.h

constexpr int64_t kBlock = 16;  // query rows a task
constexpr int kKeyTile = 32;    // keys a tile of the scores' panel (two vectors)

// Each mask row's first and last allowed key (`t` and -1 where it allows none), scanned 8 bytes at a time.
void MaskRange(const bool* m, int64_t t, int32_t* range) {
  auto word = [m](int64_t j) {
    uint64_t w;
    std::memcpy(&w, m + j, sizeof w);
    return w;
  };
  int64_t first = 0, last = t - 1;
  while (first + 8 <= t && word(first) == 0) first += 8;
  while (first < t && !m[first]) ++first;
  if (first == t) {
    range[0] = static_cast<int32_t>(t), range[1] = -1;
    return;
  }
  while (last - 7 > first && word(last - 7) == 0) last -= 8;
  while (!m[last]) --last;
  range[0] = static_cast<int32_t>(first), range[1] = static_cast<int32_t>(last);
}

#ifdef DEW_X86
#define DEW_PREFILL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Transposes 16 rows of 16 32-bit units in place: shuffles within 128-bit lanes gather each lane's 4 x 4
// blocks, then shuffles of whole lanes put each column's four blocks together.
DEW_PREFILL_TARGET inline void Transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j]: column 4L + j of rows 4i..4i+3, in lane L
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    __m512 v01 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), w01 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    __m512 v23 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xee), w23 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xee);
    r[j] = _mm512_shuffle_f32x4(v01, w01, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(v01, w01, 0xdd);
    r[8 + j] = _mm512_shuffle_f32x4(v23, w23, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(v23, w23, 0xdd);
  }
}

// acc + a * b over 16 lanes of units: float32 values, or pairs of bfloat16 values (`kPairs`).
template <bool kPairs>
DEW_PREFILL_TARGET [[gnu::always_inline]] inline __m512 MultiplyAdd(__m512 acc, __m512i a, __m512i b) {
  if constexpr (kPairs) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  } else {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
  }
}

// Scores of `MR` query rows (`q`, `units` each) against a tile of kKeyTile keys (`panel`: `[units][kKeyTile]`),
// stored to `s` (rows `stride` apart).
template <bool kPairs, int MR>
DEW_PREFILL_TARGET void ScoreTile(const uint32_t* q, int64_t units, const uint32_t* panel, float* s, int64_t stride) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t x = 0; x < units; ++x) {
    __m512i k0 = _mm512_loadu_si512(panel + x * kKeyTile), k1 = _mm512_loadu_si512(panel + x * kKeyTile + 16);
    for (int r = 0; r < MR; ++r) {
      __m512i qr = _mm512_set1_epi32(static_cast<int>(q[r * units + x]));
      acc[r][0] = MultiplyAdd<kPairs>(acc[r][0], qr, k0);
      acc[r][1] = MultiplyAdd<kPairs>(acc[r][1], qr, k1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(s + r * stride, acc[r][0]);
    _mm512_storeu_ps(s + r * stride + 16, acc[r][1]);
  }
}

// `MR` rows of probability units (`p`, rows `stride` units apart) times `steps` rows of value units (`v`,
// rows `dv` apart), 16 NZ columns of them, into `o` (rows `dv` apart).
template <bool kPairs, int MR, int NZ>
DEW_PREFILL_TARGET void ValueTile(const uint32_t* p, int64_t stride, const uint32_t* v, int64_t dv, int64_t steps,
                                  float* o) {
  __m512 acc[MR][NZ];
  for (int r = 0; r < MR; ++r)
    for (int z = 0; z < NZ; ++z) acc[r][z] = _mm512_setzero_ps();
  for (int64_t t = 0; t < steps; ++t) {
    __m512i vz[NZ];
    for (int z = 0; z < NZ; ++z) vz[z] = _mm512_loadu_si512(v + t * dv + 16 * z);
    for (int r = 0; r < MR; ++r) {
      __m512i pr = _mm512_set1_epi32(static_cast<int>(p[r * stride + t]));
      for (int z = 0; z < NZ; ++z) acc[r][z] = MultiplyAdd<kPairs>(acc[r][z], pr, vz[z]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(o + r * dv + 16 * z, acc[r][z]);
}

// `ScoreTile` and `ValueTile` for a runtime `mr` (at most 8, 4) and `nz` (at most 4).
template <bool kPairs, int MR = 8>
DEW_PREFILL_TARGET void ScoreRows(int mr, const uint32_t* q, int64_t units, const uint32_t* panel, float* s,
                                  int64_t stride) {
  if constexpr (MR > 1) {
    if (mr < MR) return ScoreRows<kPairs, MR - 1>(mr, q, units, panel, s, stride);
  }
  ScoreTile<kPairs, MR>(q, units, panel, s, stride);
}

template <bool kPairs, int MR = 4, int NZ = 4>
DEW_PREFILL_TARGET void ValueRows(int mr, int nz, const uint32_t* p, int64_t stride, const uint32_t* v, int64_t dv,
                                  int64_t steps, float* o) {
  if constexpr (MR > 1) {
    if (mr < MR) return ValueRows<kPairs, MR - 1, NZ>(mr, nz, p, stride, v, dv, steps, o);
  }
  if constexpr (NZ > 1) {
    if (nz < NZ) return ValueRows<kPairs, MR, NZ - 1>(mr, nz, p, stride, v, dv, steps, o);
  }
  ValueTile<kPairs, MR, NZ>(p, stride, v, dv, steps, o);
}

// One query row's probabilities from its scores `s` (padded with finite values to a multiple of 16 past `n`):
// the softmax of `scale * s` over the keys its mask row `m` allows, which lie in [first, end), zeros elsewhere
// up to `width`, stored as float32 to `p` or (`kPairs`) rounded to bfloat16 bits (to nearest even) to `bits`.
// Masked keys' exponentials are zeros outright (as `attend`'s are wherever a row allows a key); no fused
// multiply-adds, so the exponential's bits are the softmax kernel's.
template <bool kPairs>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), optimize("fp-contract=off")))
void ProbabilityRow(const float* s, const bool* m, int64_t n, int64_t first, int64_t end, int64_t width, float scale,
                    float* p, uint16_t* bits) {
  int64_t from = first & ~int64_t{15}, to = (end + 15) & ~int64_t{15};
  if constexpr (kPairs) {
    std::fill(bits, bits + from, uint16_t{0});
    std::fill(bits + to, bits + width, uint16_t{0});
  } else {
    std::fill(p, p + from, 0.0f);
    std::fill(p + to, p + width, 0.0f);
  }
  auto allowed = [&](int64_t j) {  // the mask's lanes, none read past the row's n keys
    __mmask16 inside = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    __m128i bytes = _mm_maskz_loadu_epi8(inside, m + j);
    return _mm_test_epi8_mask(bytes, bytes);
  };
  const __m512 scales = _mm512_set1_ps(scale);
  __m512 tops = _mm512_set1_ps(-HUGE_VALF);
  for (int64_t j = from; j < to; j += 16)
    tops = _mm512_mask_max_ps(tops, allowed(j), tops, _mm512_mul_ps(_mm512_loadu_ps(s + j), scales));
  __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(tops)), sums = _mm512_setzero_ps();
  thread_local std::vector<float> exps;
  exps.resize(static_cast<size_t>(to));
  for (int64_t j = from; j < to; j += 16) {
    __m512 e = _mm512_maskz_mov_ps(allowed(j), Exp(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), scales), top)));
    sums = _mm512_add_ps(sums, e);
    _mm512_storeu_ps(exps.data() + j, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums));
  for (int64_t j = from; j < to; j += 16) {
    __m512 probs = _mm512_mul_ps(_mm512_loadu_ps(exps.data() + j), inverse);
    if constexpr (kPairs) {  // probabilities are finite: no NaN to keep
      __m512i units = _mm512_castps_si512(probs);
      __m512i odd = _mm512_and_si512(_mm512_srli_epi32(units, 16), _mm512_set1_epi32(1));
      units = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(units, _mm512_set1_epi32(0x7fff)), odd), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + j), _mm512_cvtepi32_epi16(units));
    } else {
      _mm512_storeu_ps(p + j, probs);
    }
  }
}

// 16 float32 results stored as float32 or rounded to bfloat16 bits (`RoundToBf16`'s steps, lane by lane).
template <typename Q>
DEW_PREFILL_TARGET [[gnu::always_inline]] inline void Store16(Q* out, __m512 x) {
  if constexpr (std::is_same_v<Q, float>) {
    _mm512_storeu_ps(out, x);
  } else {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i nearest = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
    __m512i quiet = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x8000)),
                                    _mm512_set1_epi32(0x7fc0));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i rounded = _mm512_mask_blend_epi32(nan, nearest, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
  }
}

// Where vpermt2w takes each half of a pair of keys' 32 value columns (key t the first operand, t + 1 the
// second): unit i of the low vector is column i of key t (low half) and of key t + 1 (high half), of the
// high vector column 16 + i.
alignas(64) constexpr uint16_t kPairLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

struct Shape {
  int64_t b, h, s, d, layers, c, k, t, dv, blocks;
};

// One task: row `bi`'s key/value head `kh`, query rows [start, start + rows). `ranges` holds each mask row's
// first and last allowed key (first > last where it allows none). Q is float (float32 queries over a float32
// cache) or uint16_t (bfloat16 bits over a bfloat16 cache: kPairs).
template <typename Q>
DEW_PREFILL_TARGET void Task(const Shape& a, const Q* qp, const Q* kp, const Q* vp, int64_t layer, const bool* mp,
                             const int32_t* ranges, Q* op, float scale, int64_t bi, int64_t kh, int64_t start,
                             int64_t rows) {
  constexpr bool kPairs = std::is_same_v<Q, uint16_t>;
  constexpr int64_t per_unit = kPairs ? 2 : 1;  // values a 32-bit unit holds
  int64_t group = a.h / a.k, gr = group * rows, lo = a.t, hi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* range = ranges + 2 * (bi * a.s + start + r);
    if (range[0] <= range[1]) lo = std::min<int64_t>(lo, range[0]), hi = std::max<int64_t>(hi, range[1] + 1);
  }
  auto out_row = [&](int64_t i) { return op + ((bi * a.s + start + i % rows) * a.h + kh * group + i / rows) * a.dv; };
  if (hi <= lo) {  // no query of the block reads a key: zeros
    for (int64_t i = 0; i < gr; ++i)
      for (int64_t z = 0; z < a.dv; z += 16) Store16(out_row(i) + z, _mm512_setzero_ps());
    return;
  }
  int64_t n = hi - lo, tiles = (n + kKeyTile - 1) / kKeyTile, width = tiles * kKeyTile, units = a.d / per_unit;
  thread_local std::vector<uint32_t> queries, panel, pairs;
  thread_local std::vector<float> scores, probs, outs;
  thread_local std::vector<uint16_t> probs16;
  thread_local std::vector<int64_t> spans;  // each query row's allowed keys [first, last + 1) from lo
  queries.resize(static_cast<size_t>(gr * units));
  panel.resize(static_cast<size_t>(width * units));
  scores.resize(static_cast<size_t>(gr * width));
  outs.resize(static_cast<size_t>(gr * a.dv));
  spans.resize(static_cast<size_t>(2 * gr));
  // The block's queries `[G * rows, units]`, head by head.
  for (int64_t i = 0; i < gr; ++i)
    std::memcpy(queries.data() + i * units,
                qp + ((bi * a.h + kh * group + i / rows) * a.s + start + i % rows) * a.d, a.d * sizeof(Q));
  // The keys [lo, hi) transposed into tiles `[tiles][units][kKeyTile]` (keys past `hi` as zeros).
  int64_t head = ((layer * a.c + bi) * a.k + kh) * a.t;
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(kp + (head + lo) * a.d);
  for (int64_t t0 = 0; t0 < width; t0 += 16) {
    uint32_t* tile = panel.data() + t0 / kKeyTile * units * kKeyTile + t0 % kKeyTile;
    for (int64_t x0 = 0; x0 < units; x0 += 16) {
      int64_t count = std::min<int64_t>(16, units - x0);
      __mmask16 inside = count == 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
      __m512 block[16];
      for (int j = 0; j < 16; ++j)
        block[j] = t0 + j < n ? _mm512_maskz_loadu_ps(inside, keys + (t0 + j) * units + x0) : _mm512_setzero_ps();
      Transpose16(block);
      for (int j = 0; j < count; ++j) _mm512_storeu_ps(tile + (x0 + j) * kKeyTile, block[j]);
    }
  }
  for (int64_t tile = 0; tile < tiles; ++tile)
    for (int64_t i = 0; i < gr; i += 8)
      ScoreRows<kPairs>(static_cast<int>(std::min<int64_t>(8, gr - i)), queries.data() + i * units, units,
                        panel.data() + tile * units * kKeyTile, scores.data() + i * width + tile * kKeyTile, width);
  // Each query row's probabilities over its own allowed keys, a row that reads nothing weighing nothing.
  if constexpr (kPairs) {
    probs16.resize(static_cast<size_t>(gr * width));
  } else {
    probs.resize(static_cast<size_t>(gr * width));
  }
  for (int64_t i = 0; i < gr; ++i) {
    const int32_t* range = ranges + 2 * (bi * a.s + start + i % rows);
    int64_t first = range[0] <= range[1] ? range[0] - lo : 0, end = range[0] <= range[1] ? range[1] + 1 - lo : 0;
    spans[2 * i] = first, spans[2 * i + 1] = end;
    ProbabilityRow<kPairs>(scores.data() + i * width, mp + (bi * a.s + start + i % rows) * a.t + lo, n, first, end,
                           width, scale, probs.data() + (kPairs ? 0 : i * width),
                           probs16.data() + (kPairs ? i * width : 0));
  }
  // The values [lo, hi) as units: a float32 cache's in place, a bfloat16 one's interleaved in pairs of keys
  // (the last key of an odd count beside zeros).
  const uint32_t* values;
  if constexpr (kPairs) {
    pairs.resize(static_cast<size_t>((n + 1) / 2 * a.dv));
    const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
    const uint16_t* source = vp + (head + lo) * a.dv;
    for (int64_t t = 0; t < n; t += 2) {
      for (int64_t z = 0; z < a.dv; z += 32) {
        int64_t count = std::min<int64_t>(32, a.dv - z);
        __mmask32 inside = count == 32 ? __mmask32(0xffffffffu) : __mmask32((1u << count) - 1);
        __m512i row = _mm512_maskz_loadu_epi16(inside, source + t * a.dv + z);
        __m512i next = t + 1 < n ? _mm512_maskz_loadu_epi16(inside, source + (t + 1) * a.dv + z) : _mm512_setzero_si512();
        uint32_t* into = pairs.data() + t / 2 * a.dv + z;
        _mm512_storeu_si512(into, _mm512_permutex2var_epi16(row, low, next));
        if (count > 16) _mm512_storeu_si512(into + 16, _mm512_permutex2var_epi16(row, high, next));
      }
    }
    values = pairs.data();
  } else {
    values = reinterpret_cast<const uint32_t*>(vp + (head + lo) * a.dv);
  }
  const uint32_t* weights = kPairs ? reinterpret_cast<const uint32_t*>(probs16.data())
                                   : reinterpret_cast<const uint32_t*>(probs.data());
  int64_t stride = width / per_unit;
  for (int64_t i = 0; i < gr; i += 4) {
    int64_t mr = std::min<int64_t>(4, gr - i), first = n, end = 0;  // the keys any of the tile's rows reads
    for (int64_t r = i; r < i + mr; ++r)
      if (spans[2 * r] < spans[2 * r + 1]) first = std::min(first, spans[2 * r]), end = std::max(end, spans[2 * r + 1]);
    first = std::min(first, end) / per_unit, end = (end + per_unit - 1) / per_unit;  // in steps (keys or pairs)
    for (int64_t z = 0; z < a.dv; z += 64)
      ValueRows<kPairs>(static_cast<int>(mr), static_cast<int>(std::min<int64_t>(4, (a.dv - z) / 16)),
                        weights + i * stride + first, stride, values + first * a.dv + z, a.dv, end - first,
                        outs.data() + i * a.dv + z);
  }
  for (int64_t i = 0; i < gr; ++i)
    for (int64_t z = 0; z < a.dv; z += 16) Store16(out_row(i) + z, _mm512_loadu_ps(outs.data() + i * a.dv + z));
}
#endif

// Whether this CPU runs the kernel: AVX-512 (F, BW, VL, DQ) for float32, and AVX512_BF16 for bfloat16.
bool Supported(bool bfloat16) {
#ifdef DEW_X86
  static const bool avx512 = DetectIsa() == kAvx512 && __builtin_cpu_supports("avx512dq");
  static const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
  return bfloat16 ? bf16 : avx512;
#else
  (void)bfloat16;
  return false;
#endif
}

// DType is the queries' and the result's, CType the cache's (F32, or U16 holding bfloat16 bits).
template <ffi::DataType DType, ffi::DataType CType>
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<DType> q, ffi::Buffer<CType> keys,
                            ffi::Buffer<CType> values, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::PRED> mask,
                            ffi::Result<ffi::Buffer<DType>> out, float scale) {
  if (!Supported(DType == ffi::BF16))
    return ffi::Error::InvalidArgument("dew prefill attention: this CPU lacks the AVX-512 sets it needs");
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || md.size() != 3)
    return ffi::Error::InvalidArgument(
        "dew prefill attention: q [B, H, S, D], keys [L, C, K, T, D], values [L, C, K, T, Dv], mask [B, S, T]");
  Shape a{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], kd[3], vd[4], 0};
  if (kd[4] != a.d || vd[0] != a.layers || vd[1] != a.c || vd[2] != a.k || vd[3] != a.t || a.c < a.b || a.k == 0 ||
      a.h % a.k != 0 || a.d % 16 != 0 || a.dv % 16 != 0 || md[0] != a.b || md[1] != a.s || md[2] != a.t)
    return ffi::Error::InvalidArgument("dew prefill attention: q, keys, values and mask shapes do not agree");
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= a.layers) return ffi::Error::InvalidArgument("dew prefill attention: the layer is outside the cache");
  if (a.s == 0 || a.b == 0 || a.h == 0) return ffi::Error::Success();
#ifdef DEW_X86
  using Q = std::conditional_t<DType == ffi::F32, float, uint16_t>;
  const Q* qp = reinterpret_cast<const Q*>(q.untyped_data());
  const Q* kp = reinterpret_cast<const Q*>(keys.untyped_data());
  const Q* vp = reinterpret_cast<const Q*>(values.untyped_data());
  const bool* mp = mask.typed_data();
  Q* op = reinterpret_cast<Q*>(out->untyped_data());
  std::vector<int32_t> ranges(static_cast<size_t>(2 * a.b * a.s));
  int32_t* rp = ranges.data();
  ForEach(pool, a.b * a.s, 64, [=](int64_t row) { MaskRange(mp + row * a.t, a.t, rp + 2 * row); });
  a.blocks = (a.s + kBlock - 1) / kBlock;
  int64_t heads = a.b * a.k;
  // Tasks (block, row, key/value head), the last blocks (the most keys, in a causal pass) first.
  ForEach(pool, heads * a.blocks, 1, [=](int64_t task) {
    int64_t blk = a.blocks - 1 - task / heads, bi = task % heads / a.k, kh = task % a.k;
    int64_t start = blk * kBlock, rows = std::min(kBlock, a.s - start);
    Task<Q>(a, qp, kp, vp, l, mp, rp, op, scale, bi, kh, start, rows);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dew prefill attention: x86-64 only; use dew.nn.attention.attend");
#endif
}

}  // namespace

#define DEW_PREFILL_HANDLER(name, dtype, cache)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (PrefillAttention<dtype, cache>),                   \
                                ffi::Ffi::Bind()                                          \
                                    .Ctx<ffi::ThreadPool>()                               \
                                    .Arg<ffi::Buffer<dtype>>()                            \
                                    .Arg<ffi::Buffer<cache>>()                            \
                                    .Arg<ffi::Buffer<cache>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                         \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                        \
                                    .Ret<ffi::Buffer<dtype>>()                            \
                                    .Attr<float>("scale"));
DEW_PREFILL_HANDLER(DewPrefillAttentionF32, ffi::F32, ffi::F32)
DEW_PREFILL_HANDLER(DewPrefillAttentionBF16, ffi::BF16, ffi::U16)

// Python module: handlers() -> {"f32", "bf16": capsule}; supported(bfloat16) whether this CPU runs the kernel
// for that dtype.
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewPrefillAttentionF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewPrefillAttentionBF16)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyObject* IsSupported(PyObject*, PyObject* args) {
  int bfloat16 = 0;
  if (!PyArg_ParseTuple(args, "p", &bfloat16)) return nullptr;
  return PyBool_FromLong(Supported(bfloat16 != 0));
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by dtype."},
    {"supported", IsSupported, METH_VARARGS, "Whether this CPU runs the kernel, for bfloat16 (True) or float32."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_prefill_attention",
                              "Dew's XLA FFI attention of a prefill over its cache.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_prefill_attention(void) { return PyModule_Create(&kModule); }
