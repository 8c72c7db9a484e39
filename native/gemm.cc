// XLA FFI handlers for 2-D matrix products (and batches of them) run by a tuned BLAS-style library.
//
// The library is not linked: Python loads it (dew.kernels.loader) and hands this module the addresses
// of its row-major `gemm` entry points, whose signature is oneDNN's C API:
//   status gemm(char transa, char transb, int64 M, int64 N, int64 K, float alpha,
//               const T *A, int64 lda, const T *B, int64 ldb, float beta, float *C, int64 ldc)
// with T float (dnnl_sgemm) or bfloat16 bits (dnnl_gemm_bf16bf16f32), and its OpenMP runtime's
// omp_set_num_threads. Products accumulate and return float32 in either case; the caller converts.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "module.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using SgemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                        int64_t, float, float*, int64_t);
using Bf16GemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t,
                           const uint16_t*, int64_t, float, float*, int64_t);

SgemmFn g_sgemm = nullptr;
Bf16GemmFn g_bf16_gemm = nullptr;

// float32 to bfloat16, rounding to nearest even as XLA's convert does; a NaN stays a (quiet) NaN.
// Branch-free, so the loop vectorizes; cloned for AVX-512 and AVX2, chosen when the library loads.
__attribute__((target_clones("avx512f", "avx2", "default")))
void RoundToBf16(const float* in, uint16_t* out, int64_t count) {
  for (int64_t e = 0; e < count; ++e) {
    uint32_t bits;
    std::memcpy(&bits, in + e, sizeof bits);
    uint32_t nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
    out[e] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest);
  }
}

// One product's operands, and how a call's products divide into pieces: (product, chunk of the
// result's rows or columns), claimed from `next` by whichever of XLA's intra-op threads is free, each
// piece one single-threaded library gemm. XLA's pool, not the library's OpenMP team, spreads the
// work: a team splits a product evenly and waits for its slowest thread, which XLA's other thunks
// running beside the call would be. Shared by pointer, since a pool task may start after the call
// has returned (it then finds nothing to claim).
template <typename Elem, typename Fn>
struct Pieces {
  Fn fn;
  char trans_a, trans_b;
  int64_t m, n, k, lda, ldb, a_size, b_size;
  const Elem* a;
  const Elem* b;
  float* c = nullptr;         // the float32 result, or
  uint16_t* c_bf16 = nullptr; // the result rounded to bfloat16, each piece's rows as it finishes them
  // A lone product's pieces are chunks of its result's rows, or with `by_columns` of its columns.
  bool by_columns = false;
  int64_t chunks = 1, chunk_rows = 0, chunk_cols = 0, total = 0;
  void (*single_thread)(int) = nullptr;  // omp_set_num_threads, or null
  int (*max_threads)() = nullptr;        // omp_get_max_threads
  std::atomic<int64_t> next{0}, done{0}, failed{0};

  void RunPiece(int64_t i) {
    int64_t item = i / chunks, piece = i % chunks;
    int64_t row = by_columns ? 0 : piece * chunk_rows, rows = by_columns ? m : std::min(chunk_rows, m - row);
    int64_t col = by_columns ? piece * chunk_cols : 0, cols = by_columns ? std::min(chunk_cols, n - col) : n;
    if (rows <= 0 || cols <= 0) return;
    // Row `row` of op(a) starts `row` rows down a stored a, or `row` columns across a stored a^T;
    // column `col` of op(b) starts `col` columns across a stored b, or `col` rows down a stored b^T.
    const Elem* pa = a + item * a_size + (trans_a == 'T' ? row : row * lda);
    const Elem* pb = b + item * b_size + (trans_b == 'T' ? col * ldb : col);
    thread_local std::vector<float> scratch;
    float* out = c;
    int64_t ldc = n;
    if (c_bf16 != nullptr) {
      scratch.resize(static_cast<size_t>(rows * cols));
      out = scratch.data();
      ldc = cols;
    } else {
      out += (item * m + row) * n + col;
    }
    int status = fn(trans_a, trans_b, rows, cols, k, 1.0f, pa, lda, pb, ldb, 0.0f, out, ldc);
    if (status != 0) {
      int64_t none = 0;  // keep the first piece's status
      failed.compare_exchange_strong(none, status, std::memory_order_relaxed);
    }
    if (c_bf16 != nullptr) {
      for (int64_t r = 0; r < rows; ++r)
        RoundToBf16(out + r * cols, c_bf16 + (item * m + row + r) * n + col, cols);
    }
  }

