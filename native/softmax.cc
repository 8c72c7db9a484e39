// XLA FFI handlers for attention's masked softmax and its backward, one pass over each row, for the
// first maximum of each row of logits (the loss's argmax accuracy), and for a whole float32 attention
// pass and its backward (the softmax between single-threaded library gemms, per block of query rows).
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
#include <string>
#include <thread>
#include <vector>

#include "module.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dew;  // the vector types and helpers of vectors.h

// All ones in the lanes whose mask byte is set (a C++ bool is 0 or 1). Each lane shifts its byte out
// of the 32-bit word holding it, a handful of vector instructions in the AVX2 and AVX-512 clones:
// `__builtin_convertvector` of the 8 bytes compiles to scalar code (docs/performance.md).
typedef uint32_t Words __attribute__((vector_size(4 * kWidth)));
[[gnu::always_inline]] inline Ints LoadMask(const bool* mask) {
  static_assert(kWidth == 8, "two 32-bit words of mask bytes a vector");
  uint32_t words[2];
  std::memcpy(words, mask, sizeof words);
  Words spread = {words[0], words[0], words[0], words[0], words[1], words[1], words[1], words[1]};
  Words shifts = {0, 8, 16, 24, 0, 8, 16, 24};
  if constexpr (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__) shifts = 24 - shifts;
  return (Ints)(((spread >> shifts) & 0xffu) != 0);
}

// The forward's rows in AVX-512's 16 lanes: one register holds the kLanes partial results, lane `l`
// the one two `Vec`s hold in vector l / 8, lane l % 8, so its sums and maxima are theirs, bit for bit.
typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));
static_assert(kLanes == 16, "one Vec16 holds the kLanes partial results");

// `LoadMask` of 16 lanes: the bytes widen to 16-bit and then 32-bit lanes, vector instructions in both
// steps (GCC 12 widens bytes to 32-bit lanes in one `__builtin_convertvector` a lane at a time).
[[gnu::always_inline]] inline Ints16 LoadMask16(const bool* mask) {
  typedef uint8_t Bytes __attribute__((vector_size(16)));
  typedef uint16_t Halves __attribute__((vector_size(32)));
  typedef uint32_t Words16 __attribute__((vector_size(64)));
  Bytes bytes;
  std::memcpy(&bytes, mask, sizeof bytes);
  return (Ints16)(__builtin_convertvector(__builtin_convertvector(bytes, Halves), Words16) != 0);
}

// One row of the forward in vectors `V` (`Vec` or `Vec16`): `p` gets the probabilities, `p_bf16` (when
// not null) them rounded. Where the row's maximum makes a masked score's exponential exactly 0 (always,
// unless every score is masked), a vector of masked lanes skips the exponential and takes that 0.
template <typename V>
[[gnu::always_inline]] inline void ForwardRowOf(const float* s, const bool* mask, float* p, uint16_t* p_bf16,
                                                int64_t t, float scale, float masked) {
  constexpr int lanes = sizeof(V) / sizeof(float), parts = kLanes / lanes;
  auto load = [](const float* x) {
    V v;
    std::memcpy(&v, x, sizeof v);
    return v;
  };
  auto store = [](float* x, V v) { std::memcpy(x, &v, sizeof v); };
  auto load_mask = [](const bool* m) {
    if constexpr (lanes == 16) {
      return LoadMask16(m);
    } else {
      return LoadMask(m);
    }
  };
  V tops[parts], sums[parts];
  for (int h = 0; h < parts; ++h) tops[h] = V{} - HUGE_VALF, sums[h] = V{};
  int64_t body = t - t % kLanes;
  for (int64_t j = 0; j < body; j += kLanes)
    for (int h = 0; h < parts; ++h) {
      int64_t k = j + h * lanes;
      V x = load_mask(mask + k) ? load(s + k) * scale : V{} + masked;
      store(p + k, x);
      tops[h] = tops[h] < x ? x : tops[h];  // std::max(tops, x)
    }
  float top = -HUGE_VALF;
  for (int l = 0; l < kLanes; ++l) top = std::max(top, tops[l / lanes][l % lanes]);
  for (int64_t j = body; j < t; ++j) {
    p[j] = mask[j] ? s[j] * scale : masked;
    top = std::max(top, p[j]);
  }
  bool masked_is_zero = masked - top < kExpLowest;
  for (int64_t j = 0; j < body; j += kLanes)
    for (int h = 0; h < parts; ++h) {
      int64_t k = j + h * lanes;
      uint64_t words[lanes / 8], read = 0;  // the vector's mask bytes, 8 a word
      std::memcpy(words, mask + k, sizeof words);
      for (uint64_t word : words) read |= word;
      if (masked_is_zero && read == 0) {  // sums[h] += 0 would leave it as it is
        store(p + k, V{});
        continue;
      }
      V e = Exp(load(p + k) - top);
      store(p + k, e);
      sums[h] += e;
    }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += sums[l / lanes][l % lanes];
  for (int64_t j = body; j < t; ++j) {
    p[j] = Exp(p[j] - top);
    sum += p[j];
  }
  int64_t whole = t - t % lanes;
  for (int64_t j = 0; j < whole; j += lanes) {
    V probs = load(p + j) / sum;
    store(p + j, probs);
    if (p_bf16 != nullptr) {
      Vec pieces[lanes / kWidth];  // `StoreBf16` takes kWidth lanes (GCC 12 cannot narrow a templated vector)
      std::memcpy(pieces, &probs, sizeof pieces);
      for (int h = 0; h < lanes / kWidth; ++h) StoreBf16(p_bf16 + j + h * kWidth, pieces[h]);
    }
  }
  for (int64_t j = whole; j < t; ++j) {
    p[j] = p[j] / sum;
    if (p_bf16 != nullptr) p_bf16[j] = RoundToBf16(p[j]);
  }
}

