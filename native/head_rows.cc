// XLA FFI handlers for the logits of a few rows of hidden states against the output head:
//   y [M, V] float32 = x [M, E] . head,   head [V, E] (a tied embedding, `transposed`) or [E, V],
// float32 x with a float32 head, or bfloat16 x with a bfloat16 head (or its bits, uint16). A decode
// step's head is the largest weight the step reads (SmolLM2's 49,152 x 576), and its rows are few: the
// head is streamed once for all rows, in pieces of the vocabulary that XLA's intra-op threads (the FFI's
// ThreadPool) claim, and every output is computed by one thread in a fixed order, so the result does not
// depend on the threads. Each output is exactly:
//
// [V, E] (`transposed`): 16 lane sums, then a fixed tree over the lanes. float32: lane l sums the terms
//   e = 16s + l in order of s, s_l = fma(w[v, e], x[m, e], s_l) from zero. bfloat16: lane l holds the
//   pairs e = 32s + 2l + 1 and 32s + 2l, in order of s, each pair added odd term first:
//   s_l = fma(w[v, e + 1], x[m, e + 1], s_l), then s_l = fma(w[v, e], x[m, e], s_l) (a bfloat16 product
//   is exact in float32, so each is one rounding of the sum: vdpbf16ps's order). Terms past E are zeros.
//   Then y[m, v] = the lanes halved four times: s_i += s_{i+8} (i < 8), s_i += s_{i+4} (i < 4),
//   s_i += s_{i+2} (i < 2), s_0 + s_1.
// [E, V]: one chain over e in order from zero, s = fma(x[m, e], w[e, v], s) (a widened bfloat16 is exact).
//
// The AVX-512 (with AVX512_BF16's vdpbf16ps where the CPU has it, else the bfloat16 pairs widened by a
// 16-bit shift or mask and two FMAs), AVX2 and portable bodies give the same bits, chosen at run time by
// what the CPU reports; vdpbf16ps alone treats subnormal inputs and results as zeros. On a CPU with AMX, a
// bfloat16 [V, E] head of whole steps of 32 (and at most 32 rows) goes through AMX's tiles instead, on the
// calling thread: each output is the tiles' tdpbf16ps sums over the steps in order, in the hardware's
// own order within a step (subnormals as zeros), so its bits differ from the other bodies'.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "module.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One call's operands. `x` as given ([m, e] float32 or bfloat16 bits); `xf` the same rows as float32
// (the [E, V] bodies broadcast them); for bfloat16, `xp` the rows' pairs widened for the AVX-512F [V, E]
// body: per row and step of 32 elements, the 16 odd terms then the 16 even ones, zeros past E.
template <typename W>
struct Head {
  const W* x;
  const float* xf;
  const float* xp;
  const uint16_t* xb;  // bfloat16 x as AMX's tiles take it (`AmxOperandIndex`), or null
  const W* w;
  float* y;
  int64_t m, e, v;
};

// Vocabulary rows of a [V, E] piece's unit: a unit is read once from memory and stays in the first cache
// while every group of hidden rows passes over it. Columns of an [E, V] unit.
constexpr int64_t kUnitRows = 16;
constexpr int64_t kUnitColumns = 64;
// At least this many weight bytes a piece: waking a thread costs microseconds.
constexpr int64_t kPieceBytes = 64 << 10;

inline float Widen(float value) { return value; }
inline float Widen(uint16_t bits) { return dew::Bf16ToFloat(bits); }

// The four halvings of 16 lane sums (the header's tree).
inline float Reduce16(float* s) {
  for (int half = 8; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) s[i] += s[i + half];
  return s[0];
}

// Elements a [V, E] step covers: 16 float32 lanes, of one term or one bfloat16 pair each.
template <typename W>
constexpr int64_t kStep = std::is_same_v<W, float> ? 16 : 32;

// One step of 16 lanes: `w` and `x` hold kStep<W> elements each (zeros past E).
template <typename W>
inline void LanesStep(const W* w, const W* x, float* s) {
  for (int l = 0; l < 16; ++l) {
    if constexpr (std::is_same_v<W, float>) {
      s[l] = std::fma(w[l], x[l], s[l]);
    } else {
      s[l] = std::fma(Widen(w[2 * l + 1]), Widen(x[2 * l + 1]), s[l]);
      s[l] = std::fma(Widen(w[2 * l]), Widen(x[2 * l]), s[l]);
    }
  }
}

