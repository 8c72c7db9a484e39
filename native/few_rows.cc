// XLA FFI handlers for products of a few rows against a weight: y [M, N] = x [M, K] w [K, N], all
// row-major, the shape of a decode step's linears (M the rows being decoded), in float32 (x and w float32)
// or in bfloat16 (x bfloat16, w bfloat16 held as its uint16 bits), the result float32 either way.
//
// A few rows leave the product bound by reading w, which each row shares: the weight is streamed once for
// all rows, in blocks of kBlockRows whole rows of w (a contiguous region) read across the columns, so the
// memory sees long runs of consecutive bytes; the rows' sums wait in a buffer between blocks. With AVX2 or
// AVX-512 and 16 rows or more, the multiply-adds weigh more than the reading: a slice runs in strips of 32 columns
// instead, each copied a panel of 128 rows at a time into a buffer that stays in the first cache while every
// group of x's rows runs the panel with its sums in registers. w's rows split into a fixed number of slices,
// claimed by XLA's intra-op threads (the FFI's ThreadPool). Each output is, per slice, one chain of fused
// multiply-adds over k in order, sum = fma(x[m, k], w[k, n], sum) from zero, and the slices' sums are added
// in slice order: the AVX-512, AVX2 and portable bodies give the same bits, whatever the threads.
//
// In bfloat16 the same bodies widen x and w to float32 (a bfloat16 is the high half of a float32's bits),
// where a product of two bfloat16s is exact, so each fma rounds only the sum. On a CPU with AVX512_BF16
// the bfloat16 body is `vdpbf16ps` instead: it takes w's rows in pairs (k, k + 1), each 32-bit lane one
// column's pair (row k in the high half, row k + 1 in the low one) against x's pair broadcast the same way,
// and adds the high half's product, then the low half's, into the float32 sum, each addition rounded to
// nearest even (the order and roundings Intel's manual gives): the same chain over k in order. It reads
// denormal inputs (x, w and the running sum) as zero and flushes denormal results to zero, as the FMA
// bodies do under XLA, whose CPU threads run with MXCSR's FTZ and DAZ set; an odd K's last row goes alone
// through the widening FMA, and columns past the last whole 16 through the portable body. These bfloat16
// bodies give the same bits.
//
// A bfloat16 product of 2 rows or more takes AMX's tiles instead where the CPU has them and Linux grants
// them to the process (arch_prctl(ARCH_REQ_XCOMP_PERM), asked once, when first needed): 32 of w's rows at
// a time, 32 columns at a time, are interleaved into tdpbf16ps's pair layout in a 2 KiB buffer and
// multiplied by x's rows in one or two tiles of 16, into float32 sums held in tiles across blocks of 64
// rows (in y between blocks). tdpbf16ps adds each step's 32 products into a sum in the order and with the
// roundings the hardware chooses, not the chain above: every output is within K - 1 roundings of the
// exact sum, as the chain is, denormals flushed.
//
// A bfloat16 product of more than 32 rows (a prefill's) takes AMX's tiles in a body of its own, where the
// weight is no longer the only cost: each piece interleaves its group of 32-column panels of w over the
// whole of K once, then multiplies every block of 32 rows against each panel with the sums held in tiles
// over all of K (one chain of tile products an output, whatever the threads). A scanned decoder's prefill
// reads its layer in place this way, where XLA would copy the layer's weight out of the stack first.
// A gated feed-forward's two products (gate and up, the same rows against two weights of one shape) may run
// in one call of that body, which holds both weights' panels and finishes each block with act(gate) * up,
// each product rounded to bfloat16 first and the activation looked up in a table XLA computed, so that the
// result is the bits of the two products and XLA's fusion of the activation after them.
// A bfloat16 product may return its sums rounded to bfloat16 (to nearest, ties to even, as XLA rounds).
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// `W` is float for float32 weights, uint16_t for bfloat16 ones (their bits).
template <typename W>
struct Product {
  const float* x;  // [m, k] (a bfloat16 x widened)
  const W* w;      // [k, n]
  float* y;        // [m, n]
  int64_t m, k, n;
  // For the vdpbf16ps body: x's rows in pairs [m, ceil(k / 2)], x[m, 2i] in the high half, x[m, 2i + 1] in
  // the low one (zero past k).
  const uint32_t* pairs = nullptr;
  // For the AMX body: x's bfloat16 bits [m, padded_k], zero past k to whole 32-row steps, and the tile
  // configuration for m rows.
  const uint16_t* padded = nullptr;
  int64_t padded_k = 0;
  const void* tiles = nullptr;
};

inline float Widen(float w) { return w; }
inline float Widen(uint16_t w) {
  uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rows of w a block reads before the sums go back to y: a block of a piece's columns stays in the first
// cache while each group of rows of x passes over it.
constexpr int64_t kBlockRows = 16;

// Block [k_begin, k_end) for columns [c_begin, c_end) of every row of x, into `sums` ([m, n], from zero
// where `first`).
template <typename W>
using BlockBody = void (*)(const Product<W>&, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end,
                           bool first, float* sums);

// Columns [c_begin, c_end) over rows [k_begin, k_end) of w for every row of x, into `sums` from zero.
template <typename W>
using StripBody = void (*)(const Product<W>&, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end,
                           float* sums);

template <typename W>
void BlockPortable(const Product<W>& p, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end, bool first,
                   float* sums) {
  for (int64_t r = 0; r < p.m; ++r) {
    float* y = sums + r * p.n;
    for (int64_t c = c_begin; c < c_end; ++c) {
      float sum = first ? 0.0f : y[c];
      for (int64_t k = k_begin; k < k_end; ++k) sum = std::fma(p.x[r * p.k + k], Widen(p.w[k * p.n + c]), sum);
      y[c] = sum;
    }
  }
}

#ifdef DEW_X86

// How many rows ahead of the one being read a tile asks the memory for (rows are N floats apart, a stride
// the hardware prefetchers follow poorly across pages).
constexpr int kAheadRows = 16;

// 16 columns of a weight's row as float32.
__attribute__((target("avx512f,avx512vl"))) inline __m512 Load16(const float* w) { return _mm512_loadu_ps(w); }
__attribute__((target("avx512f,avx512vl"))) inline __m512 Load16(const uint16_t* w) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 8 columns of a weight's row as float32.
__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* w) {
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// ---- AVX-512: R rows of x against L vectors of 16 columns, R * L <= 16 accumulators ----

// Rows [k_begin, k_end) of the weight's columns from `w` (row k_begin's column c), rows `stride` apart.
// `kAhead`: ask the memory for the rows kAheadRows on (w read in place; a packed panel is in cache).
template <typename W, int R, int L, bool kAhead = true>
__attribute__((target("avx512f,avx512vl"))) void TileAvx512(const Product<W>& p, int64_t r0, int64_t c, int64_t k_begin,
                                                          int64_t k_end, bool first, float* sums, const W* w,
                                                          int64_t stride) {
  __m512 acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r0 + r) * p.n + c + 16 * j);
  const float* x = p.x + r0 * p.k;
  for (int64_t k = k_begin; k < k_end; ++k, w += stride) {
    if constexpr (kAhead)
      for (int j = 0; j < L; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * stride + 16 * j), _MM_HINT_T0);
    for (int j = 0; j < L; ++j) {
      __m512 wj = Load16(w + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * p.k + k]), wj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) _mm512_storeu_ps(sums + (r0 + r) * p.n + c + 16 * j, acc[r][j]);
}

