#include "kernels/cpu.h"

#include <algorithm>

#include "common/check.h"
#include "kernels/reduce.h"

namespace pyddp {
namespace kernels {
namespace {

template <typename T>
Finish<acc_t<T>> finishFor(const ReduceSpec& spec, bool finish) {
  using A = acc_t<T>;
  const bool divide = finish && spec.op == RedOp::Avg;
  return Finish<A>{divide ? static_cast<A>(spec.worldSize) : A(0)};
}

// Calls body(T{}, Op{}) for the spec's element type and operator.
template <typename Body>
void dispatch(const ReduceSpec& spec, Body&& body) {
  PYDDP_CHECK(
      spec.op != RedOp::Avg || isFloating(spec.dtype),
      "AVG reduction on integer dtype ", toString(spec.dtype));
  dispatchType(spec.dtype, [&](auto t) {
    dispatchOp(spec.op, [&](auto op) { body(t, op); });
  });
}

// Elements reduced per tile in reduceN: the accumulator tile stays in L1
// while every source streams through it, and each inner loop is a plain
// element-wise loop the compiler vectorises.
constexpr size_t kTileElems = 512;

} // namespace

void reduce2(const ReduceSpec& spec, bool finish, void* dst, const void* a,
             const void* b, size_t count) {
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    const auto fin = finishFor<T>(spec, finish);
    auto* d = static_cast<T*>(dst);
    const auto* x = static_cast<const T*>(a);
    const auto* y = static_cast<const T*>(b);
    for (size_t i = 0; i < count; ++i) {
      reduce2Elem(d, x, y, static_cast<int64_t>(i), op, fin);
    }
  });
}

void reduce2Dual(const ReduceSpec& spec, void* dst0, void* dst1, const void* a,
                 const void* b, size_t count) {
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    const auto fin = finishFor<T>(spec, true);
    auto* d0 = static_cast<T*>(dst0);
    auto* d1 = static_cast<T*>(dst1);
    const auto* x = static_cast<const T*>(a);
    const auto* y = static_cast<const T*>(b);
    for (size_t i = 0; i < count; ++i) {
      reduce2DualElem(d0, d1, x, y, static_cast<int64_t>(i), op, fin);
    }
  });
}

void reduceN(const ReduceSpec& spec, void* dst, const void* const* src,
             int nsrc, size_t count) {
  PYDDP_CHECK(nsrc >= 1, "reduceN needs at least one source, got ", nsrc);
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    using A = acc_t<T>;
    const auto fin = finishFor<T>(spec, true);
    auto* d = static_cast<T*>(dst);
    A acc[kTileElems];
    for (size_t base = 0; base < count; base += kTileElems) {
      const size_t n = std::min(kTileElems, count - base);
      const T* s0 = static_cast<const T*>(src[0]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] = static_cast<A>(s0[i]);
      for (int k = 1; k < nsrc; ++k) {
        const T* sk = static_cast<const T*>(src[k]) + base;
        for (size_t i = 0; i < n; ++i) acc[i] = op(acc[i], static_cast<A>(sk[i]));
      }
      for (size_t i = 0; i < n; ++i) d[base + i] = static_cast<T>(fin(acc[i]));
    }
  });
}

} // namespace kernels
} // namespace pyddp
