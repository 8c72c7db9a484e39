// XLA FFI handler for products with an int8 weight and float32 scales per output column and group of
// `group` consecutive inputs (G = ceil(D / group) groups, the last one possibly shorter):
//   y[n, f] = sum_g scale[g, f] * sum_{d in g} x[n, d] * q[d, f]    (q [D, F], scale [G, F]), or
//   y[n, f] = sum_g scale[f, g] * sum_{d in g} x[n, d] * q[f, d]    (q [F, D], scale [F, G]: `transposed`).
// The group is ceil(D / G), which the scale's shape gives. Decoding reads each weight once per token,
// so the speed is the speed of streaming the int8 bytes: the int8 values are widened to float32 in
// registers and never written back as floats. Sums accumulate in float32; a scale multiplies its
// group's partial sum (in the [D, F] layout, each block of up to kBlockRows rows within one group).
//
// One binary runs on every x86-64: the AVX-512 and AVX2 bodies are compiled for their targets only and
// chosen at run time by what the CPU reports; other machines run the portable body. The work splits
// across XLA's intra-op thread pool (the FFI's ThreadPool context) in pieces claimed from a counter, so
// the calling thread never waits for a piece no thread has started: for a few rows of x, slices of q's
// rows (each thread streams one contiguous region; the partial sums are added in slice order, so the
// result does not depend on the threads), else chunks of columns.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "isa.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One product of the batch: x [n, d] row-major, q as stored, y [n, f]. A body computes the columns
// [f_begin, f_end) of every row.
struct Product {
  const float* x;
  const int8_t* q;
  const float* scale;  // [G, F] or [F, G]
  float* y;
  int64_t n, d, f;
  int64_t groups, group;  // G, and the inputs per group (ceil(D / G))
};

// [D, F] layout: sums over q's rows [k_begin, k_end) (all in one group) for the columns [c_begin, c_end)
// of every row of x, times the group's scales, into `sums` ([n, f] row-major), added to what it holds
// unless `first`.
using ColumnsBody = void (*)(const Product&, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end,
                             bool first, float* sums);
// [F, D] layout: the finished columns [c_begin, c_end) of y.
using RowsBody = void (*)(const Product&, int64_t c_begin, int64_t c_end);

// ---- portable bodies (any CPU; also the column tails the vector bodies leave) ----

void ColumnsPortable(const Product& p, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end, bool first,
                     float* sums) {
  const float* scale = p.scale + (k_begin / p.group) * p.f;
  std::vector<float> block(c_end - c_begin);
  for (int64_t r = 0; r < p.n; ++r) {
    const float* x = p.x + r * p.d;
    float* y = sums + r * p.f;
    std::fill(block.begin(), block.end(), 0.0f);
    for (int64_t k = k_begin; k < k_end; ++k) {
      const int8_t* q = p.q + k * p.f;
      float xk = x[k];
      for (int64_t c = c_begin; c < c_end; ++c) block[c - c_begin] += xk * static_cast<float>(q[c]);
    }
    for (int64_t c = c_begin; c < c_end; ++c) y[c] = (first ? 0.0f : y[c]) + block[c - c_begin] * scale[c];
  }
}

void RowsPortable(const Product& p, int64_t f_begin, int64_t f_end) {
  for (int64_t c = f_begin; c < f_end; ++c) {
    const int8_t* q = p.q + c * p.d;
    for (int64_t r = 0; r < p.n; ++r) {
      const float* x = p.x + r * p.d;
      float total = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float sum = 0.0f;
        for (int64_t k = g * p.group, end = std::min(k + p.group, p.d); k < end; ++k)
          sum += x[k] * static_cast<float>(q[k]);
        total += sum * p.scale[c * p.groups + g];
      }
      p.y[r * p.f + c] = total;
    }
  }
}

#ifdef DEW_X86

