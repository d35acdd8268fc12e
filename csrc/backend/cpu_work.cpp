#include "backend/cpu_work.h"

#include "backend/torch_types.h"
#include "common/check.h"
#include "common/interrupt.h"

namespace pyddp {

CpuWork::CpuWork(int rank, CollectiveKind kind, std::vector<at::Tensor> outputs,
                 std::thread::id workerId, GiveUp giveUp)
    : c10d::Work(rank, opTypeOf(kind)),
      kind_(kind),
      workerId_(workerId),
      giveUp_(std::move(giveUp)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

std::string CpuWork::describe() const {
  const uint64_t seq = seq_.load(std::memory_order_relaxed);
  return std::string(toString(kind_)) + (seq ? " #" + std::to_string(seq) : " (queued)");
}

bool CpuWork::isCompleted() {
  return c10d::Work::isCompleted() && future_->completed();
}

bool CpuWork::wait(std::chrono::milliseconds timeout) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!completed_) {
      PYDDP_CHECK(std::this_thread::get_id() != workerId_, "rank ", rank_, ": waiting for ",
                  describe(), " inside a future callback of the same process group would "
                  "deadlock (callbacks run on the thread that runs the collectives); chain "
                  "it with get_future().then(...) instead");
      // An interruptible waiter wakes up every InterruptScope::kPeriod to ask.
      const bool bounded = timeout != kNoTimeout;
      const auto deadline = Clock::now() + (bounded ? timeout : std::chrono::milliseconds(0));
      const bool polls = interruptible();
      while (!completed_) {
        const auto now = Clock::now();
        PYDDP_CHECK_COMM(!bounded || now < deadline, "rank ", rank_, ": ", describe(),
                         " did not complete within the ", timeout.count(),
                         " ms given to Work.wait(); it is still running");
        if (!polls) {
          if (bounded) {
            cv_.wait_until(lock, deadline);
          } else {
            cv_.wait(lock);
          }
          continue;
        }
        const auto wake = now + InterruptScope::kPeriod;
        cv_.wait_until(lock, bounded ? std::min(deadline, wake) : wake);
        if (completed_) break;
        // Not under mutex_: the check takes the GIL, which a thread asking
        // is_completed() may hold.
        lock.unlock();
        const bool interrupted = interruptRequested();
        lock.lock();
        if (interrupted && !completed_) {
          const std::string why = c10::str("rank ", rank_, ": interrupted while waiting for ",
                                           describe(), "; this rank gave up on the group");
          lock.unlock();
          if (giveUp_) giveUp_(why);
          PYDDP_CHECK_COMM(false, why);
        }
      }
    }
    if (exception_) std::rethrow_exception(exception_);
  }
  // complete() marks the Work done before the future; wait for both.
  future_->wait();
  return true;
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
