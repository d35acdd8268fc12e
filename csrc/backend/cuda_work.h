// The Work of one GPU collective (CudaWork), with the stream semantics
// every GPU engine shares (docs/architecture.md, "Execution"), in the
// manner of torch's ProcessGroupNCCL:
//
//  - the Work holds a "done" event recorded after the collective on the
//    engine's internal stream (backend/cuda_stream.h): wait() makes the
//    caller's current stream wait on it without blocking the host,
//    isCompleted() queries it, and getFuture() is a CUDA-aware future
//    completed at enqueue time, whose value()/then() synchronise the
//    consumer's streams with the event;
//  - errors that appear after enqueue (a timeout, NCCL's asynchronous
//    errors, a transport that detects a device-side timeout) reach the Work
//    through CudaWork::setError, usually from the WorkMonitor
//    (backend/work_monitor.h).
//
// Only compiled in CUDA builds. Uses only APIs present in torch 2.11-2.14.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/types.h"

namespace pyddp {
namespace gpu {

// A DistBackendError carrying `message` (prefixed "pyddp: "), for failing
// a Work from another thread.
std::exception_ptr commError(const std::string& message);

// A CUDA event without timing data, owned.
class Event {
 public:
  explicit Event(c10::DeviceIndex device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(cudaStream_t stream);
  // `stream` waits for the work before the last record(); the host does not.
  void block(cudaStream_t stream) const;
  // True once the work before the last record() is done (and, as in CUDA,
  // when record() was never called). Throws on a CUDA error.
  bool query() const;

 private:
  const c10::DeviceIndex device_;
  cudaEvent_t event_ = nullptr;
};

// The Work of one GPU collective.
class CudaWork final : public c10d::Work {
 public:
  // `what` names the collective in errors ("all_reduce #3"). hostBlocking:
  // wait() also blocks the host until the collective is done, as a barrier
  // must.
  // Reports an error that the device recorded while running the
  // collective (e.g. a cuda_ipc wait that gave up, after which the stream
  // drains with wrong data); "" when none. Read once the done event has
  // fired, before the Work settles as a success; may run on any thread,
  // also after the engine is gone, so it must own what it reads.
  using DeviceCheck = std::function<std::string()>;

  CudaWork(int rank, CollectiveKind kind, std::string what, c10::Device device,
           std::vector<at::Tensor> outputs, bool hostBlocking,
           DeviceCheck deviceCheck = nullptr);

  // The collective is enqueued on `stream`: records the done event there
  // and completes the future with the outputs (CUDA-aware: consumers'
  // streams wait on the event). Called once, before the Work is shared.
  void enqueued(const c10::cuda::CUDAStream& stream);

  // The hook for errors found after enqueue, callable from any thread: the
  // first of setError() and the done event settles the Work; returns true
  // when this call did. wait() and exception() report the error. The
  // future, completed at enqueue, is not changed (as in ProcessGroupNCCL):
  // a failed group refuses its later collectives instead.
  bool setError(std::exception_ptr error);

  // Done (the event fired) or failed. Non-blocking.
  bool isCompleted() override;
  // Rethrows the error, if any; then makes the caller's current stream wait
  // for the collective. Blocks the host only for host-blocking Works or
  // when `timeout` is given (then until done, or throws after timeout).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // The caller's current stream waits for the collective.
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  const std::string& what() const { return what_; }

 private:
  bool settle(std::exception_ptr error);
  // Blocks the host until completed or `timeout` (kNoTimeout: no limit).
  void waitHost(std::chrono::milliseconds timeout);

  const std::string what_;
  const c10::Device device_;
  const bool hostBlocking_;
  const DeviceCheck deviceCheck_;
  std::vector<at::Tensor> outputs_;
  Event done_;
  std::atomic<bool> enqueued_{false};
  std::atomic<bool> settled_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace gpu
} // namespace pyddp
