// XLA FFI handlers for a prefill's attention over a run's cache, read in place: scores, masked softmax and
// weighted values in one call, float32 or bfloat16.
//
// Queries heads-major `[B, H, S, D]`; keys `[L, C, K, T, D]` and values `[L, C, K, T, Dv]` of a run's cache
// (layer `layer`, rows 0..B-1 of C; bfloat16 as its bits); the mask `[B, S, T]`. A task is one row's key/value
// head and a block of kBlock query rows: the G query heads sharing that key/value head score those rows
// together against the keys between the block's first and last allowed ones (a prefill at an offset reads only
// the filled keys, a fresh one only the keys up to the block's end), each query row's masked softmax is taken
// in float32 over its own first to last allowed keys, its probabilities rounded to the cache's dtype, and the
// values weighted in float32, each tile of rows over the keys its rows read.
//
// The products are float32 fused multiply-adds in AVX-512 (a bfloat16 value widens exactly, and a product of
// two bfloat16 values is exact in float32, so each rounds only the sum, as `vdpbf16ps` would: the same
// roundings, and every AVX-512 CPU runs them, not only those with AVX512_BF16). Keys are transposed into panels of kKeyTile keys, so a query value broadcast
// meets 32 keys at a time, and a probability broadcast meets 16 value columns at a time. What differs from
// `dew.nn.attention.attend` is the order of the sums and the normalizer's reciprocal (a product where
// `attend` divides); a query whose mask allows no key gets zeros.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "module.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace dew;  // Exp and ForEach of vectors.h

constexpr int64_t kBlock = 16;  // query rows a task
constexpr int kKeyTile = 32;    // keys a tile of the scores' panel (two vectors)

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

#ifdef DEW_X86
#define DEW_PREFILL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// 16 values from float32 or bfloat16 bits, as float32.
template <typename E>
DEW_PREFILL_TARGET [[gnu::always_inline]] inline __m512 Load16(const E* x) {
  if constexpr (std::is_same_v<E, float>) {
    return _mm512_loadu_ps(x);
  } else {
    __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
}

// Transposes 16 rows of 16 floats in place: shuffles within 128-bit lanes gather each lane's 4 x 4
// blocks, then shuffles of whole lanes put each column's four blocks together.
DEW_PREFILL_TARGET inline void Transpose16(__m512 r[16]) {
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

// `ScoreTile` and `ValueTile` for a runtime `mr` (at most 8, 4) and `nz` (at most 4).
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

// One query row's probabilities, in place over its scores `p` (padded with finite values to a multiple of 16
// past `n`): the softmax of `scale * s` over the keys its mask row `m` allows, which lie in [first, end), zeros
// elsewhere up to `width`, with `kRound` each rounded to bfloat16 (to nearest even, kept as float32). Masked
// keys' exponentials are zeros outright (as `attend`'s are wherever a row allows a key); no fused
// multiply-adds, so the exponential's bits are the softmax kernel's.
template <bool kRound>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), optimize("fp-contract=off")))
void ProbabilityRow(float* p, const bool* m, int64_t n, int64_t first, int64_t end, int64_t width, float scale) {
  int64_t from = first & ~int64_t{15}, to = (end + 15) & ~int64_t{15};
  std::fill(p, p + from, 0.0f);
  std::fill(p + to, p + width, 0.0f);
  auto allowed = [&](int64_t j) {  // the mask's lanes, none read past the row's n keys
    __mmask16 inside = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    __m128i bytes = _mm_maskz_loadu_epi8(inside, m + j);
    return _mm_test_epi8_mask(bytes, bytes);
  };
  const __m512 scales = _mm512_set1_ps(scale);
  __m512 tops = _mm512_set1_ps(-HUGE_VALF);
  for (int64_t j = from; j < to; j += 16)
    tops = _mm512_mask_max_ps(tops, allowed(j), tops, _mm512_mul_ps(_mm512_loadu_ps(p + j), scales));
  __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(tops)), sums = _mm512_setzero_ps();
  for (int64_t j = from; j < to; j += 16) {
    __m512 e = _mm512_maskz_mov_ps(allowed(j), Exp(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + j), scales), top)));
    sums = _mm512_add_ps(sums, e);
    _mm512_storeu_ps(p + j, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums));
  for (int64_t j = from; j < to; j += 16) {
    __m512 probs = _mm512_mul_ps(_mm512_loadu_ps(p + j), inverse);
    if constexpr (kRound) {  // probabilities are finite: no NaN to keep
      __m512i bits = _mm512_castps_si512(probs);
      __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      bits = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
      probs = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(int32_t(0xffff0000u))));
    }
    _mm512_storeu_ps(p + j, probs);
  }
}

