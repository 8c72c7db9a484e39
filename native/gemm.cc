// XLA FFI handlers for 2-D matrix products (and batches of them) run by a tuned BLAS-style library.
//
// The library is not linked: Python loads it (dew.nn.fast_matmul) and hands this module the addresses
// of its row-major `gemm` entry points, whose signature is oneDNN's C API:
//   status gemm(char transa, char transb, int64 M, int64 N, int64 K, float alpha,
//               const T *A, int64 lda, const T *B, int64 ldb, float beta, float *C, int64 ldc)
// with T float (dnnl_sgemm) or bfloat16 bits (dnnl_gemm_bf16bf16f32). Products accumulate and return
// float32 in either case; the caller converts.
#include <Python.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using SgemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                        int64_t, float, float*, int64_t);
using Bf16GemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t,
                           const uint16_t*, int64_t, float, float*, int64_t);

SgemmFn g_sgemm = nullptr;
Bf16GemmFn g_bf16_gemm = nullptr;

// Operands `[..., rows, cols]` with the same leading (batch) dimensions; `transpose_*` says the stored
// matrix is the transpose of the product's operand. The result is `[..., M, N]` float32.
template <ffi::DataType T, typename Elem, typename Fn>
ffi::Error Gemm(Fn fn, ffi::Buffer<T> a, ffi::Buffer<T> b, ffi::Result<ffi::Buffer<ffi::F32>> c,
                bool transpose_a, bool transpose_b) {
  if (fn == nullptr) return ffi::Error::Internal("dew gemm: the library's gemm was not set");
  auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions();
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
  const Elem* pa = reinterpret_cast<const Elem*>(a.untyped_data());
  const Elem* pb = reinterpret_cast<const Elem*>(b.untyped_data());
  float* pc = c->typed_data();
  for (int64_t i = 0; i < batch; ++i) {
    int status = fn(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k, 1.0f, pa + i * a_rows * a_cols,
                    a_cols, pb + i * b_rows * b_cols, b_cols, 0.0f, pc + i * m * n, n);
    if (status != 0)
      return ffi::Error::Internal("dew gemm: the library returned status " + std::to_string(status));
  }
  return ffi::Error::Success();
}

ffi::Error GemmF32(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Result<ffi::Buffer<ffi::F32>> c,
                   bool transpose_a, bool transpose_b) {
  return Gemm<ffi::F32, float>(g_sgemm, a, b, c, transpose_a, transpose_b);
}

ffi::Error GemmBF16(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b, ffi::Result<ffi::Buffer<ffi::F32>> c,
                    bool transpose_a, bool transpose_b) {
  return Gemm<ffi::BF16, uint16_t>(g_bf16_gemm, a, b, c, transpose_a, transpose_b);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewGemmF32, GemmF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewGemmBF16, GemmBF16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

// Python module: handlers() -> {"f32": capsule, "bf16": capsule}; set_gemm(sgemm_address, bf16_address).
static PyObject* Handlers(PyObject*, PyObject*) {
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  PyObject* f32 = PyCapsule_New(reinterpret_cast<void*>(&DewGemmF32), nullptr, nullptr);
  PyObject* bf16 = PyCapsule_New(reinterpret_cast<void*>(&DewGemmBF16), nullptr, nullptr);
  if (f32 == nullptr || bf16 == nullptr || PyDict_SetItemString(out, "f32", f32) != 0 ||
      PyDict_SetItemString(out, "bf16", bf16) != 0) {
    Py_XDECREF(f32);
    Py_XDECREF(bf16);
    Py_DECREF(out);
    return nullptr;
  }
  Py_DECREF(f32);
  Py_DECREF(bf16);
  return out;
}

static PyObject* SetGemm(PyObject*, PyObject* args) {
  unsigned long long sgemm = 0, bf16 = 0;
  if (!PyArg_ParseTuple(args, "KK", &sgemm, &bf16)) return nullptr;
  g_sgemm = reinterpret_cast<SgemmFn>(static_cast<uintptr_t>(sgemm));
  g_bf16_gemm = reinterpret_cast<Bf16GemmFn>(static_cast<uintptr_t>(bf16));
  Py_RETURN_NONE;
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by operand dtype."},
    {"set_gemm", SetGemm, METH_VARARGS, "Set the addresses of the float32 and bfloat16 gemm functions."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_gemm", "Dew's XLA FFI matrix products.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_gemm(void) { return PyModule_Create(&kModule); }
