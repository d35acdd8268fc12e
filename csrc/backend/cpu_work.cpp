#include "backend/cpu_work.h"

#include "backend/torch_types.h"
#include "common/check.h"
#include "common/interrupt.h"
#include "common/process_state.h"
#include "transport/wait_policy.h"

namespace pyddp {

CpuWork::CpuWork(int rank, CollectiveKind kind, std::vector<at::Tensor> outputs,
                 std::thread::id workerId, Driver driver, std::string what, GiveUp giveUp)
    : c10d::Work(rank, opTypeOf(kind)),
      kind_(kind),
      workerId_(workerId),
      driver_(std::move(driver)),
      what_(std::move(what)),
      giveUp_(std::move(giveUp)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

std::string CpuWork::describe() const {
  if (!what_.empty()) return what_;
  const uint64_t seq = seq_.load(std::memory_order_relaxed);
  return std::string(toString(kind_)) + (seq ? " #" + std::to_string(seq) : " (queued)");
}

CpuWork::~CpuWork() {
  std::lock_guard<std::mutex> lock(mutex_);
}

bool CpuWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ && future_->completed();
}

c10::intrusive_ptr<c10::ivalue::Future> CpuWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  return future_;
}

int CpuWork::sourceRank() const {
  const int source = source_.load(std::memory_order_relaxed);
  return source >= 0 ? source : c10d::Work::sourceRank();
}

std::vector<at::Tensor> CpuWork::result() {
  std::lock_guard<std::mutex> lock(mutex_);
  return outputs_;
}

bool CpuWork::wait(std::chrono::milliseconds timeout) {
  const process::ExitGate gate;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!completed_) {
      PYDDP_CHECK(std::this_thread::get_id() != workerId_, "rank ", rank_, ": waiting for ",
                  describe(), " inside a future callback of the same process group would "
                  "deadlock (callbacks run on the thread that runs the collectives); chain "
                  "it with get_future().then(...) instead");
      const bool done = driver_ ? drive(lock, timeout) : sleep(lock, timeout);
      PYDDP_CHECK_COMM(done, "rank ", rank_, ": ", describe(), " did not complete within the ",
                       timeout.count(), " ms given to Work.wait(); it is still running");
    }
  }
  // complete() and fail() settle the Work before the future; wait for both,
  // so that is_completed() and exception() agree with what wait() returned.
  future_->wait();
  std::lock_guard<std::mutex> lock(mutex_);
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

bool CpuWork::drive(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  Backoff backoff;
  while (!completed_) {
    if (timeout != kNoTimeout && Clock::now() - start >= timeout) return false;
    lock.unlock();
    const bool moved = driver_();
    giveUpIfInterrupted();
    if (moved) {
      backoff.restart();
    } else {
      backoff.pause();
    }
    lock.lock();
  }
  return true;
}

bool CpuWork::sleep(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout) {
  const bool bounded = timeout != kNoTimeout;
  const auto deadline = Clock::now() + (bounded ? timeout : std::chrono::milliseconds(0));
  if (!interruptible()) {
    if (!bounded) {
      cv_.wait(lock, [&] { return completed_; });
      return true;
    }
    return cv_.wait_until(lock, deadline, [&] { return completed_; });
  }
  // An interruptible waiter wakes up every InterruptScope::kPeriod to ask.
  while (!completed_) {
    const auto now = Clock::now();
    if (bounded && now >= deadline) return false;
    const auto wake = now + InterruptScope::kPeriod;
    cv_.wait_until(lock, bounded ? std::min(deadline, wake) : wake);
    if (completed_) break;
    lock.unlock();
    giveUpIfInterrupted();
    lock.lock();
  }
  return true;
}

void CpuWork::giveUpIfInterrupted() {
  if (!interruptRequested()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completed_) return;  // it finished meanwhile: nothing to give up
  }
  const std::string why = c10::str("rank ", rank_, ": interrupted while waiting for ",
                                   describe(), "; this rank gave up on it");
  if (giveUp_) giveUp_(why);
  PYDDP_CHECK_COMM(false, why);
}

// The Work completes first: a future callback that waits for this Work
// (on the worker thread) then finds it done.
void CpuWork::complete() {
  finish();
  future_->markCompleted(c10::IValue(outputs_));
}

void CpuWork::fail(std::exception_ptr error) {
  finish(error);
  future_->setError(error);
}

} // namespace pyddp