// How many rows ahead of the one being read a tile asks the memory for: the rows of a [D, F] tile are
// F bytes apart, a stride the hardware prefetchers follow poorly across pages.
constexpr int kAheadRows = 16;
// How many 4-column groups ahead the [F, D] layout's bodies prefetch.
constexpr int kAheadGroups = 2;

// ---- AVX-512: tiles of L cache lines of q per row (64 L columns) against R rows of x, R * 4L <= 16
// accumulators. Wider tiles read more contiguous bytes per row, which the memory streams faster. ----

template <int R, int L>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void TileAvx512(const Product& p, int64_t r0, int64_t c,
                                                                  int64_t k_begin, int64_t k_end, bool first,
                                                                  float* sums) {
  constexpr int V = 4 * L;  // 16-column vectors per row
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  const int8_t* q = p.q + k_begin * p.f + c;
  const float* x = p.x + r0 * p.d;
  for (int64_t k = k_begin; k < k_end; ++k, q += p.f) {
    for (int l = 0; l < L; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(q + kAheadRows * p.f + 64 * l), _MM_HINT_T0);
    for (int j = 0; j < V; ++j) {
      __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * p.d + k]), w, acc[r][j]);
    }
  }
  const float* scale = p.scale + (k_begin / p.group) * p.f + c;
  for (int j = 0; j < V; ++j) {
    __m512 s = _mm512_loadu_ps(scale + 16 * j);
    for (int r = 0; r < R; ++r) {
      float* y = sums + (r0 + r) * p.f + c + 16 * j;
      _mm512_storeu_ps(y, _mm512_fmadd_ps(acc[r][j], s, first ? _mm512_setzero_ps() : _mm512_loadu_ps(y)));
    }
  }
}

