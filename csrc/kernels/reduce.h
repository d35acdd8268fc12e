// Element-wise reduction bodies shared by the CPU kernels (cpu.cpp) and the
// grid kernels that run on a GPU or an emulated grid (elementwise.h):
// everything here is __host__ __device__ and depends only on common/ and
// c10's header-only scalar types.
//
// Arithmetic rules, identical on every rank and every device:
//  - half types (fp16, bf16) accumulate in fp32 and round once per store;
//  - integers wrap modulo 2^bits (computed in the unsigned type, so no UB);
//  - AVG is SUM followed by a division by the world size, done on the
//    accumulator before the final rounding;
//  - BAND, BOR and BXOR are for integers (the argument checks refuse them on
//    floating types before any kernel runs).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "common/types.h"

#define PYDDP_HD C10_HOST_DEVICE

namespace pyddp {
namespace kernels {

// Accumulator type: fp32 for half types, the type itself otherwise.
template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<c10::Half> {
  using type = float;
};
template <>
struct Acc<c10::BFloat16> {
  using type = float;
};
template <typename T>
using acc_t = typename Acc<T>::type;

template <typename A>
PYDDP_HD inline A wrapAdd(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename A>
PYDDP_HD inline A wrapMul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    // uint8 * uint8 promotes to (signed) int but cannot overflow it; wider
    // types stay unsigned and wrap.
    using U = std::make_unsigned_t<A>;
    using W = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, U>;
    return static_cast<A>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
  } else {
    return a * b;
  }
}

// One functor per operator; AVG reduces with SumOp and is divided at the end.
struct SumOp {
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const { return wrapAdd(a, b); }
};
struct ProdOp {
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const { return wrapMul(a, b); }
};
struct MinOp {
  // NaN wins, as in torch.minimum.
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return b < a ? b : a;
  }
};
struct MaxOp {
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) {
      if (a != a) return a;
      if (b != b) return b;
    }
    return a < b ? b : a;
  }
};

// Every (dtype, operator) pair is instantiated, so the bitwise operators
// compile for floating types too, where they keep the first operand: never
// reached, since floating tensors with a bitwise operator are refused first.
struct BitAndOp {
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      return static_cast<A>(a & b);
    } else {
      return a;
    }
  }
};
struct BitOrOp {
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      return static_cast<A>(a | b);
    } else {
      return a;
    }
  }
};
struct BitXorOp {
  template <typename A>
  PYDDP_HD A operator()(A a, A b) const {
    if constexpr (std::is_integral_v<A>) {
      return static_cast<A>(a ^ b);
    } else {
      return a;
    }
  }
};

// The final step of a reduction: AVG divides by the world size, other
// operators pass through. Division (not multiplication by a reciprocal) so
// results equal sum / n computed independently.
template <typename A>
struct Finish {
  A divisor;  // 0 = no division
  PYDDP_HD A operator()(A v) const { return divisor != A(0) ? v / divisor : v; }
};

// Partial results (what a ring passes between ranks before the reduction is
// complete) are kept in acc_t<T>, so a ring accumulates half types in fp32
// exactly as a direct reduction does, and rounds once at the end.

// dst[i] = partial[i] op local[i], still a partial result.
template <typename T, typename Op>
PYDDP_HD inline void reducePartialElem(
    acc_t<T>* dst, const acc_t<T>* partial, const T* local, int64_t i, Op op) {
  dst[i] = op(partial[i], static_cast<acc_t<T>>(local[i]));
}

// The finished element finish(partial[i] op local[i]).
template <typename T, typename Op>
PYDDP_HD inline T reduceFinalElem(
    const acc_t<T>* partial, const T* local, int64_t i, Op op, Finish<acc_t<T>> fin) {
  return static_cast<T>(fin(op(partial[i], static_cast<acc_t<T>>(local[i]))));
}

// Calls f.template operator()<T>() with T the C++ type of `t`.
template <typename F>
PYDDP_HD inline void dispatchType(DataType t, F&& f) {
  switch (t) {
    case DataType::Float32: f(float{}); break;
    case DataType::Float64: f(double{}); break;
    case DataType::Float16: f(c10::Half{}); break;
    case DataType::BFloat16: f(c10::BFloat16{}); break;
    case DataType::Int8: f(int8_t{}); break;
    case DataType::UInt8: f(uint8_t{}); break;
    case DataType::Int32: f(int32_t{}); break;
    case DataType::Int64: f(int64_t{}); break;
  }
}

template <typename F>
PYDDP_HD inline void dispatchOp(RedOp op, F&& f) {
  switch (op) {
    case RedOp::Sum:
    case RedOp::Avg: f(SumOp{}); break;
    case RedOp::Product: f(ProdOp{}); break;
    case RedOp::Min: f(MinOp{}); break;
    case RedOp::Max: f(MaxOp{}); break;
    case RedOp::BitAnd: f(BitAndOp{}); break;
    case RedOp::BitOr: f(BitOrOp{}); break;
    case RedOp::BitXor: f(BitXorOp{}); break;
  }
}

} // namespace kernels
} // namespace pyddp
