// An XLA FFI handler for decoding's attention: one new query per row against that row's cached keys
// and values, reading only the slots the row may attend to.
//
// Queries `[B, H, D]` float32; the cache of a run of layers, keys `[L, C, K, T, D]` and values
// `[L, C, K, T, Dv]` (float32 or bfloat16, heads-major as dew.nn.kv_cache lays them out; query row b
// reads cache row b of C >= B, so a step over a server's first rows reads its whole cache in place), the layer
// to read (an int32 scalar: a scanned run's layer index is traced), and per row the slots
// `[starts[b], ends[b])` its query reads. Query head `h` reads key/value head `h / (H / K)`:
//   out[b, h] = sum_j p_j v[b, kh, j],  p = softmax_j(x_j),  x_j = cap(scale * q[b, h] . k[b, kh, j])
// over those slots only, in float32 (`cap(x)` is `softcap * tanh(x / softcap)`, or x without a cap).
// A row whose range is empty gets zeros.
//
// XLA's form scores every slot of the cache's capacity, masks, and weighs every value: at a context
// of thousands of slots that is most of a decode step. Here the keys go in chunks of kChunk slots;
// each (row, key/value head, chunk) is one task, which scores the chunk for the H / K query heads
// sharing that key/value head (every key and value is read from memory once), and keeps the chunk's
// maximum, its sum of exponentials and its weighted values. The chunks are then combined in order,
// each rescaled by exp(its maximum - the row's). The chunking is fixed, so the result does not depend
// on the number of threads.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "module.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dew;  // the vector types and helpers of vectors.h

constexpr int64_t kChunk = 256;  // key slots a task scores

// The eight lane sums of `a[0..7]`, one a lane (lane i holds the sum of a[i]'s lanes), by three rounds
// of pairwise shuffles and adds: the same order of additions on every CPU.
[[gnu::always_inline]] inline Vec SumEach(const Vec* a) {
  const Ints even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const Ints low = {0, 1, 8, 9, 4, 5, 12, 13}, high = {2, 3, 10, 11, 6, 7, 14, 15};
  const Ints first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
  Vec pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)
    pairs[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
  for (int i = 0; i < 2; ++i)
    quads[i] = __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], low) +
               __builtin_shuffle(pairs[2 * i], pairs[2 * i + 1], high);
  // quads[0] holds a[0..3]'s halves as [a0 a1 a2 a3 | a0 a1 a2 a3] (low, high lanes), quads[1] a[4..7]'s.
  return __builtin_shuffle(quads[0], quads[1], first) + __builtin_shuffle(quads[0], quads[1], second);
}

[[gnu::always_inline]] inline float SumLanes(Vec a) {
  float sum = 0.0f;
  for (int l = 0; l < kWidth; ++l) sum += a[l];
  return sum;
}

