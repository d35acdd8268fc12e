// Host side of the grid kernels, shared by the CUDA launchers (cuda.cu) and
// the emulated grid (emulate.cpp): checks a call, builds the body of
// elementwise.h for its dtype and operator, chooses the split from the
// operands' addresses, and hands (body, count, split) to `launch`, which runs
// gridMap over some grid. Nothing is launched for zero elements.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/check.h"
#include "kernels/cpu.h"
#include "kernels/dispatch.h"
#include "kernels/elementwise.h"

namespace pyddp {
namespace kernels {
namespace grid {

// The split for body f over count elements (elementwise.h's alignedSplit),
// once every operand is checked to be aligned to its elements.
template <typename F>
Split planSplit(const F& f, size_t count) {
  f.forEachOperand([&](const void* p, size_t size) {
    PYDDP_CHECK(reinterpret_cast<uintptr_t>(p) % size == 0, "kernel operand ", p,
                " is not aligned to its ", size, "-byte elements");
  });
  return alignedSplit(f, count);
}

template <typename F, typename Launch>
void run(const F& f, size_t count, Launch& launch) {
  if (count == 0) return;
  launch(f, count, planSplit(f, count));
}

template <typename Launch>
void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count,
               Launch&& launch) {
  dispatchType(spec.dtype, [&](auto t) {
    using T = decltype(t);
    const ToPartial<T> f{static_cast<acc_t<T>*>(dst), static_cast<const T*>(src)};
    run(f, count, launch);
  });
}

template <typename Launch>
void reducePartial(const ReduceSpec& spec, void* dst, const void* partial, const void* local,
                   size_t count, Launch&& launch) {
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    using A = acc_t<T>;
    const ReducePartial<T, decltype(op)> f{static_cast<A*>(dst), static_cast<const A*>(partial),
                                           static_cast<const T*>(local), op};
    run(f, count, launch);
  });
}

template <typename Launch>
void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* partial,
                 const void* local, size_t count, Launch&& launch) {
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    using A = acc_t<T>;
    const ReduceFinal<T, decltype(op)> f{static_cast<T*>(dst), static_cast<T*>(dst2),
                                         static_cast<const A*>(partial),
                                         static_cast<const T*>(local), op, finishFor<T>(spec)};
    run(f, count, launch);
  });
}

template <typename Launch>
void reduceN(const ReduceSpec& spec, void* dst, const void* const* src, int nsrc, size_t count,
             Launch&& launch) {
  PYDDP_CHECK(nsrc >= 1 && nsrc <= kMaxSources, "reduceN takes 1 to ", kMaxSources,
              " sources in one launch, got ", nsrc);
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    ReduceN<T, decltype(op)> f{};
    f.dst = static_cast<T*>(dst);
    for (int k = 0; k < nsrc; ++k) f.src[k] = static_cast<const T*>(src[k]);
    f.nsrc = nsrc;
    f.op = op;
    f.fin = finishFor<T>(spec);
    run(f, count, launch);
  });
}

// Copies in the widest unit (8, 4, 2 or 1 bytes) that divides every address
// and the length, so that even operands that cannot be vectorised together
// move several bytes per step.
template <typename Launch>
void copy(void* dst, void* dst2, const void* src, size_t bytes, Launch&& launch) {
  const uintptr_t common = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(dst2) |
                           reinterpret_cast<uintptr_t>(src) | bytes;
  auto go = [&](auto unit) {
    using U = decltype(unit);
    const Copy<U> f{static_cast<U*>(dst), static_cast<U*>(dst2), static_cast<const U*>(src)};
    run(f, bytes / sizeof(U), launch);
  };
  if (common % 8 == 0) {
    go(uint64_t{});
  } else if (common % 4 == 0) {
    go(uint32_t{});
  } else if (common % 2 == 0) {
    go(uint16_t{});
  } else {
    go(uint8_t{});
  }
}

} // namespace grid
} // namespace kernels
} // namespace pyddp