// 16 float32 results stored as float32 or rounded to bfloat16 bits (`RoundToBf16`'s steps, lane by lane).
template <typename Q>
DEW_PREFILL_TARGET [[gnu::always_inline]] inline void Store16(Q* out, __m512 x) {
  if constexpr (std::is_same_v<Q, float>) {
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

struct Shape {
  int64_t b, h, s, d, layers, c, k, t, dv, blocks;
};

// One task: row `bi`'s key/value head `kh`, query rows [start, start + rows) (at most kBlock), whose mask rows
// it scans for their first and last allowed keys (each task of the block scans them again: a few microseconds,
// where one more pass over the threads would cost more). Q is float (float32 queries over a float32
// cache) or uint16_t (bfloat16 bits over a bfloat16 cache, widened).
template <typename Q>
DEW_PREFILL_TARGET void Task(const Shape& a, const Q* qp, const Q* kp, const Q* vp, int64_t layer, const bool* mp,
                             Q* op, float scale, int64_t bi, int64_t kh, int64_t start, int64_t rows) {
  constexpr bool kWiden = !std::is_same_v<Q, float>;
  int32_t ranges[2 * kBlock];  // each query row's first and last allowed key (first > last: none)
  for (int64_t r = 0; r < rows; ++r) MaskRange(mp + (bi * a.s + start + r) * a.t, a.t, ranges + 2 * r);
  int64_t group = a.h / a.k, gr = group * rows, lo = a.t, hi = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* range = ranges + 2 * r;
    if (range[0] <= range[1]) lo = std::min<int64_t>(lo, range[0]), hi = std::max<int64_t>(hi, range[1] + 1);
  }
  auto out_row = [&](int64_t i) { return op + ((bi * a.s + start + i % rows) * a.h + kh * group + i / rows) * a.dv; };
  if (hi <= lo) {  // no query of the block reads a key: zeros
    for (int64_t i = 0; i < gr; ++i)
      for (int64_t z = 0; z < a.dv; z += 16) Store16(out_row(i) + z, _mm512_setzero_ps());
    return;
  }
  int64_t n = hi - lo, tiles = (n + kKeyTile - 1) / kKeyTile, width = tiles * kKeyTile;
  thread_local std::vector<float> queries, panel, scores, widened, outs;
  thread_local std::vector<int64_t> spans;  // each query row's allowed keys [first, last + 1) from lo
  queries.resize(static_cast<size_t>(gr * a.d));
  panel.resize(static_cast<size_t>(width * a.d));
  scores.resize(static_cast<size_t>(gr * width));
  outs.resize(static_cast<size_t>(gr * a.dv));
  spans.resize(static_cast<size_t>(2 * gr));
  // The block's queries as float32 `[G * rows, D]`, head by head.
  for (int64_t i = 0; i < gr; ++i) {
    const Q* row = qp + ((bi * a.h + kh * group + i / rows) * a.s + start + i % rows) * a.d;
    for (int64_t x = 0; x < a.d; x += 16) _mm512_storeu_ps(queries.data() + i * a.d + x, Load16(row + x));
  }
  // The keys [lo, hi) transposed into tiles `[tiles][D][kKeyTile]` (keys past `hi` as zeros).
  int64_t head = ((layer * a.c + bi) * a.k + kh) * a.t;
  const Q* keys = kp + (head + lo) * a.d;
  for (int64_t t0 = 0; t0 < width; t0 += 16) {
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
                panel.data() + tile * a.d * kKeyTile, scores.data() + i * width + tile * kKeyTile, width);
  // Each query row's probabilities over its own allowed keys, a row that reads nothing weighing nothing.
  for (int64_t i = 0; i < gr; ++i) {
    const int32_t* range = ranges + 2 * (i % rows);
    int64_t first = range[0] <= range[1] ? range[0] - lo : 0, end = range[0] <= range[1] ? range[1] + 1 - lo : 0;
    spans[2 * i] = first, spans[2 * i + 1] = end;
    ProbabilityRow<kWiden>(scores.data() + i * width, mp + (bi * a.s + start + i % rows) * a.t + lo, n, first, end,
                           width, scale);
  }
  // The values [lo, hi) as float32, in place for a float32 cache.
  const float* values;
  if constexpr (kWiden) {
    widened.resize(static_cast<size_t>(n * a.dv));
    const Q* source = vp + (head + lo) * a.dv;
    for (int64_t j = 0; j < n * a.dv; j += 16) _mm512_storeu_ps(widened.data() + j, Load16(source + j));
    values = widened.data();
  } else {
    values = vp + (head + lo) * a.dv;
  }
  for (int64_t i = 0; i < gr; i += 4) {
    int64_t mr = std::min<int64_t>(4, gr - i), first = n, end = 0;  // the keys any of the tile's rows reads
    for (int64_t r = i; r < i + mr; ++r)
      if (spans[2 * r] < spans[2 * r + 1]) first = std::min(first, spans[2 * r]), end = std::max(end, spans[2 * r + 1]);
    first = std::min(first, end);
    for (int64_t z = 0; z < a.dv; z += 64)
      ValueRows(static_cast<int>(mr), static_cast<int>(std::min<int64_t>(4, (a.dv - z) / 16)),
                scores.data() + i * width + first, width, values + first * a.dv + z, a.dv, end - first,
                outs.data() + i * a.dv + z);
  }
  for (int64_t i = 0; i < gr; ++i)
    for (int64_t z = 0; z < a.dv; z += 16) Store16(out_row(i) + z, _mm512_loadu_ps(outs.data() + i * a.dv + z));
}
#endif

// Whether this CPU runs the kernel: AVX-512 (F, BW, VL, DQ).
bool Supported() {
#ifdef DEW_X86
  static const bool avx512 = DetectIsa() == kAvx512 && __builtin_cpu_supports("avx512dq");
  return avx512;
#else
  return false;
#endif
}

// `run(task)` for each of `total` tasks, claimed one at a time by the caller and XLA's threads: a task takes tens
// of microseconds and the tasks differ in size, so single claims keep every thread busy to the end, even
// where one is preempted while the others finish.
void ForEachTask(ffi::ThreadPool pool, int64_t total, std::function<void(int64_t)> run) {
  if (total == 0) return;
  auto work = std::make_shared<Pieces>();
  work->total = work->pieces = total;
  work->per_piece = 1;
  work->run = std::move(run);
  int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), total) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Work(); });
  work->Work();
  WaitForPieces(work->done, work->pieces);
}

