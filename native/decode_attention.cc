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
// each (row, key/value head, chunk) with slots to read is one task, which scores the chunk for the
// H / K query heads sharing that key/value head (every key and value is read from memory once), and
// keeps the chunk's maximum, its sum of exponentials and its weighted values. The task that finishes a
// (row, key/value head)'s last chunk combines its chunks in order, each rescaled by exp(its maximum -
// the row's). The chunking is fixed, so the result does not depend on the number of threads.
//
// A decode step reads each row's few thousand bytes of keys and values once, so the AVX-512 body
// widens bfloat16 with two integer operations for 32 elements, keeps the dots and weighted sums of up
// to 4 query heads in registers, and asks for the cache lines ahead of use (kAhead).
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"
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

// A chunk's work: `n` key slots for `g` query heads, `q` `[g, d]`, keys `[n, d]`, values `[n, dv]`.
// `partial` gets, per query head, its largest logit, the sum of exp(logit - largest) and the values
// weighted by those exponentials, `[g, 2 + dv]`. `x` is scratch of `g * round_up(n, kWidth)` floats and
// `q_scratch` of `g * d`. `d` and `dv` are multiples of kWidth.
struct Chunk {
  const float* q;
  const void* k;
  const void* v;
  int64_t n, d, dv, g;
  float scale, softcap;
  float* x;
  float* q_scratch;
  float* partial;
};

// The logits `xh[0, n)` (raw dot products) scaled and capped, then replaced by exp(logit - largest); the
// padding up to `padded` becomes 0. Returns (largest, sum of the exponentials).
[[gnu::always_inline]] inline std::pair<float, float> Exponentials(float* xh, int64_t n, int64_t padded, float scale,
                                                                   float softcap) {
  for (int64_t j = 0; j < padded; j += kWidth) Store(xh + j, Load(xh + j) * scale);
  if (softcap > 0.0f)
    for (int64_t j = 0; j < n; ++j) xh[j] = softcap * std::tanh(xh[j] / softcap);
  for (int64_t j = n; j < padded; ++j) xh[j] = -HUGE_VALF;  // exp(-inf - top) is 0
  Vec tops = Splat(-HUGE_VALF);
  for (int64_t j = 0; j < padded; j += kWidth) {
    Vec logits = Load(xh + j);
    tops = logits > tops ? logits : tops;
  }
  float top = -HUGE_VALF;
  for (int l = 0; l < kWidth; ++l) top = std::max(top, tops[l]);
  Vec sums = Splat(0.0f);
  for (int64_t j = 0; j < padded; j += kWidth) {
    Vec e = Exp(Load(xh + j) - top);
    Store(xh + j, e);
    sums += e;
  }
  return {top, SumLanes(sums)};
}

// The body for any CPU in GCC's 8-float vectors: each head's dots with 8 keys at a time, then each value
// row read once for all g heads, their weighted sums kept in memory (the first-level cache).
template <typename T>
[[gnu::always_inline]] inline void ChunkVectors(const Chunk& c) {
  const T *k = static_cast<const T*>(c.k), *v = static_cast<const T*>(c.v);
  int64_t n = c.n, d = c.d, dv = c.dv, padded = (n + kWidth - 1) / kWidth * kWidth;
  for (int64_t h = 0; h < c.g; ++h) {
    const float* qh = c.q + h * d;
    float* xh = c.x + h * padded;
    int64_t j = 0;
    for (; j + kWidth <= n; j += kWidth) {
      Vec dots[kWidth] = {};
      for (int64_t e = 0; e < d; e += kWidth) {
        Vec qe = Load(qh + e);
        for (int r = 0; r < kWidth; ++r) dots[r] += qe * LoadFloats(k + (j + r) * d + e);
      }
      Store(xh + j, SumEach(dots));
    }
    for (; j < n; ++j) {
      Vec dot = Splat(0.0f);
      for (int64_t e = 0; e < d; e += kWidth) dot += Load(qh + e) * LoadFloats(k + j * d + e);
      xh[j] = SumLanes(dot);
    }
    auto [top, total] = Exponentials(xh, n, padded, c.scale, c.softcap);
    float* out = c.partial + h * (2 + dv);
    out[0] = top;
    out[1] = total;
    std::fill(out + 2, out + 2 + dv, 0.0f);
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t e = 0; e < dv; e += kWidth) {
      Vec ve = LoadFloats(v + j * dv + e);
      for (int64_t h = 0; h < c.g; ++h) {
        float* acc = c.partial + h * (2 + dv) + 2 + e;
        Store(acc, Load(acc) + Splat(c.x[h * padded + j]) * ve);
      }
    }
  }
}

