#include "backend/work_monitor.h"

#include <pthread.h>

#include "common/check.h"
#include "common/cuda_device.h"
#include "common/process_state.h"

namespace pyddp {
namespace gpu {
namespace {

// How often the monitor looks at pending Works. Deadlines are minutes, so
// this only bounds how late a timeout or an asynchronous NCCL error is
// noticed and how long finished Works (and their tensors) stay referenced
// by the monitor. ProcessGroupNCCL's watchdog wakes every 100 ms; 10 ms
// releases tensors sooner and costs nothing measurable.
constexpr auto kMonitorPeriod = std::chrono::milliseconds(10);

} // namespace

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
  process::markOwnThread();
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopped_ || !pending_.empty(); });
    if (cv_.wait_for(lock, kMonitorPeriod, [&] { return stopped_; })) return;
    std::string why;
    try {
      // Event queries go to the engine's device: no context on device 0.
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
      why = messageOf(e);
    }
    if (why.empty()) continue;
    lock.unlock();
    fail(why);
    lock.lock();
  }
}

} // namespace gpu
} // namespace pyddp