// No fused multiply-adds: GCC contracts `a * b + c` into them for AVX-512's 512-bit vectors (whose
// instructions include them) and not in the other clones, and the bits would differ between CPUs.
__attribute__((target("avx512f"), optimize("fp-contract=off")))
void ForwardRowAvx512(const float* s, const bool* mask, float* p, uint16_t* p_bf16, int64_t t, float scale,
                      float masked) {
  ForwardRowOf<Vec16>(s, mask, p, p_bf16, t, scale, masked);
}

__attribute__((target_clones("avx2", "default")))
void ForwardRowNarrow(const float* s, const bool* mask, float* p, uint16_t* p_bf16, int64_t t, float scale,
                      float masked) {
  ForwardRowOf<Vec>(s, mask, p, p_bf16, t, scale, masked);
}

// One row of the forward, in 16 lanes where the CPU has AVX-512 (the same results either way).
void ForwardRow(const float* s, const bool* mask, float* p, uint16_t* p_bf16, int64_t t, float scale, float masked) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  (avx512 ? ForwardRowAvx512 : ForwardRowNarrow)(s, mask, p, p_bf16, t, scale, masked);
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
    for (int h = 0; h < 2; ++h) dots[h] += LoadFloats(g + j + h * kWidth) * Load(p + j + h * kWidth);
  float dot = 0.0f;
  for (int l = 0; l < kLanes; ++l) dot += dots[l / kWidth][l % kWidth];
  for (int64_t j = body; j < t; ++j) dot += load(g[j]) * p[j];
  for (int64_t j = 0; j < t - t % kWidth; j += kWidth)
    Store(ds + j, LoadMask(mask + j) ? (Load(p + j) * (LoadFloats(g + j) - dot)) * scale : Splat(0.0f));
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

