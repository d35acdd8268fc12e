// Conversions between the half types (fp16, bf16) and fp32, many elements
// at a time, for the CPU kernels: a half type's reduction widens a tile of
// each operand to fp32, reduces it as fp32 and narrows the result once
// (cpu.cpp), as reduce.h's rules say; its ring steps do the same in vector
// registers, one pass each, where the CPU can.
//
// On x86 CPUs with AVX2 and F16C the conversions are vector instructions,
// 8 elements at a time; elsewhere they are c10's scalar conversions. Both
// round to nearest even and give the same bits for every value but a NaN's
// payload (tests/unit/test_cpu_kernels.py sweeps every half value and the
// rounding cases of both). c10's scalar conversions made an fp16 all_reduce
// of 64 MiB on 2 ranks 9x slower than an fp32 one of the same bytes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>

#include "kernels/cpu.h"

namespace pyddp {
namespace kernels {

// dst[i] = src[i] as fp32 (exact).
void widen(const c10::Half* src, float* dst, size_t n);
void widen(const c10::BFloat16* src, float* dst, size_t n);
// dst[i] = src[i] rounded to nearest even.
void narrow(const float* src, c10::Half* dst, size_t n);
void narrow(const float* src, c10::BFloat16* dst, size_t n);

// Whether this CPU takes the vector conversions.
bool vectorHalfConversions();

// cpu.cpp's reducePartial and reduceFinal for a half type in one vector pass
// over the longest run of whole vectors: each operand widened, combined,
// and for the final step finished (divided by `divisor` unless it is 0) and
// narrowed, in registers. They return how many leading elements they did
// (0 without the vector conversions); the tile loops do the rest. AVG comes
// as Sum with its divisor. With the tiles alone a half type's ring step
// cost more than its bytes: 2 ranks, all_reduce, 1 to 64 MiB, bfloat16 and
// float16 reached 0.46-0.54x float32's bandwidth, and 0.75-1.05x with these
// passes (benchmarks/studies/half-types.md).
size_t reducePartialVector(RedOp op, float* dst, const void* in, Incoming incoming,
                           const c10::Half* local, size_t n);
size_t reducePartialVector(RedOp op, float* dst, const void* in, Incoming incoming,
                           const c10::BFloat16* local, size_t n);
size_t reduceFinalVector(RedOp op, float divisor, c10::Half* dst, c10::Half* dst2,
                         const void* in, Incoming incoming, const c10::Half* local, size_t n);
size_t reduceFinalVector(RedOp op, float divisor, c10::BFloat16* dst, c10::BFloat16* dst2,
                         const void* in, Incoming incoming, const c10::BFloat16* local,
                         size_t n);

// The scalar conversions alone, whatever the CPU: what the vector ones must
// equal (tests).
namespace scalar {
void widen(const c10::Half* src, float* dst, size_t n);
void widen(const c10::BFloat16* src, float* dst, size_t n);
void narrow(const float* src, c10::Half* dst, size_t n);
void narrow(const float* src, c10::BFloat16* dst, size_t n);
} // namespace scalar

} // namespace kernels
} // namespace pyddp
