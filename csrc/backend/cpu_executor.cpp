#include "backend/cpu_executor.h"

#include <pthread.h>

#include "common/check.h"

namespace pyddp {
namespace {

// Marks the queue busy for one job, whatever the job throws. Only a queued
// job waits for `busy` to clear: waking the idle worker after every inline
// call would cost two context switches per small collective.
template <typename Queue>
class BusyScope {
 public:
  BusyScope(std::unique_lock<std::mutex>& lock, Queue& queue) : lock_(lock), queue_(queue) {
    queue_.busy = true;
    lock_.unlock();
  }
  ~BusyScope() {
    lock_.lock();
    queue_.busy = false;
    if (!queue_.jobs.empty()) queue_.cv.notify_all();
  }

 private:
  std::unique_lock<std::mutex>& lock_;
  Queue& queue_;
};

} // namespace

CpuExecutor::CpuExecutor(int rank, int64_t timeoutMs) : rank_(rank), timeoutMs_(timeoutMs) {}

CpuExecutor::Hooks CpuExecutor::hooksOf(Transport& transport) {
  return Hooks{[&transport] { transport.flush(); },
               [&transport](const std::string& why) { transport.abandon(why); },
               [&transport] { transport.abort(); }};
}

void CpuExecutor::start(Hooks hooks) {
  hooks_ = std::move(hooks);
  started_ = true;
  worker_ = std::thread(workerLoop, queue_, this);
  std::lock_guard<std::mutex> lock(queue_->mu);
  queue_->workerId = worker_.get_id();
}

CpuExecutor::~CpuExecutor() {
  shutdown();
}

void CpuExecutor::shutdown() {
  // The first caller does the work; a concurrent or later one returns (a
  // callback on the worker must not wait for a caller joining the worker).
  if (shutDown_.exchange(true)) return;
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stop = true;
    dropped.swap(queue_->jobs);
  }
  queue_->cv.notify_all();
  if (started_) hooks_.abort();
  for (Job& job : dropped) {
    job.work->fail(std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        c10::str("pyddp: rank ", rank_, ": the process group was destroyed before this ",
                 toString(job.collective.desc.kind), " ran"))));
  }
  if (!worker_.joinable()) return;
  if (std::this_thread::get_id() == worker_.get_id()) {
    // Destroyed from a future callback: the worker leaves its loop once the
    // callback returns, touching only the shared Queue.
    worker_.detach();
  } else {
    worker_.join();
  }
}

void CpuExecutor::workerLoop(std::shared_ptr<Queue> queue, CpuExecutor* executor) {
  pthread_setname_np(pthread_self(), "pyddp-worker");
  std::unique_lock<std::mutex> lock(queue->mu);
  while (true) {
    queue->cv.wait(lock, [&] { return queue->stop || (!queue->jobs.empty() && !queue->busy); });
    if (queue->stop) return;
    Job job = std::move(queue->jobs.front());
    queue->jobs.pop_front();
    BusyScope busy(lock, *queue);
    executor->run(job);  // `executor` may be gone once this returns
  }
}

c10::intrusive_ptr<c10d::Work> CpuExecutor::submit(Collective c, bool asyncOp) {
  std::unique_lock<std::mutex> lock(queue_->mu);
  PYDDP_CHECK(started_, "rank ", rank_, ": ", toString(c.desc.kind),
              " before the process group connected");
  PYDDP_CHECK(!queue_->stop, "rank ", rank_, ": ", toString(c.desc.kind),
              " on a process group that was destroyed");
  ++issued_;
  auto work = c10::make_intrusive<CpuWork>(rank_, c.desc.kind, std::move(c.outputs),
                                           queue_->workerId);
  Job job{std::move(c), work};
  if (!asyncOp && std::this_thread::get_id() == queue_->workerId) {
    // A future callback (on the worker, inside the job that just finished
    // its transfer) waits for this call: queueing it would deadlock.
    lock.unlock();
    run(job);
    return work;
  }
  if (!asyncOp && queue_->jobs.empty() && !queue_->busy) {
    // Nothing is ahead of this call: run it here, keeping call order.
    BusyScope busy(lock, *queue_);
    run(job);
    return work;
  }
  queue_->jobs.push_back(std::move(job));
  queue_->cv.notify_all();
  return work;
}

void CpuExecutor::run(Job& job) {
  Collective& c = job.collective;
  c.desc.seq = nextSeq_++;
  job.work->started(c.desc.seq);
  try {
    PYDDP_CHECK_COMM(brokenBy_.empty(), "rank ", rank_, ": ", toString(c.desc.kind), " #",
                     c.desc.seq, " refused: an earlier collective failed and left the "
                     "process group unusable (", brokenBy_, "); destroy it and create a new one");
    try {
      const auto timeout =
          c.timeout.count() > 0 ? c.timeout : std::chrono::milliseconds(timeoutMs_);
      c.transfer(c.desc, Clock::now() + timeout);
      if (hooks_.flush) hooks_.flush();
    } catch (const std::exception& e) {
      brokenBy_ = messageOf(e);
      hooks_.abandon(brokenBy_);
      throw;
    }
    c.finish();
  } catch (const std::exception&) {
    job.work->fail(std::current_exception());
    return;
  }
  job.work->complete();
}

} // namespace pyddp