// One chunk of `n` key slots for `g` query heads: `q` `[g, d]`, keys `[n, d]`, values `[n, dv]`.
// `partial` gets, per query head, its largest logit, the sum of exp(logit - largest) and the values
// weighted by those exponentials, `[g, 2 + dv]`. `x` is scratch of `g * round_up(n, kWidth)` floats.
// `d` and `dv` are multiples of kWidth.
template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default")))
void ChunkPartials(const float* q, const T* k, const T* v, int64_t n, int64_t d, int64_t dv, int64_t g, float scale,
                   float softcap, float* x, float* partial) {
  int64_t padded = (n + kWidth - 1) / kWidth * kWidth;
  for (int64_t h = 0; h < g; ++h) {
    const float* qh = q + h * d;
    float* xh = x + h * padded;
    int64_t j = 0;
    for (; j + kWidth <= n; j += kWidth) {
      Vec dots[kWidth] = {};
      for (int64_t c = 0; c < d; c += kWidth) {
        Vec qc = Load(qh + c);
        for (int r = 0; r < kWidth; ++r) dots[r] += qc * LoadFloats(k + (j + r) * d + c);
      }
      Store(xh + j, SumEach(dots));
    }
    for (; j < n; ++j) {
      Vec dot = Splat(0.0f);
      for (int64_t c = 0; c < d; c += kWidth) dot += Load(qh + c) * LoadFloats(k + j * d + c);
      xh[j] = SumLanes(dot);
    }
    for (j = 0; j < n; ++j) {
      float logit = xh[j] * scale;
      xh[j] = softcap > 0.0f ? softcap * std::tanh(logit / softcap) : logit;
    }
    float top = -HUGE_VALF;
    for (j = 0; j < n; ++j) top = std::max(top, xh[j]);
    for (j = n; j < padded; ++j) xh[j] = -HUGE_VALF;  // exp(-inf - top) is 0
    Vec sums = Splat(0.0f);
    for (j = 0; j < padded; j += kWidth) {
      Vec e = Exp(Load(xh + j) - top);
      Store(xh + j, e);
      sums += e;
    }
    float* out = partial + h * (2 + dv);
    out[0] = top;
    out[1] = SumLanes(sums);
    std::fill(out + 2, out + 2 + dv, 0.0f);
  }
  // Each value row is read once for all g heads; the heads' weighted sums stay in the first-level cache.
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < dv; c += kWidth) {
      Vec vc = LoadFloats(v + j * dv + c);
      for (int64_t h = 0; h < g; ++h) {
        float* acc = partial + h * (2 + dv) + 2 + c;
        Store(acc, Load(acc) + Splat(x[h * padded + j]) * vc);
      }
    }
  }
}

// Row `b`, head `h`'s result from its chunks' partials `[chunks, 2 + dv]` (`stride` floats apart).
void Combine(const float* partials, int64_t chunks, int64_t stride, int64_t dv, float* out) {
  float top = -HUGE_VALF;
  for (int64_t c = 0; c < chunks; ++c)
    if (partials[c * stride + 1] != 0.0f) top = std::max(top, partials[c * stride]);
  std::fill(out, out + dv, 0.0f);
  if (top == -HUGE_VALF) return;  // nothing to read
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = partials + c * stride;
    if (p[1] == 0.0f) continue;  // an empty chunk
    float weight = Exp(p[0] - top);
    total += weight * p[1];
    for (int64_t e = 0; e < dv; ++e) out[e] += weight * p[2 + e];
  }
  for (int64_t e = 0; e < dv; ++e) out[e] /= total;
}