// Rows [r0, r0 + R) across columns [c, end) in whole 16-column vectors; returns where they end. Column c of
// row k_begin is at `w + (c - origin)`, rows `stride` apart: w itself (origin 0) or a panel of it.
template <typename W, int R, bool kAhead = true>
__attribute__((target("avx512f,avx512vl"))) int64_t TilesAvx512(const Product<W>& p, int64_t r0, int64_t c, int64_t end,
                                                              int64_t k_begin, int64_t k_end, bool first, float* sums,
                                                              const W* w, int64_t origin, int64_t stride) {
  constexpr int L = 16 / R < 4 ? 16 / R : 4;
  for (; c + 16 * L <= end; c += 16 * L)
    TileAvx512<W, R, L, kAhead>(p, r0, c, k_begin, k_end, first, sums, w + (c - origin), stride);
  for (; c + 16 <= end; c += 16)
    TileAvx512<W, R, 1, kAhead>(p, r0, c, k_begin, k_end, first, sums, w + (c - origin), stride);
  return c;
}

template <typename W>
__attribute__((target("avx512f,avx512vl"))) void BlockAvx512(const Product<W>& p, int64_t k_begin, int64_t k_end,
                                                          int64_t c_begin, int64_t c_end, bool first, float* sums) {
  const W* w = p.w + k_begin * p.n;
  int64_t r = 0, c = c_end;
  for (; r + 8 <= p.m; r += 8) c = TilesAvx512<W, 8>(p, r, c_begin, c_end, k_begin, k_end, first, sums, w, 0, p.n);
  for (; r + 4 <= p.m; r += 4) c = TilesAvx512<W, 4>(p, r, c_begin, c_end, k_begin, k_end, first, sums, w, 0, p.n);
  for (; r < p.m; ++r) c = TilesAvx512<W, 1>(p, r, c_begin, c_end, k_begin, k_end, first, sums, w, 0, p.n);
  if (c < c_end) BlockPortable(p, k_begin, k_end, c, c_end, first, sums);
}

// Every row of x over the panel's rows [kb, ke) of the strip [c_begin, c_end), `width` columns a row: groups of
// 8 rows by 2 vectors (16 sums, 2 of w, 8 broadcasts: 26 of the 32 registers), then 4 and 1.
template <typename W>
__attribute__((target("avx512f,avx512vl"))) void PanelAvx512(const Product<W>& p, int64_t kb, int64_t ke, int64_t c_begin,
                                                          int64_t c_end, bool first, float* sums, const W* panel,
                                                          int64_t width) {
  int64_t r = 0;
  for (; r + 8 <= p.m; r += 8) TilesAvx512<W, 8, false>(p, r, c_begin, c_end, kb, ke, first, sums, panel, c_begin, width);
  for (; r + 4 <= p.m; r += 4) TilesAvx512<W, 4, false>(p, r, c_begin, c_end, kb, ke, first, sums, panel, c_begin, width);
  for (; r < p.m; ++r) TilesAvx512<W, 1, false>(p, r, c_begin, c_end, kb, ke, first, sums, panel, c_begin, width);
}

// ---- AVX2 with FMA: R rows against L vectors of 8 columns, R * L <= 12 accumulators ----
// Groups of 3 rows by 4 vectors: 12 sums, one vector of w and 3 broadcasts of x fill the 16 registers. The
// compiler hoists a k's R broadcasts, so 4 rows by 3 vectors needed 17 and kept a sum in memory, whose
// store and reload then bound every k.

// Rows [k_begin, k_end) of the weight's columns from `w` (row k_begin's column c), rows `stride` apart.
// `kAhead`: ask the memory for the rows kAheadRows on (w read in place; a packed panel is in cache).
template <typename W, int R, int L, bool kAhead = true>
__attribute__((target("avx2,fma"))) void TileAvx2(const Product<W>& p, int64_t r0, int64_t c, int64_t k_begin,
                                                 int64_t k_end, bool first, float* sums, const W* w, int64_t stride) {
  __m256 acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + (r0 + r) * p.n + c + 8 * j);
  const float* x = p.x + r0 * p.k;
  for (int64_t k = k_begin; k < k_end; ++k, w += stride) {
    if constexpr (kAhead)
      for (int j = 0; j < L; j += 2)
        _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * stride + 8 * j), _MM_HINT_T0);
    for (int j = 0; j < L; ++j) {
      __m256 wj = Load8(w + 8 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * p.k + k]), wj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) _mm256_storeu_ps(sums + (r0 + r) * p.n + c + 8 * j, acc[r][j]);
}

// Rows [r0, r0 + R) across columns [c, end) in whole 8-column vectors; returns where they end. Column c of
// row k_begin is at `w + (c - origin)`, rows `stride` apart: w itself (origin 0) or a panel of it.
template <typename W, int R, bool kAhead = true>
__attribute__((target("avx2,fma"))) int64_t TilesAvx2(const Product<W>& p, int64_t r0, int64_t c, int64_t end,
                                                     int64_t k_begin, int64_t k_end, bool first, float* sums,
                                                     const W* w, int64_t origin, int64_t stride) {
  constexpr int L = 12 / R < 4 ? 12 / R : 4;
  for (; c + 8 * L <= end; c += 8 * L)
    TileAvx2<W, R, L, kAhead>(p, r0, c, k_begin, k_end, first, sums, w + (c - origin), stride);
  for (; c + 8 <= end; c += 8)
    TileAvx2<W, R, 1, kAhead>(p, r0, c, k_begin, k_end, first, sums, w + (c - origin), stride);
  return c;
}

template <typename W>
__attribute__((target("avx2,fma"))) void BlockAvx2(const Product<W>& p, int64_t k_begin, int64_t k_end, int64_t c_begin,
                                                  int64_t c_end, bool first, float* sums) {
  const W* w = p.w + k_begin * p.n;
  int64_t r = 0, c = c_end;
  for (; r + 3 <= p.m; r += 3) c = TilesAvx2<W, 3>(p, r, c_begin, c_end, k_begin, k_end, first, sums, w, 0, p.n);
  for (; r + 2 <= p.m; r += 2) c = TilesAvx2<W, 2>(p, r, c_begin, c_end, k_begin, k_end, first, sums, w, 0, p.n);
  for (; r < p.m; ++r) c = TilesAvx2<W, 1>(p, r, c_begin, c_end, k_begin, k_end, first, sums, w, 0, p.n);
  if (c < c_end) BlockPortable(p, k_begin, k_end, c, c_end, first, sums);
}

// From this many rows of x the AVX2 and AVX-512 bodies run a slice in strips of columns: each weight element
// then serves enough rows that the multiply-adds bound the time, not the reading of w, and a panel in the first
// cache feeds them faster than whole rows of w with the sums going to memory between blocks. With fewer rows
// the blocks are as fast or faster: they read w as one stream (docs/performance.md, "The AVX2 few-rows body";
// on the Zen 4, 64-column strips measured the same as 32).
constexpr int64_t kStripRows = 16;
// Columns of a strip: one tile of 32 columns for every group of rows.
constexpr int64_t kStripColumns = 32;
// Rows of w a panel holds: with its 32 columns, 16 KiB of float32, which stay in the first cache.
constexpr int64_t kPanelRows = 128;

