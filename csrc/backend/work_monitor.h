// WorkMonitor: the thread that fails a GPU engine's collectives when they
// outlive their deadline or when the engine finds an asynchronous error.
// Only compiled in CUDA builds.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "backend/cuda_work.h"

namespace pyddp {
namespace gpu {

// Watches an engine's pending Works on one device from a thread of its
// own. Every kMonitorPeriod it drops the Works that are done, polls for
// asynchronous errors, and checks deadlines; the first failure (a deadline
// passed, or poll() returned a message) fails every pending Work, then
// calls onFailure (e.g. abort the communicator, so that kernels waiting for
// a peer exit), and stays: failure() is then non-empty and the engine
// refuses new collectives. Works watched after a failure fail at once.
class WorkMonitor {
 public:
  // A message when the engine found an asynchronous error, else "".
  using Poll = std::function<std::string()>;
  using OnFailure = std::function<void(const std::string& why)>;

  // `rank` names this rank in errors.
  WorkMonitor(int rank, c10::DeviceIndex device, Poll poll, OnFailure onFailure);
  ~WorkMonitor();
  WorkMonitor(const WorkMonitor&) = delete;
  WorkMonitor& operator=(const WorkMonitor&) = delete;

  // `work` (already enqueued) must finish within `timeout` from now.
  void watch(c10::intrusive_ptr<CudaWork> work, std::chrono::milliseconds timeout);
  // The failure that broke the engine; "" while healthy.
  std::string failure() const;
  // Fails the engine now with `why` (e.g. an enqueue failed).
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