// DType is the queries' and the result's, CType the cache's (F32, or U16 holding bfloat16 bits).
template <ffi::DataType DType, ffi::DataType CType>
ffi::Error PrefillAttention(ffi::ThreadPool pool, ffi::Buffer<DType> q, ffi::Buffer<CType> keys,
                            ffi::Buffer<CType> values, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::PRED> mask,
                            ffi::Result<ffi::Buffer<DType>> out, float scale) {
  if (!Supported()) return ffi::Error::InvalidArgument("dew prefill attention: this CPU lacks AVX-512");
  auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || md.size() != 3)
    return ffi::Error::InvalidArgument(
        "dew prefill attention: q [B, H, S, D], keys [L, C, K, T, D], values [L, C, K, T, Dv], mask [B, S, T]");
  Shape a{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], kd[3], vd[4], 0};
  if (kd[4] != a.d || vd[0] != a.layers || vd[1] != a.c || vd[2] != a.k || vd[3] != a.t || a.c < a.b || a.k == 0 ||
      a.h % a.k != 0 || a.d % 16 != 0 || a.dv % 16 != 0 || md[0] != a.b || md[1] != a.s || md[2] != a.t)
    return ffi::Error::InvalidArgument("dew prefill attention: q, keys, values and mask shapes do not agree");
  int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= a.layers) return ffi::Error::InvalidArgument("dew prefill attention: the layer is outside the cache");
  if (a.s == 0 || a.b == 0 || a.h == 0) return ffi::Error::Success();