// `run(row)` for each of `total` rows of `t` values, at least 16 rows a piece.
void ForEachRow(ffi::ThreadPool pool, int64_t total, int64_t t, std::function<void(int64_t)> run) {
  if (t == 0) return;
  ForEach(pool, total, 16, std::move(run));
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

// The bfloat16 probabilities alone (a pass nothing differentiates): each row's float32 ones stay in a
// scratch row of the thread's.
ffi::Error SoftmaxBF16Probs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores, ffi::Buffer<ffi::PRED> mask,
                            ffi::Result<ffi::Buffer<ffi::BF16>> rounded, float scale, float masked) {
  const float* s = scores.typed_data();
  const bool* m = mask.typed_data();
  uint16_t* r = reinterpret_cast<uint16_t*>(rounded->untyped_data());
  int64_t t = scores.dimensions().back();
  return RunRows(pool, scores.dimensions(), mask.dimensions(), [=](int64_t row, int64_t mask_row) {
    thread_local std::vector<float> probs;
    probs.resize(static_cast<size_t>(t));
    ForwardRow(s + row * t, m + mask_row * t, probs.data(), r + row * t, t, scale, masked);
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

// Attention in one call: each block of query rows' scores, softmax and weighted values (and, in the
// backward, their gradients), one single-threaded gemm at a time on XLA's threads, with the block's
// scores in cache between the steps. The gemm is the library's (oneDNN's `dnnl_sgemm`, row-major, its
// address handed over by Python as native/gemm.cc's is), with its OpenMP team held to the calling
// thread while a piece runs.
using SgemmFn = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                        int64_t, float, float*, int64_t);
SgemmFn g_sgemm = nullptr;
void (*g_omp_set_num_threads)(int) = nullptr;
int (*g_omp_get_max_threads)() = nullptr;

// Queries `[B, S, H, D]`, keys `[B, T, K, D]`, values `[B, T, K, Dv]` (the projections' own layouts:
// no transposes), the mask `[B, S, T]`; query head `h` reads key/value head `h / (H / K)`. Query rows go
// in blocks of `block`; with `causal_blocks` (a causal pass whose query slot `i` is key slot `i`) a block
// scores the keys up to its own last row only, else every key, exactly as `dew.nn.attention.attend`.
struct AttentionShape {
  int64_t b, s, h, k, d, dv, t, block, blocks;
  bool causal_blocks;
  int64_t Start(int64_t blk) const { return blk * block; }
  int64_t Rows(int64_t blk) const { return std::min(block, s - blk * block); }
  int64_t End(int64_t blk) const { return causal_blocks ? blk * block + Rows(blk) : t; }
  // Where a block's probabilities `[Rows, End]` start in a head's packed `[P]` of them (every block
  // before it is whole), and P: a causal pass keeps about half the `S x T` scores, not all of them.
  int64_t Offset(int64_t blk) const { return causal_blocks ? block * block * blk * (blk + 1) / 2 : blk * block * t; }
  int64_t Packed() const { return Offset(blocks - 1) + Rows(blocks - 1) * End(blocks - 1); }
};

ffi::Error CheckAttention(ffi::Span<const int64_t> q, ffi::Span<const int64_t> k, ffi::Span<const int64_t> v,
                          ffi::Span<const int64_t> mask, ffi::Span<const int64_t> probs, int64_t block,
                          bool causal_blocks, AttentionShape* out) {
  if (g_sgemm == nullptr) return ffi::Error::Internal("dew attention: the library's gemm was not set");
  if (q.size() != 4 || k.size() != 4 || v.size() != 4 || mask.size() != 3)
    return ffi::Error::InvalidArgument(
        "dew attention: q [B, S, H, D], k [B, T, K, D], v [B, T, K, Dv], mask [B, S, T]");
  AttentionShape a{q[0], q[1], q[2], k[2], q[3], v[3], k[1], block, 0, causal_blocks};
  if (k[0] != a.b || v[0] != a.b || v[1] != a.t || v[2] != a.k || k[3] != a.d || a.k == 0 || a.h % a.k != 0 ||
      mask[0] != a.b || mask[1] != a.s || mask[2] != a.t)
    return ffi::Error::InvalidArgument("dew attention: q, k, v and mask shapes do not agree");
  if (block <= 0) return ffi::Error::InvalidArgument("dew attention: block must be positive");
  if (causal_blocks && a.s > a.t)
    return ffi::Error::InvalidArgument("dew attention: causal blocks need at least as many keys as queries");
  a.blocks = (a.s + block - 1) / block;
  if (probs.size() != 3 || probs[0] != a.b || probs[1] != a.h || probs[2] != (a.s == 0 ? 0 : a.Packed()))
    return ffi::Error::InvalidArgument("dew attention: the probabilities must be [B, H, packed blocks]");
  *out = a;
  return ffi::Error::Success();
}

// Runs `run(task)` for `total` tasks, one a piece, the library's OpenMP team held to the thread (each
// caller's tasks keep the first failing gemm's status themselves).
void ForEachTask(ffi::ThreadPool pool, int64_t total, std::function<void(int64_t)> run) {
  ForEach(pool, total, 1, [run = std::move(run)](int64_t task) {
    int before = g_omp_get_max_threads != nullptr ? g_omp_get_max_threads() : 0;
    if (g_omp_set_num_threads != nullptr) g_omp_set_num_threads(1);
    run(task);
    if (g_omp_set_num_threads != nullptr) g_omp_set_num_threads(before);
  });
}

ffi::Error GemmFailed(int64_t status) {
  return ffi::Error::Internal("dew attention: the library's gemm returned status " + std::to_string(status));
}

// Forward: `out` `[B, S, H, Dv]` and, for the backward, the probabilities `[B, H, P]`, each head's
// blocks `[Rows, End]` one after another (`AttentionShape::Offset`).
ffi::Error AttentionF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Result<ffi::Buffer<ffi::F32>> out,
                        ffi::Result<ffi::Buffer<ffi::F32>> probs, float scale, float masked, int64_t block,
                        bool causal_blocks) {
  AttentionShape a;
  if (auto error = CheckAttention(q.dimensions(), k.dimensions(), v.dimensions(), mask.dimensions(),
                                  probs->dimensions(), block, causal_blocks, &a);
      error.failure())
    return error;
  if (a.s == 0) return ffi::Error::Success();
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float *op = out->typed_data(), *pp = probs->typed_data();
  auto failed = std::make_shared<std::atomic<int64_t>>(0);
  int64_t heads = a.b * a.h;
  // Tasks (block, row, head), the widest blocks first so that the last ones to finish are short.
  ForEachTask(pool, heads * a.blocks, [=](int64_t task) {
    int64_t blk = a.blocks - 1 - task / heads, bh = task % heads, bi = bh / a.h, h = bh % a.h, kh = h / (a.h / a.k);
    int64_t start = a.Start(blk), rows = a.Rows(blk), end = a.End(blk);
    thread_local std::vector<float> scores;
    scores.resize(static_cast<size_t>(rows * end));
    const float* qb = qp + ((bi * a.s + start) * a.h + h) * a.d;
    const float* kb = kp + bi * a.t * a.k * a.d + kh * a.d;
    const float* vb = vp + bi * a.t * a.k * a.dv + kh * a.dv;
    float* pb = pp + bh * a.Packed() + a.Offset(blk);
    int status = g_sgemm('N', 'T', rows, end, a.d, 1.0f, qb, a.h * a.d, kb, a.k * a.d, 0.0f, scores.data(), end);
    for (int64_t r = 0; r < rows && status == 0; ++r) {
      ForwardRow(scores.data() + r * end, mp + (bi * a.s + start + r) * a.t, pb + r * end, nullptr, end, scale,
                 masked);
    }
    if (status == 0)
      status = g_sgemm('N', 'N', rows, a.dv, end, 1.0f, pb, end, vb, a.k * a.dv, 0.0f,
                       op + ((bi * a.s + start) * a.h + h) * a.dv, a.h * a.dv);
    int64_t none = 0;
    if (status != 0) failed->compare_exchange_strong(none, status, std::memory_order_relaxed);
  });
  if (int64_t status = failed->load(); status != 0) return GemmFailed(status);
  return ffi::Error::Success();
}

// Backward, from the forward's probabilities and the output's cotangent `g` `[B, S, H, Dv]`: per key/value
// head of a row (the query heads sharing it add into its gradients), per block, dv += p^T g,
// dp = g v^T, ds = the softmax's backward of dp (`BackwardRow`, scaled), dq = ds k, dk += ds^T q.
ffi::Error AttentionGradF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> probs,
                            ffi::Buffer<ffi::F32> g, ffi::Result<ffi::Buffer<ffi::F32>> dq,
                            ffi::Result<ffi::Buffer<ffi::F32>> dk, ffi::Result<ffi::Buffer<ffi::F32>> dv, float scale,
                            int64_t block, bool causal_blocks) {
  AttentionShape a;
  if (auto error = CheckAttention(q.dimensions(), k.dimensions(), v.dimensions(), mask.dimensions(),
                                  probs.dimensions(), block, causal_blocks, &a);
      error.failure())
    return error;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *pp = probs.typed_data();
  const float* gp = g.typed_data();
  const bool* mp = mask.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  auto failed = std::make_shared<std::atomic<int64_t>>(0);
  int64_t group = a.h / a.k;
  ForEachTask(pool, a.b * a.k, [=](int64_t task) {
    int64_t bi = task / a.k, kh = task % a.k;
    const float* kb = kp + bi * a.t * a.k * a.d + kh * a.d;
    const float* vb = vp + bi * a.t * a.k * a.dv + kh * a.dv;
    float* dkb = dkp + bi * a.t * a.k * a.d + kh * a.d;
    float* dvb = dvp + bi * a.t * a.k * a.dv + kh * a.dv;
    for (int64_t j = 0; j < a.t; ++j) {
      std::fill(dkb + j * a.k * a.d, dkb + j * a.k * a.d + a.d, 0.0f);
      std::fill(dvb + j * a.k * a.dv, dvb + j * a.k * a.dv + a.dv, 0.0f);
    }
    thread_local std::vector<float> dprobs, dscores;
    int status = 0;
    for (int64_t h = kh * group; h < (kh + 1) * group && status == 0; ++h) {
      for (int64_t blk = 0; blk < a.blocks && status == 0; ++blk) {
        int64_t start = a.Start(blk), rows = a.Rows(blk), end = a.End(blk);
        dprobs.resize(static_cast<size_t>(rows * end));
        dscores.resize(static_cast<size_t>(rows * end));
        const float* pb = pp + (bi * a.h + h) * a.Packed() + a.Offset(blk);
        const float* gb = gp + ((bi * a.s + start) * a.h + h) * a.dv;
        const float* qb = qp + ((bi * a.s + start) * a.h + h) * a.d;
        status = g_sgemm('T', 'N', end, a.dv, rows, 1.0f, pb, end, gb, a.h * a.dv, 1.0f, dvb, a.k * a.dv);
        if (status == 0)
          status = g_sgemm('N', 'T', rows, end, a.dv, 1.0f, gb, a.h * a.dv, vb, a.k * a.dv, 0.0f, dprobs.data(), end);
        if (status != 0) break;
        for (int64_t r = 0; r < rows; ++r)
          BackwardRow<float>(pb + r * end, dprobs.data() + r * end, mp + (bi * a.s + start + r) * a.t,
                             dscores.data() + r * end, end, scale);
        status = g_sgemm('N', 'N', rows, a.d, end, 1.0f, dscores.data(), end, kb, a.k * a.d, 0.0f,
                         dqp + ((bi * a.s + start) * a.h + h) * a.d, a.h * a.d);
        if (status == 0)
          status = g_sgemm('T', 'N', end, a.d, rows, 1.0f, dscores.data(), end, qb, a.h * a.d, 1.0f, dkb, a.k * a.d);
      }
    }
    int64_t none = 0;
    if (status != 0) failed->compare_exchange_strong(none, status, std::memory_order_relaxed);
  });
  if (int64_t status = failed->load(); status != 0) return GemmFailed(status);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewSoftmaxBF16Probs, SoftmaxBF16Probs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewAttentionF32, AttentionF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("masked")
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("causal_blocks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DewAttentionGradF32, AttentionGradF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block")
                                  .Attr<bool>("causal_blocks"));

