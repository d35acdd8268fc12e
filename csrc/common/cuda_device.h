// CUDA error checks and device selection shared by the CUDA parts (CUDA
// builds only).
#pragma once

#include <cuda_runtime_api.h>

#include "common/check.h"

namespace pyddp {

// Throws DistBackendError "pyddp: <what> failed: <name>: <message>" unless
// err is cudaSuccess, and clears CUDA's last error so that a later,
// unrelated check does not report it. `what` is only read on failure.
inline void checkCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  PYDDP_CHECK_COMM(false, what, " failed: ", cudaGetErrorName(err), ": ",
                   cudaGetErrorString(err));
}

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
