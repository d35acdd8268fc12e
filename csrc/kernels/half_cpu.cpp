#include "kernels/half_cpu.h"

#include <type_traits>

#include "kernels/reduce.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYDDP_X86 1
#endif

namespace pyddp {
namespace kernels {
namespace scalar {

template <typename H>
void widenScalar(const H* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <typename H>
void narrowScalar(const float* src, H* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = static_cast<H>(src[i]);
}

void widen(const c10::Half* src, float* dst, size_t n) { widenScalar(src, dst, n); }
void widen(const c10::BFloat16* src, float* dst, size_t n) { widenScalar(src, dst, n); }
void narrow(const float* src, c10::Half* dst, size_t n) { narrowScalar(src, dst, n); }
void narrow(const float* src, c10::BFloat16* dst, size_t n) { narrowScalar(src, dst, n); }

} // namespace scalar

#ifdef PYDDP_X86
namespace {

// Elements per vector step: 8 fp32 in a 256-bit register, 8 halves in 128.
constexpr size_t kLanes = 8;

#define PYDDP_AVX2_F16C __attribute__((target("avx2,f16c")))

// 8 elements as fp32, exact.
PYDDP_AVX2_F16C inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
PYDDP_AVX2_F16C inline __m256 load8(const c10::Half* src) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}
// bf16 is the top half of an fp32: widening shifts it into place.
PYDDP_AVX2_F16C inline __m256 load8(const c10::BFloat16* src) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 fp32 rounded to nearest even, as the half type's bits.
PYDDP_AVX2_F16C inline __m128i round8(__m256 x, const c10::Half*) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}
// c10's round_to_nearest_even, 8 at a time: add 0x7fff plus the lowest kept
// bit, keep the top 16 bits; a NaN becomes 0x7fc0. The bf16 bits end in the
// low half of each 32-bit lane, so an unsigned pack of two results keeps them.
PYDDP_AVX2_F16C inline __m256i roundToBf16Lanes(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 isNan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(isNan));
}
PYDDP_AVX2_F16C inline __m128i round8(__m256 x, const c10::BFloat16*) {
  const __m256i top = roundToBf16Lanes(x);
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

// 16 bf16 at a time, in a lane order of their own. Unpacking 16 bf16 with
// zeros below them widens elements 0-3 and 8-11 into one register's fp32
// lanes and 4-7 and 12-15 into the other's (both instructions work within
// 128-bit halves); the unsigned pack of the two rounded registers is the
// inverse and restores the order. An elementwise step does not care which
// lane holds which element, so two bf16 operands are widened and narrowed
// without the cross-lane conversions of load8 and round8. The last ring step
// of two bf16 operands (a 2-rank all_reduce's whole reduction), 16,384
// elements in L1: 0.33-0.35 -> 0.25 ns per element; 2 ranks, all_reduce
// 1-64 MiB, bfloat16 against float32's bandwidth: 0.55-0.84x -> 0.74-1.01x
// (benchmarks/studies/half-types.md).
struct Bf16x16 {
  __m256 a, b;
};
PYDDP_AVX2_F16C inline Bf16x16 load16(const c10::BFloat16* src) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h)),
          _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h))};
}
PYDDP_AVX2_F16C inline __m256i round16(__m256 a, __m256 b) {
  return _mm256_packus_epi32(roundToBf16Lanes(a), roundToBf16Lanes(b));
}

template <typename H>
PYDDP_AVX2_F16C void widenVector(const H* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(dst + i, load8(src + i));
  scalar::widen(src + i, dst + i, n - i);
}

template <typename H>
PYDDP_AVX2_F16C void narrowVector(const float* src, H* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), round8(_mm256_loadu_ps(src + i), dst));
  }
  scalar::narrow(src + i, dst + i, n - i);
}

// reduce.h's operators on 8 lanes, with the same results: MIN and MAX
// return the first NaN operand, as MinOp and MaxOp do. The bitwise operators
// have no lanes: half types never reduce bitwise (refused before any kernel).
template <typename Op>
constexpr bool kLaneOp = std::is_same_v<Op, SumOp> || std::is_same_v<Op, ProdOp> ||
    std::is_same_v<Op, MinOp> || std::is_same_v<Op, MaxOp>;

template <typename Op>
PYDDP_AVX2_F16C inline __m256 combine8(__m256 a, __m256 b) {
  if constexpr (std::is_same_v<Op, SumOp>) {
    return _mm256_add_ps(a, b);
  } else if constexpr (std::is_same_v<Op, ProdOp>) {
    return _mm256_mul_ps(a, b);
  } else {
    static_assert(std::is_same_v<Op, MinOp> || std::is_same_v<Op, MaxOp>);
    // MinOp: b < a ? b : a; MaxOp: a < b ? b : a.
    const __m256 takeB = std::is_same_v<Op, MinOp> ? _mm256_cmp_ps(b, a, _CMP_LT_OQ)
                                                   : _mm256_cmp_ps(a, b, _CMP_LT_OQ);
    const __m256 picked = _mm256_blendv_ps(a, b, takeB);
    const __m256 withB = _mm256_blendv_ps(picked, b, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    return _mm256_blendv_ps(withB, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
}

// One pass over 8 lanes at a time: both operands widened, combined (and for
// the last hop finished and narrowed) in registers. The tile loops of
// cpu.cpp make four passes over L1 for the same work.
template <typename Op, typename In, typename H>
PYDDP_AVX2_F16C size_t partialPass(float* dst, const In* in, const H* local, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm256_storeu_ps(dst + i, combine8<Op>(load8(in + i), load8(local + i)));
  }
  return i;
}

template <typename Op, typename In, typename H>
PYDDP_AVX2_F16C size_t finalPass(H* dst, H* dst2, const In* in, const H* local, size_t n,
                                 float divisor) {
  const __m256 div = _mm256_set1_ps(divisor);
  size_t i = 0;
  if constexpr (std::is_same_v<In, c10::BFloat16> && std::is_same_v<H, c10::BFloat16>) {
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      const Bf16x16 x = load16(in + i), y = load16(local + i);
      __m256 a = combine8<Op>(x.a, y.a), b = combine8<Op>(x.b, y.b);
      if (divisor != 0.0f) {
        a = _mm256_div_ps(a, div);
        b = _mm256_div_ps(b, div);
      }
      const __m256i h = round16(a, b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
      if (dst2 != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst2 + i), h);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    __m256 v = combine8<Op>(load8(in + i), load8(local + i));
    if (divisor != 0.0f) v = _mm256_div_ps(v, div);
    const __m128i h = round8(v, dst);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    if (dst2 != nullptr) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst2 + i), h);
  }
  return i;
}