// Rows [r0, r0 + R) of x across columns [c, end): the widest tiles first, whole cache lines only;
// returns where the whole lines end.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t ColumnTilesAvx512(const Product& p, int64_t r0,
                                                                            int64_t c, int64_t end, int64_t k_begin,
                                                                            int64_t k_end, bool first,
                                                                            float* sums) {
  if constexpr (R == 1)
    for (; c + 256 <= end; c += 256) TileAvx512<1, 4>(p, r0, c, k_begin, k_end, first, sums);
  if constexpr (R <= 2)
    for (; c + 128 <= end; c += 128) TileAvx512<R, 2>(p, r0, c, k_begin, k_end, first, sums);
  for (; c + 64 <= end; c += 64) TileAvx512<R, 1>(p, r0, c, k_begin, k_end, first, sums);
  return c;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void ColumnsAvx512(const Product& p, int64_t k_begin,
                                                                    int64_t k_end, int64_t c_begin,
                                                                    int64_t c_end, bool first, float* sums) {
  int64_t r = 0, c = c_begin;
  for (; r + 4 <= p.n; r += 4) c = ColumnTilesAvx512<4>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  switch (p.n - r) {
    case 3: c = ColumnTilesAvx512<3>(p, r, c_begin, c_end, k_begin, k_end, first, sums); break;
    case 2: c = ColumnTilesAvx512<2>(p, r, c_begin, c_end, k_begin, k_end, first, sums); break;
    case 1: c = ColumnTilesAvx512<1>(p, r, c_begin, c_end, k_begin, k_end, first, sums); break;
  }
  if (c < c_end) ColumnsPortable(p, k_begin, k_end, c, c_end, first, sums);
}

__attribute__((target("avx512f"))) inline float Sum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// [F, D] layout: 4 output columns (4 contiguous q rows) against up to 3 rows of x, 16 terms a step. Each
// group's sums fold into `total` times the group's scales: R * 4 of each, with the 4 widened q vectors
// and x, within the 32 registers: folding each group's sums once takes fewer multiplies than scaling
// every widened q vector by its scale, and runs faster (docs/performance.md).
// `Whole`: every group is whole 16-term steps (SmolLM2's groups of 64), so no step needs a mask.
template <int R, bool Whole>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void DotsAvx512(const Product& p, int64_t r0, int64_t c) {
  __m512 total[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) total[r][j] = _mm512_setzero_ps();
  const int8_t* q = p.q + c * p.d;
  const float* x = p.x + r0 * p.d;
  const float* scale = p.scale + c * p.groups;
  // The next groups' rows: one cache line a step covers a group of 4 rows (4 * D bytes, 4 lines per
  // 16 terms) while this one is summed.
  const char* ahead = reinterpret_cast<const char*>(q + kAheadGroups * 4 * p.d);
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t end = std::min((g + 1) * p.group, p.d);
    for (int64_t k = g * p.group; k < end; k += 16) {
      _mm_prefetch(ahead + 4 * k, _MM_HINT_T0);
      __mmask16 mask = Whole || end - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                              : static_cast<__mmask16>((1u << (end - k)) - 1);
      __m512 w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + j * p.d + k)));
      for (int r = 0; r < R; ++r) {
        __m512 xr = _mm512_maskz_loadu_ps(mask, x + r * p.d + k);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xr, w[j], acc[r][j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      __m512 s = _mm512_set1_ps(scale[j * p.groups + g]);
      for (int r = 0; r < R; ++r) total[r][j] = _mm512_fmadd_ps(acc[r][j], s, total[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) p.y[(r0 + r) * p.f + c + j] = Sum512(total[r][j]);
}

template <bool Whole>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void RowsAvx512Of(const Product& p, int64_t f_begin,
                                                                     int64_t f_end) {
  int64_t c = f_begin;
  for (; c + 4 <= f_end; c += 4) {
    int64_t r = 0;
    for (; r + 3 <= p.n; r += 3) DotsAvx512<3, Whole>(p, r, c);
    if (p.n - r == 2) DotsAvx512<2, Whole>(p, r, c);
    if (p.n - r == 1) DotsAvx512<1, Whole>(p, r, c);
  }
  if (c < f_end) RowsPortable(p, c, f_end);
}

void RowsAvx512(const Product& p, int64_t f_begin, int64_t f_end) {
  if (p.group % 16 == 0 && p.d % 16 == 0)
    RowsAvx512Of<true>(p, f_begin, f_end);
  else
    RowsAvx512Of<false>(p, f_begin, f_end);
}

// ---- AVX2 + FMA: V 8-column vectors per row against R rows of x, R * V <= 8 accumulators of the 16
// registers: 64 columns (one cache line) for one row, 32 for two. ----

template <int R, int V>
__attribute__((target("avx2,fma"))) void TileAvx2(const Product& p, int64_t r0, int64_t c, int64_t k_begin,
                                                 int64_t k_end, bool first, float* sums) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm256_setzero_ps();
  const int8_t* q = p.q + k_begin * p.f + c;
  const float* x = p.x + r0 * p.d;
  for (int64_t k = k_begin; k < k_end; ++k, q += p.f) {
    _mm_prefetch(reinterpret_cast<const char*>(q + kAheadRows * p.f), _MM_HINT_T0);
    for (int j = 0; j < V; ++j) {
      __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * p.d + k), w, acc[r][j]);
    }
  }
  const float* scale = p.scale + (k_begin / p.group) * p.f + c;
  for (int j = 0; j < V; ++j) {
    __m256 s = _mm256_loadu_ps(scale + 8 * j);
    for (int r = 0; r < R; ++r) {
      float* y = sums + (r0 + r) * p.f + c + 8 * j;
      _mm256_storeu_ps(y, _mm256_fmadd_ps(acc[r][j], s, first ? _mm256_setzero_ps() : _mm256_loadu_ps(y)));
    }
  }
}

