// Host-side dtype x operator dispatch shared by the CPU kernels (cpu.cpp)
// and the grid kernels (grid_launch.h), so both accept and refuse the same
// specs and finish AVG the same way.
#pragma once

#include "common/check.h"
#include "kernels/cpu.h"
#include "kernels/reduce.h"

namespace pyddp {
namespace kernels {

// The final step for T: AVG divides by the world size, in acc_t<T>.
template <typename T>
Finish<acc_t<T>> finishFor(const ReduceSpec& spec) {
  using A = acc_t<T>;
  return Finish<A>{spec.op == RedOp::Avg ? static_cast<A>(spec.worldSize) : A(0)};
}

// Calls body(T{}, Op{}) for the spec's element type and operator.
template <typename Body>
void dispatch(const ReduceSpec& spec, Body&& body) {
  PYDDP_CHECK(
      spec.op != RedOp::Avg || isFloating(spec.dtype),
      "AVG reduction on integer dtype ", toString(spec.dtype));
  PYDDP_CHECK(!isBitwise(spec.op) || !isFloating(spec.dtype), toString(spec.op),
              " reduction on floating dtype ", toString(spec.dtype));
  dispatchType(spec.dtype, [&](auto t) {
    dispatchOp(spec.op, [&](auto op) { body(t, op); });
  });
}

} // namespace kernels
} // namespace pyddp