#undef PYDDP_AVX2_F16C

template <typename H>
size_t reducePartialVector(RedOp op, float* dst, const void* in, Incoming incoming,
                           const H* local, size_t n) {
  if (!vectorHalfConversions()) return 0;
  size_t done = 0;
  dispatchOp(op, [&](auto o) {
    using Op = decltype(o);
    if constexpr (kLaneOp<Op>) {
      done = incoming == Incoming::Elements
                 ? partialPass<Op>(dst, static_cast<const H*>(in), local, n)
                 : partialPass<Op>(dst, static_cast<const float*>(in), local, n);
    }
  });
  return done;
}

template <typename H>
size_t reduceFinalVector(RedOp op, float divisor, H* dst, H* dst2, const void* in,
                         Incoming incoming, const H* local, size_t n) {
  if (!vectorHalfConversions()) return 0;
  size_t done = 0;
  dispatchOp(op, [&](auto o) {
    using Op = decltype(o);
    if constexpr (kLaneOp<Op>) {
      done = incoming == Incoming::Elements
                 ? finalPass<Op>(dst, dst2, static_cast<const H*>(in), local, n, divisor)
                 : finalPass<Op>(dst, dst2, static_cast<const float*>(in), local, n, divisor);
    }
  });
  return done;
}

} // namespace

bool vectorHalfConversions() {
  static const bool vector = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return vector;
}

void widen(const c10::Half* src, float* dst, size_t n) {
  vectorHalfConversions() ? widenVector(src, dst, n) : scalar::widen(src, dst, n);
}
void widen(const c10::BFloat16* src, float* dst, size_t n) {
  vectorHalfConversions() ? widenVector(src, dst, n) : scalar::widen(src, dst, n);
}
void narrow(const float* src, c10::Half* dst, size_t n) {
  vectorHalfConversions() ? narrowVector(src, dst, n) : scalar::narrow(src, dst, n);
}
void narrow(const float* src, c10::BFloat16* dst, size_t n) {
  vectorHalfConversions() ? narrowVector(src, dst, n) : scalar::narrow(src, dst, n);
}

size_t reducePartialVector(RedOp op, float* dst, const void* in, Incoming incoming,
                           const c10::Half* local, size_t n) {
  return reducePartialVector<c10::Half>(op, dst, in, incoming, local, n);
}
size_t reducePartialVector(RedOp op, float* dst, const void* in, Incoming incoming,
                           const c10::BFloat16* local, size_t n) {
  return reducePartialVector<c10::BFloat16>(op, dst, in, incoming, local, n);
}
size_t reduceFinalVector(RedOp op, float divisor, c10::Half* dst, c10::Half* dst2,
                         const void* in, Incoming incoming, const c10::Half* local, size_t n) {
  return reduceFinalVector<c10::Half>(op, divisor, dst, dst2, in, incoming, local, n);
}
size_t reduceFinalVector(RedOp op, float divisor, c10::BFloat16* dst, c10::BFloat16* dst2,
                         const void* in, Incoming incoming, const c10::BFloat16* local,
                         size_t n) {
  return reduceFinalVector<c10::BFloat16>(op, divisor, dst, dst2, in, incoming, local, n);
}

#else

bool vectorHalfConversions() { return false; }

void widen(const c10::Half* src, float* dst, size_t n) { scalar::widen(src, dst, n); }
void widen(const c10::BFloat16* src, float* dst, size_t n) { scalar::widen(src, dst, n); }
void narrow(const float* src, c10::Half* dst, size_t n) { scalar::narrow(src, dst, n); }
void narrow(const float* src, c10::BFloat16* dst, size_t n) { scalar::narrow(src, dst, n); }

size_t reducePartialVector(RedOp, float*, const void*, Incoming, const c10::Half*, size_t) {
  return 0;
}
size_t reducePartialVector(RedOp, float*, const void*, Incoming, const c10::BFloat16*, size_t) {
  return 0;
}
size_t reduceFinalVector(RedOp, float, c10::Half*, c10::Half*, const void*, Incoming,
                         const c10::Half*, size_t) {
  return 0;
}
size_t reduceFinalVector(RedOp, float, c10::BFloat16*, c10::BFloat16*, const void*, Incoming,
                         const c10::BFloat16*, size_t) {
  return 0;
}

#endif

} // namespace kernels
} // namespace pyddp
