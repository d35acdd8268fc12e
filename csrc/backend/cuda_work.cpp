#include "backend/cuda_work.h"

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "backend/torch_types.h"
#include "common/check.h"
#include "common/cuda_device.h"
#include "common/process_state.h"

namespace pyddp {
namespace gpu {
namespace {

// Host waits (host-blocking Works, wait() with a timeout) poll the done
// event, backing off from kHostPollMin to kHostPollMax: a barrier's event
// usually fires within microseconds of the last rank's arrival, while a
// long wait should cost little CPU; the price is at most kHostPollMax of
// extra latency on long waits.
constexpr auto kHostPollMin = std::chrono::microseconds(20);
constexpr auto kHostPollMax = std::chrono::microseconds(1000);

} // namespace

std::exception_ptr commError(const std::string& message) {
  try {
    PYDDP_CHECK_COMM(false, message);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

Event::Event(c10::DeviceIndex device) : device_(device) {
  c10::cuda::CUDAGuard guard(device);
  checkCuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
}

Event::~Event() {
  if (!event_) return;
  // Under the event's device, so that a thread without a CUDA context (the
  // Python garbage collector's) does not create one on device 0.
  QuietDeviceGuard guard(device_);
  cudaEventDestroy(event_);
}

void Event::record(cudaStream_t stream) {
  checkCuda(cudaEventRecord(event_, stream), "cudaEventRecord");
}

void Event::block(cudaStream_t stream) const {
  checkCuda(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

bool Event::query() const {
  // A Work is polled from any thread (the monitor's, Python's): without the
  // guard, one with no current context would make one on device 0.
  QuietDeviceGuard guard(device_);
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  checkCuda(err, "cudaEventQuery");
  return true;
}

CudaWork::CudaWork(int rank, CollectiveKind kind, std::string what, c10::Device device,
                   std::vector<at::Tensor> outputs, bool hostBlocking,
                   DeviceCheck deviceCheck)
    : c10d::Work(rank, opTypeOf(kind)),
      what_(std::move(what)),
      device_(device),
      hostBlocking_(hostBlocking),
      deviceCheck_(std::move(deviceCheck)),
      outputs_(std::move(outputs)),
      done_(device.index()),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device})) {}

void CudaWork::enqueued(const c10::cuda::CUDAStream& stream) {
  // The future records its events on the current stream of each device
  // its tensors live on: that must be the stream that wrote them.
  c10::cuda::CUDAStreamGuard guard(stream.unwrap());
  done_.record(stream.stream());
  enqueued_.store(true, std::memory_order_release);
  future_->markCompleted(c10::IValue(outputs_));
}

bool CudaWork::settle(std::exception_ptr error) {
  if (settled_.exchange(true)) return false;
  finish(std::move(error));
  return true;
}

bool CudaWork::setError(std::exception_ptr error) {
  return settle(std::move(error));
}

bool CudaWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return true;
  }
  if (!enqueued_.load(std::memory_order_acquire)) return false;
  try {
    if (done_.query()) {
      const std::string failed = deviceCheck_ ? deviceCheck_() : "";
      settle(failed.empty() ? nullptr : commError(failed));
    }
  } catch (const std::exception&) {
    settle(std::current_exception());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_;
}

void CudaWork::waitHost(std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  std::chrono::microseconds pause = kHostPollMin;
  while (!isCompleted()) {
    PYDDP_CHECK_COMM(timeout == kNoTimeout || Clock::now() - start < timeout, "rank ", rank_,
                     ": ", what_, " did not complete within the ", timeout.count(),
                     " ms given to Work.wait(); it is still running");
    std::unique_lock<std::mutex> lock(mutex_);
    // setError() notifies cv_; the event needs polling.
    cv_.wait_for(lock, pause, [&] { return completed_; });
    pause = std::min<std::chrono::microseconds>(pause * 2, kHostPollMax);
  }
}

bool CudaWork::wait(std::chrono::milliseconds timeout) {
  const process::ExitGate gate;
  if (hostBlocking_ || timeout != kNoTimeout) waitHost(timeout);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (exception_) std::rethrow_exception(exception_);
  }
  synchronize();
  return true;
}

void CudaWork::synchronize() {
  done_.block(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
}

} // namespace gpu
} // namespace pyddp
