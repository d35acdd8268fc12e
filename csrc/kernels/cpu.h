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

// dst = a op b, finished (AVG divides) only when `finish` is true: partial
// results travelling through a ring stay undivided.
void reduce2(const ReduceSpec& spec, bool finish, void* dst, const void* a,
             const void* b, size_t count);
// dst0 = dst1 = finish(a op b).
void reduce2Dual(const ReduceSpec& spec, void* dst0, void* dst1, const void* a,
                 const void* b, size_t count);
// dst = finish(src[0] op ... op src[nsrc-1]), in source order.
void reduceN(const ReduceSpec& spec, void* dst, const void* const* src,
             int nsrc, size_t count);

} // namespace kernels
} // namespace pyddp
