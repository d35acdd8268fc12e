#include "backend/arg_checks.h"

#include <ATen/MemoryOverlap.h>

#include "backend/torch_types.h"
#include "common/check.h"

namespace pyddp {

ArgChecks::ArgChecks(int rank, int size, c10::Device device, std::string server)
    : rank_(rank), size_(size), device_(device), server_(std::move(server)) {}

DataType ArgChecks::tensor(const at::Tensor& t, const char* call,
                                  const char* what) const {
  PYDDP_CHECK_TYPE(t.defined(), "rank ", rank_, ": ", call, ": ", what,
                   " is an undefined tensor");
  PYDDP_CHECK_TYPE(t.device() == device_, "rank ", rank_, ": ", call, ": ", what, " is on ",
                   t.device(), "; ", server_, " serves ", device_,
                   " tensors only");
  PYDDP_CHECK_TYPE(t.layout() == at::kStrided, "rank ", rank_, ": ", call, ": ", what,
                   " has layout ", t.layout(), "; only dense (strided) tensors are supported");
  const auto dtype = dataTypeOf(t.scalar_type());
  PYDDP_CHECK_TYPE(dtype.has_value(), "rank ", rank_, ": ", call, ": ", what, " has dtype ",
                   t.scalar_type(), "; supported: float32, float64, float16, "
                   "bfloat16, int8, uint8, int32, int64");
  return *dtype;
}
DataType ArgChecks::single(const char* call, const at::Tensor& output,
                                  const at::Tensor& input, bool outputIsWhole) const {
  const DataType dtype = tensor(input, call, "input");
  PYDDP_CHECK_TYPE(tensor(output, call, "output") == dtype, "rank ", rank_, ": ", call,
                   ": output dtype ", output.scalar_type(), " differs from input dtype ",
                   input.scalar_type());
  writable(output, call, "output");
  const at::Tensor& whole = outputIsWhole ? output : input;
  const at::Tensor& block = outputIsWhole ? input : output;
  PYDDP_CHECK_VALUE(whole.numel() == block.numel() * size_, "rank ", rank_, ": ", call, ": ",
                    outputIsWhole ? "output" : "input", " has ", whole.numel(),
                    " elements, expected ", block.numel() * size_, " (world_size ", size_,
                    " x ", outputIsWhole ? "input" : "output", "'s ", block.numel(), ")");
  return dtype;
}
void ArgChecks::writable(const at::Tensor& t, const char* call,
                                const char* what) const {
  PYDDP_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, "rank ", rank_,
                    ": ", call, ": ", what, " has elements that share memory (an "
                    "expand()ed view?); results cannot be written into it");
}
void ArgChecks::op(RedOp op, DataType dtype, const char* call) const {
  PYDDP_CHECK_TYPE(op != RedOp::Avg || isFloating(dtype), "rank ", rank_, ": ", call,
                   ": ReduceOp.AVG needs a floating-point tensor, got ",
                   toString(dtype), "; use SUM and divide");
}
void ArgChecks::root(int root, const char* call, const char* what) const {
  PYDDP_CHECK_VALUE(root >= 0 && root < size_, "rank ", rank_, ": ", call, ": ", what, "=",
                    root, " is not a rank of this group (world_size ", size_, ")");
}

} // namespace pyddp