// The steps of [whole, e) padded with zeros, for the bodies that have no masked loads.
template <typename W>
struct Tail {
  W w[kStep<W>] = {}, x[kStep<W>] = {};
  Tail(const W* w_row, const W* x_row, int64_t whole, int64_t e) {
    std::copy(w_row + whole, w_row + e, w);
    std::copy(x_row + whole, x_row + e, x);
  }
};

// ---- portable bodies ----

template <typename W>
void RowsPortable(const Head<W>& p, int64_t v_begin, int64_t v_end) {
  int64_t whole = p.e / kStep<W> * kStep<W>;
  for (int64_t v = v_begin; v < v_end; ++v)
    for (int64_t r = 0; r < p.m; ++r) {
      const W *w = p.w + v * p.e, *x = p.x + r * p.e;
      float s[16] = {};
      for (int64_t k = 0; k < whole; k += kStep<W>) LanesStep(w + k, x + k, s);
      if (whole < p.e) {
        Tail<W> tail(w, x, whole, p.e);
        LanesStep(tail.w, tail.x, s);
      }
      p.y[r * p.v + v] = Reduce16(s);
    }
}

template <typename W>
void ColumnsPortable(const Head<W>& p, int64_t c_begin, int64_t c_end) {
  for (int64_t r = 0; r < p.m; ++r)
    for (int64_t c = c_begin; c < c_end; ++c) {
      float s = 0.0f;
      for (int64_t k = 0; k < p.e; ++k) s = std::fma(p.xf[r * p.e + k], Widen(p.w[k * p.v + c]), s);
      p.y[r * p.v + c] = s;
    }
}

// How the hidden rows go in groups: fours, then a two and a one for what is left.
template <typename Tile>
inline void ForRowGroups(int64_t m, Tile tile) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile(r, std::integral_constant<int, 4>{});
  if (m - r >= 2) tile(r, std::integral_constant<int, 2>{}), r += 2;
  if (m - r == 1) tile(r, std::integral_constant<int, 1>{});
}

#ifdef DEW_X86

#define DEW_AVX512 "avx512f,avx512bw,avx512vl,avx512dq"

// ---- AVX-512, [V, E]: tiles of RV vocabulary rows x RH hidden rows, RV * RH = 16 accumulators, reduced
// together (the header's tree: lanes 8 apart, then 4, then 2, then 1) into one vector whose lane 4k + j is
// accumulator 4j + k. ----

__attribute__((target(DEW_AVX512))) inline __m512 Halve8(__m512 a, __m512 b) {  // [a's 8 | b's 8]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

__attribute__((target(DEW_AVX512))) inline __m512 Halve4(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

__attribute__((target(DEW_AVX512))) inline __m512 Halve2(__m512 a, __m512 b) {
  __m512d da = _mm512_castps_pd(a), db = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(da, db)), _mm512_castpd_ps(_mm512_unpackhi_pd(da, db)));
}

