#include "kernels/half_cpu.h"

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

PYDDP_AVX2_F16C void widenHalf(const c10::Half* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  scalar::widen(src + i, dst + i, n - i);
}

PYDDP_AVX2_F16C void narrowHalf(const float* src, c10::Half* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  scalar::narrow(src + i, dst + i, n - i);
}

// bf16 is the top half of an fp32: widening shifts it into place.
PYDDP_AVX2_F16C void widenBFloat16(const c10::BFloat16* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(bits));
  }
  scalar::widen(src + i, dst + i, n - i);
}

// c10's round_to_nearest_even, 8 at a time: add 0x7fff plus the lowest kept
// bit, keep the top 16 bits; a NaN becomes 0x7fc0.
PYDDP_AVX2_F16C void narrowBFloat16(const float* src, c10::BFloat16* dst, size_t n) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i nan = _mm256_set1_epi32(0x7fc0);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, bias)), 16);
    const __m256 isNan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    top = _mm256_blendv_epi8(top, nan, _mm256_castps_si256(isNan));
    // Every lane holds a value below 2^16: the unsigned pack keeps it.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top),
                                            _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), packed);
  }
  scalar::narrow(src + i, dst + i, n - i);
}

#undef PYDDP_AVX2_F16C

} // namespace

bool vectorHalfConversions() {
  static const bool vector = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return vector;
}

void widen(const c10::Half* src, float* dst, size_t n) {
  vectorHalfConversions() ? widenHalf(src, dst, n) : scalar::widen(src, dst, n);
}
void widen(const c10::BFloat16* src, float* dst, size_t n) {
  vectorHalfConversions() ? widenBFloat16(src, dst, n) : scalar::widen(src, dst, n);
}
void narrow(const float* src, c10::Half* dst, size_t n) {
  vectorHalfConversions() ? narrowHalf(src, dst, n) : scalar::narrow(src, dst, n);
}
void narrow(const float* src, c10::BFloat16* dst, size_t n) {
  vectorHalfConversions() ? narrowBFloat16(src, dst, n) : scalar::narrow(src, dst, n);
}

#else

bool vectorHalfConversions() { return false; }

void widen(const c10::Half* src, float* dst, size_t n) { scalar::widen(src, dst, n); }
void widen(const c10::BFloat16* src, float* dst, size_t n) { scalar::widen(src, dst, n); }
void narrow(const float* src, c10::Half* dst, size_t n) { scalar::narrow(src, dst, n); }
void narrow(const float* src, c10::BFloat16* dst, size_t n) { scalar::narrow(src, dst, n); }

#endif

} // namespace kernels
} // namespace pyddp