  void Run() {
    // This thread's OpenMP teams: itself alone while it runs pieces, then what they were. The runtime
    // may be shared with other libraries in the process (torch loads one with the same soname), and
    // XLA may run a call on the Python thread that calls them next.
    int before = single_thread != nullptr ? max_threads() : 0;
    if (single_thread != nullptr) single_thread(1);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      RunPiece(i);
      done.fetch_add(1, std::memory_order_release);
    }
    if (single_thread != nullptr) single_thread(before);
  }
};

void (*g_omp_set_num_threads)(int) = nullptr;
int (*g_omp_get_max_threads)() = nullptr;
constexpr int64_t kMinChunkRows = 64;  // fewer rows a piece and the gemm's packing of b costs more than it saves
constexpr int64_t kMinChunkCols = 64;  // the same for columns and the packing of a
// A lone weight gradient (`a` transposed) at least this many times wider than tall splits its columns
// rather than its rows: each row piece packs all of b again, which a wide b (the loss head's weight
// gradient) makes slower than column pieces. Other products stay in rows, which are no slower alone and
// faster inside a step (docs/performance.md).
constexpr int64_t kColumnsAspect = 4;
// A lone product splits into this many pieces a thread: XLA's other thread is often partway through
// another thunk when a call starts, and with one piece each the caller then runs both halves while the
// helper arrives to find nothing left (or the caller spins on the helper's whole half). Two a thread
// let a late helper still take a share (docs/performance.md).
constexpr int64_t kPiecesPerThread = 2;

// Operands `[..., rows, cols]` with the same leading (batch) dimensions; `transpose_*` says the stored
// matrix is the transpose of the product's operand. The result is `[..., M, N]` float32.
// `a_data`, `b_data` and `c_data` are the operands' and the result's bytes, `da`, `db` and `dc` their shapes.
template <ffi::DataType Out, typename Elem, typename Fn, typename Dims>
ffi::Error GemmOf(ffi::ThreadPool pool, Fn fn, const void* a_data, Dims da, const void* b_data, Dims db,
                  void* c_data, Dims dc, bool transpose_a, bool transpose_b) {
  if (fn == nullptr) return ffi::Error::Internal("dew gemm: the library's gemm was not set");
  size_t rank = da.size();
  if (rank < 2 || db.size() != rank || dc.size() != rank)
    return ffi::Error::InvalidArgument("dew gemm: operands must share one rank >= 2");
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (da[i] != db[i] || da[i] != dc[i])
      return ffi::Error::InvalidArgument("dew gemm: operands' batch dimensions differ");
    batch *= da[i];
  }
  int64_t a_rows = da[rank - 2], a_cols = da[rank - 1], b_rows = db[rank - 2], b_cols = db[rank - 1];
  int64_t m = transpose_a ? a_cols : a_rows, k = transpose_a ? a_rows : a_cols;
  int64_t n = transpose_b ? b_rows : b_cols, kb = transpose_b ? b_cols : b_rows;
  if (k != kb || dc[rank - 2] != m || dc[rank - 1] != n)
    return ffi::Error::InvalidArgument("dew gemm: operand shapes do not make a product");
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  auto pieces = std::make_shared<Pieces<Elem, Fn>>();
  Pieces<Elem, Fn>& p = *pieces;
  p.fn = fn;
  p.trans_a = transpose_a ? 'T' : 'N';
  p.trans_b = transpose_b ? 'T' : 'N';
  p.m = m, p.n = n, p.k = k, p.lda = a_cols, p.ldb = b_cols, p.a_size = a_rows * a_cols, p.b_size = b_rows * b_cols;
  p.a = static_cast<const Elem*>(a_data);
  p.b = static_cast<const Elem*>(b_data);
  if constexpr (Out == ffi::F32) {
    p.c = static_cast<float*>(c_data);
  } else {
    p.c_bf16 = static_cast<uint16_t*>(c_data);
  }
  if (g_omp_set_num_threads != nullptr && g_omp_get_max_threads != nullptr) {
    p.single_thread = g_omp_set_num_threads;
    p.max_threads = g_omp_get_max_threads;
  }
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Enough pieces for every thread; a lone product splits its rows (a wide weight gradient its
  // columns), a batch goes matrix by matrix.
  int64_t wanted = kPiecesPerThread * threads;
  int64_t per_item = (wanted + batch - 1) / batch;
  p.by_columns = batch < threads && transpose_a && n >= kColumnsAspect * m;
  if (batch >= threads) {
    p.chunks = 1;
  } else if (p.by_columns) {
    // Column pieces a multiple of 16 floats (one AVX-512 register) wide, but for the last.
    int64_t chunks = std::max<int64_t>(1, std::min(per_item, n / kMinChunkCols));
    p.chunk_cols = ((n + chunks - 1) / chunks + 15) / 16 * 16;
    p.chunks = (n + p.chunk_cols - 1) / p.chunk_cols;
  } else {
    p.chunks = std::max<int64_t>(1, std::min(per_item, m / kMinChunkRows));
  }
  p.chunk_rows = (m + p.chunks - 1) / p.chunks;
  p.total = batch * p.chunks;
  int64_t helpers = std::min(threads, p.total) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([pieces] { pieces->Run(); });
  p.Run();
  // Every piece is claimed; wait for the pieces other threads are still finishing.
  for (int spins = 0; p.done.load(std::memory_order_acquire) < p.total; ++spins) {
    if (spins > 1024) std::this_thread::yield();
  }
  if (int64_t status = p.failed.load(); status != 0) {
    // dnnl_status_t: 3 is dnnl_unimplemented, what the bfloat16 gemm says on a CPU without the
    // instructions it needs (Python's side asks it once and keeps such products in XLA).
    return ffi::Error::Internal("dew gemm: oneDNN's gemm returned status " + std::to_string(status) +
                                (status == 3 ? " (unimplemented on this CPU)" : ""));
  }
  return ffi::Error::Success();
}