// Every row of x over the panel's rows [kb, ke) of the strip [c_begin, c_end), `width` columns a row: groups of
// 3 rows by 4 vectors, then 2 and 1.
template <typename W>
__attribute__((target("avx2,fma"))) void PanelAvx2(const Product<W>& p, int64_t kb, int64_t ke, int64_t c_begin,
                                                  int64_t c_end, bool first, float* sums, const W* panel, int64_t width) {
  int64_t r = 0;
  for (; r + 3 <= p.m; r += 3) TilesAvx2<W, 3, false>(p, r, c_begin, c_end, kb, ke, first, sums, panel, c_begin, width);
  for (; r + 2 <= p.m; r += 2) TilesAvx2<W, 2, false>(p, r, c_begin, c_end, kb, ke, first, sums, panel, c_begin, width);
  for (; r < p.m; ++r) TilesAvx2<W, 1, false>(p, r, c_begin, c_end, kb, ke, first, sums, panel, c_begin, width);
}

template <typename W>
using PanelBody = void (*)(const Product<W>&, int64_t kb, int64_t ke, int64_t c_begin, int64_t c_end, bool first,
                           float* sums, const W* panel, int64_t width);

// A strip of whole vectors [c_begin, c_end) over rows [k_begin, k_end) of w, every row of x, from zero:
// kPanelRows rows of the strip at a time are copied into a contiguous panel, which stays in the first cache
// while `kPanel` runs each group of x's rows over it, its sums in registers (in `sums` between panels; the
// panel is in the first cache, so no rows are asked for ahead there).
template <typename W, PanelBody<W> kPanel>
void Strip(const Product<W>& p, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end, float* sums) {
  const int64_t width = c_end - c_begin;
  alignas(64) W panel[kPanelRows * kStripColumns];
  for (int64_t kb = k_begin; kb < k_end; kb += kPanelRows) {
    const int64_t ke = std::min(kb + kPanelRows, k_end);
    const W* w = p.w + kb * p.n + c_begin;
    for (int64_t k = kb; k < ke; ++k, w += p.n) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * p.n), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * p.n + width - 1), _MM_HINT_T0);
      std::memcpy(panel + (k - kb) * width, w, static_cast<size_t>(width) * sizeof(W));
    }
    kPanel(p, kb, ke, c_begin, c_end, kb == k_begin, sums, panel, width);
  }
}

// ---- AVX512_BF16: R rows against L vectors of 16 columns by vdpbf16ps, w's rows in pairs ----

// Where vpermt2w takes each 16-bit half of a pair of rows' 32 columns (row k the first operand, row k + 1
// the second, 32 on): lane i of the low vector is column i of row k + 1 then of row k, of the high vector
// column 16 + i.
alignas(64) constexpr uint16_t kPairLow[32] = {32, 0,  33, 1,  34, 2,  35, 3,  36, 4,  37, 5,  38, 6,  39, 7,
                                               40, 8,  41, 9,  42, 10, 43, 11, 44, 12, 45, 13, 46, 14, 47, 15};
alignas(64) constexpr uint16_t kPairHigh[32] = {48, 16, 49, 17, 50, 18, 51, 19, 52, 20, 53, 21, 54, 22, 55, 23,
                                                56, 24, 57, 25, 58, 26, 59, 27, 60, 28, 61, 29, 62, 30, 63, 31};

#define DEW_BF16_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16")))

template <int R, int L>
DEW_BF16_TARGET void TilePairs(const Product<uint16_t>& p, int64_t r0, int64_t c, int64_t k_begin, int64_t k_end,
                               bool first, float* sums) {
  static_assert(L == 1 || L % 2 == 0, "pairs of rows interleave 32 columns at a time, or 16 alone");
  __m512 acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r0 + r) * p.n + c + 16 * j);
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  const uint16_t* w = p.w + k_begin * p.n + c;
  const int64_t half = (p.k + 1) / 2;
  const uint32_t* x = p.pairs + r0 * half;
  int64_t k = k_begin;
  for (; k + 1 < k_end; k += 2, w += 2 * p.n) {
    for (int j = 0; j < L; j += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * p.n + 16 * j), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kAheadRows + 1) * p.n + 16 * j), _MM_HINT_T0);
    }
    __m512i pair[L];
    if constexpr (L == 1) {
      __m512i row = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      __m512i next = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p.n)));
      pair[0] = _mm512_permutex2var_epi16(row, low, next);
    } else {
      for (int j = 0; j < L; j += 2) {
        __m512i row = _mm512_loadu_si512(w + 16 * j), next = _mm512_loadu_si512(w + p.n + 16 * j);
        pair[j] = _mm512_permutex2var_epi16(row, low, next);
        pair[j + 1] = _mm512_permutex2var_epi16(row, high, next);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * half + k / 2]));
      for (int j = 0; j < L; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)pair[j], xr);
    }
  }
  if (k < k_end) {  // an odd K's last row, alone
    for (int j = 0; j < L; ++j) {
      __m512 wj = Load16(w + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(p.x[(r0 + r) * p.k + k]), wj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) _mm512_storeu_ps(sums + (r0 + r) * p.n + c + 16 * j, acc[r][j]);
}

// One row takes 128 columns at a time: 256 bytes of each of w's rows in one run.
template <int R>
DEW_BF16_TARGET int64_t TilesPairs(const Product<uint16_t>& p, int64_t r0, int64_t c, int64_t end, int64_t k_begin,
                                   int64_t k_end, bool first, float* sums) {
  constexpr int L = R == 1 ? 8 : 16 / R < 4 ? 16 / R : 4;
  for (; c + 16 * L <= end; c += 16 * L) TilePairs<R, L>(p, r0, c, k_begin, k_end, first, sums);
  if constexpr (L > 2)
    for (; c + 32 <= end; c += 32) TilePairs<R, 2>(p, r0, c, k_begin, k_end, first, sums);
  for (; c + 16 <= end; c += 16) TilePairs<R, 1>(p, r0, c, k_begin, k_end, first, sums);
  return c;
}

// Columns past the last whole 16 go through the portable body.
DEW_BF16_TARGET void BlockPairs(const Product<uint16_t>& p, int64_t k_begin, int64_t k_end, int64_t c_begin,
                                int64_t c_end, bool first, float* sums) {
  int64_t r = 0, c = c_end;
  for (; r + 8 <= p.m; r += 8) c = TilesPairs<8>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  for (; r + 4 <= p.m; r += 4) c = TilesPairs<4>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  for (; r < p.m; ++r) c = TilesPairs<1>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  if (c < c_end) BlockPortable(p, k_begin, k_end, c, c_end, first, sums);
}

// ---- AMX: 1 to 32 rows by tdpbf16ps, blocks of 32 of w's rows across 32 columns at a time ----

// Rows of w a tile holds (16 pairs), and rows of w an AMX block reads, the sums held in tiles.
constexpr int64_t kAmxDepth = 32, kAmxBlockRows = 64;

// The tiles: C for rows 0-15 and 16-31 of x against columns 0-15 (tmm0, tmm1) and 16-31 (tmm2, tmm3) of a
// 32-column group, A for x's two row groups (tmm4, tmm5), B for the two column halves (tmm6, tmm7).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};  // bytes a row, per tile
  uint8_t rows[16] = {};
};

TileConfig TilesFor(int64_t m) {
  TileConfig config;
  int low = static_cast<int>(std::min<int64_t>(m, 16)), high = static_cast<int>(std::max<int64_t>(m - 16, 1));
  for (int t : {0, 2, 4}) config.rows[t] = low;
  for (int t : {1, 3, 5}) config.rows[t] = high;
  config.rows[6] = config.rows[7] = 16;
  for (int t = 0; t < 8; ++t) config.bytes[t] = 64;
  return config;
}

