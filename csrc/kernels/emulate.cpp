#include "kernels/emulate.h"

#include "common/check.h"
#include "kernels/grid_launch.h"

namespace pyddp {
namespace kernels {
namespace emulated {
namespace {

// Runs every thread of the grid one after another. The bodies share no
// memory between threads and never synchronise, so any interleaving gives
// the same result as a GPU's.
struct Loop {
  Grid shape;
  Launched* launched;

  template <typename F>
  void operator()(const F& f, size_t count, const grid::Split& split) const {
    *launched = Launched{F::kWidth, split.head, split.packs};
    for (uint32_t b = 0; b < shape.blocks; ++b) {
      for (uint32_t t = 0; t < shape.threads; ++t) {
        grid::gridMap(grid::GridPos{b, shape.blocks, t, shape.threads}, f, count, split);
      }
    }
  }
};

Loop loopOver(const Grid& shape, Launched* launched) {
  PYDDP_CHECK_VALUE(shape.blocks >= 1 && shape.threads >= 1, "an emulated grid needs at least ",
                    "one block and one thread, got ", shape.blocks, " x ", shape.threads);
  return Loop{shape, launched};
}

} // namespace

Launched toPartial(const Grid& shape, const ReduceSpec& spec, void* dst, const void* src,
                   size_t count) {
  Launched launched;
  grid::toPartial(spec, dst, src, count, loopOver(shape, &launched));
  return launched;
}

Launched reducePartial(const Grid& shape, const ReduceSpec& spec, void* dst, const void* partial,
                       const void* local, size_t count) {
  Launched launched;
  grid::reducePartial(spec, dst, partial, local, count, loopOver(shape, &launched));
  return launched;
}

Launched reduceFinal(const Grid& shape, const ReduceSpec& spec, void* dst, void* dst2,
                     const void* partial, const void* local, size_t count) {
  Launched launched;
  grid::reduceFinal(spec, dst, dst2, partial, local, count, loopOver(shape, &launched));
  return launched;
}

Launched reduceN(const Grid& shape, const ReduceSpec& spec, void* dst, const void* const* src,
                 int nsrc, size_t count) {
  Launched launched;
  grid::reduceN(spec, dst, src, nsrc, count, loopOver(shape, &launched));
  return launched;
}

Launched copy(const Grid& shape, void* dst, void* dst2, const void* src, size_t bytes) {
  Launched launched;
  grid::copy(dst, dst2, src, bytes, loopOver(shape, &launched));
  return launched;
}

} // namespace emulated
} // namespace kernels
} // namespace pyddp
