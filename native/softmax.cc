// XLA FFI handlers for attention's masked softmax and its backward, one pass over each row, and for
// the first maximum of each row of logits (the loss's argmax accuracy).
//
// Scores `[B, H, R, T]` float32 (the raw `q . k` products), a mask `[B, R, T]` shared by the H heads
// of a row, a scale and the value a masked score takes:
//   forward   x = mask ? s * scale : masked;  p = exp(x - max(x)) / sum(exp(x - max(x)))
//   backward  ds = mask ? (p * (g - sum(g * p))) * scale : 0
// which is what `jnp.where` and `jax.nn.softmax` compute and differentiate, in the same roundings but
// for the exponential (a polynomial here, within 2 ulps, as XLA's own is) and the order of the sums.
// XLA's CPU backend runs the same math as five to seven passes over the scores, each reading and
// writing them from memory; a row here (a few hundred floats) stays in the first-level cache.
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <memory>
#include <thread>
#include <vector>

#include "module.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Sums and maxima over a row are kept in kLanes partial results, two `Vec`s of kWidth lanes (GCC's
// vector extension: a register each in the AVX2 and AVX-512 clones below, two SSE ones in the
// default), so every loop is vector code and every CPU adds in the same order, without letting the
// compiler reorder float arithmetic on its own. Written as scalar loops, GCC left the forward's
// loops scalar (2.3 ns a score on an AVX2 EPYC, 2.8x XLA's own passes), and as one 16-float vector
// type its AVX2 clone spilled to the stack.
constexpr int kLanes = 16;
constexpr int kWidth = 8;
typedef float Vec __attribute__((vector_size(4 * kWidth)));
typedef int32_t Ints __attribute__((vector_size(4 * kWidth)));
typedef int8_t Bytes __attribute__((vector_size(kWidth)));
// The helpers below take and return vectors by value; they are always inlined, so each clone compiles
// them for its own target and no call passes one (GCC warns that such a call's ABI differs by target).
#pragma GCC diagnostic ignored "-Wpsabi"

[[gnu::always_inline]] inline Vec Load(const float* x) {
  Vec v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

[[gnu::always_inline]] inline void Store(float* x, Vec v) { std::memcpy(x, &v, sizeof v); }

[[gnu::always_inline]] inline Vec Splat(float x) { return Vec{} + x; }

// All ones in the lanes whose mask byte is set (a C++ bool is 0 or 1).
[[gnu::always_inline]] inline Ints LoadMask(const bool* mask) {
  Bytes bytes;
  std::memcpy(&bytes, mask, sizeof bytes);
  return __builtin_convertvector(bytes, Ints) != 0;
}

// exp(x) for float32, lane by lane: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-7
// Taylor-like polynomial (the minimax coefficients of Cephes' expf), times 2^n built in the exponent
// bits; n rounds to nearest even by adding and subtracting 1.5 * 2^23. Within 2 ulps of the exact
// result for x in [-87.3, 88.7]; 0 below (XLA's gives a subnormal there, under 1e-38), +inf above, NaN
// for NaN.
template <typename V>
[[gnu::always_inline]] inline V Exp(V x) {
  const float lo = -87.33654f, hi = 88.72283f, round = 12582912.0f;
  V clamped = x < lo ? V{} + lo : x;  // std::max(x, lo), NaN kept
  clamped = hi < clamped ? V{} + hi : clamped;
  V n = (clamped * 1.44269504088896341f + round) - round;
  V r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  V result;
  if constexpr (std::is_same_v<V, float>) {
    int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    result = p * two_n;
    result = x < lo ? 0.0f : result;
    return x > hi ? HUGE_VALF : result;
  } else {
    Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
    result = p * (Vec)bits;  // the same bits as floats (a vector cast)
    result = x < lo ? V{} : result;
    return x > hi ? V{} + HUGE_VALF : result;
  }
}

inline uint16_t RoundToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  uint32_t nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest);
}

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// One row of the forward: `p` gets the probabilities, `p_bf16` (when not null) them rounded.
__attribute__((target_clones("avx512f", "avx2", "default")))
void ForwardRow(const float* s, const bool* mask, float* p, uint16_t* p_bf16, int64_t t, float scale, float masked) {
  Vec tops[2] = {Splat(-HUGE_VALF), Splat(-HUGE_VALF)}, sums[2] = {Splat(0.0f), Splat(0.0f)};
  int64_t body = t - t % kLanes;
  for (int64_t j = 0; j < body; j += kLanes)
    for (int h = 0; h < 2; ++h) {
      int64_t k = j + h * kWidth;
      Vec x = LoadMask(mask + k) ? Load(s + k) * scale : Splat(masked);
      Store(p + k, x);
      tops[h] = tops[h] < x ? x : tops[h];  // std::max(tops, x)
    }
  float top = -HUGE_VALF;
  for (int l = 0; l < kLanes; ++l) top = std::max(top, tops[l / kWidth][l % kWidth]);
  for (int64_t j = body; j < t; ++j) {
    p[j] = mask[j] ? s[j] * scale : masked;
    top = std::max(top, p[j]);
  }
  for (int64_t j = 0; j < body; j += kLanes)
    for (int h = 0; h < 2; ++h) {
      int64_t k = j + h * kWidth;
      Vec e = Exp(Load(p + k) - top);
      Store(p + k, e);
      sums[h] += e;
    }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += sums[l / kWidth][l % kWidth];
  for (int64_t j = body; j < t; ++j) {
    p[j] = Exp(p[j] - top);
    sum += p[j];
  }
  for (int64_t j = 0; j < t; ++j) p[j] = p[j] / sum;
  if (p_bf16 != nullptr)
    for (int64_t j = 0; j < t; ++j) p_bf16[j] = RoundToBf16(p[j]);
}