template <ffi::DataType T, ffi::DataType Out, typename Elem, typename Fn>
ffi::Error Gemm(ffi::ThreadPool pool, Fn fn, ffi::Buffer<T> a, ffi::Buffer<T> b, ffi::Result<ffi::Buffer<Out>> c,
                bool transpose_a, bool transpose_b) {
  return GemmOf<Out, Elem>(pool, fn, a.untyped_data(), a.dimensions(), b.untyped_data(), b.dimensions(),
                           c->untyped_data(), c->dimensions(), transpose_a, transpose_b);
}

// a [M, K] times layer `layer` of a stack of weights b [L, K, N] (float32, or bfloat16 as itself or as its
// uint16 bits), read in place: a scanned decoder passes its layers' whole stack and the layer's index, so
// that XLA does not copy the layer's weight out of the stack before every product. The product is the
// same library call, on the same bytes, as that of the layer's weight on its own.
template <ffi::DataType Out, typename Elem, typename Fn>
ffi::Error StackedGemm(ffi::ThreadPool pool, Fn fn, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> layer,
                       ffi::Result<ffi::Buffer<Out>> c) {
  auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions();
  if (da.size() != 2 || db.size() != 3 || dc.size() != 2 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("dew stacked gemm: a [M, K], b [L, K, N], layer [] and c [M, N]");
  if (ffi::ByteWidth(a.element_type()) != sizeof(Elem) || ffi::ByteWidth(b.element_type()) != sizeof(Elem))
    return ffi::Error::InvalidArgument("dew stacked gemm: operands of another width than the gemm's elements");
  int64_t at = *layer.typed_data();
  if (at < 0 || at >= db[0])
    return ffi::Error::InvalidArgument("dew stacked gemm: layer " + std::to_string(at) + " outside the stack of " +
                                       std::to_string(db[0]));
  const int64_t b_dims[2] = {db[1], db[2]};
  const auto* b_layer = static_cast<const char*>(b.untyped_data()) + at * db[1] * db[2] * sizeof(Elem);
  return GemmOf<Out, Elem>(pool, fn, a.untyped_data(), da, b_layer, ffi::Span<const int64_t>(b_dims, 2),
                           c->untyped_data(), dc, false, false);
}

ffi::Error StackedF32(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> layer,
                      ffi::Result<ffi::Buffer<ffi::F32>> c) {
  return StackedGemm<ffi::F32, float>(pool, g_sgemm, a, b, layer, c);
}

ffi::Error StackedBF16(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> layer,
                       ffi::Result<ffi::Buffer<ffi::F32>> c) {
  return StackedGemm<ffi::F32, uint16_t>(pool, g_bf16_gemm, a, b, layer, c);
}

ffi::Error StackedBF16ToBF16(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> layer,
                             ffi::Result<ffi::Buffer<ffi::BF16>> c) {
  return StackedGemm<ffi::BF16, uint16_t>(pool, g_bf16_gemm, a, b, layer, c);
}

ffi::Error GemmF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                   ffi::Result<ffi::Buffer<ffi::F32>> c, bool transpose_a, bool transpose_b) {
  return Gemm<ffi::F32, ffi::F32, float>(pool, g_sgemm, a, b, c, transpose_a, transpose_b);
}

