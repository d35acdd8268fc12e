// CPU element-wise kernels over raw buffers: the loops around the
// __host__ __device__ bodies in reduce.h.
#pragma once

#include <cstddef>

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

// dst (partials) = src (elements), converted: the start of a ring reduction.
void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count);
// dst (partials) = partial op local (elements).
void reducePartial(const ReduceSpec& spec, void* dst, const void* partial,
                   const void* local, size_t count);
// dst (elements) = finish(partial op local); AVG divides here. When dst2 is
// not null it receives the same elements.
void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* partial,
                 const void* local, size_t count);
// dst = finish(src[0] op ... op src[nsrc-1]), in source order.
void reduceN(const ReduceSpec& spec, void* dst, const void* const* src,
             int nsrc, size_t count);

} // namespace kernels
} // namespace pyddp