__attribute__((target(DEW_AVX512))) inline __m512 Halve1(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Accumulator i = v * RH + h is the logit of vocabulary row v0 + v and hidden row r0 + h; rows past V
// (read as row V - 1) are not stored.
template <typename W, int RH>
__attribute__((target(DEW_AVX512))) inline void StoreTile(const Head<W>& p, __m512* acc, int64_t v0, int64_t r0) {
  __m512 u[8], q[4], t[2];
  for (int i = 0; i < 8; ++i) u[i] = Halve8(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 4; ++i) q[i] = Halve4(u[2 * i], u[2 * i + 1]);
  for (int i = 0; i < 2; ++i) t[i] = Halve2(q[2 * i], q[2 * i + 1]);
  alignas(64) float sums[16];
  _mm512_store_ps(sums, Halve1(t[0], t[1]));
  for (int i = 0; i < 16; ++i) {
    int64_t v = v0 + i / RH;
    if (v < p.v) p.y[(r0 + i % RH) * p.v + v] = sums[4 * (i % 4) + i / 4];
  }
}

// The mask of the elements [k, e) of a step of kStep<W>, in the step's 32- or 16-bit elements.
template <typename W>
inline uint32_t StepMask(int64_t k, int64_t e) {
  int64_t left = std::min<int64_t>(e - k, kStep<W>);
  return left >= 32 ? 0xFFFFFFFFu : (1u << left) - 1;
}

// One step of a tile at element k of the rows `w` (RV) and `x` (RH), masked to `mask`'s elements.
// float32, or bfloat16 pairs widened (odd terms by masking off the low half, even terms by a 16-bit
// shift) with two FMAs: AVX-512F.
// `x` is the float32 rows, or the bfloat16 rows' widened pairs (`Head::xp`).
template <typename W, int RV, int RH, bool Masked>
[[gnu::always_inline]] __attribute__((target(DEW_AVX512))) inline void StepAvx512(__m512* acc, const W* const* w,
                                                                                const float* const* x, int64_t k,
                                                                                uint32_t mask) {
  if constexpr (std::is_same_v<W, float>) {
    __m512 xs[RH];
#pragma GCC unroll 16
    for (int h = 0; h < RH; ++h) xs[h] = Masked ? _mm512_maskz_loadu_ps(mask, x[h] + k) : _mm512_loadu_ps(x[h] + k);
#pragma GCC unroll 16
    for (int v = 0; v < RV; ++v) {
      __m512 ws = Masked ? _mm512_maskz_loadu_ps(mask, w[v] + k) : _mm512_loadu_ps(w[v] + k);
#pragma GCC unroll 16
      for (int h = 0; h < RH; ++h) acc[v * RH + h] = _mm512_fmadd_ps(ws, xs[h], acc[v * RH + h]);
    }
  } else {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 x_odd[RH], x_even[RH];
#pragma GCC unroll 16
    for (int h = 0; h < RH; ++h) {
      x_odd[h] = _mm512_loadu_ps(x[h] + k);
      x_even[h] = _mm512_loadu_ps(x[h] + k + 16);
    }
#pragma GCC unroll 16
    for (int v = 0; v < RV; ++v) {
      __m512i bits = Masked ? _mm512_maskz_loadu_epi16(mask, w[v] + k) : _mm512_loadu_si512(w[v] + k);
      __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(bits, high));
      __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
#pragma GCC unroll 16
      for (int h = 0; h < RH; ++h) {
        acc[v * RH + h] = _mm512_fmadd_ps(w_odd, x_odd[h], acc[v * RH + h]);
        acc[v * RH + h] = _mm512_fmadd_ps(w_even, x_even[h], acc[v * RH + h]);
      }
    }
  }
}

// bfloat16 pairs in vdpbf16ps: AVX512_BF16.
template <int RV, int RH, bool Masked>
[[gnu::always_inline]] __attribute__((target(DEW_AVX512 ",avx512bf16"))) inline void StepBf16(
    __m512* acc, const uint16_t* const* w, const uint16_t* const* x, int64_t k, uint32_t mask) {
  __m512bh xs[RH];
#pragma GCC unroll 16
  for (int h = 0; h < RH; ++h)
    xs[h] = (__m512bh)(Masked ? _mm512_maskz_loadu_epi16(mask, x[h] + k) : _mm512_loadu_si512(x[h] + k));
#pragma GCC unroll 16
  for (int v = 0; v < RV; ++v) {
    __m512bh ws = (__m512bh)(Masked ? _mm512_maskz_loadu_epi16(mask, w[v] + k) : _mm512_loadu_si512(w[v] + k));
#pragma GCC unroll 16
    for (int h = 0; h < RH; ++h) acc[v * RH + h] = _mm512_dpbf16_ps(acc[v * RH + h], ws, xs[h]);
  }
}

// A tile's vocabulary rows (rows past V read row V - 1).
template <typename W, int RV>
inline void TileRows(const Head<W>& p, int64_t v0, const W** w) {
  for (int v = 0; v < RV; ++v) w[v] = p.w + std::min(v0 + v, p.v - 1) * p.e;
}

// Elements of a row of `Head::xp`: E rounded up to whole steps of 32.
inline int64_t PairedWidth(int64_t e) { return (e + 31) / 32 * 32; }

// A tile in AVX-512F: its whole steps, the masked last one, the store.
template <typename W, int RV, int RH>
__attribute__((target(DEW_AVX512))) void TileAvx512(const Head<W>& p, int64_t v0, int64_t r0) {
  const W* w[RV];
  const float* x[RH];
  TileRows<W, RV>(p, v0, w);
  for (int h = 0; h < RH; ++h)
    x[h] = std::is_same_v<W, float> ? p.xf + (r0 + h) * p.e : p.xp + (r0 + h) * PairedWidth(p.e);
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t e = p.e, whole = e / kStep<W> * kStep<W>;
  for (int64_t k = 0; k < whole; k += kStep<W>) StepAvx512<W, RV, RH, false>(acc, w, x, k, 0);
  if (whole < e) StepAvx512<W, RV, RH, true>(acc, w, x, whole, StepMask<W>(whole, e));
  StoreTile<W, RH>(p, acc, v0, r0);
}