ffi::Error GemmBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                    ffi::Result<ffi::Buffer<ffi::F32>> c, bool transpose_a, bool transpose_b) {
  return Gemm<ffi::BF16, ffi::F32, uint16_t>(pool, g_bf16_gemm, a, b, c, transpose_a, transpose_b);
}

// The same product rounded to bfloat16 by the piece that computed it, while its rows are in cache:
// no separate pass over a float32 result.
ffi::Error GemmBF16ToBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                          ffi::Result<ffi::Buffer<ffi::BF16>> c, bool transpose_a, bool transpose_b) {
  return Gemm<ffi::BF16, ffi::BF16, uint16_t>(pool, g_bf16_gemm, a, b, c, transpose_a, transpose_b);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewGemmF32, GemmF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewGemmBF16, GemmBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewGemmBF16ToBF16, GemmBF16ToBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

#define DEW_STACKED_GEMM(name, function, out)                                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, function,                                                          \
                                ffi::Ffi::Bind()                                                         \
                                    .Ctx<ffi::ThreadPool>()                                              \
                                    .Arg<ffi::AnyBuffer>()                                               \
                                    .Arg<ffi::AnyBuffer>()                                               \
                                    .Arg<ffi::Buffer<ffi::S32>>()                                        \
                                    .Ret<ffi::Buffer<out>>());
DEW_STACKED_GEMM(DewStackedGemmF32, StackedF32, ffi::F32)
DEW_STACKED_GEMM(DewStackedGemmBF16, StackedBF16, ffi::F32)
DEW_STACKED_GEMM(DewStackedGemmBF16ToBF16, StackedBF16ToBF16, ffi::BF16)

// Python module: handlers() -> {"f32", "bf16", "bf16_to_bf16", "stacked_" each: capsule}; set_gemm(addresses).
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewGemmF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewGemmBF16)},
                                       {"bf16_to_bf16", reinterpret_cast<void*>(&DewGemmBF16ToBF16)},
                                       {"stacked_f32", reinterpret_cast<void*>(&DewStackedGemmF32)},
                                       {"stacked_bf16", reinterpret_cast<void*>(&DewStackedGemmBF16)},
                                       {"stacked_bf16_to_bf16", reinterpret_cast<void*>(&DewStackedGemmBF16ToBF16)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyObject* SetGemm(PyObject*, PyObject* args) {
  unsigned long long sgemm = 0, bf16 = 0, omp_set_num_threads = 0, omp_get_max_threads = 0;
  if (!PyArg_ParseTuple(args, "KKKK", &sgemm, &bf16, &omp_set_num_threads, &omp_get_max_threads)) return nullptr;
  g_sgemm = reinterpret_cast<SgemmFn>(static_cast<uintptr_t>(sgemm));
  g_bf16_gemm = reinterpret_cast<Bf16GemmFn>(static_cast<uintptr_t>(bf16));
  g_omp_set_num_threads = reinterpret_cast<void (*)(int)>(static_cast<uintptr_t>(omp_set_num_threads));
  g_omp_get_max_threads = reinterpret_cast<int (*)()>(static_cast<uintptr_t>(omp_get_max_threads));
  Py_RETURN_NONE;
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by operand dtype."},
    {"set_gemm", SetGemm, METH_VARARGS,
     "Set the addresses of the float32 and bfloat16 gemm functions and of the library's omp_set_num_threads "
     "and omp_get_max_threads."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_gemm", "Dew's XLA FFI matrix products.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_gemm(void) { return PyModule_Create(&kModule); }
