// The cuda_ipc flag kernels. Lean on purpose (docs/building.md: every
// include costs compile time): CUDA runtime and the plain protocol header
// only.
#include <cuda_runtime.h>

#include "transport/cuda_ipc_kernels.h"

namespace pyddp {
namespace ipc {
namespace {

// Nanoseconds between two looks at a flag: a peer's flag lives in another
// process's memory (maybe another GPU's), and a tight loop of remote loads
// takes bandwidth from the data kernels beside it. An initial value; not
// yet tuned on a GPU.
constexpr unsigned kPollSleepNs = 64;

__device__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void waitKernel(WaitList waits, SharedWords words, uint64_t timeoutNs) {
  if (*words.error != 0) return;  // an earlier wait gave up: drain the stream
  const uint64_t start = globalTimerNs();
  for (int i = 0; i < waits.n; ++i) {
    while (true) {
      const int64_t verdict =
          waitVerdict(*waits.flag[i], waits.target[i], *waits.peerFailed[i], *words.abort,
                      globalTimerNs() - start, timeoutNs, waits.peer[i]);
      if (verdict == kOk) break;
      if (verdict > 0) {
        *words.error = verdict;
        __threadfence_system();
        *words.ownFailed = 1;
        return;
      }
      __nanosleep(kPollSleepNs);
    }
  }
  // acquire: the data kernel after this one reads what the flags guard
  __threadfence_system();
}

__global__ void signalKernel(SignalList signals, SharedWords words) {
  if (*words.error != 0) return;
  // release: the data written before (by earlier kernels of this stream)
  // is visible to any rank that sees the flags
  __threadfence_system();
  for (int i = 0; i < signals.n; ++i) *signals.flag[i] = signals.value[i];
}

} // namespace

cudaError_t launchWait(const WaitList& waits, const SharedWords& words, uint64_t timeoutNs,
                       cudaStream_t stream) {
  waitKernel<<<1, 1, 0, stream>>>(waits, words, timeoutNs);
  return cudaGetLastError();
}

cudaError_t launchSignal(const SignalList& signals, const SharedWords& words,
                         cudaStream_t stream) {
  signalKernel<<<1, 1, 0, stream>>>(signals, words);
  return cudaGetLastError();
}

} // namespace ipc
} // namespace pyddp
