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

#include "isa.h"
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

// ---- A prefill's attention over a run's cache, read in place ----
//
// Queries heads-major `[B, H, S, D]`; keys `[L, C, K, T, D]` and values `[L, C, K, T, Dv]` of a run's cache
// (layer `layer`, rows 0..B-1 of C), float32 or bfloat16 bits; the mask `[B, S, T]`. A task is one row's key/value
// head and a block of kPrefillBlock query rows: the G query heads sharing that key/value head score those rows
// against the keys between the block's first and last allowed ones (a prefill at an offset reads only the filled
// keys, a fresh one only the keys up to the block's end), the masked softmax of each query row is `ForwardRow`'s,
// its probabilities rounded to the cache's dtype as `attend` rounds them, and the values are weighted in float32.
// Products are float32 fused multiply-adds in AVX-512 (a bfloat16 operand widens exactly, and a product of two
// bfloat16 values is exact in float32), so only the order of the sums differs from `attend`'s.
constexpr int64_t kPrefillBlock = 16;  // query rows a task
constexpr int kKeyTile = 32;           // keys a tile of the scores' panel (two vectors)

#ifdef DEW_X86
#define DEW_PREFILL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define DEW_PREFILL_INLINE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) inline

// 16 values from float32 or bfloat16 bits, as float32.
template <typename E>
DEW_PREFILL_INLINE __m512 Load16(const E* x) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm512_loadu_ps(x);
  } else {
    __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
}

