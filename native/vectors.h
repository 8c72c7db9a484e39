// What the vector kernels of native/*.cc share: GCC vector types of 8 floats, their loads, the
// exponential, bfloat16 conversions, and the loop that spreads items over XLA's intra-op threads.
#ifndef DEW_NATIVE_VECTORS_H_
#define DEW_NATIVE_VECTORS_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace dew {

// Sums and maxima over a row are kept in kLanes partial results, two `Vec`s of kWidth lanes (GCC's
// vector extension: a register each in the AVX2 and AVX-512 clones of the kernels, two SSE ones in the
// default), so every loop is vector code and every CPU adds in the same order, without letting the
// compiler reorder float arithmetic on its own: GCC leaves scalar loops of this kind scalar, and spills
// a single 16-float vector type to the stack in the AVX2 clone (docs/performance.md).
constexpr int kLanes = 16;
constexpr int kWidth = 8;
typedef float Vec __attribute__((vector_size(4 * kWidth)));
typedef int32_t Ints __attribute__((vector_size(4 * kWidth)));
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

// exp(x) for float32, lane by lane: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-7
// Taylor-like polynomial (the minimax coefficients of Cephes' expf), times 2^n built in the exponent
// bits; n rounds to nearest even by adding and subtracting 1.5 * 2^23. Within 2 ulps of the exact
// result for x in [-87.3, 88.7]; 0 below (XLA's gives a subnormal there, under 1e-38), +inf above, NaN
// for NaN.
constexpr float kExpLowest = -87.33654f;  // below it `Exp` gives exactly 0

template <typename V>
[[gnu::always_inline]] inline V Exp(V x) {
  const float lo = kExpLowest, hi = 88.72283f, round = 12582912.0f;
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
    using Lanes = decltype(x < x);  // int32 lanes as many as V's
    Lanes bits = (__builtin_convertvector(n, Lanes) + 127) << 23;
    result = p * (V)bits;  // the same bits as floats (a vector cast)
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

// `RoundToBf16` of kWidth lanes at once (the same integer steps, lane by lane), stored to `out`.
[[gnu::always_inline]] inline void StoreBf16(uint16_t* out, Vec v) {
  typedef uint32_t Bits __attribute__((vector_size(4 * kWidth)));
  typedef uint16_t Halves __attribute__((vector_size(2 * kWidth)));
  Bits bits = (Bits)v;
  Bits nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  Bits quiet_nan = ((bits >> 16) & 0x8000u) | 0x7fc0u;
  Bits rounded = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest;
  Halves halves = __builtin_convertvector(rounded, Halves);
  std::memcpy(out, &halves, sizeof halves);
}

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// kWidth values as float32, from float32 or bfloat16 bits.
template <typename G>
[[gnu::always_inline]] inline Vec LoadFloats(const G* g) {
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

// Items divide into pieces that XLA's intra-op threads claim (as in native/gemm.cc); shared by pointer,
// since a pool task may start after the call has returned (it then finds nothing to claim).
struct Pieces {
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

// `run(item)` for each of `total` items, in pieces of at least `min_piece` items, a few pieces a
// thread so that one descheduled thread costs little.
inline void ForEach(xla::ffi::ThreadPool pool, int64_t total, int64_t min_piece, std::function<void(int64_t)> run) {
  if (total == 0) return;
  auto work = std::make_shared<Pieces>();
  work->total = total;
  work->run = std::move(run);
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->per_piece = std::max<int64_t>(min_piece, (total + 4 * threads - 1) / (4 * threads));
  work->pieces = (total + work->per_piece - 1) / work->per_piece;
  int64_t helpers = std::min(threads, work->pieces) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Work(); });
  work->Work();
  for (int spins = 0; work->done.load(std::memory_order_acquire) < work->pieces; ++spins) {
    if (spins > 1024) std::this_thread::yield();
  }
}

}  // namespace dew

#endif  // DEW_NATIVE_VECTORS_H_