// Where vpermt2w takes each 16-bit half of a pair of rows' 32 columns for a B tile (row k the first operand,
// row k + 1 the second, 32 on): lane i of the low vector is column i of row k then of row k + 1 (the layout
// tdpbf16ps reads), of the high vector column 16 + i.
alignas(64) constexpr uint16_t kTileLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kTileHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

#define DEW_AMX_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16,amx-tile,amx-bf16")))

// Rows [k_begin, k_end) of w (at most 32), columns [c, c + 32) (or 16 where `half`), into B tiles' layout:
// 16 rows of 64 bytes a half, rows past k_end zero.
// `ahead` is where the next step's 32 rows start (same stride), asked of the memory one cache line a row.
template <bool kHalf>
DEW_AMX_TARGET void PackTiles(const Product<uint16_t>& p, int64_t k_begin, int64_t k_end, int64_t c,
                              const uint16_t* ahead, uint16_t (*packed)[16][32]) {
  const __m512i low = _mm512_load_si512(kTileLow), high = _mm512_load_si512(kTileHigh);
  const uint16_t* w = p.w + k_begin * p.n + c;
  for (int pair = 0; pair < 16; ++pair, w += 2 * p.n, ahead += 2 * p.n) {
    int64_t k = k_begin + 2 * pair;
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + p.n), _MM_HINT_T0);
    __m512i row = _mm512_setzero_si512(), next = _mm512_setzero_si512();
    if constexpr (kHalf) {
      if (k < k_end) row = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      if (k + 1 < k_end) next = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p.n)));
    } else {
      if (k < k_end) row = _mm512_loadu_si512(w);
      if (k + 1 < k_end) next = _mm512_loadu_si512(w + p.n);
    }
    _mm512_store_si512(packed[0][pair], _mm512_permutex2var_epi16(row, low, next));
    if constexpr (!kHalf) _mm512_store_si512(packed[1][pair], _mm512_permutex2var_epi16(row, high, next));
  }
}

// Columns past the last whole 16 go through the portable body.
DEW_AMX_TARGET void BlockAmx(const Product<uint16_t>& p, int64_t k_begin, int64_t k_end, int64_t c_begin,
                             int64_t c_end, bool first, float* sums) {
  alignas(64) uint16_t packed[2][16][32];
  _tile_loadconfig(p.tiles);
  const bool two = p.m > 16;
  const int64_t stride = p.n * 4, x_stride = p.padded_k * 2;
  int64_t c = c_begin;
  for (; c + 16 <= c_end; c += 32) {
    const bool half = c + 32 > c_end;
    float* y = sums + c;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, y, stride);
      if (two) _tile_loadd(1, y + 16 * p.n, stride);
      if (!half) {
        _tile_loadd(2, y + 16, stride);
        if (two) _tile_loadd(3, y + 16 * p.n + 16, stride);
      }
    }
    // The sums stay in the tiles across the block's 32-row steps.
    for (int64_t k = k_begin; k < k_end; k += kAmxDepth) {
      const int64_t step_end = std::min(k + kAmxDepth, k_end);
      // The next step: the block's next 32 rows, else its first 32 in the next 32 columns (the weight's
      // rows past the block's end are asked for too, harmlessly, where the block is the last).
      const uint16_t* ahead = p.w + (step_end < k_end ? step_end * p.n + c : k_begin * p.n + c + 32);
      if (half) {
        PackTiles<true>(p, k, step_end, c, ahead, packed);
      } else {
        PackTiles<false>(p, k, step_end, c, ahead, packed);
      }
      _tile_loadd(4, p.padded + k, x_stride);
      if (two) _tile_loadd(5, p.padded + 16 * p.padded_k + k, x_stride);
      _tile_loadd(6, packed[0], 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two) _tile_dpbf16ps(1, 5, 6);
      if (!half) {
        _tile_loadd(7, packed[1], 64);
        _tile_dpbf16ps(2, 4, 7);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, y, stride);
    if (two) _tile_stored(1, y + 16 * p.n, stride);
    if (!half) {
      _tile_stored(2, y + 16, stride);
      if (two) _tile_stored(3, y + 16 * p.n + 16, stride);
    }
    if (half) c -= 16;
  }
  _tile_release();
  if (c < c_end) BlockPortable(p, k_begin, k_end, c, c_end, first, sums);
}

// ---- AMX for more than kAmxFewRows rows (a prefill's products): one chain of tiles over all of K ----

// The most rows the few-rows AMX body above takes (two row tiles of 16); more go to the body below.
constexpr int64_t kAmxFewRows = 32;
// Bytes of interleaved weight a piece holds (its panels): they stay in the second cache while each block of
// x's rows passes over them.
constexpr int64_t kGroupBytes = 1 << 20;

// A product of many rows: w's columns split into groups of panels of 32 columns, one group a piece. A
// piece reads its columns of w once, whole rows of the group at a time, interleaved into tdpbf16ps's pair
// layout over all of K; each block of 32 rows then runs the whole of K against each panel in turn (the
// block's rows stay in the first cache) with its four sums held in tiles, so each output is one chain of
// tile products from zero.
struct ManyRows {
  const uint16_t* x;  // [m, k], bfloat16 bits
  const uint16_t* w;  // [k, n]
  float* y;           // [m, n], float32 results; or null, and
  uint16_t* rounded;  // [m, n], the results rounded to bfloat16 (their bits)
  // With `up` ([k, n], y null), `rounded` is act(x w) * (x up), each product rounded to bfloat16 first
  // (GatedColumns): a gated feed-forward's two products and its activation in one pass.
  const uint16_t* up = nullptr;
  // With `up`: the activation's rounded value for every bfloat16 gate, by its bits, and two zeros past the end
  // (a 32-bit gather reads the last entry and the next).
  const uint16_t* act = nullptr;
  int64_t m, k, n;
  int64_t steps;        // 32-row steps over K: ceil(k / 32)
  int64_t direct_rows;  // rows of x that A tiles read in place: whole blocks of 32, where k is a multiple of 32
  // Rows [direct_rows, ceil(m / 32) * 32) of x, zero past k to whole steps and past m: [.., steps * 32].
  const uint16_t* padded;
  // A piece: a group of `group` panels (the last one may have fewer) against rows [part * part_rows, ...).
  int64_t group, groups, part_rows, pieces;
  std::atomic<int64_t> next{0}, done{0};
};

// Every tile 16 rows of 64 bytes: C tmm0-3 (rows 0-15 and 16-31 of a block, against columns 0-15 and 16-31
// of a panel), A tmm4-5 (the block's two row tiles), B tmm6-7 (the panel's two column halves).
TileConfig WholeTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes[t] = 64;
  }
  return config;
}

