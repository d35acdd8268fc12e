// pyddp's vocabulary (common/types.h) in torch's terms and back: element
// types, c10d's reduction operators and operation types.
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <optional>

#include "common/types.h"

namespace pyddp {

// pyddp's element type for a torch dtype; nullopt when unsupported.
std::optional<DataType> dataTypeOf(at::ScalarType t);
// pyddp's operator for a c10d ReduceOp; nullopt for those pyddp does not
// support (BAND, BOR, BXOR, PREMUL_SUM).
std::optional<RedOp> redOpOf(const c10d::ReduceOp& op);
// c10d's name of a ReduceOp ("SUM", "BAND", ...).
const char* nameOf(const c10d::ReduceOp& op);
// c10d's operation type of a collective kind (Work::retrieveOpType).
c10d::OpType opTypeOf(CollectiveKind kind);

} // namespace pyddp