// 16 float32 values stored as float32 or rounded to bfloat16 (`RoundToBf16`'s steps, lane by lane).
template <typename E>
DEW_PREFILL_INLINE void Store16(E* out, __m512 x) {
  if constexpr (std::is_same_v<E, float>) {
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

// Transposes 16 rows of 16 floats in place: shuffles within 128-bit lanes gather each lane's 4 x 4 blocks,
// then shuffles of whole lanes put each column's four blocks together.
DEW_PREFILL_INLINE void Transpose16(__m512 r[16]) {
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

// Scores of `MR` query rows (`q`, `d` floats each) against a tile of kKeyTile keys (`panel`: `[d][kKeyTile]`),
// stored to `s` (rows `stride` apart).
template <int MR>
DEW_PREFILL_TARGET void ScoreTile(const float* q, int64_t d, const float* panel, float* s, int64_t stride) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t x = 0; x < d; ++x) {
    __m512 k0 = _mm512_loadu_ps(panel + x * kKeyTile), k1 = _mm512_loadu_ps(panel + x * kKeyTile + 16);
    for (int r = 0; r < MR; ++r) {
      __m512 qr = _mm512_set1_ps(q[r * d + x]);
      acc[r][0] = _mm512_fmadd_ps(qr, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qr, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(s + r * stride, acc[r][0]);
    _mm512_storeu_ps(s + r * stride + 16, acc[r][1]);
  }
}

// `MR` rows of probabilities (`p`, rows `stride` apart) times `n` value rows (`v`, rows `dv` apart), 16 NZ
// columns of them, into `o` (rows `dv` apart).
template <int MR, int NZ>
DEW_PREFILL_TARGET void ValueTile(const float* p, int64_t stride, const float* v, int64_t dv, int64_t n, float* o) {
  __m512 acc[MR][NZ];
  for (int r = 0; r < MR; ++r)
    for (int z = 0; z < NZ; ++z) acc[r][z] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 vz[NZ];
    for (int z = 0; z < NZ; ++z) vz[z] = _mm512_loadu_ps(v + t * dv + 16 * z);
    for (int r = 0; r < MR; ++r) {
      __m512 pr = _mm512_set1_ps(p[r * stride + t]);
      for (int z = 0; z < NZ; ++z) acc[r][z] = _mm512_fmadd_ps(pr, vz[z], acc[r][z]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(o + r * dv + 16 * z, acc[r][z]);
}

// `ScoreTile<MR>` and `ValueTile<MR, NZ>` for a runtime `MR` (at most 8, 4) and `NZ` (at most 4).
template <int MR = 8>
DEW_PREFILL_TARGET void ScoreRows(int mr, const float* q, int64_t d, const float* panel, float* s, int64_t stride) {
  if constexpr (MR > 1) {
    if (mr < MR) return ScoreRows<MR - 1>(mr, q, d, panel, s, stride);
  }
  ScoreTile<MR>(q, d, panel, s, stride);
}

template <int MR = 4, int NZ = 4>
DEW_PREFILL_TARGET void ValueRows(int mr, int nz, const float* p, int64_t stride, const float* v, int64_t dv, int64_t n,
                                  float* o) {
  if constexpr (MR > 1) {
    if (mr < MR) return ValueRows<MR - 1, NZ>(mr, nz, p, stride, v, dv, n, o);
  }
  if constexpr (NZ > 1) {
    if (nz < NZ) return ValueRows<MR, NZ - 1>(mr, nz, p, stride, v, dv, n, o);
  }
  ValueTile<MR, NZ>(p, stride, v, dv, n, o);
}

struct PrefillShape {
  int64_t b, h, s, d, layers, c, k, t, dv, blocks;
};

// One task: row `bi`'s key/value head `kh`, query rows [start, start + rows). `ranges` holds each mask row's
// first and last allowed key (first > last where it allows none). Q and C are float or uint16_t (bfloat16 bits).
template <typename Q, typename C>
DEW_PREFILL_TARGET void PrefillTask(const PrefillShape& a, const Q* qp, const C* kp, const C* vp, int64_t layer,
                                    const bool* mp, const int32_t* ranges, Q* op, float scale, float masked,
                                    int64_t bi, int64_t kh, int64_t start, int64_t rows) {
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
  int64_t n = hi - lo, tiles = (n + kKeyTile - 1) / kKeyTile, tp = tiles * kKeyTile;
  thread_local std::vector<float> queries, panel, scores, widened, outs;
  thread_local std::vector<uint16_t> rounded;
  queries.resize(static_cast<size_t>(gr * a.d));
  panel.resize(static_cast<size_t>(tp * a.d));
  scores.resize(static_cast<size_t>(gr * tp));
  outs.resize(static_cast<size_t>(gr * a.dv));
  // The block's queries as float32 `[G * rows, D]`, head by head.
  for (int64_t i = 0; i < gr; ++i) {
    const Q* row = qp + ((bi * a.h + kh * group + i / rows) * a.s + start + i % rows) * a.d;
    for (int64_t x = 0; x < a.d; x += 16) _mm512_storeu_ps(queries.data() + i * a.d + x, Load16(row + x));
  }
  // The keys [lo, hi) transposed into tiles `[tiles][D][kKeyTile]` (keys past `hi` as zeros).
  int64_t head = ((layer * a.c + bi) * a.k + kh) * a.t;
  const C* keys = kp + (head + lo) * a.d;
  for (int64_t t0 = 0; t0 < tp; t0 += 16) {
    float* tile = panel.data() + t0 / kKeyTile * a.d * kKeyTile + t0 % kKeyTile;
    for (int64_t x0 = 0; x0 < a.d; x0 += 16) {
      __m512 block[16];
      for (int j = 0; j < 16; ++j) block[j] = t0 + j < n ? Load16(keys + (t0 + j) * a.d + x0) : _mm512_setzero_ps();
      Transpose16(block);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(tile + (x0 + j) * kKeyTile, block[j]);
    }
  }
  for (int64_t tile = 0; tile < tiles; ++tile)
    for (int64_t i = 0; i < gr; i += 8)
      ScoreRows(static_cast<int>(std::min<int64_t>(8, gr - i)), queries.data() + i * a.d, a.d,
                panel.data() + tile * a.d * kKeyTile, scores.data() + i * tp + tile * kKeyTile, tp);
  // Each query row's masked softmax over [lo, hi), rounded to the values' dtype; a row that reads nothing
  // weighs nothing (its output is zeros: a padding query's, which nothing reads).
  if constexpr (!std::is_same_v<C, float>) rounded.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < gr; ++i) {
    int64_t srow = bi * a.s + start + i % rows;
    float* p = scores.data() + i * tp;
    if (ranges[2 * srow] > ranges[2 * srow + 1]) {
      std::fill(p, p + n, 0.0f);
      continue;
    }
    if constexpr (std::is_same_v<C, float>) {
      ForwardRow(p, mp + srow * a.t + lo, p, nullptr, n, scale, masked);
    } else {
      ForwardRow(p, mp + srow * a.t + lo, p, rounded.data(), n, scale, masked);
      for (int64_t j = 0; j < n; ++j) p[j] = Bf16ToFloat(rounded[j]);
    }
  }
  // The values [lo, hi) as float32, in place for a float32 cache.
  const float* values;
  if constexpr (std::is_same_v<C, float>) {
    values = vp + (head + lo) * a.dv;
  } else {
    widened.resize(static_cast<size_t>(n * a.dv));
    const C* source = vp + (head + lo) * a.dv;
    for (int64_t j = 0; j < n * a.dv; j += 16) _mm512_storeu_ps(widened.data() + j, Load16(source + j));
    values = widened.data();
  }
  for (int64_t i = 0; i < gr; i += 4)
    for (int64_t z = 0; z < a.dv; z += 64)
      ValueRows(static_cast<int>(std::min<int64_t>(4, gr - i)), static_cast<int>(std::min<int64_t>(4, (a.dv - z) / 16)),
                scores.data() + i * tp, tp, values + z, a.dv, n, outs.data() + i * a.dv + z);
  for (int64_t i = 0; i < gr; ++i)
    for (int64_t z = 0; z < a.dv; z += 16) Store16(out_row(i) + z, _mm512_loadu_ps(outs.data() + i * a.dv + z));
}
#endif

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

bool PrefillAttentionSupported() {
#ifdef DEW_X86
  static const bool supported = DetectIsa() == kAvx512 && __builtin_cpu_supports("avx512dq");
  return supported;
#else
  return false;
#endif
}

template <ffi::DataType QType, ffi::DataType CType>
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<QType> q, ffi::Buffer<CType> keys,
                            ffi::Buffer<CType> values, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::PRED> mask,
                            ffi::Result<ffi::Buffer<QType>> out, float scale, float masked) {
  if (!PrefillAttentionSupported())
    return ffi::Error::InvalidArgument("dew prefill attention: this CPU lacks AVX-512; use dew.nn.attention.attend");
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || md.size() != 3)
    return ffi::Error::InvalidArgument(
        "dew prefill attention: q [B, H, S, D], keys [L, C, K, T, D], values [L, C, K, T, Dv], mask [B, S, T]");
  PrefillShape a{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], kd[3], vd[4], 0};
  if (kd[4] != a.d || vd[0] != a.layers || vd[1] != a.c || vd[2] != a.k || vd[3] != a.t || a.c < a.b || a.k == 0 ||
      a.h % a.k != 0 || a.d % 16 != 0 || a.dv % 16 != 0 || md[0] != a.b || md[1] != a.s || md[2] != a.t)
    return ffi::Error::InvalidArgument("dew prefill attention: q, keys, values and mask shapes do not agree");
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= a.layers) return ffi::Error::InvalidArgument("dew prefill attention: the layer is outside the cache");
  if (a.s == 0 || a.b == 0 || a.h == 0) return ffi::Error::Success();
#ifdef DEW_X86
  using Q = std::conditional_t<QType == ffi::F32, float, uint16_t>;
  using C = std::conditional_t<CType == ffi::F32, float, uint16_t>;
  const Q* qp = reinterpret_cast<const Q*>(q.untyped_data());
  const C* kp = reinterpret_cast<const C*>(keys.untyped_data());
  const C* vp = reinterpret_cast<const C*>(values.untyped_data());
  const bool* mp = mask.typed_data();
  Q* op = reinterpret_cast<Q*>(out->untyped_data());
  std::vector<int32_t> ranges(static_cast<size_t>(2 * a.b * a.s));
  int32_t* rp = ranges.data();
  ForEach(pool, a.b * a.s, 64, [=](int64_t row) { MaskRange(mp + row * a.t, a.t, rp + 2 * row); });
  a.blocks = (a.s + kPrefillBlock - 1) / kPrefillBlock;
  int64_t heads = a.b * a.k;
  // Tasks (block, row, key/value head), the last blocks (the most keys, in a causal pass) first.
  ForEach(pool, heads * a.blocks, 1, [=](int64_t task) {
    int64_t blk = a.blocks - 1 - task / heads, bi = task % heads / a.k, kh = task % a.k;
    int64_t start = blk * kPrefillBlock, rows = std::min(kPrefillBlock, a.s - start);
    PrefillTask<Q, C>(a, qp, kp, vp, l, mp, rp, op, scale, masked, bi, kh, start, rows);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dew prefill attention: x86-64 only; use dew.nn.attention.attend");
#endif
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

#define DEW_PREFILL_HANDLER(name, q_type, cache_type)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (PrefillAttention<q_type, cache_type>),               \
                                ffi::Ffi::Bind()                                            \
                                    .Ctx<ffi::ThreadPool>()                                 \
                                    .Arg<ffi::Buffer<q_type>>()                             \
                                    .Arg<ffi::Buffer<cache_type>>()                         \
                                    .Arg<ffi::Buffer<cache_type>>()                         \
                                    .Arg<ffi::Buffer<ffi::S32>>()                           \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                          \
                                    .Ret<ffi::Buffer<q_type>>()                             \
                                    .Attr<float>("scale")                                   \
                                    .Attr<float>("masked"));
DEW_PREFILL_HANDLER(DewPrefillAttentionF32, ffi::F32, ffi::F32)
DEW_PREFILL_HANDLER(DewPrefillAttentionBF16, ffi::BF16, ffi::U16)

// Python module: handlers() -> {"f32", "bf16", "bf16_probs", "grad_f32", "grad_bf16", "first_max", "attention_f32",
// "attention_grad_f32", "prefill_attention_f32", "prefill_attention_bf16": capsule}; set_gemm(addresses) for the
// attention's products; prefill_attention_supported() whether this CPU runs the prefill's attention.
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewSoftmaxF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewSoftmaxBF16)},
                                       {"bf16_probs", reinterpret_cast<void*>(&DewSoftmaxBF16Probs)},
                                       {"grad_f32", reinterpret_cast<void*>(&DewSoftmaxGradF32)},
                                       {"grad_bf16", reinterpret_cast<void*>(&DewSoftmaxGradBF16)},
                                       {"first_max", reinterpret_cast<void*>(&DewFirstMax)},
                                       {"attention_f32", reinterpret_cast<void*>(&DewAttentionF32)},
                                       {"attention_grad_f32", reinterpret_cast<void*>(&DewAttentionGradF32)},
                                       {"prefill_attention_f32", reinterpret_cast<void*>(&DewPrefillAttentionF32)},
                                       {"prefill_attention_bf16", reinterpret_cast<void*>(&DewPrefillAttentionBF16)}};
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

static PyObject* PrefillSupported(PyObject*, PyObject*) { return PyBool_FromLong(PrefillAttentionSupported()); }

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by dtype and direction."},
    {"set_gemm", SetGemm, METH_VARARGS,
     "Set the addresses of the float32 gemm and of its library's omp_set_num_threads and omp_get_max_threads."},
    {"prefill_attention_supported", PrefillSupported, METH_NOARGS,
     "Whether this CPU runs the prefill attention kernel (AVX-512)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_softmax", "Dew's XLA FFI attention softmax.", -1,
                              kMethods};

PyMODINIT_FUNC PyInit__native_softmax(void) { return PyModule_Create(&kModule); }
