// The grid kernels of elementwise.h run on the CPU over an emulated 1-D grid:
// the same host-side choices (grid_launch.h) and the same bodies as the CUDA
// kernels of cuda.h, with a loop over blocks and threads in place of the
// GPU. For the CPU test suite; compiled in every build.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu.h"

namespace pyddp {
namespace kernels {
namespace emulated {

struct Grid {
  uint32_t blocks;
  uint32_t threads;
};

// What a call launched, so tests can check that the vector path was taken
// where the operands allow it: width = elements per pack (0 when nothing
// was launched), head = scalar elements before the first pack.
struct Launched {
  int width = 0;
  size_t head = 0;
  size_t packs = 0;
};

// As the functions of the same names in cuda.h.
Launched toPartial(const Grid& grid, const ReduceSpec& spec, void* dst, const void* src,
                   size_t count);
Launched reducePartial(const Grid& grid, const ReduceSpec& spec, void* dst, const void* partial,
                       const void* local, size_t count);
Launched reduceFinal(const Grid& grid, const ReduceSpec& spec, void* dst, void* dst2,
                     const void* partial, const void* local, size_t count);
Launched reduceN(const Grid& grid, const ReduceSpec& spec, void* dst, const void* const* src,
                 int nsrc, size_t count);
Launched copy(const Grid& grid, void* dst, void* dst2, const void* src, size_t bytes);

} // namespace emulated
} // namespace kernels
} // namespace pyddp
