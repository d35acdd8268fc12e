// Grid bodies of the element-wise kernels: what one thread of a 1-D grid
// does for toPartial, reducePartial, reduceFinal, reduceN and copy. They are
// __host__ __device__ so that the CUDA kernels (cuda.cu) and the CPU test
// suite's emulated grid (emulate.cpp) run exactly the same code.
//
// Work split (one Split per launch, chosen on the host by grid_launch.h):
//   [0, head)                        scalar, one element per step
//   [head, head + packs * kWidth)    packs of kWidth elements, loaded and
//                                    stored 16 bytes at a time
//   [head + packs * kWidth, count)   scalar tail
// kWidth = 16 / sizeof(element), so an element pack is one 16-byte load;
// a partial pack of a half type (fp32) is two. The host picks head so that
// every operand is 16-byte aligned at element `head`; when no such head
// exists (operands misaligned relative to each other) packs = 0 and every
// element goes through the scalar step.
//
// Each thread walks its grid-stride share of the packs, then of the scalar
// elements; every element is read and written by exactly one thread in one
// step, so operands may alias element for element (dst == partial, ...).
//
// Arithmetic is the element bodies of reduce.h, identical in the vector and
// the scalar step; reduceN combines sources strictly in index order. So a
// result does not depend on the grid, the split or the device, and every
// rank computes the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/reduce.h"

// The per-pack loops have a constant trip count; nvcc is asked to unroll
// them (g++ has no such pragma and unrolls or vectorises them itself).
#ifdef __CUDACC__
#define PYDDP_UNROLL _Pragma("unroll")
#else
#define PYDDP_UNROLL
#endif

namespace pyddp {
namespace kernels {
namespace grid {

// Bytes of one vector load or store (ld.v4.u32 / st.v4.u32 on a GPU).
constexpr size_t kVecBytes = 16;

// Most sources one reduceN launch takes: the pointers travel as a kernel
// argument. cuda.cu checks that cuda::kMaxSources agrees.
constexpr int kMaxSources = 16;

// Where one thread stands in a 1-D grid: the CUDA builtins on a GPU, loop
// counters in the emulation.
struct GridPos {
  uint32_t block;
  uint32_t blocks;
  uint32_t thread;
  uint32_t threads;
};

struct Split {
  size_t head = 0;
  size_t packs = 0;

  // Thread steps needed for count elements: one per pack, one per scalar.
  PYDDP_HD size_t steps(size_t count, int width) const {
    return packs + (count - packs * static_cast<size_t>(width));
  }
};

// N elements of T held in registers; for N > 1 exactly a whole number of
// 16-byte chunks.
template <typename T, int N>
struct alignas(N == 1 ? alignof(T) : kVecBytes) Pack {
  static_assert(N == 1 || (sizeof(T) * N) % kVecBytes == 0, "a pack is whole 16-byte chunks");
  T v[N];
};

// N consecutive elements at p; for N > 1 p is 16-byte aligned (the split
// guarantees it).
template <int N, typename T>
PYDDP_HD inline Pack<T, N> load(const T* p) {
  Pack<T, N> out;
  if constexpr (N == 1) {
    out.v[0] = *p;
  } else {
#ifdef __CUDA_ARCH__
    const auto* src = reinterpret_cast<const uint4*>(p);
    auto* dst = reinterpret_cast<uint4*>(out.v);
PYDDP_UNROLL
    for (size_t k = 0; k < sizeof(out) / kVecBytes; ++k) dst[k] = src[k];
#else
    std::memcpy(out.v, p, sizeof(out));
#endif
  }
  return out;
}

template <int N, typename T>
PYDDP_HD inline void store(T* p, const Pack<T, N>& in) {
  if constexpr (N == 1) {
    *p = in.v[0];
  } else {
#ifdef __CUDA_ARCH__
    const auto* src = reinterpret_cast<const uint4*>(in.v);
    auto* dst = reinterpret_cast<uint4*>(p);
PYDDP_UNROLL
    for (size_t k = 0; k < sizeof(in) / kVecBytes; ++k) dst[k] = src[k];
#else
    std::memcpy(p, in.v, sizeof(in));
#endif
  }
}

template <typename T>
constexpr int widthOf() {
  return static_cast<int>(kVecBytes / sizeof(T));
}

// Each body below: kWidth (elements per pack), step<N>(i) (elements
// [i, i + N)), and forEachOperand(fn) calling fn(pointer, element bytes) for
// every pointer it touches, which the host uses to choose the split.

// dst (partials) = src (elements), converted.
template <typename T>
struct ToPartial {
  using A = acc_t<T>;
  static constexpr int kWidth = widthOf<T>();
  A* dst;
  const T* src;

  template <int N>
  PYDDP_HD void step(size_t i) const {
    const auto x = load<N>(src + i);
    Pack<A, N> y;
PYDDP_UNROLL
    for (int j = 0; j < N; ++j) y.v[j] = static_cast<A>(x.v[j]);
    store<N>(dst + i, y);
  }

  template <typename Fn>
  PYDDP_HD void forEachOperand(Fn&& fn) const {
    fn(dst, sizeof(A));
    fn(src, sizeof(T));
  }
};

// dst (partials) = partial op local (elements).
template <typename T, typename Op>
struct ReducePartial {
  using A = acc_t<T>;
  static constexpr int kWidth = widthOf<T>();
  A* dst;
  const A* partial;
  const T* local;
  Op op;