// Panels [first, first + count) of w (columns past n zero) over all of K (rows past k zero), as B tiles:
// [count][steps][2][16 pairs][32]. Each of w's rows is read across the group's columns in one run.
DEW_AMX_TARGET void PackPanels(const ManyRows& p, const uint16_t* weight, int64_t first, int64_t count,
                                uint16_t* panels) {
  const __m512i low = _mm512_load_si512(kTileLow), high = _mm512_load_si512(kTileHigh);
  const int64_t panel_size = p.steps * 1024, end = std::min(p.n, (first + count) * 32);
  for (int64_t s = 0; s < p.steps; ++s)
    for (int64_t pair = 0; pair < 16; ++pair) {
      const int64_t k = s * kAmxDepth + 2 * pair;
      const uint16_t* w = weight + k * p.n;
      for (int64_t g = 0; g < count; ++g) {
        const int64_t c = (first + g) * 32, columns = std::min<int64_t>(32, end - c);
        // The rows 32 on, asked of the memory a cache line each (rows n apart, a stride the hardware
        // prefetchers follow poorly across pages).
        _mm_prefetch(reinterpret_cast<const char*>(w + kAmxDepth * p.n + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + (kAmxDepth + 1) * p.n + c), _MM_HINT_T0);
        const __mmask32 mask = columns == 32 ? ~__mmask32{0} : (__mmask32{1} << columns) - 1;
        __m512i row = k < p.k ? _mm512_maskz_loadu_epi16(mask, w + c) : _mm512_setzero_si512();
        __m512i next = k + 1 < p.k ? _mm512_maskz_loadu_epi16(mask, w + p.n + c) : _mm512_setzero_si512();
        uint16_t* step = panels + g * panel_size + s * 1024 + 32 * pair;
        _mm512_storeu_si512(step, _mm512_permutex2var_epi16(row, low, next));
        _mm512_storeu_si512(step + 512, _mm512_permutex2var_epi16(row, high, next));
      }
    }
}

// ---- act(gate) * up as XLA's CPU fusion computes it from two bfloat16 products ----

// float32 to bfloat16 as XLA's convert rounds: to nearest, ties to even; a NaN keeps its sign and exponent
// and turns quiet. The bits sit in the float32's high half.
DEW_AMX_TARGET inline __m512i XlaRound(__m512 f) {
  __m512i bits = _mm512_castps_si512(f), one = _mm512_set1_epi32(1);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
  __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  __m512i quiet = _mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFF800000u))),
                                  _mm512_set1_epi32(0x400000));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), rounded, quiet);
}

// 16 float32 sums rounded to bfloat16 as the product's rounded output is (vcvtneps2bf16), their bits.
DEW_AMX_TARGET inline __m512i ProductBits(const float* sums) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sums)));
}

// act(gate) * up of 16 columns, rounded to bfloat16 as XLA rounds (their bits). A gate rounded to bfloat16
// has only 65,536 values: `act` holds the activation's rounded value for each, by its bits, as XLA computes
// it (dew.kernels.matmul.activation_table), and a lookup costs a fraction of computing it. The product of two
// bfloat16s is exact in float32 but for overflow and underflow, flushed to zero under FTZ as in XLA's fusion.
DEW_AMX_TARGET inline __m256i GatedColumns(const float* gate, const float* up, const uint16_t* act) {
  __m512i looked_up = _mm512_slli_epi32(_mm512_i32gather_epi32(ProductBits(gate), act, 2), 16);
  __m512 widened_up = _mm512_castsi512_ps(_mm512_slli_epi32(ProductBits(up), 16));
  __m512 both = _mm512_mul_ps(_mm512_castsi512_ps(looked_up), widened_up);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(XlaRound(both), 16));
}

// A gated block's rows still to finish (the previous panel's), while the tiles compute the next panel.
struct Pending {
  const float* gate = nullptr;  // its sums [32][32], null where nothing is pending
  const float* up = nullptr;
  uint16_t* out = nullptr;  // where row 0's first column goes in `rounded`
  int64_t n = 0, rows = 0;  // the stride of `out`; rows past m are not written
  __mmask32 columns = 0;
  const uint16_t* act = nullptr;
};

DEW_AMX_TARGET inline void FinishRow(const Pending& pending, int64_t i) {
  if (!pending.gate || i >= pending.rows) return;
  const float *gate = pending.gate + 32 * i, *up = pending.up + 32 * i;
  __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(GatedColumns(gate, up, pending.act)),
                                    GatedColumns(gate + 16, up + 16, pending.act), 1);
  _mm512_mask_storeu_epi16(pending.out + i * pending.n, pending.columns, both);
}

// The sums of the block of 32 rows `rows` (`a_row` uint16s from one row to the next) against one panel over
// all of K, into `out` (32 rows of `stride` floats). With `pending`, step s also finishes its row
// `first_pending + s` (s < 16): the vector units work while the tiles do.
DEW_AMX_TARGET void PanelSums(const ManyRows& p, const uint16_t* rows, int64_t a_row, const uint16_t* panel,
                              float* out, int64_t stride, const Pending* pending = nullptr,
                              int64_t first_pending = 0) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // Each product issued as soon as its tiles are loaded, so that loads and products overlap.
  const uint16_t *a = rows, *b = panel;
  for (int64_t s = 0; s < p.steps; ++s, a += kAmxDepth, b += 1024) {
    _tile_loadd(4, a, a_row * 2);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + 16 * a_row, a_row * 2);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
    if (pending && s < 16) FinishRow(*pending, first_pending + s);
  }
  if (pending)
    for (int64_t s = p.steps; s < 16; ++s) FinishRow(*pending, first_pending + s);
  _tile_stored(0, out, stride * 4);
  _tile_stored(1, out + 16 * stride, stride * 4);
  _tile_stored(2, out + 16, stride * 4);
  _tile_stored(3, out + 16 * stride + 16, stride * 4);
}

// The block of 32 rows from r (rows past m included) against panels [first, first + count).
DEW_AMX_TARGET void MultiplyBlock(const ManyRows& p, const uint16_t* panels, int64_t first, int64_t count,
                                  int64_t r) {
  alignas(64) float spill[32][32];
  const int64_t padded_k = p.steps * kAmxDepth;
  const bool in_place = r + 32 <= p.direct_rows;
  const uint16_t* rows = in_place ? p.x + r * p.k : p.padded + (r - p.direct_rows) * padded_k;
  const int64_t a_row = in_place ? p.k : padded_k;  // uint16s from one of x's rows to the next
  for (int64_t g = 0; g < count; ++g) {
    const int64_t c = (first + g) * 32, columns = std::min<int64_t>(32, p.n - c);
    // A whole block of float32 results goes straight to y; a ragged one (rows past m, columns past n), or
    // one rounded to bfloat16, through `spill`.
    const bool whole = p.y && r + 32 <= p.m && columns == 32;
    PanelSums(p, rows, a_row, panels + g * p.steps * 1024, whole ? p.y + r * p.n + c : &spill[0][0],
              whole ? p.n : 32);
    if (whole) continue;
    const __mmask32 mask = columns == 32 ? ~__mmask32{0} : (__mmask32{1} << columns) - 1;
    for (int64_t i = 0; i < std::min<int64_t>(32, p.m - r); ++i) {
      if (p.y) {
        std::copy(spill[i], spill[i] + columns, p.y + (r + i) * p.n + c);
      } else {  // to nearest, ties to even (NaN stays a quiet NaN), as XLA rounds float32 to bfloat16
        __m512bh both = _mm512_cvtne2ps_pbh(_mm512_load_ps(spill[i] + 16), _mm512_load_ps(spill[i]));
        _mm512_mask_storeu_epi16(p.rounded + (r + i) * p.n + c, mask, (__m512i)both);
      }
    }
  }
}

