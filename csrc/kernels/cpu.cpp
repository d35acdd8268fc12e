#include "kernels/cpu.h"

#include <algorithm>

#include "common/check.h"
#include "kernels/dispatch.h"
#include "kernels/reduce.h"

namespace pyddp {
namespace kernels {
namespace {

// Elements reduced per tile in reduceN: the accumulator tile stays in L1
// while every source streams through it, and each inner loop is a plain
// element-wise loop the compiler vectorises.
constexpr size_t kTileElems = 512;

} // namespace

size_t partialSize(DataType t) {
  size_t bytes = 0;
  dispatchType(t, [&](auto v) { bytes = sizeof(acc_t<decltype(v)>); });
  return bytes;
}

void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count) {
  dispatchType(spec.dtype, [&](auto t) {
    using T = decltype(t);
    auto* d = static_cast<acc_t<T>*>(dst);
    const auto* x = static_cast<const T*>(src);
    for (size_t i = 0; i < count; ++i) d[i] = static_cast<acc_t<T>>(x[i]);
  });
}

void reducePartial(const ReduceSpec& spec, void* dst, const void* partial,
                   const void* local, size_t count) {
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    auto* d = static_cast<acc_t<T>*>(dst);
    const auto* p = static_cast<const acc_t<T>*>(partial);
    const auto* x = static_cast<const T*>(local);
    for (size_t i = 0; i < count; ++i) {
      reducePartialElem(d, p, x, static_cast<int64_t>(i), op);
    }
  });
}

void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* partial,
                 const void* local, size_t count) {
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    const auto fin = finishFor<T>(spec);
    auto* d = static_cast<T*>(dst);
    auto* d2 = static_cast<T*>(dst2);
    const auto* p = static_cast<const acc_t<T>*>(partial);
    const auto* x = static_cast<const T*>(local);
    if (d2 == nullptr) {
      for (size_t i = 0; i < count; ++i) {
        d[i] = reduceFinalElem(p, x, static_cast<int64_t>(i), op, fin);
      }
    } else {
      for (size_t i = 0; i < count; ++i) {
        d[i] = d2[i] = reduceFinalElem(p, x, static_cast<int64_t>(i), op, fin);
      }
    }
  });
}

void reduceN(const ReduceSpec& spec, void* dst, const void* const* src,
             int nsrc, size_t count) {
  PYDDP_CHECK(nsrc >= 1, "reduceN needs at least one source, got ", nsrc);
  dispatch(spec, [&](auto t, auto op) {
    using T = decltype(t);
    using A = acc_t<T>;
    const auto fin = finishFor<T>(spec);
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
