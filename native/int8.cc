// XLA FFI handler for products with an int8 weight and one float32 scale per output column:
//   y[n, f] = scale[f] * sum_d x[n, d] * q[d, f]        (q stored [D, F]), or
//   y[n, f] = scale[f] * sum_d x[n, d] * q[f, d]        (q stored [F, D]: `transposed`, a tied head).
// Decoding reads each weight once per token, so the speed is the speed of streaming the int8 bytes:
// the int8 values are widened to float32 in registers and never written back as floats. Sums
// accumulate in float32 and the scale multiplies the finished sum, as the XLA form does.
//
// One binary runs on every x86-64: the AVX-512 and AVX2 bodies are compiled for their targets only and
// chosen at run time by what the CPU reports; other machines run the portable body. The work splits
// across XLA's intra-op thread pool (the FFI's ThreadPool context) in pieces claimed from a counter, so
// the calling thread never waits for a piece no thread has started.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DEW_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One product of the batch: x [n, d] row-major, q as stored, y [n, f]. A body computes the columns
// [f_begin, f_end) of every row.
struct Product {
  const float* x;
  const int8_t* q;
  const float* scale;
  float* y;
  int64_t n, d, f;
};

using Body = void (*)(const Product&, int64_t f_begin, int64_t f_end);

// ---- portable bodies (any CPU; also the column tails the vector bodies leave) ----

void ColumnsPortable(const Product& p, int64_t f_begin, int64_t f_end) {
  for (int64_t r = 0; r < p.n; ++r) {
    const float* x = p.x + r * p.d;
    float* y = p.y + r * p.f;
    for (int64_t c = f_begin; c < f_end; ++c) y[c] = 0.0f;
    for (int64_t k = 0; k < p.d; ++k) {
      const int8_t* q = p.q + k * p.f;
      float xk = x[k];
      for (int64_t c = f_begin; c < f_end; ++c) y[c] += xk * static_cast<float>(q[c]);
    }
    for (int64_t c = f_begin; c < f_end; ++c) y[c] *= p.scale[c];
  }
}

void RowsPortable(const Product& p, int64_t f_begin, int64_t f_end) {
  for (int64_t c = f_begin; c < f_end; ++c) {
    const int8_t* q = p.q + c * p.d;
    for (int64_t r = 0; r < p.n; ++r) {
      const float* x = p.x + r * p.d;
      float sum = 0.0f;
      for (int64_t k = 0; k < p.d; ++k) sum += x[k] * static_cast<float>(q[k]);
      p.y[r * p.f + c] = sum * p.scale[c];
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
__attribute__((target("avx512f,avx512bw,avx512vl"))) void TileAvx512(const Product& p, int64_t r0, int64_t c) {
  constexpr int V = 4 * L;  // 16-column vectors per row
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  const int8_t* q = p.q + c;
  const float* x = p.x + r0 * p.d;
  for (int64_t k = 0; k < p.d; ++k, q += p.f) {
    for (int l = 0; l < L; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(q + kAheadRows * p.f + 64 * l), _MM_HINT_T0);
    for (int j = 0; j < V; ++j) {
      __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j))));
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * p.d + k]), w, acc[r][j]);
    }
  }
  for (int j = 0; j < V; ++j) {
    __m512 s = _mm512_loadu_ps(p.scale + c + 16 * j);
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.f + c + 16 * j, _mm512_mul_ps(acc[r][j], s));
  }
}