// The same tile of bfloat16 in vdpbf16ps.
template <int RV, int RH>
__attribute__((target(DEW_AVX512 ",avx512bf16"))) void TileBf16(const Head<uint16_t>& p, int64_t v0, int64_t r0) {
  const uint16_t *w[RV], *x[RH];
  TileRows<uint16_t, RV>(p, v0, w);
  for (int h = 0; h < RH; ++h) x[h] = p.x + (r0 + h) * p.e;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t e = p.e, whole = e / 32 * 32;
  for (int64_t k = 0; k < whole; k += 32) StepBf16<RV, RH, false>(acc, w, x, k, 0);
  if (whole < e) StepBf16<RV, RH, true>(acc, w, x, whole, StepMask<uint16_t>(whole, e));
  StoreTile<uint16_t, RH>(p, acc, v0, r0);
}

// The vocabulary rows [v_begin, v_end) in units of kUnitRows, each read by every group of hidden rows
// while it stays in the first cache.
template <typename W, bool Dp>
void RowsOf(const Head<W>& p, int64_t v_begin, int64_t v_end) {
  for (int64_t v = v_begin; v < v_end; v += kUnitRows) {
    ForRowGroups(p.m, [&](int64_t r, auto rh) {
      constexpr int RH = decltype(rh)::value, RV = 16 / RH;
      for (int64_t t = v; t < std::min(v + kUnitRows, v_end); t += RV) {
        if constexpr (Dp)
          TileBf16<RV, RH>(p, t, r);
        else
          TileAvx512<W, RV, RH>(p, t, r);
      }
    });
  }
}

// ---- AVX-512, [E, V]: R hidden rows x L vectors of 16 columns, R * L <= 16 accumulators, one chain over
// e each; a masked vector for the last columns. ----

template <typename W>
__attribute__((target(DEW_AVX512))) inline __m512 LoadColumns(const W* w, __mmask16 mask) {
  if constexpr (std::is_same_v<W, float>)
    return _mm512_maskz_loadu_ps(mask, w);
  else
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w)), 16));
}

template <typename W, int R, int L>
__attribute__((target(DEW_AVX512))) void ColumnTileAvx512(const Head<W>& p, int64_t r0, int64_t c, __mmask16 last) {
  __m512 acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) acc[r][j] = _mm512_setzero_ps();
  const W* w = p.w + c;
  for (int64_t k = 0; k < p.e; ++k, w += p.v) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 8 * p.v), _MM_HINT_T0);
    for (int j = 0; j < L; ++j) {
      __m512 wj = LoadColumns(w + 16 * j, j == L - 1 ? last : static_cast<__mmask16>(0xFFFF));
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(p.xf[(r0 + r) * p.e + k]), wj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j)
      _mm512_mask_storeu_ps(p.y + (r0 + r) * p.v + c + 16 * j, j == L - 1 ? last : static_cast<__mmask16>(0xFFFF),
                            acc[r][j]);
}

template <typename W>
__attribute__((target(DEW_AVX512))) void ColumnsAvx512(const Head<W>& p, int64_t c_begin, int64_t c_end) {
  ForRowGroups(p.m, [&](int64_t r, auto rh) {
    constexpr int R = decltype(rh)::value, L = 16 / R < 4 ? 16 / R : 4;
    int64_t c = c_begin;
    for (; c + 16 * L <= c_end; c += 16 * L) ColumnTileAvx512<W, R, L>(p, r, c, 0xFFFF);
    for (; c < c_end; c += 16)
      ColumnTileAvx512<W, R, 1>(p, r, c, static_cast<__mmask16>((1u << std::min<int64_t>(16, c_end - c)) - 1));
  });
}

// ---- AVX2: [V, E] in tiles of logits, 16 lanes each as two 8-lane halves (float32 2 x 3, bfloat16 2 x 2);
// [E, V] in R hidden rows x 2 vectors of 8 columns. The portable body takes the last steps and columns. ----

// A bfloat16 step of 32 elements as its odd and even terms widened, two halves of 8 lanes each.
__attribute__((target("avx2,fma"))) inline void LoadHalves(const uint16_t* w, __m256* odd, __m256* even) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int i = 0; i < 2; ++i) {
    __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * i));
    odd[i] = _mm256_castsi256_ps(_mm256_and_si256(bits, high));
    even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  }
}