template <typename T>
void ChunkPortable(const Chunk& c) {
  ChunkVectors<T>(c);
}

#ifdef DEW_X86
template <typename T>
__attribute__((target("avx2,fma"))) void ChunkAvx2(const Chunk& c) {
  ChunkVectors<T>(c);
}

#define DEW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// 32 elements as two vectors of 16 floats: float32 in order, bfloat16 bits as the even elements (each
// 32-bit word's low half shifted up) and the odd ones (its high half, the low half cleared). The query is
// laid out in the same order (QueryOrder), so each product meets its own key element.
template <typename T>
DEW_AVX512 [[gnu::always_inline]] inline void Widen(const T* p, __m512& first, __m512& second) {
  if constexpr (std::is_same_v<T, float>) {
    first = _mm512_loadu_ps(p);
    second = _mm512_loadu_ps(p + 16);
  } else {
    __m512i bits = _mm512_loadu_si512(p);
    first = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    second = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
}

// `g` query heads of `d` floats in Widen's order: for bfloat16 keys each 32 elements become their even
// elements, then their odd ones.
template <typename T>
DEW_AVX512 void QueryOrder(const float* q, int64_t g, int64_t d, float* ordered) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t e = 0; e < g * d; e += 32) {
    __m512 low = _mm512_loadu_ps(q + e), high = _mm512_loadu_ps(q + e + 16);
    if constexpr (!std::is_same_v<T, float>) {
      __m512 evens = _mm512_permutex2var_ps(low, even, high);
      high = _mm512_permutex2var_ps(low, odd, high);
      low = evens;
    }
    _mm512_storeu_ps(ordered + e, low);
    _mm512_storeu_ps(ordered + e + 16, high);
  }
}

// Four 16-lane sums `a[0..3]` as the four floats [sum a0, sum a1, sum a2, sum a3]: pairs interleaved and
// added, then the four 128-bit quarters added, in the same order on every CPU with AVX-512.
DEW_AVX512 [[gnu::always_inline]] inline __m128 SumFour(const __m512* a) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // each 128-bit quarter of `abcd` holds that quarter's sums of a0, a1, a2, a3
  __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
  __m512 halves = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4e));  // quarters 0+2, 1+3
  return _mm_add_ps(_mm512_castps512_ps128(halves), _mm512_extractf32x4_ps(halves, 1));
}

// The dot products of G query heads (`q` in Widen's order) with `n` keys, 4 keys at a time; every key
// and query element is read once a group of 4 keys. `x` `[G, padded]`.
// The cache rows are streams of a few kilobytes each, starting on any page; the hardware prefetcher stops at
// each 4 KiB page, so the keys are asked for kAhead slots ahead, and the values `v` `[n, dv]` of the slots
// being scored, for the weighing that follows.
constexpr int64_t kAhead = 16;

template <typename T>
DEW_AVX512 [[gnu::always_inline]] inline void Prefetch(const T* first, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(first);
  for (int64_t at = 0; at < count * static_cast<int64_t>(sizeof(T)); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
}

template <typename T, int G>
DEW_AVX512 void DotsAvx512(const float* q, const T* k, const T* v, int64_t n, int64_t d, int64_t dv, int64_t padded,
                           float* x) {
  Prefetch(k, std::min(kAhead, n) * d);
  for (int64_t j = 0; j < n; j += 4) {
    if (j + kAhead < n) Prefetch(k + (j + kAhead) * d, std::min<int64_t>(4, n - j - kAhead) * d);
    Prefetch(v + j * dv, std::min<int64_t>(4, n - j) * dv);
    const T* rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = k + std::min(j + r, n - 1) * d;  // past the end: the last key again
    __m512 acc[G][4];
    for (int h = 0; h < G; ++h)
      for (int r = 0; r < 4; ++r) acc[h][r] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 32) {
      __m512 first[4], second[4];
      for (int r = 0; r < 4; ++r) Widen(rows[r] + e, first[r], second[r]);
      for (int h = 0; h < G; ++h) {
        __m512 q_first = _mm512_loadu_ps(q + h * d + e), q_second = _mm512_loadu_ps(q + h * d + e + 16);
        for (int r = 0; r < 4; ++r) {
          acc[h][r] = _mm512_fmadd_ps(first[r], q_first, acc[h][r]);
          acc[h][r] = _mm512_fmadd_ps(second[r], q_second, acc[h][r]);
        }
      }
    }
    float sums[4];
    for (int h = 0; h < G; ++h) {
      _mm_storeu_ps(sums, SumFour(acc[h]));
      std::copy(sums, sums + std::min<int64_t>(4, n - j), x + h * padded + j);
    }
  }
}