// Rows [r0, r0 + R) across columns [c, end): the widest tiles first, whole cache lines only; returns
// where the whole lines end.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t ColumnTilesAvx512(const Product& p, int64_t r0,
                                                                            int64_t c, int64_t end) {
  if constexpr (R == 1)
    for (; c + 256 <= end; c += 256) TileAvx512<1, 4>(p, r0, c);
  if constexpr (R <= 2)
    for (; c + 128 <= end; c += 128) TileAvx512<R, 2>(p, r0, c);
  for (; c + 64 <= end; c += 64) TileAvx512<R, 1>(p, r0, c);
  return c;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void ColumnsAvx512(const Product& p, int64_t f_begin,
                                                                    int64_t f_end) {
  int64_t r = 0, c = f_begin;
  for (; r + 4 <= p.n; r += 4) c = ColumnTilesAvx512<4>(p, r, f_begin, f_end);
  switch (p.n - r) {
    case 3: c = ColumnTilesAvx512<3>(p, r, f_begin, f_end); break;
    case 2: c = ColumnTilesAvx512<2>(p, r, f_begin, f_end); break;
    case 1: c = ColumnTilesAvx512<1>(p, r, f_begin, f_end); break;
  }
  if (c < f_end) ColumnsPortable(p, c, f_end);
}

__attribute__((target("avx512f"))) inline float Sum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// [F, D] layout: 4 output columns (4 contiguous q rows) against up to 4 rows of x, 16 terms a step.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void DotsAvx512(const Product& p, int64_t r0, int64_t c) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int8_t* q = p.q + c * p.d;
  const float* x = p.x + r0 * p.d;
  // The next groups' rows: one cache line a step covers a group of 4 rows (4 * D bytes, 4 lines per
  // 16 terms) while this one is summed.
  const char* ahead = reinterpret_cast<const char*>(q + kAheadGroups * 4 * p.d);
  for (int64_t k = 0; k < p.d; k += 16) {
    _mm_prefetch(ahead + 4 * k, _MM_HINT_T0);
    __mmask16 mask = p.d - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (p.d - k)) - 1);
    __m512 w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + j * p.d + k)));
    for (int r = 0; r < R; ++r) {
      __m512 xr = _mm512_maskz_loadu_ps(mask, x + r * p.d + k);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xr, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) p.y[(r0 + r) * p.f + c + j] = Sum512(acc[r][j]) * p.scale[c + j];
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void RowsAvx512(const Product& p, int64_t f_begin, int64_t f_end) {
  int64_t c = f_begin;
  for (; c + 4 <= f_end; c += 4) {
    int64_t r = 0;
    for (; r + 4 <= p.n; r += 4) DotsAvx512<4>(p, r, c);
    switch (p.n - r) {
      case 3: DotsAvx512<3>(p, r, c); break;
      case 2: DotsAvx512<2>(p, r, c); break;
      case 1: DotsAvx512<1>(p, r, c); break;
    }
  }
  if (c < f_end) RowsPortable(p, c, f_end);
}

// ---- AVX2 + FMA: 32-column tiles, up to 2 rows of x at once (16 vector registers) ----

template <int R>
__attribute__((target("avx2,fma"))) void TileAvx2(const Product& p, int64_t r0, int64_t c) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  const int8_t* q = p.q + c;
  const float* x = p.x + r0 * p.d;
  for (int64_t k = 0; k < p.d; ++k, q += p.f) {
    _mm_prefetch(reinterpret_cast<const char*>(q + kAheadRows * p.f), _MM_HINT_T0);
    __m256 w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
    for (int r = 0; r < R; ++r) {
      __m256 xr = _mm256_broadcast_ss(x + r * p.d + k);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(xr, w[j], acc[r][j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    __m256 s = _mm256_loadu_ps(p.scale + c + 8 * j);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(p.y + (r0 + r) * p.f + c + 8 * j, _mm256_mul_ps(acc[r][j], s));
  }
}

__attribute__((target("avx2,fma"))) void ColumnsAvx2(const Product& p, int64_t f_begin, int64_t f_end) {
  int64_t c = f_begin;
  for (; c + 32 <= f_end; c += 32) {
    int64_t r = 0;
    for (; r + 2 <= p.n; r += 2) TileAvx2<2>(p, r, c);
    if (r < p.n) TileAvx2<1>(p, r, c);
  }
  if (c < f_end) ColumnsPortable(p, c, f_end);
}

__attribute__((target("avx2,fma"))) inline float Sum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R>
__attribute__((target("avx2,fma"))) void DotsAvx2(const Product& p, int64_t r0, int64_t c) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  const int8_t* q = p.q + c * p.d;
  const float* x = p.x + r0 * p.d;
  int64_t k = 0;
  for (; k + 8 <= p.d; k += 8) {
    __m256 w[4];
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j * p.d + k))));
    for (int r = 0; r < R; ++r) {
      __m256 xr = _mm256_loadu_ps(x + r * p.d + k);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(xr, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      float sum = Sum256(acc[r][j]);
      for (int64_t t = k; t < p.d; ++t) sum += x[r * p.d + t] * static_cast<float>(q[j * p.d + t]);
      p.y[(r0 + r) * p.f + c + j] = sum * p.scale[c + j];
    }
}

