// Device selection that never throws, for destructors and teardown paths
// of the CUDA parts (CUDA builds only).
#pragma once

#include <cuda_runtime_api.h>

namespace pyddp {

// Makes `device` current for a scope and restores the previous device.
// Errors (say, the driver shutting down at exit) are ignored: callers are
// destructors or paths that report CUDA errors themselves.
class QuietDeviceGuard {
 public:
  explicit QuietDeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      switched_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~QuietDeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  QuietDeviceGuard(const QuietDeviceGuard&) = delete;
  QuietDeviceGuard& operator=(const QuietDeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

} // namespace pyddp
