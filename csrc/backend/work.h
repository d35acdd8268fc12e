// The Work handle of one collective: c10d's Work (wait / is_completed /
// exception, bound by torch) plus a future completed with the output
// tensors, which is what torch DDP's comm hooks and get_future() use.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace pyddp {

class RingWork final : public c10d::Work {
 public:
  RingWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  void complete();
  void fail(std::exception_ptr error);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace pyddp