// `kLanes` values of the cotangent as float32, from float32 or bfloat16 bits.
template <typename G>
[[gnu::always_inline]] inline Vec LoadG(const G* g) {
  if constexpr (std::is_same_v<G, float>) {
    return Load(g);
  } else {
    typedef uint16_t Halves __attribute__((vector_size(2 * kWidth)));
    Halves halves;
    std::memcpy(&halves, g, sizeof halves);
    Ints wide = __builtin_convertvector(halves, Ints) << 16;
    return (Vec)wide;
  }
}

// One row of the backward, the cotangent `g` in float32 or bfloat16 bits.
template <typename G>
__attribute__((target_clones("avx512f", "avx2", "default")))
void BackwardRow(const float* p, const G* g, const bool* mask, float* ds, int64_t t, float scale) {
  auto load = [](G value) {
    if constexpr (std::is_same_v<G, float>) {
      return value;
    } else {
      return Bf16ToFloat(value);
    }
  };
  Vec dots[2] = {Splat(0.0f), Splat(0.0f)};
  int64_t body = t - t % kLanes;
  for (int64_t j = 0; j < body; j += kLanes)
    for (int h = 0; h < 2; ++h) dots[h] += LoadG(g + j + h * kWidth) * Load(p + j + h * kWidth);
  float dot = 0.0f;
  for (int l = 0; l < kLanes; ++l) dot += dots[l / kWidth][l % kWidth];
  for (int64_t j = body; j < t; ++j) dot += load(g[j]) * p[j];
  for (int64_t j = 0; j < t - t % kWidth; j += kWidth)
    Store(ds + j, LoadMask(mask + j) ? (Load(p + j) * (LoadG(g + j) - dot)) * scale : Splat(0.0f));
  for (int64_t j = t - t % kWidth; j < t; ++j) ds[j] = mask[j] ? (p[j] * (load(g[j]) - dot)) * scale : 0.0f;
}

