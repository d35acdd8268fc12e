// DeviceExecutor: runs an engine's CUDA collectives. Each collective is
// enqueued from the caller's thread onto the engine's internal stream
// (backend/cuda_stream.h), behind the work the caller queued on its
// current stream; its Work (backend/cuda_work.h) completes when the stream
// passes it, and a WorkMonitor (backend/work_monitor.h) fails the
// collectives whose device-side waits gave up or that outlive the timeout.
// Only compiled in CUDA builds.
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "backend/cuda_stream.h"
#include "backend/cuda_work.h"
#include "backend/executor.h"
#include "backend/work_monitor.h"
#include "transport/transport.h"

namespace pyddp {

class DeviceExecutor final : public Executor {
 public:
  // What differs between the engines that enqueue on a device.
  struct Hooks {
    // The ring transport whose verbs the transfers enqueue; null for an
    // engine that calls a library (NCCL) itself. After each transfer it
    // flushes; when an enqueue fails it abandons the collective, so that
    // peers learn it; its flag targets are fixed at enqueue, so CUDA graph
    // capture is refused.
    Transport* transport = nullptr;
    // Asynchronous errors (device waits that gave up, dead peers, NCCL's
    // errors), polled by the monitor while collectives are pending.
    gpu::WorkMonitor::Poll poll;
    // The group failed: make kernels still waiting for peers exit.
    gpu::WorkMonitor::OnFailure onFailure;
    // An error the device recorded while running a collective, read when
    // its done event fires (see CudaWork::DeviceCheck); may be null.
    gpu::CudaWork::DeviceCheck deviceCheck;
  };

  DeviceExecutor(int rank, c10::Device device, std::chrono::milliseconds timeout);
  ~DeviceExecutor() override;

  // Stream first, hooks second: a transport is made on stream() and then
  // handed over with the hooks, before the first submit.
  cudaStream_t stream() const { return stream_.stream().stream(); }
  void start(Hooks hooks);

  c10::intrusive_ptr<c10d::Work> submit(Collective c, const CallOptions& call) override;
  // Fails pending collectives and stops the monitor; true when any was
  // pending (the caller then aborts rather than ends gracefully).
  bool stop(const std::string& why);
  void shutdown(Teardown how) override;

  // A clean end for an engine whose peers read its memory: unless the group
  // failed, lets queued collectives finish (bounded by the timeout), then
  // calls meet(seq, deadline) with the sequence number of one more
  // collective, every rank alike, while no other collective can start.
  void retire(const std::function<void(const CollectiveDesc& desc, Deadline deadline)>&
                  meet);

 private:
  // Blocks until the stream has drained, or the deadline passes (false).
  bool drain(Clock::time_point deadline) const;

  const int rank_;
  const c10::Device device_;
  const std::chrono::milliseconds timeout_;
  gpu::CollectiveStream stream_;
  Hooks hooks_;
  std::unique_ptr<gpu::WorkMonitor> monitor_;
  // Serialises launches: the order of sequence numbers is the order on the
  // stream, which every rank must share.
  std::mutex mu_;
  uint64_t nextSeq_ = 1;  // mu_
  std::atomic<bool> stopped_{false};
};

} // namespace pyddp