__attribute__((target("avx2,fma"))) void RowsAvx2(const Product& p, int64_t f_begin, int64_t f_end) {
  int64_t c = f_begin;
  for (; c + 4 <= f_end; c += 4) {
    int64_t r = 0;
    for (; r + 2 <= p.n; r += 2) DotsAvx2<2>(p, r, c);
    if (r < p.n) DotsAvx2<1>(p, r, c);
  }
  if (c < f_end) RowsPortable(p, c, f_end);
}

#endif  // DEW_X86

// The instruction set the bodies use, chosen once: "avx512", "avx2" or "portable". DEW_INT8_ISA (read
// by the Python side and passed to `set_isa`) can only lower it, for tests of the narrower bodies.
enum Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

Isa DetectIsa() {
#ifdef DEW_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

const Isa g_best_isa = DetectIsa();
std::atomic<int> g_isa{static_cast<int>(g_best_isa)};

Body PickBody(bool transposed) {
  switch (static_cast<Isa>(g_isa.load(std::memory_order_relaxed))) {
#ifdef DEW_X86
    case kAvx512: return transposed ? RowsAvx512 : ColumnsAvx512;
    case kAvx2: return transposed ? RowsAvx2 : ColumnsAvx2;
#endif
    default: return transposed ? RowsPortable : ColumnsPortable;
  }
}

// Pieces of the output columns, claimed from `next` by whichever thread is free; `done` counts the
// finished ones. Shared by pointer, since a pool task may start after the call has returned (it then
// finds nothing left to claim).
struct Pieces {
  std::vector<Product> products;
  Body body;
  int64_t columns_per_piece, pieces_per_product, total;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      const Product& p = products[i / pieces_per_product];
      int64_t begin = (i % pieces_per_product) * columns_per_piece;
      body(p, begin, std::min(begin + columns_per_piece, p.f));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Column alignment of a piece: whole tiles of the widest body (64 columns), or 4 for the [F, D] layout.
int64_t PieceColumns(int64_t f, int64_t d, int64_t n, int64_t threads, bool transposed) {
  int64_t align = transposed ? 4 : 64;
  // At least ~32 KiB of weights per piece (a piece's fixed cost is a few hundred nanoseconds), and up
  // to 4 pieces a thread so a thread slowed by another process does not hold up the rest.
  int64_t min_columns = std::max<int64_t>(align, (32 << 10) / std::max<int64_t>(d, 1));
  int64_t want = std::max<int64_t>(1, 4 * threads);
  int64_t columns = std::max(min_columns, (f + want - 1) / want);
  (void)n;
  return (columns + align - 1) / align * align;
}

ffi::Error Int8Product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                       ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> y, bool transposed) {
  auto dx = x.dimensions(), dq = q.dimensions(), ds = scale.dimensions(), dy = y->dimensions();
  size_t rank = dy.size();
  if (rank < 2 || dx.size() != rank || dq.size() != rank || ds.size() != rank - 1)
    return ffi::Error::InvalidArgument("dew int8 product: x [..., N, D], q [..., D, F] and scale [..., F] must "
                                       "share their leading axes (vmap with vmap_method='expand_dims')");
  int64_t n = dx[rank - 2], d = dx[rank - 1];
  int64_t f = transposed ? dq[rank - 2] : dq[rank - 1];
  int64_t dq_in = transposed ? dq[rank - 1] : dq[rank - 2];
  if (dq_in != d || ds[rank - 2] != f || dy[rank - 2] != n || dy[rank - 1] != f)
    return ffi::Error::InvalidArgument("dew int8 product: operand shapes do not make a product");
  // Leading axes broadcast: an operand's axis is the result's or 1 (vmap's expand_dims).
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    for (int64_t extent : {dx[i], dq[i], ds[i]})
      if (extent != dy[i] && extent != 1)
        return ffi::Error::InvalidArgument("dew int8 product: leading axes neither match nor broadcast");
    batch *= dy[i];
  }
  auto pieces = std::make_shared<Pieces>();
  pieces->products.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t ox = 0, oq = 0, os = 0, rest = b;
    int64_t sx = 1, sq = 1, ss = 1;  // element counts of one step along the current leading axis
    for (size_t i = rank - 2; i-- > 0;) {
      int64_t index = rest % dy[i];
      rest /= dy[i];
      if (dx[i] != 1) ox += index * sx;
      if (dq[i] != 1) oq += index * sq;
      if (ds[i] != 1) os += index * ss;
      sx *= dx[i], sq *= dq[i], ss *= ds[i];
    }
    pieces->products.push_back(Product{x.typed_data() + ox * n * d, q.typed_data() + oq * d * f,
                                       scale.typed_data() + os * f, y->typed_data() + b * n * f, n, d, f});
  }
  if (batch == 0 || n == 0 || f == 0) return ffi::Error::Success();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  pieces->body = PickBody(transposed);
  pieces->columns_per_piece = PieceColumns(f, d, n, threads, transposed);
  pieces->pieces_per_product = (f + pieces->columns_per_piece - 1) / pieces->columns_per_piece;
  pieces->total = batch * pieces->pieces_per_product;
  int64_t helpers = std::min<int64_t>(threads, pieces->total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([pieces] { pieces->Run(); });
  pieces->Run();
  // Every piece is claimed; wait for those other threads are finishing (microseconds).
  for (int spins = 0; pieces->done.load(std::memory_order_acquire) < pieces->total; ++spins) {
#ifdef DEW_X86
    _mm_pause();
#endif
    if (spins > 4096) std::this_thread::yield();
  }
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

// Python module: handler() -> capsule; isa() -> the body in use; set_isa(name) lowers it.
static const char* IsaName(int isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "portable"; }

static PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&DewInt8Product), nullptr, nullptr);
}

static PyObject* GetIsa(PyObject*, PyObject*) { return PyUnicode_FromString(IsaName(g_isa.load())); }

static PyObject* SetIsa(PyObject*, PyObject* args) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  std::string wanted(name);
  int isa = wanted == "avx512" ? kAvx512 : wanted == "avx2" ? kAvx2 : wanted == "portable" ? kPortable : -1;
  if (isa < 0) {
    PyErr_Format(PyExc_ValueError, "instruction set %R is not one of avx512, avx2, portable", PyTuple_GetItem(args, 0));
    return nullptr;
  }
  if (isa > g_best_isa) {
    PyErr_Format(PyExc_ValueError, "instruction set %s is beyond this CPU's best, %s", name, IsaName(g_best_isa));
    return nullptr;
  }
  g_isa.store(isa);
  Py_RETURN_NONE;
}

static PyMethodDef kMethods[] = {
    {"handler", Handler, METH_NOARGS, "The XLA FFI handler of the int8 product, as a capsule."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the product's bodies use: avx512, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use a narrower instruction set than the CPU's best (for tests)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_int8", "Dew's XLA FFI int8 weight product.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_int8(void) { return PyModule_Create(&kModule); }
