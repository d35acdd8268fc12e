#include "kernels/cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "common/check.h"
#include "kernels/dispatch.h"
#include "kernels/half_cpu.h"
#include "kernels/reduce.h"

namespace pyddp {
namespace kernels {
namespace {

// Elements per tile: an accumulator tile stays in L1 while every source
// streams through it, and each inner loop is a plain element-wise loop the
// compiler vectorises. A half type's operands are widened to fp32 a tile at
// a time (half_cpu.h), so its loops are fp32 loops too; its ring steps take
// half_cpu.h's one-pass vector loops first, and tiles for the rest.
constexpr size_t kTileElems = 512;

template <typename T>
constexpr bool kHalf = !std::is_same_v<acc_t<T>, T>;

// A half type's incoming operand, one tile as fp32: partials are read where
// they lie, elements are widened into `tile` first.
template <typename T>
const float* incomingTile(const void* in, Incoming incoming, size_t base, size_t n,
                          float* tile) {
  if (incoming == Incoming::Partials) return static_cast<const float*>(in) + base;
  widen(static_cast<const T*>(in) + base, tile, n);
  return tile;
}

LoopIsa bestLoopIsa() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2")) return LoopIsa::Avx2;
#endif
  return LoopIsa::Baseline;
}

std::atomic<LoopIsa>& currentLoopIsa() {
  static std::atomic<LoopIsa> isa{bestLoopIsa()};
  return isa;
}

// body(), its loops compiled for one instruction set: flatten inlines every
// call inside body into these functions, so the vectoriser sees the loops
// under the function's target. Only the kernels' loops run here, where the
// element-wise work is; the rest of the library stays at the baseline.
// 2 ranks, all_reduce of float32 (`python benchmarks/side_by_side.py
// loop_isa all_reduce BYTES`, AMD EPYC VM;
// benchmarks/studies/vector-loops-for-the-reductions.md), us per call with
// the baseline's 16-byte
// vectors and AVX2's 32-byte ones: near cores 64 KiB 14.7 -> 11.0, 64 MiB
// 9725 -> 8150; far cores 64 KiB 41.5 -> 29.3, 1 MiB 530 -> 425. A build
// for AVX-512 ran as fast as AVX2's, so it is not built.
template <typename Body>
[[gnu::flatten]] void loopsBaseline(Body& body) {
  body();
}
#if defined(__x86_64__) && defined(__GNUC__)
template <typename Body>
[[gnu::target("avx2"), gnu::flatten]] void loopsAvx2(Body& body) {
  body();
}
#endif

// Runs body() with the loops of the instruction set in use.
template <typename Body>
void vectorised(Body&& body) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (loopIsa()) {
    case LoopIsa::Avx2: return loopsAvx2(body);
    case LoopIsa::Baseline: break;
  }
#endif
  loopsBaseline(body);
}

// dispatch(), each dtype x operator body run with the loops of the
// instruction set in use.
template <typename Body>
void dispatchVectorised(const ReduceSpec& spec, Body&& body) {
  dispatch(spec, [&](auto t, auto op) { vectorised([&] { body(t, op); }); });
}

} // namespace

const char* toString(LoopIsa isa) {
  switch (isa) {
    case LoopIsa::Baseline: return "baseline";
    case LoopIsa::Avx2: return "avx2";
  }
  return "unknown";
}

LoopIsa loopIsa() {
  return currentLoopIsa().load(std::memory_order_relaxed);
}

std::vector<LoopIsa> supportedLoopIsas() {
  std::vector<LoopIsa> isas;
  for (LoopIsa isa : {LoopIsa::Baseline, LoopIsa::Avx2}) {
    if (isa <= bestLoopIsa()) isas.push_back(isa);
  }
  return isas;
}

void useLoopIsa(LoopIsa isa) {
  PYDDP_CHECK_VALUE(isa <= bestLoopIsa(), "this CPU cannot run the loops compiled for ",
                    toString(isa), "; it runs ", toString(bestLoopIsa()), " at best");
  currentLoopIsa().store(isa, std::memory_order_relaxed);
}

size_t partialSize(DataType t) {
  size_t bytes = 0;
  dispatchType(t, [&](auto v) { bytes = sizeof(acc_t<decltype(v)>); });
  return bytes;
}

void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count) {
  dispatchType(spec.dtype, [&](auto t) {
    vectorised([&] {
      using T = decltype(t);
      auto* d = static_cast<acc_t<T>*>(dst);
      const auto* x = static_cast<const T*>(src);
      if constexpr (kHalf<T>) {
        widen(x, d, count);
      } else {
        for (size_t i = 0; i < count; ++i) d[i] = x[i];
      }
    });
  });
}

