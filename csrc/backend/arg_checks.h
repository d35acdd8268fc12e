// Argument checks shared by the engines, done before anything is queued
// (so a refused call leaves the group usable). Messages name the rank, the
// call and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "common/types.h"

namespace pyddp {

class ArgChecks {
 public:
  // `server` names what serves `device`'s tensors in messages, e.g. "this
  // group's shm transport".
  ArgChecks(int rank, int size, c10::Device device, std::string server);

  // A dense tensor of a supported dtype on the device; returns the dtype.
  DataType tensor(const at::Tensor& t, const char* call, const char* what) const;
  // No two elements share memory (results are written into it).
  void writable(const at::Tensor& t, const char* call, const char* what) const;
  // all_gather_single and reduce_scatter_single: one rank-sized tensor and
  // one world-sized tensor of the same dtype; returns that dtype.
  DataType single(const char* call, const at::Tensor& output, const at::Tensor& input,
                  bool outputIsWhole) const;
  void op(RedOp op, DataType dtype, const char* call) const;
  void root(int root, const char* call, const char* what) const;

 private:
  const int rank_;
  const int size_;
  const c10::Device device_;
  const std::string server_;
};

} // namespace pyddp