// Python module: handlers() -> {"f32", "bf16", "bf16_probs", "grad_f32", "grad_bf16", "first_max", "attention_f32",
// "attention_grad_f32": capsule}; set_gemm(addresses) for the attention's products.
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewSoftmaxF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewSoftmaxBF16)},
                                       {"bf16_probs", reinterpret_cast<void*>(&DewSoftmaxBF16Probs)},
                                       {"grad_f32", reinterpret_cast<void*>(&DewSoftmaxGradF32)},
                                       {"grad_bf16", reinterpret_cast<void*>(&DewSoftmaxGradBF16)},
                                       {"first_max", reinterpret_cast<void*>(&DewFirstMax)},
                                       {"attention_f32", reinterpret_cast<void*>(&DewAttentionF32)},
                                       {"attention_grad_f32", reinterpret_cast<void*>(&DewAttentionGradF32)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyObject* SetGemm(PyObject*, PyObject* args) {
  unsigned long long sgemm = 0, omp_set_num_threads = 0, omp_get_max_threads = 0;
  if (!PyArg_ParseTuple(args, "KKK", &sgemm, &omp_set_num_threads, &omp_get_max_threads)) return nullptr;
  g_sgemm = reinterpret_cast<SgemmFn>(static_cast<uintptr_t>(sgemm));
  g_omp_set_num_threads = reinterpret_cast<void (*)(int)>(static_cast<uintptr_t>(omp_set_num_threads));
  g_omp_get_max_threads = reinterpret_cast<int (*)()>(static_cast<uintptr_t>(omp_get_max_threads));
  Py_RETURN_NONE;
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by dtype and direction."},
    {"set_gemm", SetGemm, METH_VARARGS,
     "Set the addresses of the float32 gemm and of its library's omp_set_num_threads and omp_get_max_threads."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_softmax", "Dew's XLA FFI attention softmax.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_softmax(void) { return PyModule_Create(&kModule); }