// The first column holding the row's maximum, as `argmax` picks it (`t` when the row holds a NaN, as
// `min(where(x == max(x), column, t))` gives, the maximum then being NaN). One pass: each of kLanes
// lanes keeps its own maximum and the first column where it met it (a strictly greater value
// replaces it), so the row's first maximum is the least such column among the lanes holding the
// greatest value; the tail's columns come after every lane's.
__attribute__((target_clones("avx512f", "avx2", "default")))
int32_t FirstMaxRow(const float* x, int64_t t) {
  Vec tops[2] = {Splat(-HUGE_VALF), Splat(-HUGE_VALF)};
  Ints firsts[2], nans = Ints{} + 0;
  Ints columns[2];
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < kWidth; ++l) firsts[h][l] = columns[h][l] = h * kWidth + l;
  int64_t body = t - t % kLanes;
  for (int64_t j = 0; j < body; j += kLanes) {
    for (int h = 0; h < 2; ++h) {
      Vec v = Load(x + j + h * kWidth);
      Ints greater = tops[h] < v;
      tops[h] = greater ? v : tops[h];
      firsts[h] = greater ? columns[h] : firsts[h];
      nans |= v != v;
      columns[h] += kLanes;
    }
  }
  float top = -HUGE_VALF;
  int64_t first = t;  // no column yet
  bool nan = false;
  if (body > 0) {
    for (int l = 0; l < kLanes; ++l) {
      float value = tops[l / kWidth][l % kWidth];
      int64_t column = firsts[l / kWidth][l % kWidth];
      nan |= nans[l % kWidth] != 0;
      if (first == t || value > top || (value == top && column < first)) top = value, first = column;
    }
  }
  for (int64_t j = body; j < t; ++j) {
    nan |= x[j] != x[j];
    if (first == t || x[j] > top) top = x[j], first = j;
  }
  return nan ? static_cast<int32_t>(t) : static_cast<int32_t>(first);
}

// Rows divide into pieces that XLA's intra-op threads claim (as in native/gemm.cc); shared by pointer,
// since a pool task may start after the call has returned (it then finds nothing to claim).
struct Rows {
  int64_t total = 0, per_piece = 0, pieces = 0;
  std::function<void(int64_t row)> run;
  std::atomic<int64_t> next{0}, done{0};

  void Work() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
      int64_t first = i * per_piece, last = std::min(total, first + per_piece);
      for (int64_t row = first; row < last; ++row) run(row);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// `run(row)` for each of `total` rows of `t` values.
void ForEachRow(ffi::ThreadPool pool, int64_t total, int64_t t, std::function<void(int64_t)> run) {
  if (total == 0 || t == 0) return;
  auto work = std::make_shared<Rows>();
  work->total = total;
  work->run = std::move(run);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // A few pieces a thread, so one descheduled thread costs little; at least 16 rows a piece.
  work->per_piece = std::max<int64_t>(16, (total + 4 * threads - 1) / (4 * threads));
  work->pieces = (total + work->per_piece - 1) / work->per_piece;
  int64_t helpers = std::min(threads, work->pieces) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Work(); });
  work->Work();
  for (int spins = 0; work->done.load(std::memory_order_acquire) < work->pieces; ++spins) {
    if (spins > 1024) std::this_thread::yield();
  }
}

// `run(row, mask_row)` for each row of scores `[B, H, R, T]`, `mask_row` its row of the mask `[B, R, T]`.
ffi::Error RunRows(ffi::ThreadPool pool, ffi::Span<const int64_t> dims, ffi::Span<const int64_t> mask_dims,
                   std::function<void(int64_t, int64_t)> run) {
  if (dims.size() != 4 || mask_dims.size() != 3)
    return ffi::Error::InvalidArgument("dew softmax: scores must be [B, H, R, T] and the mask [B, R, T]");
  if (mask_dims[0] != dims[0] || mask_dims[1] != dims[2] || mask_dims[2] != dims[3])
    return ffi::Error::InvalidArgument("dew softmax: the mask's [B, R, T] differ from the scores'");
  int64_t heads = dims[1], rows = dims[2];
  ForEachRow(pool, dims[0] * heads * rows, dims[3], [heads, rows, run = std::move(run)](int64_t row) {
    // Row `row` of [B, H, R]: its batch is row / (H R), its query row % R.
    run(row, row / (heads * rows) * rows + row % rows);
  });
  return ffi::Error::Success();
}