// A logit's 16 lane sums from two halves of 8, the steps past `whole` added, then reduced into y.
template <typename W>
__attribute__((target("avx2,fma"))) inline void StoreLogitAvx2(const Head<W>& p, __m256 low, __m256 high, int64_t v,
                                                              int64_t r, int64_t whole) {
  float s[16];
  _mm256_storeu_ps(s, low);
  _mm256_storeu_ps(s + 8, high);
  if (whole < p.e) {
    Tail<W> tail(p.w + v * p.e, p.x + r * p.e, whole, p.e);
    LanesStep(tail.w, tail.x, s);
  }
  p.y[r * p.v + v] = Reduce16(s);
}

// float32 [V, E]: a tile of NV vocabulary rows by NR hidden rows, each logit's 16 lanes as two halves of
// 8 (2 x 3 tiles: 12 sums, 2 vectors of w and one of x in the 16 registers).
template <int NV, int NR>
__attribute__((target("avx2,fma"))) void RowsTileAvx2(const Head<float>& p, int64_t v0, int64_t r0, int64_t whole) {
  __m256 acc[NV][NR][2];
  for (auto& a : acc)
    for (auto& b : a) b[0] = b[1] = _mm256_setzero_ps();
  const float* w = p.w + v0 * p.e;
  const float* x = p.x + r0 * p.e;
  for (int64_t k = 0; k < whole; k += 16)
    for (int i = 0; i < 2; ++i) {
      __m256 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(w + v * p.e + k + 8 * i);
      for (int h = 0; h < NR; ++h) {
        const __m256 xh = _mm256_loadu_ps(x + h * p.e + k + 8 * i);
        for (int v = 0; v < NV; ++v) acc[v][h][i] = _mm256_fmadd_ps(wv[v], xh, acc[v][h][i]);
      }
    }
  for (int v = 0; v < NV; ++v)
    for (int h = 0; h < NR; ++h) StoreLogitAvx2(p, acc[v][h][0], acc[v][h][1], v0 + v, r0 + h, whole);
}

// Vocabulary rows of a float32 block: their 8 rows stay in the first cache while every group of hidden rows
// (read from it too) passes over them.
constexpr int64_t kRowsBlock = 8;

template <int NR>
__attribute__((target("avx2,fma"))) void RowsBlockAvx2(const Head<float>& p, int64_t v_begin, int64_t v_end,
                                                      int64_t r0, int64_t whole) {
  int64_t v0 = v_begin;
  for (; v0 + 2 <= v_end; v0 += 2) RowsTileAvx2<2, NR>(p, v0, r0, whole);
  if (v0 < v_end) RowsTileAvx2<1, NR>(p, v0, r0, whole);
}