__attribute__((target("avx2,fma"))) void ColumnsAvx2(const Product& p, int64_t k_begin, int64_t k_end,
                                                    int64_t c_begin, int64_t c_end, bool first, float* sums) {
  int64_t r = 0, c = c_begin;
  for (; r + 2 <= p.n; r += 2)
    for (c = c_begin; c + 32 <= c_end; c += 32) TileAvx2<2, 4>(p, r, c, k_begin, k_end, first, sums);
  if (r < p.n) {
    for (c = c_begin; c + 64 <= c_end; c += 64) TileAvx2<1, 8>(p, r, c, k_begin, k_end, first, sums);
    for (; c + 32 <= c_end; c += 32) TileAvx2<1, 4>(p, r, c, k_begin, k_end, first, sums);
  }
  if (c < c_end) ColumnsPortable(p, k_begin, k_end, c, c_end, first, sums);
}

__attribute__((target("avx2,fma"))) inline float Sum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [F, D] layout: 4 output columns against one row of x, 8 terms a step; each group's sums (its terms
// past the last whole step summed one by one) fold into `total` times the group's scales.
__attribute__((target("avx2,fma"))) void DotsAvx2(const Product& p, int64_t r0, int64_t c) {
  __m256 total[4];
  float rest[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int j = 0; j < 4; ++j) total[j] = _mm256_setzero_ps();
  const int8_t* q = p.q + c * p.d;
  const float* x = p.x + r0 * p.d;
  const float* scale = p.scale + c * p.groups;
  const char* ahead = reinterpret_cast<const char*>(q + kAheadGroups * 4 * p.d);
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
    int64_t k = g * p.group, end = std::min(k + p.group, p.d);
    for (; k + 8 <= end; k += 8) {
      if (k % 16 == 0) _mm_prefetch(ahead + 4 * k, _MM_HINT_T0);
      __m256 xr = _mm256_loadu_ps(x + k);
      for (int j = 0; j < 4; ++j) {
        const __m128i* bytes = reinterpret_cast<const __m128i*>(q + j * p.d + k);
        __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bytes)));
        acc[j] = _mm256_fmadd_ps(xr, w, acc[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      float s = scale[j * p.groups + g], tail = 0.0f;
      for (int64_t t = k; t < end; ++t) tail += x[t] * static_cast<float>(q[j * p.d + t]);
      total[j] = _mm256_fmadd_ps(acc[j], _mm256_set1_ps(s), total[j]);
      rest[j] += tail * s;
    }
  }
  for (int j = 0; j < 4; ++j) p.y[r0 * p.f + c + j] = Sum256(total[j]) + rest[j];
}

__attribute__((target("avx2,fma"))) void RowsAvx2(const Product& p, int64_t f_begin, int64_t f_end) {
  int64_t c = f_begin;
  for (; c + 4 <= f_end; c += 4)
    for (int64_t r = 0; r < p.n; ++r) DotsAvx2(p, r, c);
  if (c < f_end) RowsPortable(p, c, f_end);
}

#endif  // DEW_X86

// The instruction set the bodies use (native/isa.h), the CPU's best at load unless set_isa lowered it.
using dew::Isa;
using dew::kAvx2;
using dew::kAvx512;

const Isa g_best_isa = dew::DetectIsa();
std::atomic<int> g_isa{static_cast<int>(g_best_isa)};

ColumnsBody PickColumns() {
  switch (static_cast<Isa>(g_isa.load(std::memory_order_relaxed))) {
#ifdef DEW_X86
    case kAvx512: return ColumnsAvx512;
    case kAvx2: return ColumnsAvx2;
#endif
    default: return ColumnsPortable;
  }
}

RowsBody PickRows() {
  switch (static_cast<Isa>(g_isa.load(std::memory_order_relaxed))) {
#ifdef DEW_X86
    case kAvx512: return RowsAvx512;
    case kAvx2: return RowsAvx2;
#endif
    default: return RowsPortable;
  }
}