ffi::Error SoftmaxF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::PRED> mask,
                      ffi::Result<ffi::Buffer<ffi::F32>> probs, float scale, float masked) {
  const float* s = scores.typed_data();
  const bool* m = mask.typed_data();
  float* p = probs->typed_data();
  int64_t t = scores.dimensions().back();
  return RunRows(pool, scores.dimensions(), mask.dimensions(), [=](int64_t row, int64_t mask_row) {
    ForwardRow(s + row * t, m + mask_row * t, p + row * t, nullptr, t, scale, masked);
  });
}

ffi::Error SoftmaxBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::PRED> mask,
                       ffi::Result<ffi::Buffer<ffi::F32>> probs, ffi::Result<ffi::Buffer<ffi::BF16>> rounded,
                       float scale, float masked) {
  const float* s = scores.typed_data();
  const bool* m = mask.typed_data();
  float* p = probs->typed_data();
  uint16_t* r = reinterpret_cast<uint16_t*>(rounded->untyped_data());
  int64_t t = scores.dimensions().back();
  return RunRows(pool, scores.dimensions(), mask.dimensions(), [=](int64_t row, int64_t mask_row) {
    ForwardRow(s + row * t, m + mask_row * t, p + row * t, r + row * t, t, scale, masked);
  });
}

template <ffi::DataType GType, typename G>
ffi::Error SoftmaxGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<GType> grad,
                       ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::F32>> dscores, float scale) {
  const float* p = probs.typed_data();
  const G* g = reinterpret_cast<const G*>(grad.untyped_data());
  const bool* m = mask.typed_data();
  float* ds = dscores->typed_data();
  int64_t t = probs.dimensions().back();
  return RunRows(pool, probs.dimensions(), mask.dimensions(), [=](int64_t row, int64_t mask_row) {
    BackwardRow<G>(p + row * t, g + row * t, m + mask_row * t, ds + row * t, t, scale);
  });
}

ffi::Error SoftmaxGradF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> grad,
                          ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::F32>> dscores, float scale) {
  return SoftmaxGrad<ffi::F32, float>(pool, probs, grad, mask, dscores, scale);
}

ffi::Error SoftmaxGradBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::BF16> grad,
                           ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::F32>> dscores, float scale) {
  return SoftmaxGrad<ffi::BF16, uint16_t>(pool, probs, grad, mask, dscores, scale);
}

// Each row of `[N, T]` float32 to its first maximum's column (int32 `[N]`), rows split over XLA's
// threads as the softmax's are.
ffi::Error FirstMax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> first) {
  auto dims = x.dimensions();
  if (dims.size() != 2 || first->dimensions().size() != 1 || first->dimensions()[0] != dims[0])
    return ffi::Error::InvalidArgument("dew first_max: takes [N, T] float32 and returns [N] int32");
  if (dims[1] > INT32_MAX) return ffi::Error::InvalidArgument("dew first_max: rows longer than 2^31 - 1");
  const float* data = x.typed_data();
  int32_t* out = first->typed_data();
  int64_t t = dims[1];
  if (t == 0) return ffi::Error::InvalidArgument("dew first_max: rows of no columns have no maximum");
  ForEachRow(pool, dims[0], t, [=](int64_t row) { out[row] = FirstMaxRow(data + row * t, t); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewFirstMax, FirstMax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewSoftmaxF32, SoftmaxF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewSoftmaxBF16, SoftmaxBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewSoftmaxGradF32, SoftmaxGradF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewSoftmaxGradBF16, SoftmaxGradBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

// Python module: handlers() -> {"f32", "bf16", "grad_f32", "grad_bf16", "first_max": capsule}.
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewSoftmaxF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewSoftmaxBF16)},
                                       {"grad_f32", reinterpret_cast<void*>(&DewSoftmaxGradF32)},
                                       {"grad_bf16", reinterpret_cast<void*>(&DewSoftmaxGradBF16)},
                                       {"first_max", reinterpret_cast<void*>(&DewFirstMax)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by dtype and direction."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_softmax", "Dew's XLA FFI attention softmax.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_softmax(void) { return PyModule_Create(&kModule); }