// The gated product's block of 32 rows from r against the gate's panels and the up projection's
// [first, first + count): each panel's two sums into one of two spills, and the previous panel's rows
// finished while the tiles compute them.
DEW_AMX_TARGET void GatedBlock(const ManyRows& p, const uint16_t* panels, const uint16_t* up_panels, int64_t first,
                               int64_t count, int64_t r) {
  alignas(64) float spills[2][2][32][32];  // [panel's parity][gate, up][row][column]
  const int64_t padded_k = p.steps * kAmxDepth, panel_size = p.steps * 1024;
  const bool in_place = r + 32 <= p.direct_rows;
  const uint16_t* rows = in_place ? p.x + r * p.k : p.padded + (r - p.direct_rows) * padded_k;
  const int64_t a_row = in_place ? p.k : padded_k;
  Pending pending;
  for (int64_t g = 0; g <= count; ++g) {
    if (g < count) {
      float(*spill)[32][32] = spills[g % 2];
      PanelSums(p, rows, a_row, panels + g * panel_size, &spill[0][0][0], 32, &pending, 0);
      PanelSums(p, rows, a_row, up_panels + g * panel_size, &spill[1][0][0], 32, &pending, 16);
      const int64_t c = (first + g) * 32, columns = std::min<int64_t>(32, p.n - c);
      pending = {&spill[0][0][0], &spill[1][0][0], p.rounded + r * p.n + c, p.n, std::min<int64_t>(32, p.m - r),
                 columns == 32 ? ~__mmask32{0} : (__mmask32{1} << columns) - 1, p.act};
    } else {
      for (int64_t i = 0; i < 32; ++i) FinishRow(pending, i);
    }
  }
}

// Claims pieces until none is left; each packs its panels (and the up projection's) into this thread's buffer.
DEW_AMX_TARGET void RunManyRows(ManyRows& p) {
  static const TileConfig tiles = WholeTiles();
  thread_local std::vector<uint16_t> panels;
  const int64_t panel_size = p.steps * 1024, blocks_end = (p.m + 31) / 32 * 32, all = (p.n + 31) / 32;
  const int64_t weights = p.up ? 2 : 1;
  bool configured = false;
  unsigned int csr = 0;
  for (int64_t i; (i = p.next.fetch_add(1, std::memory_order_relaxed)) < p.pieces;) {
    if (!configured) {
      _tile_loadconfig(&tiles);
      panels.resize(static_cast<size_t>(weights * p.group * panel_size));
      // The gated product's multiply runs under FTZ and DAZ, as XLA's fusions do, whatever this thread had set.
      csr = _mm_getcsr();
      if (p.up) _mm_setcsr(csr | 0x8040);
      configured = true;
    }
    const int64_t first = (i % p.groups) * p.group, count = std::min(p.group, all - first);
    const int64_t part_begin = i / p.groups * p.part_rows, part_end = std::min(part_begin + p.part_rows, blocks_end);
    uint16_t* up_panels = panels.data() + p.group * panel_size;
    PackPanels(p, p.w, first, count, panels.data());
    if (p.up) PackPanels(p, p.up, first, count, up_panels);
    for (int64_t r = part_begin; r < part_end; r += 32) {
      if (p.up) {
        GatedBlock(p, panels.data(), up_panels, first, count, r);
      } else {
        MultiplyBlock(p, panels.data(), first, count, r);
      }
    }
    p.done.fetch_add(1, std::memory_order_release);
  }
  if (configured) {
    _mm_setcsr(csr);
    _tile_release();
  }
}

// y = x w for more than kAmxFewRows rows, over the pool's threads (w the layer, read in place); with `up`
// and `act`, the rounded act(x w) * (x up) instead (y null). Each output is one piece's chain of tile
// products, so the result does not depend on the threads or the chunks.
void ManyRowsProduct(ffi::ThreadPool& pool, const uint16_t* x, const uint16_t* w, float* y, uint16_t* rounded,
                     int64_t m, int64_t k, int64_t n, const uint16_t* up = nullptr,
                     const uint16_t* act = nullptr) {
  auto p = std::make_shared<ManyRows>();
  p->x = x;
  p->w = w;
  p->y = y;
  p->rounded = rounded;
  p->up = up;
  p->act = act;
  p->m = m;
  p->k = k;
  p->n = n;
  p->steps = (k + kAmxDepth - 1) / kAmxDepth;
  const int64_t padded_k = p->steps * kAmxDepth, blocks = (m + 31) / 32;
  // A tiles read x in place where its rows are whole steps long; the last ragged block (and every block,
  // where they are not) is copied out, zero past k and past m. In the calling thread's buffer: every piece
  // that reads it has finished before this call returns.
  p->direct_rows = k % kAmxDepth == 0 ? m / 32 * 32 : 0;
  thread_local std::vector<uint16_t> padded;
  padded.assign(static_cast<size_t>((blocks * 32 - p->direct_rows) * padded_k), 0);
  for (int64_t r = p->direct_rows; r < m; ++r)
    std::copy(x + r * k, x + (r + 1) * k, padded.data() + (r - p->direct_rows) * padded_k);
  p->padded = padded.data();
  // Groups of panels that fit kGroupBytes (the gate's and the up projection's together), at least one a
  // thread; rows split in parts where there are fewer groups than threads.
  const int64_t all = (n + 31) / 32, panel_bytes = padded_k * 32 * 2 * (up ? 2 : 1);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t fitting = std::max<int64_t>(1, kGroupBytes / panel_bytes);
  const int64_t groups = std::min(all, threads * ((all + threads * fitting - 1) / (threads * fitting)));
  p->group = (all + groups - 1) / groups;
  p->groups = (all + p->group - 1) / p->group;
  const int64_t parts = std::min(blocks, (threads + p->groups - 1) / p->groups);
  p->part_rows = 32 * ((blocks + parts - 1) / parts);
  p->pieces = p->groups * ((blocks * 32 + p->part_rows - 1) / p->part_rows);
  const int64_t helpers = std::min(threads, p->pieces) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([p] { RunManyRows(*p); });
  RunManyRows(*p);
  dew::WaitForPieces(p->done, p->pieces);
}

#endif  // DEW_X86

// The bodies by instruction set (native/isa.h's order); the one in use is the CPU's best at load unless
// set_isa lowered it. bfloat16 products take vdpbf16ps on a CPU that has it, unless set_pairs turned it off
// or set_isa lowered the set below AVX-512.
const dew::Isa g_best_isa = dew::DetectIsa();
std::atomic<int> g_isa{static_cast<int>(g_best_isa)};
#ifdef DEW_X86
const BlockBody<float> kBodies[] = {BlockPortable<float>, BlockAvx2<float>, BlockAvx512<float>};
const BlockBody<uint16_t> kBfloat16Bodies[] = {BlockPortable<uint16_t>, BlockAvx2<uint16_t>, BlockAvx512<uint16_t>};
bool HasPairs() {
  __builtin_cpu_init();
  return g_best_isa == dew::kAvx512 && __builtin_cpu_supports("avx512bf16");
}
#else
const BlockBody<float> kBodies[] = {BlockPortable<float>};
const BlockBody<uint16_t> kBfloat16Bodies[] = {BlockPortable<uint16_t>};
bool HasPairs() { return false; }
#endif
const bool g_has_pairs = HasPairs();
// The fewest rows a bfloat16 product takes AMX's tiles for.
constexpr int64_t kAmxRows = 2;
std::atomic<bool> g_pairs{g_has_pairs};

// AMX is asked for on the first bfloat16 product that would use it.
std::atomic<bool> g_tiles{true};
bool HasTiles() {
#ifdef DEW_X86
  static const bool allowed = g_best_isa == dew::kAvx512 && dew::AmxTilesAllowed();
  return allowed;
#else
  return false;
#endif
}