// q's rows a [D, F] body sums before it moves to the next columns: a block of q (kBlockRows * F bytes)
// is read whole, in order, so the memory streams it; the sums wait in `sums` between blocks.
constexpr int64_t kBlockRows = 16;
// For more than kSplitRowsMaxN rows of x, blocks of up to this many rows (within one group), so that a
// group of 64 takes its scales once. Fewer rows, where streaming q bounds the product, keep the short
// blocks of kBlockRows, which run faster there (docs/performance.md).
constexpr int64_t kGroupBlockRows = 64;
// At least this many weight bytes a piece: a piece's fixed cost is a few hundred nanoseconds.
constexpr int64_t kPieceBytes = 32 << 10;
// Products of at most this many rows of x split q's rows (D) among the threads, so that each reads one
// contiguous region of q, and add the partial sums at the end; more rows split the columns, since
// their sums are compute-bound and the partial sums would grow with the rows.
constexpr int64_t kSplitRowsMaxN = 4;
// ... and of at most this many columns (the partial sums, slices x n x f floats, stay in cache).
constexpr int64_t kSplitRowsMaxF = 4096;

// How a batch of products divides into pieces, claimed from `next` by whichever thread is free; `done`
// counts the finished ones. A piece is (product, slice of q's rows, chunk of columns). Shared by
// pointer, since a pool task may start after the call has returned (it then finds nothing to claim).
struct Pieces {
  std::vector<Product> products;
  bool transposed;
  ColumnsBody columns_body;
  RowsBody rows_body;
  int64_t slices = 1, slice_rows = 0;  // slices of q's rows ([D, F] only)
  int64_t chunks = 1, chunk_columns = 0;
  int64_t total = 0;
  float* partial = nullptr;  // [batch, slices, n, f] partial sums when slices > 1
  std::atomic<int64_t> next{0}, done{0};

  void RunPiece(int64_t i) {
    int64_t per_product = slices * chunks;
    const Product& p = products[i / per_product];
    int64_t slice = (i % per_product) / chunks, chunk = i % chunks;
    int64_t c_begin = chunk * chunk_columns, c_end = std::min(c_begin + chunk_columns, p.f);
    if (transposed) {
      rows_body(p, c_begin, c_end);
      return;
    }
    int64_t k_begin = slice * slice_rows, k_end = std::min(k_begin + slice_rows, p.d);
    float* sums = slices > 1 ? partial + ((i / per_product) * slices + slice) * p.n * p.f : p.y;
    // Blocks end at a group's end too, so each block's sums take one group's scales.
    int64_t block_rows = p.n > kSplitRowsMaxN ? kGroupBlockRows : kBlockRows;
    for (int64_t k = k_begin, end; k < k_end; k = end) {
      end = std::min({k + block_rows, k_end, (k / p.group + 1) * p.group});
      columns_body(p, k, end, c_begin, c_end, k == k_begin, sums);
    }
    if (k_begin == k_end)
      for (int64_t r = 0; r < p.n; ++r) std::fill(sums + r * p.f + c_begin, sums + r * p.f + c_end, 0.0f);
  }

  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      RunPiece(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }

  // y = the slices' partial sums added in slice order, so the result does not depend on which thread
  // summed which slice.
  void AddSlices() {
    for (size_t b = 0; b < products.size(); ++b) {
      const Product& p = products[b];
      const float* first = partial + b * slices * p.n * p.f;
      for (int64_t e = 0; e < p.n * p.f; ++e) {
        float sum = first[e];
        for (int64_t s = 1; s < slices; ++s) sum += first[s * p.n * p.f + e];
        p.y[e] = sum;
      }
    }
  }
};

// Splits the work for `threads` threads, up to 4 pieces each, so that a thread slowed by another
// process does not hold up the rest.
void Plan(Pieces& pieces, int64_t n, int64_t d, int64_t f, int64_t threads) {
  int64_t want = std::max<int64_t>(1, std::min<int64_t>(4 * threads, d * f / kPieceBytes));
  if (!pieces.transposed && n <= kSplitRowsMaxN && f <= kSplitRowsMaxF && threads > 1) {
    int64_t blocks = (d + kBlockRows - 1) / kBlockRows;
    pieces.slices = std::min(want, blocks);
    pieces.slice_rows = (blocks + pieces.slices - 1) / pieces.slices * kBlockRows;
    pieces.slices = (d + pieces.slice_rows - 1) / pieces.slice_rows;
    pieces.chunk_columns = f;
  } else {
    // Whole tiles of the widest bodies: 64 columns, or 4 rows of q in the [F, D] layout.
    int64_t align = pieces.transposed ? 4 : 64;
    int64_t columns = (f + want - 1) / want;
    pieces.chunk_columns = (columns + align - 1) / align * align;
    pieces.slice_rows = d;
  }
  pieces.chunks = (f + pieces.chunk_columns - 1) / pieces.chunk_columns;
}