  template <int N>
  PYDDP_HD void step(size_t i) const {
    const auto p = load<N>(partial + i);
    const auto x = load<N>(local + i);
    Pack<A, N> y;
PYDDP_UNROLL
    for (int j = 0; j < N; ++j) reducePartialElem(y.v, p.v, x.v, j, op);
    store<N>(dst + i, y);
  }

  template <typename Fn>
  PYDDP_HD void forEachOperand(Fn&& fn) const {
    fn(dst, sizeof(A));
    fn(partial, sizeof(A));
    fn(local, sizeof(T));
  }
};

// dst (elements) = finish(partial op local); dst2 too when not null.
template <typename T, typename Op>
struct ReduceFinal {
  using A = acc_t<T>;
  static constexpr int kWidth = widthOf<T>();
  T* dst;
  T* dst2;
  const A* partial;
  const T* local;
  Op op;
  Finish<A> fin;

  template <int N>
  PYDDP_HD void step(size_t i) const {
    const auto p = load<N>(partial + i);
    const auto x = load<N>(local + i);
    Pack<T, N> y;
PYDDP_UNROLL
    for (int j = 0; j < N; ++j) y.v[j] = reduceFinalElem(p.v, x.v, j, op, fin);
    store<N>(dst + i, y);
    if (dst2 != nullptr) store<N>(dst2 + i, y);
  }

  template <typename Fn>
  PYDDP_HD void forEachOperand(Fn&& fn) const {
    fn(dst, sizeof(T));
    if (dst2 != nullptr) fn(dst2, sizeof(T));
    fn(partial, sizeof(A));
    fn(local, sizeof(T));
  }
};

// dst = finish(src[0] op src[1] op ... op src[nsrc - 1]), left to right in
// acc_t, as the CPU reduceN does.
template <typename T, typename Op>
struct ReduceN {
  using A = acc_t<T>;
  static constexpr int kWidth = widthOf<T>();
  T* dst;
  const T* src[kMaxSources];
  int nsrc;
  Op op;
  Finish<A> fin;

  template <int N>
  PYDDP_HD void step(size_t i) const {
    Pack<A, N> acc;
    const auto x0 = load<N>(src[0] + i);
PYDDP_UNROLL
    for (int j = 0; j < N; ++j) acc.v[j] = static_cast<A>(x0.v[j]);
    for (int k = 1; k < nsrc; ++k) {
      const auto x = load<N>(src[k] + i);
PYDDP_UNROLL
      for (int j = 0; j < N; ++j) acc.v[j] = op(acc.v[j], static_cast<A>(x.v[j]));
    }
    Pack<T, N> y;
PYDDP_UNROLL
    for (int j = 0; j < N; ++j) y.v[j] = static_cast<T>(fin(acc.v[j]));
    store<N>(dst + i, y);
  }

  template <typename Fn>
  PYDDP_HD void forEachOperand(Fn&& fn) const {
    fn(dst, sizeof(T));
    for (int k = 0; k < nsrc; ++k) fn(src[k], sizeof(T));
  }
};

// dst = src, in units of U (an unsigned integer as wide as the operands'
// common alignment allows); dst2 too when not null.
template <typename U>
struct Copy {
  static constexpr int kWidth = widthOf<U>();
  U* dst;
  U* dst2;
  const U* src;

  template <int N>
  PYDDP_HD void step(size_t i) const {
    const auto x = load<N>(src + i);
    store<N>(dst + i, x);
    if (dst2 != nullptr) store<N>(dst2 + i, x);
  }

  template <typename Fn>
  PYDDP_HD void forEachOperand(Fn&& fn) const {
    fn(dst, sizeof(U));
    if (dst2 != nullptr) fn(dst2, sizeof(U));
    fn(src, sizeof(U));
  }
};

// The split for body f over count elements, its operands aligned to their
// elements. Operands are walked in lockstep, so one head must align them
// all: the narrowest operand (the elements, kWidth of which make 16 bytes)
// fixes the only head below kWidth that puts it on a 16-byte boundary, and
// the vector path is taken when every other operand is 16-byte aligned at
// that element too.
template <typename F>
PYDDP_HD inline Split alignedSplit(const F& f, size_t count) {
  size_t narrowest = ~size_t{0};
  uintptr_t narrowestAddr = 0;
  f.forEachOperand([&](const void* p, size_t size) {
    if (size < narrowest) {
      narrowest = size;
      narrowestAddr = reinterpret_cast<uintptr_t>(p);
    }
  });
  const size_t head = (kVecBytes - narrowestAddr % kVecBytes) % kVecBytes / narrowest;
  bool aligned = true;
  f.forEachOperand([&](const void* p, size_t size) {
    aligned = aligned && (reinterpret_cast<uintptr_t>(p) + head * size) % kVecBytes == 0;
  });
  if (!aligned || head >= count) return Split{};
  const size_t packs = (count - head) / F::kWidth;
  return packs == 0 ? Split{} : Split{head, packs};
}

// One thread's share of a launch: its grid-stride packs, then its
// grid-stride scalar elements of the head and the tail.
template <typename F>
PYDDP_HD inline void gridMap(const GridPos& g, const F& f, size_t count, const Split& s) {
  constexpr size_t W = F::kWidth;
  const size_t first = static_cast<size_t>(g.block) * g.threads + g.thread;
  const size_t stride = static_cast<size_t>(g.blocks) * g.threads;
  for (size_t p = first; p < s.packs; p += stride) f.template step<F::kWidth>(s.head + p * W);
  for (size_t i = first; i < s.head; i += stride) f.template step<1>(i);
  for (size_t i = s.head + s.packs * W + first; i < count; i += stride) f.template step<1>(i);
}

} // namespace grid
} // namespace kernels
} // namespace pyddp
