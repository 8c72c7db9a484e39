// An XLA FFI handler for float32 products of a few rows against a weight: y [M, N] = x [M, K] w [K, N],
// all row-major, the shape of a decode step's linears (M the rows being decoded).
//
// A few rows leave the product bound by reading w, which each row shares: the weight is streamed once for
// all rows, in blocks of kBlockRows whole rows of w (a contiguous region) read across the columns, so the
// memory sees long runs of consecutive bytes; the rows' sums wait in a buffer between blocks. w's rows
// split into a fixed number of slices, claimed by XLA's intra-op threads (the FFI's ThreadPool). Each
// output is, per slice, one chain of fused multiply-adds over k in order, sum = fma(x[m, k], w[k, n], sum)
// from zero, and the slices' sums are added in slice order: the AVX-512, AVX2 and portable bodies give the
// same bits, whatever the threads.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "isa.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Product {
  const float* x;  // [m, k]
  const float* w;  // [k, n]
  float* y;        // [m, n]
  int64_t m, k, n;
};

// Rows of w a block reads before the sums go back to y: a block of a piece's columns stays in the first
// cache while each group of rows of x passes over it.
constexpr int64_t kBlockRows = 16;

// Block [k_begin, k_end) for columns [c_begin, c_end) of every row of x, into `sums` ([m, n], from zero
// where `first`).
using BlockBody = void (*)(const Product&, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end,
                           bool first, float* sums);

void BlockPortable(const Product& p, int64_t k_begin, int64_t k_end, int64_t c_begin, int64_t c_end, bool first,
                   float* sums) {
  for (int64_t r = 0; r < p.m; ++r) {
    float* y = sums + r * p.n;
    for (int64_t c = c_begin; c < c_end; ++c) {
      float sum = first ? 0.0f : y[c];
      for (int64_t k = k_begin; k < k_end; ++k) sum = std::fma(p.x[r * p.k + k], p.w[k * p.n + c], sum);
      y[c] = sum;
    }
  }
}

#ifdef DEW_X86

// How many rows ahead of the one being read a tile asks the memory for (rows are N floats apart, a stride
// the hardware prefetchers follow poorly across pages).
constexpr int kAheadRows = 16;

// ---- AVX-512: R rows of x against L vectors of 16 columns, R * L <= 16 accumulators ----

template <int R, int L>
__attribute__((target("avx512f,avx512vl"))) void TileAvx512(const Product& p, int64_t r0, int64_t c,
                                                          int64_t k_begin, int64_t k_end, bool first, float* sums) {
  __m512 acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j)
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r0 + r) * p.n + c + 16 * j);
  const float* w = p.w + k_begin * p.n + c;
  const float* x = p.x + r0 * p.k;
  for (int64_t k = k_begin; k < k_end; ++k, w += p.n) {
    for (int j = 0; j < L; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * p.n + 16 * j), _MM_HINT_T0);
    for (int j = 0; j < L; ++j) {
      __m512 wj = _mm512_loadu_ps(w + 16 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * p.k + k]), wj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) _mm512_storeu_ps(sums + (r0 + r) * p.n + c + 16 * j, acc[r][j]);
}

// Rows [r0, r0 + R) across columns [c, end) in whole 16-column vectors; returns where they end.
template <int R>
__attribute__((target("avx512f,avx512vl"))) int64_t TilesAvx512(const Product& p, int64_t r0, int64_t c, int64_t end,
                                                              int64_t k_begin, int64_t k_end, bool first, float* sums) {
  constexpr int L = 16 / R < 4 ? 16 / R : 4;
  for (; c + 16 * L <= end; c += 16 * L) TileAvx512<R, L>(p, r0, c, k_begin, k_end, first, sums);
  for (; c + 16 <= end; c += 16) TileAvx512<R, 1>(p, r0, c, k_begin, k_end, first, sums);
  return c;
}

__attribute__((target("avx512f,avx512vl"))) void BlockAvx512(const Product& p, int64_t k_begin, int64_t k_end,
                                                          int64_t c_begin, int64_t c_end, bool first, float* sums) {
  int64_t r = 0, c = c_end;
  for (; r + 8 <= p.m; r += 8) c = TilesAvx512<8>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  for (; r + 4 <= p.m; r += 4) c = TilesAvx512<4>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  for (; r < p.m; ++r) c = TilesAvx512<1>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  if (c < c_end) BlockPortable(p, k_begin, k_end, c, c_end, first, sums);
}

// ---- AVX2 with FMA: R rows against L vectors of 8 columns, R * L <= 12 accumulators ----

template <int R, int L>
__attribute__((target("avx2,fma"))) void TileAvx2(const Product& p, int64_t r0, int64_t c, int64_t k_begin,
                                                 int64_t k_end, bool first, float* sums) {
  __m256 acc[R][L];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j)
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + (r0 + r) * p.n + c + 8 * j);
  const float* w = p.w + k_begin * p.n + c;
  const float* x = p.x + r0 * p.k;
  for (int64_t k = k_begin; k < k_end; ++k, w += p.n) {
    for (int j = 0; j < L; j += 2)
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadRows * p.n + 8 * j), _MM_HINT_T0);
    for (int j = 0; j < L; ++j) {
      __m256 wj = _mm256_loadu_ps(w + 8 * j);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * p.k + k]), wj, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < L; ++j) _mm256_storeu_ps(sums + (r0 + r) * p.n + c + 8 * j, acc[r][j]);
}