// The products' pieces across XLA's intra-op threads, then their slices' sums added.
ffi::Error RunProducts(ffi::ThreadPool pool, const std::shared_ptr<Pieces>& pieces, int64_t batch, int64_t n,
                       int64_t d, int64_t f, bool transposed);

ffi::Error Int8Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                       ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> y, bool transposed) {
  auto dx = x.dimensions(), dq = q.dimensions(), ds = scale.dimensions(), dy = y->dimensions();
  size_t rank = dy.size();
  if (rank < 2 || dx.size() != rank || dq.size() != rank || ds.size() != rank)
    return ffi::Error::InvalidArgument("dew int8 product: x [..., N, D], q [..., D, F] and scale [..., G, F] (or "
                                       "[..., F, D] and [..., F, G]) must share their leading axes (vmap with "
                                       "vmap_method='expand_dims')");
  int64_t n = dx[rank - 2], d = dx[rank - 1];
  int64_t f = transposed ? dq[rank - 2] : dq[rank - 1];
  int64_t dq_in = transposed ? dq[rank - 1] : dq[rank - 2];
  int64_t groups = transposed ? ds[rank - 1] : ds[rank - 2];
  int64_t scale_f = transposed ? ds[rank - 2] : ds[rank - 1];
  if (dq_in != d || scale_f != f || dy[rank - 2] != n || dy[rank - 1] != f)
    return ffi::Error::InvalidArgument("dew int8 product: operand shapes do not make a product");
  int64_t group = groups > 0 ? (d + groups - 1) / groups : 0;
  if (d > 0 && (groups < 1 || (d + group - 1) / group != groups))
    return ffi::Error::InvalidArgument("dew int8 product: the scales' groups do not divide the inputs (G groups "
                                       "of ceil(D / G) inputs must cover D with none empty)");
  // Leading axes broadcast: an operand's axis is the result's or 1 (vmap's expand_dims).
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    for (int64_t extent : {dx[i], dq[i], ds[i]})
      if (extent != dy[i] && extent != 1)
        return ffi::Error::InvalidArgument("dew int8 product: leading axes neither match nor broadcast");
    batch *= dy[i];
  }
  if (batch == 0 || n == 0 || f == 0) return ffi::Error::Success();
  if (d == 0) {
    std::fill(y->typed_data(), y->typed_data() + batch * n * f, 0.0f);
    return ffi::Error::Success();
  }
  auto pieces = std::make_shared<Pieces>();
  pieces->products.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t ox = 0, oq = 0, os = 0, rest = b;
    int64_t sx = 1, sq = 1, ss = 1;  // elements per step along the current leading axis, in products
    for (size_t i = rank - 2; i-- > 0;) {
      int64_t index = rest % dy[i];
      rest /= dy[i];
      if (dx[i] != 1) ox += index * sx;
      if (dq[i] != 1) oq += index * sq;
      if (ds[i] != 1) os += index * ss;
      sx *= dx[i], sq *= dq[i], ss *= ds[i];
    }
    pieces->products.push_back(Product{x.typed_data() + ox * n * d, q.typed_data() + oq * d * f,
                                       scale.typed_data() + os * groups * f, y->typed_data() + b * n * f, n, d, f,
                                       groups, std::max<int64_t>(group, 1)});
  }
  return RunProducts(pool, pieces, batch, n, d, f, transposed);
}