template <typename W>
__attribute__((target("avx2,fma"))) void RowsAvx2(const Head<W>& p, int64_t v_begin, int64_t v_end) {
  int64_t whole = p.e / kStep<W> * kStep<W>;
  if constexpr (std::is_same_v<W, float>) {
    for (int64_t block = v_begin; block < v_end; block += kRowsBlock) {
      const int64_t end = std::min(block + kRowsBlock, v_end);
      int64_t r0 = 0;
      for (; r0 + 3 <= p.m; r0 += 3) RowsBlockAvx2<3>(p, block, end, r0, whole);
      if (p.m - r0 == 2) RowsBlockAvx2<2>(p, block, end, r0, whole);
      if (p.m - r0 == 1) RowsBlockAvx2<1>(p, block, end, r0, whole);
    }
  } else {
    for (int64_t v0 = v_begin; v0 < v_end; v0 += 2)
      for (int64_t r0 = 0; r0 < p.m; r0 += 2) {
        int nv = std::min<int64_t>(2, v_end - v0), nr = std::min<int64_t>(2, p.m - r0);
        __m256 acc[2][2][2];  // [v][h][half]
        for (auto& a : acc)
          for (auto& b : a) b[0] = b[1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < whole; k += kStep<W>) {
          __m256 x_odd[2][2], x_even[2][2];
          for (int h = 0; h < nr; ++h) LoadHalves(p.x + (r0 + h) * p.e + k, x_odd[h], x_even[h]);
          for (int v = 0; v < nv; ++v) {
            __m256 w_odd[2], w_even[2];
            LoadHalves(p.w + (v0 + v) * p.e + k, w_odd, w_even);
            for (int h = 0; h < nr; ++h)
              for (int i = 0; i < 2; ++i) {
                acc[v][h][i] = _mm256_fmadd_ps(w_odd[i], x_odd[h][i], acc[v][h][i]);
                acc[v][h][i] = _mm256_fmadd_ps(w_even[i], x_even[h][i], acc[v][h][i]);
              }
          }
        }
        for (int v = 0; v < nv; ++v)
          for (int h = 0; h < nr; ++h) StoreLogitAvx2(p, acc[v][h][0], acc[v][h][1], v0 + v, r0 + h, whole);
      }
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) inline __m256 LoadColumns8(const W* w) {
  if constexpr (std::is_same_v<W, float>)
    return _mm256_loadu_ps(w);
  else
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

template <typename W, int R>
__attribute__((target("avx2,fma"))) void ColumnTileAvx2(const Head<W>& p, int64_t r0, int64_t c) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const W* w = p.w + c;
  for (int64_t k = 0; k < p.e; ++k, w += p.v) {
    __m256 w0 = LoadColumns8(w), w1 = LoadColumns8(w + 8);
    for (int r = 0; r < R; ++r) {
      __m256 x = _mm256_set1_ps(p.xf[(r0 + r) * p.e + k]);
      acc[r][0] = _mm256_fmadd_ps(x, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(p.y + (r0 + r) * p.v + c, acc[r][0]);
    _mm256_storeu_ps(p.y + (r0 + r) * p.v + c + 8, acc[r][1]);
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) void ColumnsAvx2(const Head<W>& p, int64_t c_begin, int64_t c_end) {
  int64_t c = c_begin;
  for (; c + 16 <= c_end; c += 16) ForRowGroups(p.m, [&](int64_t r, auto rh) {
      ColumnTileAvx2<W, decltype(rh)::value>(p, r, c);
    });
  if (c < c_end) ColumnsPortable(p, c, c_end);
}

// ---- AMX (bfloat16, [V, E] with E a multiple of 32, at most 32 rows): the logits of 16 vocabulary rows
// against 16 hidden rows are one tile, C[v, n] = sum over steps of 32 of tdpbf16ps(A = the 16 rows of the
// head's step, read in place, B = the step of x's rows in pairs). The unit's last rows (V not a multiple of
// 16) take the AVX-512F body. ----

// The tile configuration: tiles 0 and 1 the sums of hidden rows 0-15 and 16-31, 2 the head's rows, 3 and 4
// x's pairs; each 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16};
};

// x's rows as AMX's B operand: per block of 16 hidden rows and step of 32 elements, 16 rows of pairs,
// row k holding (x[n, 2k], x[n, 2k + 1]) for n = 0..15 (zeros past M).
inline size_t AmxOperandIndex(int64_t block, int64_t steps, int64_t step, int64_t k, int64_t n) {
  return static_cast<size_t>(((block * steps + step) * 16 + k) * 32 + 2 * n);
}

__attribute__((target("amx-tile,amx-bf16," DEW_AVX512))) void RowsAmx(const Head<uint16_t>& p, int64_t v_begin,
                                                                      int64_t v_end) {
  const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t steps = p.e / 32, blocks = (p.m + 15) / 16, stride = p.e * 2;
  alignas(64) float sums[2][16][16];
  int64_t v = v_begin;
  for (; v + 16 <= v_end; v += 16) {
    _tile_zero(0);
    _tile_zero(1);
    const uint16_t* a = p.w + v * p.e;
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(2, a + 32 * s, stride);
      _tile_loadd(3, p.xb + AmxOperandIndex(0, steps, s, 0, 0), 64);
      _tile_dpbf16ps(0, 2, 3);
      if (blocks > 1) {
        _tile_loadd(4, p.xb + AmxOperandIndex(1, steps, s, 0, 0), 64);
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    _tile_stored(0, sums[0], 64);
    if (blocks > 1) _tile_stored(1, sums[1], 64);
    for (int64_t n = 0; n < p.m; ++n)
      for (int i = 0; i < 16; ++i) p.y[n * p.v + v + i] = sums[n / 16][i][n % 16];
  }
  _tile_release();
  if (v < v_end) RowsOf<uint16_t, false>(p, v, v_end);
}

#endif  // DEW_X86

// The instruction sets, narrowest first; the one in use is the CPU's best at load unless set_isa lowered it.
enum Set { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };
const char* const kSetNames[] = {"portable", "avx2", "avx512", "avx512_bf16", "amx"};
constexpr int kSets = 5;

Set DetectSet() {
  Set best = static_cast<Set>(dew::DetectIsa());
#ifdef DEW_X86
  if (best == kAvx512 && __builtin_cpu_supports("avx512bf16")) return dew::AmxTilesAllowed() ? kAmx : kAvx512Bf16;
#endif
  return best;
}

// The set a call starts with: the best, except that Intel's cores without AMX run vdpbf16ps at half the
// multiply-adds of FMAs (a 2-core Xeon: 0.67 G instructions a second against 2.6 G for FMAs, each a pair
// of products against one), so there the bfloat16 head takes the widening body; AMD's Zen 4 runs it at
// twice the FMAs' rate. The two give the same bits but for subnormals.
Set DefaultSet(Set best) {
#ifdef DEW_X86
  if (best == kAvx512Bf16 && __builtin_cpu_is("intel")) return kAvx512;
#endif
  return best;
}

const Set g_best_set = DetectSet();
std::atomic<int> g_set{DefaultSet(g_best_set)};

template <typename W>
using Body = void (*)(const Head<W>&, int64_t, int64_t);

// AMX takes bfloat16 [V, E] heads of whole steps of 32 and at most 32 rows.
inline bool AmxTakes(bool transposed, int64_t m, int64_t e) { return transposed && e % 32 == 0 && m <= 32; }

template <typename W>
Body<W> PickBody(Set set, bool transposed, int64_t m, int64_t e) {
  switch (set) {
#ifdef DEW_X86
    case kAmx:  // else the FMA bodies (an Intel CPU: see DefaultSet)
      if constexpr (!std::is_same_v<W, float>)
        if (AmxTakes(transposed, m, e)) return RowsAmx;
      return transposed ? RowsOf<W, false> : ColumnsAvx512<W>;
    case kAvx512Bf16:
      if constexpr (!std::is_same_v<W, float>)
        if (transposed) return RowsOf<W, true>;
      [[fallthrough]];
    case kAvx512: return transposed ? RowsOf<W, false> : ColumnsAvx512<W>;
    case kAvx2: return transposed ? RowsAvx2<W> : ColumnsAvx2<W>;
#endif
    default: return transposed ? RowsPortable<W> : ColumnsPortable<W>;
  }
}

// x and the head: float32 and float32, or bfloat16 and bfloat16 (or its bits, uint16).
template <ffi::DataType TX, ffi::DataType TW>
ffi::Error Logits(ffi::ThreadPool pool, ffi::Buffer<TX> x, ffi::Buffer<TW> w, ffi::Result<ffi::Buffer<ffi::F32>> y,
                  bool transposed) {
  using W = std::conditional_t<TX == ffi::F32, float, uint16_t>;
  auto dx = x.dimensions(), dw = w.dimensions(), dy = y->dimensions();
  int64_t e = dx.size() == 2 ? dx[1] : -1, v = dw.size() == 2 ? dw[transposed ? 0 : 1] : -1;
  if (dx.size() != 2 || dw.size() != 2 || dw[transposed ? 1 : 0] != e || dy.size() != 2 || dy[0] != dx[0] ||
      dy[1] != v)
    return ffi::Error::InvalidArgument("dew head rows: x [M, E], head [V, E] (transposed) or [E, V], and y [M, V]");
  Head<W> p{reinterpret_cast<const W*>(x.untyped_data()), nullptr, nullptr, nullptr,
            reinterpret_cast<const W*>(w.untyped_data()),
            y->typed_data(), dx[0], e, v};
  if (p.m == 0 || p.v == 0) return ffi::Error::Success();
  if (p.e == 0) {
    std::fill(p.y, p.y + p.m * p.v, 0.0f);
    return ffi::Error::Success();
  }
  // bfloat16 rows widened once here: as they are (xf) and as their pairs (xp).
  std::vector<float> widened, pairs;
  if constexpr (std::is_same_v<W, float>) {
    p.xf = p.x;
  } else {
    int64_t width = PairedWidth(p.e);
    widened.resize(p.m * p.e);
    pairs.assign(p.m * width, 0.0f);
    for (int64_t r = 0; r < p.m; ++r)
      for (int64_t k = 0; k < p.e; ++k) {
        float value = widened[r * p.e + k] = Widen(p.x[r * p.e + k]);
        int64_t step = k / 32 * 32, lane = k % 32 / 2;
        pairs[r * width + step + (k % 2 ? lane : 16 + lane)] = value;
      }
    p.xf = widened.data();
    p.xp = pairs.data();
  }
  Set set = static_cast<Set>(g_set.load(std::memory_order_relaxed));
  Body<W> body = PickBody<W>(set, transposed, p.m, p.e);
  std::vector<uint16_t> tiles;  // AMX's B operand
  if constexpr (!std::is_same_v<W, float>) {
    if (set == kAmx && AmxTakes(transposed, p.m, p.e)) {
      int64_t steps = p.e / 32;
      tiles.assign(AmxOperandIndex(2, steps, 0, 0, 0), 0);
      for (int64_t n = 0; n < p.m; ++n)
        for (int64_t k = 0; k < p.e; ++k)
          tiles[AmxOperandIndex(n / 16, steps, k / 32, k % 32 / 2, n % 16) + k % 2] = p.x[n * p.e + k];
      p.xb = tiles.data();
      // AMX's products cost little beside reading the head, which one thread streams at close to the
      // memory's rate: the calling thread reads it all, and no helper that a busy machine deschedules
      // partway through its piece holds the call up for a time slice.
      body(p, 0, p.v);
      return ffi::Error::Success();
    }
  }
  int64_t unit = transposed ? kUnitRows : kUnitColumns;
  int64_t units = (p.v + unit - 1) / unit;
  int64_t unit_bytes = unit * p.e * static_cast<int64_t>(sizeof(W));
  // Pieces of a fixed size claimed from a counter (vectors.h's Pieces): many small pieces, so that a
  // thread descheduled by a busy machine holds up little of the head.
  auto work = std::make_shared<dew::Pieces>();
  work->total = units;
  work->per_piece = std::max<int64_t>(1, kPieceBytes / unit_bytes);
  work->pieces = (units + work->per_piece - 1) / work->per_piece;
  work->run = [&p, body, unit](int64_t i) { body(p, i * unit, std::min(p.v, (i + 1) * unit)); };
  int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), work->pieces) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Work(); });
  work->Work();
  dew::WaitForPieces(work->done, work->pieces);
  return ffi::Error::Success();
}

}  // namespace

