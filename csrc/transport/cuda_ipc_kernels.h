// Launchers of the cuda_ipc flag kernels (cuda_ipc_kernels.cu): one thread
// each, enqueued between the data kernels of a ring verb or direct round.
// See cuda_ipc_protocol.h for the protocol they implement.
#pragma once

#include <cuda_runtime_api.h>

#include "transport/cuda_ipc_protocol.h"

namespace pyddp {
namespace ipc {

// Words this rank's kernels and host share, in host-mapped memory
// (device pointers to them).
struct SharedWords {
  volatile int64_t* error;        // first failure of this rank's waits; 0 = none
  const volatile int64_t* abort;  // set by the host to end every wait
  volatile uint64_t* ownFailed;   // this rank's IpcHeader::failed (device memory)
};

// Waits until every condition of `waits` holds, or records a failure.
cudaError_t launchWait(const WaitList& waits, const SharedWords& words, uint64_t timeoutNs,
                       cudaStream_t stream);
// Stores the flags of `signals` unless this rank already failed.
cudaError_t launchSignal(const SignalList& signals, const SharedWords& words,
                         cudaStream_t stream);

} // namespace ipc
} // namespace pyddp