// x [N, D] times layer `layer` of a stack of int8 weights q [L, D, F], with that layer's scales [G, F], read
// in place: a scanned decoder passes its layers' whole stack and the layer's index, so that XLA does not
// copy the layer's weight out of the stack before every product. The same product as of q[layer] alone.
ffi::Error Int8StackedProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                              ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                              ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto dx = x.dimensions(), dq = q.dimensions(), ds = scale.dimensions(), dy = y->dimensions();
  if (dx.size() != 2 || dq.size() != 3 || ds.size() != 2 || dy.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("dew int8 stacked product: x [N, D], q [L, D, F], scale [G, F], layer []");
  int64_t n = dx[0], d = dx[1], f = dq[2], groups = ds[0], at = *layer.typed_data();
  if (dq[1] != d || ds[1] != f || dy[0] != n || dy[1] != f)
    return ffi::Error::InvalidArgument("dew int8 stacked product: operand shapes do not make a product");
  if (at < 0 || at >= dq[0])
    return ffi::Error::InvalidArgument("dew int8 stacked product: layer " + std::to_string(at) +
                                       " outside the stack of " + std::to_string(dq[0]));
  int64_t group = groups > 0 ? (d + groups - 1) / groups : 0;
  if (d > 0 && (groups < 1 || (d + group - 1) / group != groups))
    return ffi::Error::InvalidArgument("dew int8 stacked product: the scales' groups do not divide the inputs");
  if (n == 0 || f == 0) return ffi::Error::Success();
  if (d == 0) {
    std::fill(y->typed_data(), y->typed_data() + n * f, 0.0f);
    return ffi::Error::Success();
  }
  auto pieces = std::make_shared<Pieces>();
  pieces->products.push_back(Product{x.typed_data(), q.typed_data() + at * d * f, scale.typed_data(),
                                     y->typed_data(), n, d, f, groups, std::max<int64_t>(group, 1)});
  return RunProducts(pool, pieces, 1, n, d, f, false);
}

ffi::Error RunProducts(ffi::ThreadPool pool, const std::shared_ptr<Pieces>& pieces, int64_t batch, int64_t n,
                       int64_t d, int64_t f, bool transposed) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  pieces->transposed = transposed;
  pieces->columns_body = PickColumns();
  pieces->rows_body = PickRows();
  Plan(*pieces, n, d, f, threads);
  pieces->total = batch * pieces->slices * pieces->chunks;
  // The partial sums live in the calling thread's buffer: every piece that writes them has finished
  // before this call returns.
  thread_local std::vector<float> partial;
  if (pieces->slices > 1) {
    partial.resize(static_cast<size_t>(batch * pieces->slices * n * f));
    pieces->partial = partial.data();
  }
  int64_t helpers = std::min<int64_t>(threads, pieces->total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([pieces] { pieces->Run(); });
  pieces->Run();
  dew::WaitForPieces(pieces->done, pieces->total);
  if (pieces->slices > 1) pieces->AddSlices();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewInt8Product, Int8Product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewInt8StackedProduct, Int8StackedProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Python module: handler() -> capsule; stacked_handler() -> the stacked product's; isa() -> the body in use;
// set_isa(name) lowers it.

static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewInt8Product), nullptr, nullptr);
}

static PyObject* StackedHandler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewInt8StackedProduct), nullptr, nullptr);
}

static PyObject* GetIsa(PyObject*, PyObject*) { return dew::GetIsa(g_isa); }

static PyObject* SetIsa(PyObject*, PyObject* args) { return dew::SetIsa(args, g_best_isa, g_isa); }

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of the int8 product, as a capsule."},
    {"stacked_handler", StackedHandler, METH_NOARGS, "The handler of the product with a layer of a stack."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the product's bodies use: avx512, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use a narrower instruction set than the CPU's best (for tests)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_int8", "Dew's XLA FFI int8 weight product.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_int8(void) { return PyModule_Create(&kModule); }