BlockBody<float> Body(float*, int64_t) { return kBodies[g_isa.load(std::memory_order_relaxed)]; }
BlockBody<uint16_t> Body(uint16_t*, int64_t m) {
  int isa = g_isa.load(std::memory_order_relaxed);
#ifdef DEW_X86
  if (isa == dew::kAvx512 && m >= kAmxRows && g_tiles.load(std::memory_order_relaxed) && HasTiles()) return BlockAmx;
  if (isa == dew::kAvx512 && g_pairs.load(std::memory_order_relaxed)) return BlockPairs;
#endif
  return kBfloat16Bodies[isa];
}

// The weight's rows split into at most kSlices slices of whole blocks, fixed by the shape alone; each
// thread that claims a slice streams one contiguous region of w, and the slices' sums are added in slice
// order at the end, so the result does not depend on the threads.
constexpr int64_t kSlices = 4;
// At least this many weight bytes a slice: waking a thread costs microseconds.
constexpr int64_t kSliceBytes = 128 << 10;

// Slices claimed from `next` by whichever thread is free; shared by pointer, since a pool task may start
// after the call has returned (it then finds nothing to claim).
template <typename W>
struct Pieces {
  Product<W> p;
  BlockBody<W> body;
  StripBody<W> strip = nullptr;  // where set, a slice runs in strips of columns instead of blocks of rows
  int64_t strip_vector = 8;       // the strip body's columns a vector
  int64_t block_rows = kBlockRows, slices = 1, slice_rows = 0;
  float* partial = nullptr;  // [slices - 1, m, n]: the sums of slices 1 on (slice 0 sums into y)
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < slices;) {
      float* sums = i == 0 ? p.y : partial + (i - 1) * p.m * p.n;
      int64_t k_begin = i * slice_rows, k_end = std::min(k_begin + slice_rows, p.k);
      if (strip && k_begin < k_end) {
        const int64_t whole = p.n / strip_vector * strip_vector;  // whole vectors; the rest through the portable body
        for (int64_t c = 0; c < whole; c += kStripColumns)
          strip(p, k_begin, k_end, c, std::min(c + kStripColumns, whole), sums);
        if (whole < p.n) BlockPortable(p, k_begin, k_end, whole, p.n, true, sums);
      } else {
        for (int64_t k = k_begin; k < k_end; k += block_rows)
          body(p, k, std::min(k + block_rows, k_end), 0, p.n, k == k_begin, sums);
      }
      if (k_begin >= k_end) std::fill(sums, sums + p.m * p.n, 0.0f);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The layer `*at` of w after checking the operands' shapes and the layer; the error names the handler's `what`.
template <typename X, typename W, typename Y>
ffi::Error CheckShapes(const char* what, const X& x, const W& w, const ffi::Buffer<ffi::S32>& layer, Y& y,
                       int64_t* at) {
  auto dx = x.dimensions(), dw = w.dimensions(), dy = y->dimensions();
  if (dx.size() != 2 || dw.size() != 3 || dy.size() != 2 || dx[1] != dw[1] || dy[0] != dx[0] || dy[1] != dw[2] ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument(std::string(what) + ": x [M, K], w [L, K, N], layer [] and y [M, N]");
  *at = *layer.typed_data();
  if (*at < 0 || *at >= dw[0])
    return ffi::Error::InvalidArgument(std::string(what) + ": layer " + std::to_string(*at) +
                                       " outside the stack of " + std::to_string(dw[0]));
  return ffi::Error::Success();
}

// y = p.x p.w over the pool's threads, slices added in order.
template <typename W>
void Run(ffi::ThreadPool& pool, const Product<W>& product) {
  auto pieces = std::make_shared<Pieces<W>>();
  Product<W>& p = pieces->p;
  p = product;
  pieces->body = Body(static_cast<W*>(nullptr), p.m);
  if (p.m == 0 || p.n == 0) return;
#ifdef DEW_X86
  if (p.m >= kStripRows && pieces->body == BlockBody<W>(BlockAvx2<W>)) pieces->strip = Strip<W, PanelAvx2<W>>;
  if (p.m >= kStripRows && pieces->body == BlockBody<W>(BlockAvx512<W>))
    pieces->strip = Strip<W, PanelAvx512<W>>, pieces->strip_vector = 16;
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (pieces->body == BlockAmx) pieces->block_rows = kAmxBlockRows;
  }
#endif
  const int64_t block_rows = pieces->block_rows;
  int64_t blocks = std::max<int64_t>(1, (p.k + block_rows - 1) / block_rows);
  int64_t slices = std::clamp<int64_t>(p.k * p.n * static_cast<int64_t>(sizeof(W)) / kSliceBytes, 1, kSlices);
  pieces->slice_rows = (blocks + slices - 1) / slices * block_rows;
  pieces->slices = std::max<int64_t>(1, (p.k + pieces->slice_rows - 1) / pieces->slice_rows);
  // In the calling thread's buffer: every slice that writes it has finished before this call returns.
  thread_local std::vector<float> partial;
  partial.resize(static_cast<size_t>((pieces->slices - 1) * p.m * p.n));
  pieces->partial = partial.data();
  int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), pieces->slices) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([pieces] { pieces->Run(); });
  pieces->Run();
  dew::WaitForPieces(pieces->done, pieces->slices);
  for (int64_t s = 1; s < pieces->slices; ++s) {
    const float* slice = partial.data() + (s - 1) * p.m * p.n;
    for (int64_t e = 0; e < p.m * p.n; ++e) p.y[e] += slice[e];
  }
}

// y = x w[layer]: `w` is a stack of weights [L, K, N] (one weight is a stack of one); a scanned decoder
// passes its layers' whole stack and the layer's index, so that XLA does not copy the layer's weight out
// of the stack before every product.
ffi::Error FewRowsProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  int64_t at;
  if (ffi::Error error = CheckShapes("dew few-rows product", x, w, layer, y, &at); error.failure()) return error;
  auto dx = x.dimensions(), dw = w.dimensions();
  Run<float>(pool, {x.typed_data(), w.typed_data() + at * dw[1] * dw[2], y->typed_data(), dx[0], dx[1], dw[2]});
  return ffi::Error::Success();
}

