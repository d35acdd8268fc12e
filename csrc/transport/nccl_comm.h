// NCCL for pyddp: a communicator whose every host-side wait is bounded,
// shared by NcclEngine (NCCL's own collectives) and NcclTransport (NCCL
// send/recv as a pyddp ring transport). Only compiled in CUDA builds.
//
// Communicators are nonblocking (ncclConfig_t::blocking = 0): NCCL then
// returns ncclInProgress instead of blocking the host while it waits for
// peers (init, first-use connection setup), and the host polls with a
// deadline. A collective that waits for a peer on the device is not a host
// wait: the engine's WorkMonitor notices its deadline and aborts the
// communicator, which makes the waiting kernels exit.
//
// Several ranks on one GPU need NCCL >= 2.30 with
// NCCL_MULTI_RANK_GPU_ENABLE=1 (older NCCL refuses with "Duplicate GPU").
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>

#include "transport/transport.h"

namespace pyddp {
namespace nccl {

// The NCCL library's version (ncclGetVersion): {major, minor, patch}.
std::array<int, 3> version();
std::string versionString();

ncclDataType_t dataType(DataType t);
// NCCL's operator for `op` over `ranks` ranks. AVG is ncclAvg (NCCL >= 2.10),
// except on one rank, where an average is the value itself and ncclSum (a
// copy) gives it: NCCL's one-rank path for ncclAvg, a pre-multiplied sum over
// up to 32 blocks of nElts / 32 elements each, leaves the last nElts % 32
// elements of an out-of-place call unwritten (NCCL 2.28.9 on an H200: 3 of
// 1048579 floats; tests/gpu/test_nccl_engine.py's world1 cases).
ncclRedOp_t redOp(RedOp op, int ranks);

// A fresh ncclUniqueId, as NCCL_UNIQUE_ID_BYTES bytes (works without a GPU).
std::string newUniqueId();

// One rank's NCCL communicator on one device. Thread-safe: calls are
// serialised by a mutex that is released while waiting, so abort() (from a
// monitor thread, or teardown) is never stuck behind a waiting call.
class Communicator {
 public:
  // Joins the communicator of `size` ranks named by uniqueId (bytes from
  // newUniqueId() on one rank); waits for the other ranks until deadline.
  Communicator(const std::string& uniqueId, int rank, int size, c10::DeviceIndex device,
               Clock::time_point deadline);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Runs `calls` (NCCL calls that enqueue work on a stream; `what` names
  // them in errors) and waits, until deadline, for NCCL to finish
  // enqueuing. Throws DistBackendError with NCCL's messages; afterwards the
  // communicator is unusable and must be aborted.
  void run(const char* what, const std::function<ncclResult_t(ncclComm_t)>& calls,
           Clock::time_point deadline);
  // "" or the error NCCL found in work already enqueued
  // (ncclCommGetAsyncError), for monitors.
  std::string asyncError();
  // Ends the communicator gracefully (ncclCommFinalize, bounded by
  // deadline, then ncclCommDestroy); falls back to abort(). Returns
  // whether it ended gracefully.
  bool destroy(Clock::time_point deadline);
  // Frees the communicator at once; its operations still running on the
  // device exit (ncclCommAbort). Idempotent.
  void abort();

 private:
  // Polls a nonblocking call's state until it is not ncclInProgress
  // (releasing mu_ between polls), until deadline; throws on failure.
  void settle(std::unique_lock<std::mutex>& lock, ncclResult_t result, const char* what,
              Clock::time_point deadline, const char* hint);
  void abortLocked();

  const int rank_;
  const c10::DeviceIndex device_;
  std::mutex mu_;
  ncclComm_t comm_ = nullptr;  // mu_; null once aborted or destroyed
};

} // namespace nccl
} // namespace pyddp