#ifdef DEW_X86
  using Q = std::conditional_t<DType == ffi::F32, float, uint16_t>;
  const Q* qp = reinterpret_cast<const Q*>(q.untyped_data());
  const Q* kp = reinterpret_cast<const Q*>(keys.untyped_data());
  const Q* vp = reinterpret_cast<const Q*>(values.untyped_data());
  const bool* mp = mask.typed_data();
  Q* op = reinterpret_cast<Q*>(out->untyped_data());
  a.blocks = (a.s + kBlock - 1) / kBlock;
  int64_t heads = a.b * a.k;
  // Tasks (block, row, key/value head), the last blocks (the most keys, in a causal pass) first.
  ForEachTask(pool, heads * a.blocks, [=](int64_t task) {
    int64_t blk = a.blocks - 1 - task / heads, bi = task % heads / a.k, kh = task % a.k;
    int64_t start = blk * kBlock, rows = std::min(kBlock, a.s - start);
    Task<Q>(a, qp, kp, vp, l, mp, op, scale, bi, kh, start, rows);
  });
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument("dew prefill attention: x86-64 only; use dew.nn.attention.attend");
#endif
}

}  // namespace

#define DEW_PREFILL_HANDLER(name, dtype, cache)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (PrefillAttention<dtype, cache>),                   \
                                ffi::Ffi::Bind()                                          \
                                    .Ctx<ffi::ThreadPool>()                               \
                                    .Arg<ffi::Buffer<dtype>>()                            \
                                    .Arg<ffi::Buffer<cache>>()                            \
                                    .Arg<ffi::Buffer<cache>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                         \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                        \
                                    .Ret<ffi::Buffer<dtype>>()                            \
                                    .Attr<float>("scale"));
DEW_PREFILL_HANDLER(DewPrefillAttentionF32, ffi::F32, ffi::F32)
DEW_PREFILL_HANDLER(DewPrefillAttentionBF16, ffi::BF16, ffi::U16)

// Python module: handlers() -> {"f32", "bf16": capsule}; supported() whether this CPU runs the kernel.
static PyObject* Handlers(PyObject*, PyObject*) {
  const dew::HandlerEntry entries[] = {{"f32", reinterpret_cast<void*>(&DewPrefillAttentionF32)},
                                       {"bf16", reinterpret_cast<void*>(&DewPrefillAttentionBF16)}};
  return dew::HandlerDict(entries, sizeof entries / sizeof entries[0]);
}

static PyObject* IsSupported(PyObject*, PyObject*) { return PyBool_FromLong(Supported()); }

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "The XLA FFI handlers, as capsules keyed by dtype."},
    {"supported", IsSupported, METH_NOARGS, "Whether this CPU runs the kernel (AVX-512)."},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_prefill_attention",
                              "Dew's XLA FFI attention of a prefill over its cache.", -1, kMethods};

PyMODINIT_FUNC PyInit__native_prefill_attention(void) { return PyModule_Create(&kModule); }
