#include "backend/torch_types.h"

#include <iterator>

namespace pyddp {

std::optional<DataType> dataTypeOf(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::Float32;
    case at::kDouble: return DataType::Float64;
    case at::kHalf: return DataType::Float16;
    case at::kBFloat16: return DataType::BFloat16;
    case at::kChar: return DataType::Int8;
    case at::kByte: return DataType::UInt8;
    case at::kInt: return DataType::Int32;
    case at::kLong: return DataType::Int64;
    default: return std::nullopt;
  }
}

std::optional<RedOp> redOpOf(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return RedOp::Sum;
    case c10d::ReduceOp::AVG: return RedOp::Avg;
    case c10d::ReduceOp::PRODUCT: return RedOp::Product;
    case c10d::ReduceOp::MIN: return RedOp::Min;
    case c10d::ReduceOp::MAX: return RedOp::Max;
    case c10d::ReduceOp::BAND: return RedOp::BitAnd;
    case c10d::ReduceOp::BOR: return RedOp::BitOr;
    case c10d::ReduceOp::BXOR: return RedOp::BitXor;
    default: return std::nullopt;
  }
}

const char* nameOf(const c10d::ReduceOp& op) {
  // c10d's RedOpType values in order.
  static constexpr const char* kNames[] = {"SUM", "AVG",  "PRODUCT", "MIN",       "MAX",
                                           "BAND", "BOR", "BXOR",    "PREMUL_SUM"};
  const auto i = static_cast<size_t>(op.op_);
  return i < std::size(kNames) ? kNames[i] : "?";
}

c10d::OpType opTypeOf(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce: return c10d::OpType::ALLREDUCE;
    case CollectiveKind::AllGather: return c10d::OpType::ALLGATHER;
    case CollectiveKind::Broadcast: return c10d::OpType::BROADCAST;
    case CollectiveKind::ReduceScatter: return c10d::OpType::REDUCE_SCATTER;
    case CollectiveKind::Barrier: return c10d::OpType::BARRIER;
    case CollectiveKind::Reduce: return c10d::OpType::REDUCE;
    case CollectiveKind::Gather: return c10d::OpType::GATHER;
    case CollectiveKind::Scatter: return c10d::OpType::SCATTER;
    case CollectiveKind::AllToAll: return c10d::OpType::ALLTOALL_BASE;
    case CollectiveKind::Send: return c10d::OpType::SEND;
    case CollectiveKind::Recv: return c10d::OpType::RECV;
  }
  return c10d::OpType::UNKNOWN;
}

} // namespace pyddp