template <ffi::DataType KV>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<KV> keys,
                           ffi::Buffer<KV> values, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> starts,
                           ffi::Buffer<ffi::S32> ends, ffi::Result<ffi::Buffer<ffi::F32>> out, float scale,
                           float softcap) {
  using T = std::conditional_t<KV == ffi::F32, float, uint16_t>;
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5)
    return ffi::Error::InvalidArgument(
        "dew decode attention: q [B, H, D], keys [L, B, K, T, D], values [L, B, K, T, Dv]");
  int64_t b_rows = qd[0], heads = qd[1], d = qd[2], layers = kd[0], c_rows = kd[1], kv = kd[2], t = kd[3], dv = vd[4];
  if (c_rows < b_rows || kd[4] != d || vd[0] != layers || vd[1] != c_rows || vd[2] != kv || vd[3] != t || kv == 0 ||
      heads % kv != 0 || static_cast<int64_t>(starts.element_count()) != b_rows ||
      static_cast<int64_t>(ends.element_count()) != b_rows)
    return ffi::Error::InvalidArgument("dew decode attention: the shapes of q, keys, values, starts and ends differ");
  if (d % kWidth != 0 || dv % kWidth != 0)
    return ffi::Error::InvalidArgument("dew decode attention: head widths must be multiples of 8");
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("dew decode attention: the layer is outside the cache");
  if (b_rows == 0 || heads == 0) return ffi::Error::Success();
  int64_t group = heads / kv, chunks = std::max<int64_t>(1, (t + kChunk - 1) / kChunk), stride = 2 + dv;
  const float* qp = q.typed_data();
  const T* kp = reinterpret_cast<const T*>(keys.untyped_data()) + l * c_rows * kv * t * d;
  const T* vp = reinterpret_cast<const T*>(values.untyped_data()) + l * c_rows * kv * t * dv;
  const int32_t *sp = starts.typed_data(), *ep = ends.typed_data();
  float* op = out->typed_data();
  // Partials `[B, K, chunks, group, 2 + dv]`, in the calling thread's buffer: every task that writes them
  // has finished before this call returns.
  thread_local std::vector<float> partials;
  partials.resize(static_cast<size_t>(b_rows * kv * chunks * group * stride));
  float* pp = partials.data();
  ForEach(pool, b_rows * kv * chunks, 1, [=](int64_t task) {
    int64_t chunk = task % chunks, bk = task / chunks, bi = bk / kv, kh = bk % kv;
    int64_t lo = std::max<int64_t>(sp[bi], 0), hi = std::min<int64_t>(ep[bi], t);
    int64_t first = std::max(lo, chunk * kChunk), last = std::min(hi, (chunk + 1) * kChunk);
    float* partial = pp + task * group * stride;
    if (first >= last) {
      for (int64_t h = 0; h < group; ++h) partial[h * stride + 1] = 0.0f;  // an empty chunk: no weight
      return;
    }
    thread_local std::vector<float> x;
    x.resize(static_cast<size_t>(group * (kChunk + kWidth)));
    ChunkPartials<T>(qp + (bi * heads + kh * group) * d, kp + (bk * t + first) * d, vp + (bk * t + first) * dv,
                     last - first, d, dv, group, scale, softcap, x.data(), partial);
  });
  ForEach(pool, b_rows * heads, 8, [=](int64_t bh) {
    int64_t bi = bh / heads, h = bh % heads, kh = h / group;
    Combine(pp + ((bi * kv + kh) * chunks * group + h % group) * stride, chunks, group * stride, dv, op + bh * dv);
  });
  return ffi::Error::Success();
}

}  // namespace

#define DEW_DECODE_ATTENTION(name, kv)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, DecodeAttention<kv>, ffi::Ffi::Bind()              \
                                                               .Ctx<ffi::ThreadPool>()   \
                                                               .Arg<ffi::Buffer<ffi::F32>>() \
                                                               .Arg<ffi::Buffer<kv>>()   \
                                                               .Arg<ffi::Buffer<kv>>()   \
                                                               .Arg<ffi::Buffer<ffi::S32>>() \
                                                               .Arg<ffi::Buffer<ffi::S32>>() \
                                                               .Arg<ffi::Buffer<ffi::S32>>() \
                                                               .Ret<ffi::Buffer<ffi::F32>>() \
                                                               .Attr<float>("scale")     \
                                                               .Attr<float>("softcap"));

DEW_DECODE_ATTENTION(DewDecodeAttentionF32, ffi::F32)
DEW_DECODE_ATTENTION(DewDecodeAttentionBF16, ffi::BF16)
DEW_DECODE_ATTENTION(DewDecodeAttentionU16, ffi::U16)  // bfloat16 values held as their bits (dew.nn.kv_cache)

// Python module: handlers() -> {"float32", "bfloat16", "uint16": capsule}, keyed by the cache's dtype.
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"float32", reinterpret_cast<void*>(&DewDecodeAttentionF32)},
                                       {"bfloat16", reinterpret_cast<void*>(&DewDecodeAttentionBF16)},
                                       {"uint16", reinterpret_cast<void*>(&DewDecodeAttentionU16)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by the cache's dtype."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_decode_attention",
                              "Dew's XLA FFI decode attention over each row's filled cache slots.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_decode_attention(void) { return PyModule_Create(&kModule); }
