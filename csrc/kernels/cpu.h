// CPU element-wise kernels over raw buffers: the loops around the
// __host__ __device__ bodies in reduce.h.
#pragma once

#include <cstddef>
#include <vector>

#include "common/types.h"

namespace pyddp {
namespace kernels {

// How to combine elements: the operator, the element type, and for AVG the
// world size to divide by in the final step.
struct ReduceSpec {
  DataType dtype;
  RedOp op;
  int worldSize;
};

// Bytes of one partial result: acc_t of the element type (fp32 for half
// types, the element type otherwise).
size_t partialSize(DataType t);

// What the incoming operand of a ring step holds: partial results, or the
// sender's own elements. A ring's first hop carries a rank's elements
// unreduced, which are exact as elements, so a transport may send them at
// the element size (half a half type's partial bytes).
enum class Incoming { Partials, Elements };

// dst (partials) = src (elements), converted: the start of a ring reduction.
void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count);
// dst (partials) = in op local (elements); `in` holds what `incoming` says.
void reducePartial(const ReduceSpec& spec, void* dst, const void* in, Incoming incoming,
                   const void* local, size_t count);
// dst (elements) = finish(in op local); AVG divides here. When dst2 is not
// null it receives the same elements.
void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* in,
                 Incoming incoming, const void* local, size_t count);
// dst = finish(src[0] op ... op src[nsrc-1]), in source order.
void reduceN(const ReduceSpec& spec, void* dst, const void* const* src,
             int nsrc, size_t count);

// The instruction sets the element-wise loops above are compiled for. On
// x86-64 they run with AVX2 where the CPU has it, else with x86-64's
// baseline (SSE2); elsewhere with the baseline. Every loop goes element by
// element with no multiply-add to contract, so both give the same bits
// (ranks on different CPUs agree).
enum class LoopIsa { Baseline, Avx2 };
const char* toString(LoopIsa isa);
// The instruction set the loops use now.
LoopIsa loopIsa();
// Those this CPU can run, the baseline first and the default last.
std::vector<LoopIsa> supportedLoopIsas();
// Tests: the loops use `isa` (one of supportedLoopIsas()) from now on.
void useLoopIsa(LoopIsa isa);

// Whether streamingCopy writes with non-temporal stores on this CPU (x86-64:
// SSE2's, which every x86-64 has); elsewhere it is memcpy.
#if defined(__x86_64__)
constexpr bool kHasStreamingStores = true;
#else
constexpr bool kHasStreamingStores = false;
#endif

// memcpy that writes dst with non-temporal stores: the lines go towards
// memory, not into this core's cache, and leave every other cache. Ordered
// before the caller's next store (a fence ends it), so a flag released
// after it publishes the bytes. dst and src do not overlap.
void streamingCopy(void* dst, const void* src, size_t bytes);

} // namespace kernels
} // namespace pyddp