// The values `[n, dv]` weighed by G heads' exponentials `x` `[G, padded]`, columns [e, e + 32 * W), each
// head's sums in registers over the n slots; added into `out` `[G, 2 + dv]` at column 2 + e, in order.
template <typename T, int G, int W>
DEW_AVX512 void WeighAvx512(const T* v, const float* x, int64_t n, int64_t dv, int64_t padded, int64_t e, float* out) {
  __m512 acc[G][2 * W];
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < 2 * W; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 parts[2 * W];
    for (int w = 0; w < W; ++w) Widen(v + j * dv + e + 32 * w, parts[2 * w], parts[2 * w + 1]);
    for (int h = 0; h < G; ++h) {
      __m512 p = _mm512_set1_ps(x[h * padded + j]);
      for (int i = 0; i < 2 * W; ++i) acc[h][i] = _mm512_fmadd_ps(parts[i], p, acc[h][i]);
    }
  }
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int h = 0; h < G; ++h) {
    float* at = out + h * (2 + dv) + 2 + e;
    for (int w = 0; w < W; ++w) {
      __m512 first = acc[h][2 * w], second = acc[h][2 * w + 1];
      if constexpr (!std::is_same_v<T, float>) {  // even and odd elements back in order
        __m512 even = first;
        first = _mm512_permutex2var_ps(even, low, second);
        second = _mm512_permutex2var_ps(even, high, second);
      }
      _mm512_storeu_ps(at + 32 * w, first);
      _mm512_storeu_ps(at + 32 * w + 16, second);
    }
  }
}

template <typename T, int G>
DEW_AVX512 void HeadsAvx512(const Chunk& c, const float* q, const T* k, const T* v, float* x, float* partial) {
  int64_t padded = (c.n + kWidth - 1) / kWidth * kWidth;
  DotsAvx512<T, G>(q, k, v, c.n, c.d, c.dv, padded, x);
  for (int h = 0; h < G; ++h) {
    auto [top, total] = Exponentials(x + h * padded, c.n, padded, c.scale, c.softcap);
    partial[h * (2 + c.dv)] = top;
    partial[h * (2 + c.dv) + 1] = total;
  }
  int64_t e = 0;
  for (; e + 64 <= c.dv; e += 64) WeighAvx512<T, G, 2>(v, x, c.n, c.dv, padded, e, partial);
  if (e < c.dv) WeighAvx512<T, G, 1>(v, x, c.n, c.dv, padded, e, partial);
}

// The body for AVX-512, head widths multiples of 32 (others take the AVX2 body): the query heads in
// groups of at most 4, each group's dots and weighted sums held in registers.
template <typename T>
DEW_AVX512 void ChunkAvx512(const Chunk& c) {
  if (c.d % 32 != 0 || c.dv % 32 != 0) return ChunkAvx2<T>(c);
  const T *k = static_cast<const T*>(c.k), *v = static_cast<const T*>(c.v);
  QueryOrder<T>(c.q, c.g, c.d, c.q_scratch);
  int64_t padded = (c.n + kWidth - 1) / kWidth * kWidth;
  for (int64_t h = 0; h < c.g; h += 4) {
    const float* q = c.q_scratch + h * c.d;
    float *x = c.x + h * padded, *partial = c.partial + h * (2 + c.dv);
    switch (std::min<int64_t>(4, c.g - h)) {
      case 1: HeadsAvx512<T, 1>(c, q, k, v, x, partial); break;
      case 2: HeadsAvx512<T, 2>(c, q, k, v, x, partial); break;
      case 3: HeadsAvx512<T, 3>(c, q, k, v, x, partial); break;
      default: HeadsAvx512<T, 4>(c, q, k, v, x, partial); break;
    }
  }
}
#endif  // DEW_X86

// The bodies by instruction set (native/isa.h's order); the one in use is the CPU's best at load unless
// set_isa lowered it.
const Isa g_best_isa = DetectIsa();
std::atomic<int> g_isa{static_cast<int>(g_best_isa)};
template <typename T>
using ChunkBody = void (*)(const Chunk&);
#ifdef DEW_X86
template <typename T>
constexpr ChunkBody<T> kBodies[] = {ChunkPortable<T>, ChunkAvx2<T>, ChunkAvx512<T>};
#else
template <typename T>
constexpr ChunkBody<T> kBodies[] = {ChunkPortable<T>};
#endif

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