template <int R>
__attribute__((target("avx2,fma"))) int64_t TilesAvx2(const Product& p, int64_t r0, int64_t c, int64_t end,
                                                     int64_t k_begin, int64_t k_end, bool first, float* sums) {
  constexpr int L = 12 / R < 4 ? 12 / R : 4;
  for (; c + 8 * L <= end; c += 8 * L) TileAvx2<R, L>(p, r0, c, k_begin, k_end, first, sums);
  for (; c + 8 <= end; c += 8) TileAvx2<R, 1>(p, r0, c, k_begin, k_end, first, sums);
  return c;
}

__attribute__((target("avx2,fma"))) void BlockAvx2(const Product& p, int64_t k_begin, int64_t k_end, int64_t c_begin,
                                                  int64_t c_end, bool first, float* sums) {
  int64_t r = 0, c = c_end;
  for (; r + 4 <= p.m; r += 4) c = TilesAvx2<4>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  for (; r + 2 <= p.m; r += 2) c = TilesAvx2<2>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  for (; r < p.m; ++r) c = TilesAvx2<1>(p, r, c_begin, c_end, k_begin, k_end, first, sums);
  if (c < c_end) BlockPortable(p, k_begin, k_end, c, c_end, first, sums);
}

#endif  // DEW_X86

// The bodies by instruction set (native/isa.h's order); the one in use is the CPU's best at load unless
// set_isa lowered it.
const dew::Isa g_best_isa = dew::DetectIsa();
std::atomic<int> g_isa{static_cast<int>(g_best_isa)};
#ifdef DEW_X86
const BlockBody kBodies[] = {BlockPortable, BlockAvx2, BlockAvx512};
#else
const BlockBody kBodies[] = {BlockPortable};
#endif

// The weight's rows split into at most kSlices slices of whole blocks, fixed by the shape alone; each
// thread that claims a slice streams one contiguous region of w, and the slices' sums are added in slice
// order at the end, so the result does not depend on the threads.
constexpr int64_t kSlices = 4;
// At least this many weight bytes a slice: waking a thread costs microseconds.
constexpr int64_t kSliceBytes = 128 << 10;

// Slices claimed from `next` by whichever thread is free; shared by pointer, since a pool task may start
// after the call has returned (it then finds nothing to claim).
struct Pieces {
  Product p;
  BlockBody body;
  int64_t slices = 1, slice_rows = 0;
  float* partial = nullptr;  // [slices - 1, m, n]: the sums of slices 1 on (slice 0 sums into y)
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < slices;) {
      float* sums = i == 0 ? p.y : partial + (i - 1) * p.m * p.n;
      int64_t k_begin = i * slice_rows, k_end = std::min(k_begin + slice_rows, p.k);
      for (int64_t k = k_begin; k < k_end; k += kBlockRows)
        body(p, k, std::min(k + kBlockRows, k_end), 0, p.n, k == k_begin, sums);
      if (k_begin >= k_end) std::fill(sums, sums + p.m * p.n, 0.0f);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y = x w[layer]: `w` is a stack of weights [L, K, N] (one weight is a stack of one); a scanned decoder
// passes its layers' whole stack and the layer's index, so that XLA does not copy the layer's weight out
// of the stack before every product.
ffi::Error FewRowsProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto dx = x.dimensions(), dw = w.dimensions(), dy = y->dimensions();
  if (dx.size() != 2 || dw.size() != 3 || dy.size() != 2 || dx[1] != dw[1] || dy[0] != dx[0] || dy[1] != dw[2] ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument("dew few-rows product: x [M, K], w [L, K, N], layer [] and y [M, N]");
  int64_t at = *layer.typed_data();
  if (at < 0 || at >= dw[0])
    return ffi::Error::InvalidArgument("dew few-rows product: layer " + std::to_string(at) + " outside the stack of " +
                                       std::to_string(dw[0]));
  auto pieces = std::make_shared<Pieces>();
  Product& p = pieces->p;
  p = {x.typed_data(), w.typed_data() + at * dw[1] * dw[2], y->typed_data(), dx[0], dx[1], dw[2]};
  pieces->body = kBodies[g_isa.load(std::memory_order_relaxed)];
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  int64_t blocks = std::max<int64_t>(1, (p.k + kBlockRows - 1) / kBlockRows);
  int64_t slices = std::clamp<int64_t>(p.k * p.n * 4 / kSliceBytes, 1, kSlices);
  pieces->slice_rows = (blocks + slices - 1) / slices * kBlockRows;
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
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewFewRowsProduct, FewRowsProduct,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewFewRowsProduct), nullptr, nullptr);
}

static PyObject* GetIsa(PyObject*, PyObject*) { return dew::GetIsa(g_isa); }

static PyObject* SetIsa(PyObject*, PyObject* args) { return dew::SetIsa(args, g_best_isa, g_isa); }

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler, as a capsule."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the bodies use: avx512, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use the named instruction set (at most the CPU's best), for tests."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_few_rows",
                              "Dew's XLA FFI float32 product of a few rows against a weight.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_few_rows(void) { return PyModule_Create(&kModule); }
