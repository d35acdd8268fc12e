// Stream semantics of GPU collectives (DESIGN.md, "Execution model"), as
// reusable pieces for every GPU backend (NcclBackend, RingBackend's GPU
// mode), in the manner of torch's ProcessGroupNCCL:
//
//  - each backend owns an internal stream on its device (CollectiveStream);
//  - a collective runs inside a StreamScope: the internal stream first
//    waits for everything the caller queued on its current stream, then is
//    the current stream while the collective is enqueued (so ATen ops for
//    temporaries and copies run there too); tensors that cross streams are
//    protected with record_stream (StreamScope::use);
//  - the Work (CudaWork) holds a "done" event recorded after the collective:
//    wait() makes the caller's current stream wait on it without blocking
//    the host, isCompleted() queries it, and getFuture() is a CUDA-aware
//    future completed at enqueue time, whose value()/then() synchronise the
//    consumer's streams with the event;
//  - errors that appear after enqueue (a timeout, NCCL's asynchronous
//    errors, a transport that detects a device-side timeout) reach the Work
//    through CudaWork::setError, usually from a WorkMonitor thread that
//    watches every pending Work against its deadline.
//
// Only compiled in CUDA builds. Uses only APIs present in torch 2.11-2.14.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_device.h"
#include "common/types.h"

namespace pyddp {
namespace gpu {

using Clock = std::chrono::steady_clock;

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
  // also after the backend is gone, so it must own what it reads.
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

// A backend's internal stream on one device: a stream of its own, not one
// of torch's pool (which other code shares): a collective that waits on a
// peer must never hold up unrelated work queued behind it.
class CollectiveStream {
 public:
  explicit CollectiveStream(c10::Device device);
  ~CollectiveStream();
  CollectiveStream(const CollectiveStream&) = delete;
  CollectiveStream& operator=(const CollectiveStream&) = delete;
  c10::Device device() const { return device_; }
  const c10::cuda::CUDAStream& stream() const { return stream_; }

 private:
  friend class StreamScope;
  const c10::Device device_;
  const c10::cuda::CUDAStream stream_;
  // Recorded on the caller's stream by each StreamScope. One event serves
  // every collective: cudaStreamWaitEvent captures the event's state when
  // it is called, so re-recording it later does not affect earlier waits.
  Event callerReady_;
};

// One collective's visit to the internal stream. Construction: the
// internal stream waits for the caller's current stream on that device,
// and becomes the current stream. Destruction: the caller's stream (and
// device) are current again. Not thread-safe: the backend serialises
// collectives (their order on the stream is their order on every rank).
class StreamScope {
 public:
  explicit StreamScope(CollectiveStream& s);
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

  cudaStream_t stream() const { return internal_.stream(); }
  // `t` (allocated by the caller, on its stream) is used by the collective:
  // the caching allocator must not hand its memory to another tensor before
  // the internal stream is past this point, even if the caller frees it.
  void use(const at::Tensor& t) const;

 private:
  const c10::cuda::CUDAStream internal_;
  c10::cuda::CUDAStreamGuard guard_;
};

// Watches a backend's pending Works on one device from a thread of its
// own. Every kMonitorPeriod it drops the Works that are done, polls for
// asynchronous errors, and checks deadlines; the first failure (a deadline
// passed, or poll() returned a message) fails every pending Work, then
// calls onFailure (e.g. abort the communicator, so that kernels waiting for
// a peer exit), and stays: failure() is then non-empty and the backend
// refuses new collectives. Works watched after a failure fail at once.
class WorkMonitor {
 public:
  // A message when the backend found an asynchronous error, else "".
  using Poll = std::function<std::string()>;
  using OnFailure = std::function<void(const std::string& why)>;

  // `rank` names this rank in errors.
  WorkMonitor(int rank, c10::DeviceIndex device, Poll poll, OnFailure onFailure);
  ~WorkMonitor();
  WorkMonitor(const WorkMonitor&) = delete;
  WorkMonitor& operator=(const WorkMonitor&) = delete;

  // `work` (already enqueued) must finish within `timeout` from now.
  void watch(c10::intrusive_ptr<CudaWork> work, std::chrono::milliseconds timeout);
  // The failure that broke the backend; "" while healthy.
  std::string failure() const;
  // Fails the backend now with `why` (e.g. an enqueue failed).
  void fail(const std::string& why);
  // Teardown: fails the Works still pending with `why`, stops the thread
  // and returns whether any was pending. Idempotent. onFailure is not
  // called: the caller tears down the communicator itself.
  bool stop(const std::string& why);

 private:
  struct Watched {
    c10::intrusive_ptr<CudaWork> work;
    std::chrono::milliseconds timeout;
    Clock::time_point deadline;
  };
  void loop();
  // Drops completed Works from the front (they complete in stream order).
  // mu_ held.
  void dropCompleted();
  // Records the failure, fails every pending Work; true for the first.
  bool failPending(const std::string& why);

  const int rank_;
  const c10::DeviceIndex device_;
  const Poll poll_;
  const OnFailure onFailure_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Watched> pending_;  // mu_
  std::string failure_;          // mu_
  bool stopped_ = false;         // mu_
  std::thread thread_;
};

} // namespace gpu
} // namespace pyddp
