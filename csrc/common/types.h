// Vocabulary shared by every layer: element types, reduction operators,
// collective kinds and all-reduce algorithms, as small enums that cross
// process boundaries (they are fields of the descriptor each rank publishes
// per collective: common/descriptor.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace pyddp {

// Deadlines and waits.
using Clock = std::chrono::steady_clock;

// How a rank ends a group: destroyed (shutdown, destroy_process_group,
// exit), which lets peers finish what this rank has done its part of; or
// aborted (abort()), which fails everything pending here and every peer
// waiting on this rank at once.
enum class Teardown { Destroyed, Aborted };

inline const char* pastTense(Teardown how) {
  return how == Teardown::Aborted ? "aborted" : "destroyed";
}

enum class DataType : int32_t {
  Float32 = 0,
  Float64 = 1,
  Float16 = 2,
  BFloat16 = 3,
  Int8 = 4,
  UInt8 = 5,
  Int32 = 6,
  Int64 = 7,
};

enum class RedOp : int32_t {
  Sum = 0,
  Avg = 1,
  Product = 2,
  Min = 3,
  Max = 4,
  BitAnd = 5,
  BitOr = 6,
  BitXor = 7,
};

// BAND, BOR and BXOR: defined on integer types only.
inline bool isBitwise(RedOp op) {
  return op == RedOp::BitAnd || op == RedOp::BitOr || op == RedOp::BitXor;
}

// How an all-reduce runs: by size (Auto), or forced. Direct is the one-shot
// algorithm (every rank reduces the whole message from every rank's staged
// copy); TwoShot reduces one block per rank, then gathers the blocks.
// Registered is never an option, only a descriptor's: the collective reads
// registered tensors in place if every one it reads is registered, else
// runs the algorithm its size picks (algorithms::arriveRegistered), so the
// ranks' choice to try is compared as every other field is.
enum class Algo : int32_t { Auto = 0, Ring = 1, Direct = 2, TwoShot = 3, Registered = 4 };

// How a rank writes the pieces it copies into its ring slots
// (transport/slot_stores.h): chosen by measurement (Auto), or forced.
enum class SlotStores : int32_t { Auto = 0, Cached = 1, Streaming = 2 };

// Whether all-gathers, broadcasts, all-reduces and reduce-scatters read
// peers' plain CPU tensors through the kernel (cross-memory attach,
// backend/cma_chooser.h): on the calls a measurement picks (Auto), on every
// call, or never.
enum class CmaReads : int32_t { Auto = 0, Always = 1, Never = 2 };

enum class CollectiveKind : int32_t {
  AllReduce = 0,
  AllGather = 1,
  Broadcast = 2,
  ReduceScatter = 3,
  Barrier = 4,
  Reduce = 5,
  Gather = 6,
  Scatter = 7,
  AllToAll = 8,
  // Point-to-point operations: not collectives, never numbered or compared.
  Send = 9,
  Recv = 10,
};

// v rounded up to a multiple of `to`.
inline size_t roundUp(size_t v, size_t to) {
  return (v + to - 1) / to * to;
}

inline size_t elementSize(DataType t) {
  switch (t) {
    case DataType::Float64:
    case DataType::Int64:
      return 8;
    case DataType::Float32:
    case DataType::Int32:
      return 4;
    case DataType::Float16:
    case DataType::BFloat16:
      return 2;
    case DataType::Int8:
    case DataType::UInt8:
      return 1;
  }
  return 0;
}

inline bool isFloating(DataType t) {
  return t == DataType::Float32 || t == DataType::Float64 ||
      t == DataType::Float16 || t == DataType::BFloat16;
}

inline const char* toString(DataType t) {
  switch (t) {
    case DataType::Float32: return "float32";
    case DataType::Float64: return "float64";
    case DataType::Float16: return "float16";
    case DataType::BFloat16: return "bfloat16";
    case DataType::Int8: return "int8";
    case DataType::UInt8: return "uint8";
    case DataType::Int32: return "int32";
    case DataType::Int64: return "int64";
  }
  return "unknown";
}

inline const char* toString(RedOp op) {
  switch (op) {
    case RedOp::Sum: return "SUM";
    case RedOp::Avg: return "AVG";
    case RedOp::Product: return "PRODUCT";
    case RedOp::Min: return "MIN";
    case RedOp::Max: return "MAX";
    case RedOp::BitAnd: return "BAND";
    case RedOp::BitOr: return "BOR";
    case RedOp::BitXor: return "BXOR";
  }
  return "unknown";
}

inline const char* toString(Algo a) {
  switch (a) {
    case Algo::Auto: return "auto";
    case Algo::Ring: return "ring";
    case Algo::Direct: return "direct";
    case Algo::TwoShot: return "two_shot";
    case Algo::Registered: return "registered";
  }
  return "unknown";
}

inline const char* toString(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce: return "all_reduce";
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::Broadcast: return "broadcast";
    case CollectiveKind::ReduceScatter: return "reduce_scatter";
    case CollectiveKind::Barrier: return "barrier";
    case CollectiveKind::Reduce: return "reduce";
    case CollectiveKind::Gather: return "gather";
    case CollectiveKind::Scatter: return "scatter";
    case CollectiveKind::AllToAll: return "all_to_all";
    case CollectiveKind::Send: return "send";
    case CollectiveKind::Recv: return "recv";
  }
  return "unknown";
}

} // namespace pyddp