// At least this many cache bytes a piece of work: waking a thread costs microseconds.
constexpr int64_t kPieceBytes = 96 << 10;

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
  ChunkBody<T> body = kBodies<T>[g_isa.load(std::memory_order_relaxed)];
  // The tasks, (row, key/value head, chunk) with slots to read, in order; a row's chunks sit together.
  // Partials `[B, K, chunks, group, 2 + dv]`; the task that finishes a (row, key/value head)'s last
  // chunk combines them in chunk order, whichever thread it runs on. All in the calling thread's
  // buffers: every task has finished before this call returns.
  thread_local std::vector<int64_t> tasks;
  thread_local std::vector<float> partials;
  thread_local std::unique_ptr<std::atomic<int32_t>[]> unfinished;
  thread_local int64_t unfinished_size = 0;
  tasks.clear();
  partials.resize(static_cast<size_t>(b_rows * kv * chunks * group * stride));
  if (unfinished_size < b_rows * kv) {
    unfinished.reset(new std::atomic<int32_t>[b_rows * kv]);
    unfinished_size = b_rows * kv;
  }
  int64_t slots = 0;
  for (int64_t bi = 0; bi < b_rows; ++bi) {
    int64_t lo = std::clamp<int64_t>(sp[bi], 0, t), hi = std::clamp<int64_t>(ep[bi], 0, t);
    int64_t first = lo < hi ? lo / kChunk : 0, last = lo < hi ? (hi - 1) / kChunk + 1 : 0;
    for (int64_t kh = 0; kh < kv; ++kh) {
      unfinished[bi * kv + kh].store(static_cast<int32_t>(last - first), std::memory_order_relaxed);
      if (first == last) std::fill(op + (bi * heads + kh * group) * dv, op + (bi * heads + (kh + 1) * group) * dv, 0.0f);
      for (int64_t chunk = first; chunk < last; ++chunk) tasks.push_back((bi * kv + kh) * chunks + chunk);
    }
    slots += std::max<int64_t>(0, hi - lo) * kv;
  }
  if (tasks.empty()) return ffi::Error::Success();
  const int64_t* task_list = tasks.data();
  float* pp = partials.data();
  std::atomic<int32_t>* counts = unfinished.get();
  int64_t task_bytes = std::max<int64_t>(1, slots * (d + dv) * static_cast<int64_t>(sizeof(T)) / tasks.size());
  ForEach(pool, tasks.size(), (kPieceBytes + task_bytes - 1) / task_bytes, [=](int64_t at) {
    int64_t task = task_list[at], chunk = task % chunks, bk = task / chunks, bi = bk / kv, kh = bk % kv;
    int64_t lo = std::clamp<int64_t>(sp[bi], 0, t), hi = std::clamp<int64_t>(ep[bi], 0, t);
    int64_t first = std::max(lo, chunk * kChunk), last = std::min(hi, (chunk + 1) * kChunk);
    thread_local std::vector<float> x, q_scratch;
    x.resize(static_cast<size_t>(group * (kChunk + kWidth)));
    q_scratch.resize(static_cast<size_t>(group * d));
    float* partial = pp + task * group * stride;
    body({qp + (bi * heads + kh * group) * d, kp + (bk * t + first) * d, vp + (bk * t + first) * dv, last - first, d,
          dv, group, scale, softcap, x.data(), q_scratch.data(), partial});
    if (counts[bk].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    int64_t used = (hi - 1) / kChunk + 1 - lo / kChunk;  // this row's chunks with slots, from lo / kChunk on
    const float* row = pp + (bk * chunks + lo / kChunk) * group * stride;
    for (int64_t h = 0; h < group; ++h)
      Combine(row + h * stride, used, group * stride, dv, op + (bi * heads + kh * group + h) * dv);
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

static PyObject* GetIsa(PyObject*, PyObject*) { return dew::GetIsa(g_isa); }

static PyObject* SetIsa(PyObject*, PyObject* args) { return dew::SetIsa(args, g_best_isa, g_isa); }

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by the cache's dtype."},
    {"isa", GetIsa, METH_NOARGS, "The instruction set the bodies use: avx512, avx2 or portable."},
    {"set_isa", SetIsa, METH_VARARGS, "Use the named instruction set (at most the CPU's best), for tests."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_decode_attention",
                              "Dew's XLA FFI decode attention over each row's filled cache slots.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_decode_attention(void) { return PyModule_Create(&kModule); }