void reducePartial(const ReduceSpec& spec, void* dst, const void* in, Incoming incoming,
                   const void* local, size_t count) {
  dispatchVectorised(spec, [&](auto t, auto op) {
    using T = decltype(t);
    auto* d = static_cast<acc_t<T>*>(dst);
    const auto* x = static_cast<const T*>(local);
    if constexpr (kHalf<T>) {
      float wide[kTileElems], inWide[kTileElems];
      const size_t done = reducePartialVector(spec.op, d, in, incoming, x, count);
      for (size_t base = done; base < count; base += kTileElems) {
        const size_t n = std::min(kTileElems, count - base);
        const float* p = incomingTile<T>(in, incoming, base, n, inWide);
        widen(x + base, wide, n);
        for (size_t i = 0; i < n; ++i) d[base + i] = op(p[i], wide[i]);
      }
    } else {
      // Elements and partials are alike here: acc_t<T> is T.
      const auto* p = static_cast<const T*>(in);
      for (size_t i = 0; i < count; ++i) {
        reducePartialElem(d, p, x, static_cast<int64_t>(i), op);
      }
    }
  });
}

void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* in,
                 Incoming incoming, const void* local, size_t count) {
  dispatchVectorised(spec, [&](auto t, auto op) {
    using T = decltype(t);
    const auto fin = finishFor<T>(spec);
    auto* d = static_cast<T*>(dst);
    auto* d2 = static_cast<T*>(dst2);
    const auto* x = static_cast<const T*>(local);
    if constexpr (kHalf<T>) {
      float wide[kTileElems], inWide[kTileElems];
      const size_t done =
          reduceFinalVector(spec.op, fin.divisor, d, d2, in, incoming, x, count);
      for (size_t base = done; base < count; base += kTileElems) {
        const size_t n = std::min(kTileElems, count - base);
        const float* p = incomingTile<T>(in, incoming, base, n, inWide);
        widen(x + base, wide, n);
        for (size_t i = 0; i < n; ++i) wide[i] = fin(op(p[i], wide[i]));
        narrow(wide, d + base, n);
        if (d2 != nullptr) std::memcpy(d2 + base, d + base, n * sizeof(T));
      }
    } else {
      // Elements and partials are alike here: acc_t<T> is T.
      const auto* p = static_cast<const T*>(in);
      if (d2 == nullptr) {
        for (size_t i = 0; i < count; ++i) {
          d[i] = reduceFinalElem(p, x, static_cast<int64_t>(i), op, fin);
        }
      } else {
        for (size_t i = 0; i < count; ++i) {
          d[i] = d2[i] = reduceFinalElem(p, x, static_cast<int64_t>(i), op, fin);
        }
      }
    }
  });
}

void reduceN(const ReduceSpec& spec, void* dst, const void* const* src,
             int nsrc, size_t count) {
  PYDDP_CHECK(nsrc >= 1, "reduceN needs at least one source, got ", nsrc);
  dispatchVectorised(spec, [&](auto t, auto op) {
    using T = decltype(t);
    using A = acc_t<T>;
    const auto fin = finishFor<T>(spec);
    auto* d = static_cast<T*>(dst);
    if constexpr (!kHalf<T>) {
      // One or two sources (one and two ranks) in one pass: the tile's
      // copy in and out would be two more passes than the reduction.
      if (nsrc <= 2) {
        const auto* s0 = static_cast<const T*>(src[0]);
        const auto* s1 = static_cast<const T*>(src[nsrc - 1]);
        if (nsrc == 1) {
          for (size_t i = 0; i < count; ++i) d[i] = fin(s0[i]);
        } else {
          for (size_t i = 0; i < count; ++i) d[i] = fin(op(s0[i], s1[i]));
        }
        return;
      }
    }
    // Two sources of a half type (two ranks): one vector pass, as a ring's
    // last step of two operands sent as elements; tiles for the rest.
    size_t done = 0;
    if constexpr (kHalf<T>) {
      if (nsrc == 2) {
        done = reduceFinalVector(spec.op, fin.divisor, d, nullptr, src[0], Incoming::Elements,
                                 static_cast<const T*>(src[1]), count);
      }
    }
    A acc[kTileElems];
    [[maybe_unused]] A wide[kHalf<T> ? kTileElems : 1];
    for (size_t base = done; base < count; base += kTileElems) {
      const size_t n = std::min(kTileElems, count - base);
      const T* s0 = static_cast<const T*>(src[0]) + base;
      if constexpr (kHalf<T>) {
        widen(s0, acc, n);
        for (int k = 1; k < nsrc; ++k) {
          widen(static_cast<const T*>(src[k]) + base, wide, n);
          for (size_t i = 0; i < n; ++i) acc[i] = op(acc[i], wide[i]);
        }
        for (size_t i = 0; i < n; ++i) acc[i] = fin(acc[i]);
        narrow(acc, d + base, n);
      } else {
        for (size_t i = 0; i < n; ++i) acc[i] = s0[i];
        for (int k = 1; k < nsrc; ++k) {
          const T* sk = static_cast<const T*>(src[k]) + base;
          for (size_t i = 0; i < n; ++i) acc[i] = op(acc[i], sk[i]);
        }
        for (size_t i = 0; i < n; ++i) d[base + i] = fin(acc[i]);
      }
    }
  });
}

void streamingCopy(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // Non-temporal stores of 16 bytes need 16-byte aligned destinations.
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
  // Non-temporal stores are weakly ordered, even against a release store.
  _mm_sfence();
#else
  std::memcpy(dst, src, bytes);
#endif
}

} // namespace kernels
} // namespace pyddp