// float32 to bfloat16's bits, to nearest, ties to even (NaN stays a quiet NaN), as XLA rounds.
inline uint16_t RoundToBfloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// x [m, k] bfloat16 bits against w [k, n] (one layer's bits): the float32 sums into y, or with y null
// rounded to bfloat16 into `rounded`.
void Bfloat16Product(ffi::ThreadPool& pool, const uint16_t* bits, const uint16_t* w, float* y, uint16_t* rounded,
                     int64_t m, int64_t k, int64_t n) {
#ifdef DEW_X86
  if (m > kAmxFewRows && Body(static_cast<uint16_t*>(nullptr), m) == BlockAmx) {
    ManyRowsProduct(pool, bits, w, y, rounded, m, k, n);
    return;
  }
#endif
  // The other bodies sum in float32 (here, where the result is rounded) and the sums are rounded after.
  thread_local std::vector<float> sums;
  if (!y) {
    sums.resize(static_cast<size_t>(m * n));
    y = sums.data();
  }
  // x widened for the FMA bodies and paired for vdpbf16ps, once a call (m * k values, against k * n weights).
  const int64_t half = (k + 1) / 2;
  thread_local std::vector<float> widened;
  thread_local std::vector<uint32_t> pairs;
  widened.resize(static_cast<size_t>(m * k));
  pairs.assign(static_cast<size_t>(m * half), 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) {
      widened[r * k + i] = Widen(bits[r * k + i]);
      pairs[r * half + i / 2] |= static_cast<uint32_t>(bits[r * k + i]) << (i % 2 == 0 ? 16 : 0);
    }
  Product<uint16_t> p{widened.data(), w, y, m, k, n};
  p.pairs = pairs.data();
#ifdef DEW_X86
  // For AMX: x's rows, zero past k to whole 32-row steps (an A tile reads 32 of x's columns).
  thread_local std::vector<uint16_t> padded;
  thread_local TileConfig tiles;
  if (m >= kAmxRows) {
    p.padded_k = (k + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
    padded.assign(static_cast<size_t>(m * p.padded_k), 0);
    for (int64_t r = 0; r < m; ++r) std::copy(bits + r * k, bits + (r + 1) * k, padded.data() + r * p.padded_k);
    tiles = TilesFor(m);
    p.padded = padded.data();
    p.tiles = &tiles;
  }
#endif
  Run<uint16_t>(pool, p);
  if (rounded)
    for (int64_t e = 0; e < m * n; ++e) rounded[e] = RoundToBfloat16(y[e]);
}

// The same in bfloat16: x [M, K] bfloat16, w [L, K, N] bfloat16 as its uint16 bits, y float32 (`Y` F32) or
// rounded to bfloat16 in the call (`Y` BF16, once, from the float32 sums).
template <ffi::DataType Y>
ffi::Error Bfloat16FewRowsProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> w,
                                  ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<Y>> y) {
  int64_t at;
  if (ffi::Error error = CheckShapes("dew bfloat16 few-rows product", x, w, layer, y, &at); error.failure())
    return error;
  auto dx = x.dimensions(), dw = w.dimensions();
  float* sums = nullptr;
  uint16_t* rounded = nullptr;
  if constexpr (Y == ffi::F32) {
    sums = y->typed_data();
  } else {
    rounded = reinterpret_cast<uint16_t*>(y->typed_data());
  }
  Bfloat16Product(pool, x.typed_data(), w.typed_data() + at * dw[1] * dw[2], sums, rounded, dx[0], dx[1], dw[2]);
  return ffi::Error::Success();
}

// A gated feed-forward's act(x gate[gate_layer]) * (x up[up_layer]) for a prefill's rows, rounded to
// bfloat16 as the two rounded products and XLA's fusion of the activation after them give it: x [M, K]
// bfloat16, gate and up [L, K, N] bfloat16 as their uint16 bits, read in place, and `act` the activation's
// rounded value for each bfloat16 by its bits [65538] (two zeros past the end). Only the AMX body of more than
// kAmxFewRows rows computes it.
ffi::Error Bfloat16GatedProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U16> gate,
                                ffi::Buffer<ffi::S32> gate_layer, ffi::Buffer<ffi::U16> up,
                                ffi::Buffer<ffi::S32> up_layer, ffi::Buffer<ffi::U16> act,
                                ffi::Result<ffi::Buffer<ffi::BF16>> y) {
  int64_t at, up_at;
  if (ffi::Error error = CheckShapes("dew gated product (gate)", x, gate, gate_layer, y, &at); error.failure())
    return error;
  if (ffi::Error error = CheckShapes("dew gated product (up)", x, up, up_layer, y, &up_at); error.failure())
    return error;
  if (act.element_count() != 65536 + 2)
    return ffi::Error::InvalidArgument("dew gated product: the activation's table holds 65538 entries, not " +
                                       std::to_string(act.element_count()));
  auto dx = x.dimensions(), dw = gate.dimensions();
  const int64_t m = dx[0], k = dx[1], n = dw[2], layer_size = k * n;
#ifdef DEW_X86
  if (m > kAmxFewRows && Body(static_cast<uint16_t*>(nullptr), m) == BlockAmx) {
    ManyRowsProduct(pool, x.typed_data(), gate.typed_data() + at * layer_size, nullptr,
                    reinterpret_cast<uint16_t*>(y->typed_data()), m, k, n, up.typed_data() + up_at * layer_size,
                    act.typed_data());
    return ffi::Error::Success();
  }
#endif
  return ffi::Error::InvalidArgument("dew gated product: " + std::to_string(m) + " rows; it takes more than " +
                                     std::to_string(kAmxFewRows) + " with AMX's tiles on (dew.kernels.matmul "
                                     "routes other products to two products and XLA's activation)");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewFewRowsProduct, FewRowsProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewBfloat16FewRowsProduct, Bfloat16FewRowsProduct<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewBfloat16RoundedProduct, Bfloat16FewRowsProduct<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewBfloat16GatedProduct, Bfloat16GatedProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewFewRowsProduct), nullptr, nullptr);
}

static PyObject* Bfloat16Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewBfloat16FewRowsProduct), nullptr, nullptr);
}

static PyObject* RoundedHandler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewBfloat16RoundedProduct), nullptr, nullptr);
}

static PyObject* GatedHandler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewBfloat16GatedProduct), nullptr, nullptr);
}

static PyObject* GetPairs(PyObject*, PyObject*) { return PyBool_FromLong(g_pairs.load()); }

static PyObject* SetPairs(PyObject*, PyObject* args) {
  int on = 0;
  if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
  if (on && !g_has_pairs) {
    PyErr_SetString(PyExc_ValueError, "this CPU has no AVX512_BF16 (vdpbf16ps): its bfloat16 products widen to float32");
    return nullptr;
  }
  g_pairs.store(on);
  Py_RETURN_NONE;
}

static PyObject* GetTiles(PyObject*, PyObject*) { return PyBool_FromLong(g_tiles.load() && HasTiles()); }

static PyObject* SetTiles(PyObject*, PyObject* args) {
  int on = 0;
  if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
  if (on && !HasTiles()) {
    PyErr_SetString(PyExc_ValueError, "this CPU has no AMX bfloat16 tiles, or Linux refused them to this process");
    return nullptr;
  }
  g_tiles.store(on);
  Py_RETURN_NONE;
}

static PyObject* GetIsa(PyObject*, PyObject*) { return dew::GetIsa(g_isa); }

static PyObject* SetIsa(PyObject*, PyObject* args) { return dew::SetIsa(args, g_best_isa, g_isa); }

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The float32 XLA FFI handler, as a capsule."},
    {"bfloat16_handler", Bfloat16Handler, METH_NOARGS, "The bfloat16 XLA FFI handler, as a capsule."},
    {"rounded_handler", RoundedHandler, METH_NOARGS,
     "The bfloat16 XLA FFI handler whose results are rounded to bfloat16, as a capsule."},
    {"gated_handler", GatedHandler, METH_NOARGS,
     "The bfloat16 XLA FFI handler of act(x gate) * (x up) for more than 32 rows, in AMX's tiles, as a capsule."},
    {"pairs", GetPairs, METH_NOARGS, "Whether bfloat16 products take vdpbf16ps (under the avx512 set)."},
    {"set_pairs", SetPairs, METH_VARARGS, "Turn vdpbf16ps on (where the CPU has it) or off, for tests."},
    {"tiles", GetTiles, METH_NOARGS, "Whether bfloat16 products of 2 rows or more take AMX (under avx512)."},
    {"set_tiles", SetTiles, METH_VARARGS, "Turn AMX on (where the CPU and Linux allow it) or off, for tests."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the bodies use: avx512, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use the named instruction set (at most the CPU's best), for tests."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_few_rows",
                              "Dew's XLA FFI float32 and bfloat16 products of a few rows against a weight.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_few_rows(void) { return PyModule_Create(&kModule); }