#define DEW_HEAD_ROWS_HANDLER(Name, TX, TW)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, (Logits<TX, TW>),                                            \
                                ffi::Ffi::Bind()                                                   \
                                    .Ctx<ffi::ThreadPool>()                                        \
                                    .Arg<ffi::Buffer<TX>>()                                        \
                                    .Arg<ffi::Buffer<TW>>()                                        \
                                    .Ret<ffi::Buffer<ffi::F32>>()                                  \
                                    .Attr<bool>("transposed"));

DEW_HEAD_ROWS_HANDLER(DewHeadRowsF32, ffi::F32, ffi::F32)
DEW_HEAD_ROWS_HANDLER(DewHeadRowsBf16, ffi::BF16, ffi::BF16)
DEW_HEAD_ROWS_HANDLER(DewHeadRowsBits, ffi::BF16, ffi::U16)

static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewHeadRowsF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewHeadRowsBf16)},
                                       {"bits", reinterpret_cast<void*>(&DewHeadRowsBits)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyObject* GetIsa(PyObject*, PyObject*) { return PyUnicode_FromString(kSetNames[g_set.load()]); }

static PyObject* SetIsa(PyObject*, PyObject* args) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  int wanted = -1;
  for (int i = 0; i < kSets; ++i)
    if (std::string(name) == kSetNames[i]) wanted = i;
  if (wanted < 0) {
    PyErr_Format(PyExc_ValueError, "instruction set %R is not one of portable, avx2, avx512, avx512_bf16, amx",
                 PyTuple_GetItem(args, 0));
    return nullptr;
  }
  if (wanted > g_best_set) {
    PyErr_Format(PyExc_ValueError, "instruction set %s is beyond this CPU's best, %s", name, kSetNames[g_best_set]);
    return nullptr;
  }
  g_set.store(wanted);
  Py_RETURN_NONE;
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by the head's dtype (f32, bf16, bits)."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the bodies use: amx, avx512_bf16, avx512, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use the named instruction set (at most the CPU's best), for tests."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_head_rows",
                              "Dew's XLA FFI logits of a few rows against the output head.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_head_rows(void) { return PyModule_Create(&kModule); }
