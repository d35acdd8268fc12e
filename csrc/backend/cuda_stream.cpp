#include "backend/cuda_stream.h"

#include <pthread.h>

#include <algorithm>

#include "backend/work.h"
#include "common/check.h"
#include "common/cuda_device.h"

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

// How often the monitor looks at pending Works. Deadlines are minutes, so
// this only bounds how late a timeout or an asynchronous NCCL error is
// noticed and how long finished Works (and their tensors) stay referenced
// by the monitor. ProcessGroupNCCL's watchdog wakes every 100 ms; 10 ms
// releases tensors sooner and costs nothing measurable.
constexpr auto kMonitorPeriod = std::chrono::milliseconds(10);

} // namespace

std::exception_ptr commError(const std::string& message) {
  try {
    PYDDP_CHECK_COMM(false, message);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// --- Event ------------------------------------------------------------------

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
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  checkCuda(err, "cudaEventQuery");
  return true;
}

// --- CudaWork ---------------------------------------------------------------

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

// --- CollectiveStream, StreamScope ------------------------------------------

namespace {
cudaStream_t createStream(c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = nullptr;
  checkCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            "creating a collective stream");
  return stream;
}
} // namespace

CollectiveStream::CollectiveStream(c10::Device device)
    : device_(device),
      stream_(c10::cuda::getStreamFromExternal(createStream(device), device.index())),
      callerReady_(device.index()) {}

CollectiveStream::~CollectiveStream() {
  // Whatever is still queued must not touch freed memory: let it drain.
  // Errors are ignored (a destructor cannot report them).
  QuietDeviceGuard guard(device_.index());
  cudaStreamSynchronize(stream_.stream());
  cudaStreamDestroy(stream_.stream());
}

namespace {
// The internal stream, after making it wait for the caller's current
// stream (read before the scope makes the internal stream current).
c10::cuda::CUDAStream afterCaller(CollectiveStream& s, Event& callerReady) {
  c10::cuda::CUDAGuard device(s.device());
  callerReady.record(c10::cuda::getCurrentCUDAStream(s.device().index()).stream());
  callerReady.block(s.stream().stream());
  return s.stream();
}
} // namespace

StreamScope::StreamScope(CollectiveStream& s)
    : internal_(afterCaller(s, s.callerReady_)), guard_(internal_.unwrap()) {}

void StreamScope::use(const at::Tensor& t) const {
  if (t.defined() && t.is_cuda()) t.record_stream(internal_.unwrap());
}

// --- WorkMonitor ------------------------------------------------------------

WorkMonitor::WorkMonitor(int rank, c10::DeviceIndex device, Poll poll, OnFailure onFailure)
    : rank_(rank), device_(device), poll_(std::move(poll)), onFailure_(std::move(onFailure)) {
  thread_ = std::thread([this] { loop(); });
}

WorkMonitor::~WorkMonitor() {
  stop(c10::str("rank ", rank_, ": the process group was destroyed"));
}

void WorkMonitor::watch(c10::intrusive_ptr<CudaWork> work, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!failure_.empty()) {
    const std::string why = failure_;
    lock.unlock();
    work->setError(commError(why));
    return;
  }
  pending_.push_back({std::move(work), timeout, Clock::now() + timeout});
  cv_.notify_all();
}

std::string WorkMonitor::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void WorkMonitor::fail(const std::string& why) {
  if (failPending(why)) onFailure_(why);
}

bool WorkMonitor::failPending(const std::string& why) {
  std::deque<Watched> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) return false;
    failure_ = why;
    dropCompleted();  // those are settled already (a device check may have failed them)
    failed.swap(pending_);
  }
  const auto error = commError(why);
  for (auto& w : failed) w.work->setError(error);
  return true;
}

void WorkMonitor::dropCompleted() {
  while (!pending_.empty() && pending_.front().work->isCompleted()) pending_.pop_front();
}

bool WorkMonitor::stop(const std::string& why) {
  std::deque<Watched> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return false;
    stopped_ = true;
    dropCompleted();
    failed.swap(pending_);
    if (failure_.empty()) failure_ = why;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  const auto error = commError(why);
  for (auto& w : failed) w.work->setError(error);
  return !failed.empty();
}

void WorkMonitor::loop() {
  pthread_setname_np(pthread_self(), "pyddp-monitor");
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopped_ || !pending_.empty(); });
    if (cv_.wait_for(lock, kMonitorPeriod, [&] { return stopped_; })) return;
    std::string why;
    try {
      // Event queries go to the backend's device: no context on device 0.
      checkCuda(cudaSetDevice(device_), "cudaSetDevice to the monitor's device");
      dropCompleted();
      const auto now = Clock::now();
      for (const auto& w : pending_) {
        if (now < w.deadline) continue;
        why = c10::str("rank ", rank_, ": ", w.work->what(), " on cuda:",
                       static_cast<int>(device_), " did not finish within the timeout of ",
                       w.timeout.count(), " ms (a peer did not call it, called a different "
                       "collective, or died)");
        break;
      }
      if (why.empty() && !pending_.empty()) {
        lock.unlock();
        why = poll_();
        lock.lock();
      }
    } catch (const std::exception& e) {
      const auto* c10Error = dynamic_cast<const c10::Error*>(&e);
      why = c10Error ? c10Error->what_without_backtrace() : e.what();
    }
    if (why.empty()) continue;
    lock.unlock();
    fail(why);
    lock.lock();
  }
}

} // namespace gpu
} // namespace pyddp
