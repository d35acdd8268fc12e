#include "backend/cpu_executor.h"

#include <pthread.h>

#include <vector>

#include "common/check.h"
#include "common/interrupt.h"
#include "common/process_state.h"

namespace pyddp {
namespace {

// Takes the queue's lock for a caller that may hold the GIL (a small
// synchronous call, HoldsGil in bindings.cpp): if another thread has the
// lock, the caller lets Python's threads run before it waits for it, since
// that thread may be waiting for the GIL (the worker drops a finished job,
// whose tensors may take it, with the lock held; giveUp fails Works, whose
// future callbacks may, under it).
void lockAsCaller(std::unique_lock<std::mutex>& lock) {
  if (lock.try_lock()) return;
  aboutToBlock();
  lock.lock();
}

// Marks the queue busy for one job, whatever the job throws. Only a queued
// job waits for `busy` to clear: waking the idle worker after every inline
// call would cost two context switches per small collective. A workless
// call's synchronous turn (`syncTicket`, nonzero) ends with it, under the
// same lock.
template <typename Queue>
class BusyScope {
 public:
  BusyScope(std::unique_lock<std::mutex>& lock, Queue& queue, uint64_t syncTicket = 0)
      : lock_(lock), queue_(queue), syncTicket_(syncTicket) {
    queue_.busy = true;
    lock_.unlock();
  }
  ~BusyScope() {
    lockAsCaller(lock_);
    queue_.busy = false;
    if (syncTicket_ != 0 && queue_.syncTicket == syncTicket_) queue_.syncTicket = 0;
    if (!queue_.jobs.empty()) queue_.cv.notify_all();
  }

 private:
  std::unique_lock<std::mutex>& lock_;
  Queue& queue_;
  const uint64_t syncTicket_;
};

// Workers stopped from one of their own future callbacks, until another
// thread joins them. Process-wide: a worker outlives the executor and the
// engine that started it. Never destroyed: a process that exits without
// joinStoppedWorkers() (os._exit) must not run the destructor of a joinable
// std::thread, which is std::terminate.
class StoppedWorkers {
 public:
  struct Entry {
    std::thread thread;
    std::function<bool()> exited;  // the worker has left its loop
  };

  void add(Entry entry) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.push_back(std::move(entry));
  }

  // A child of fork() has none of these threads: it never joins them, and
  // never destroys their std::threads (common/process_state.h). The lock is
  // held across fork(), so no child inherits it held.
  static void lockForFork();
  static void unlockAfterFork();
  static void disownInChild();

  // Joins the workers that have left their loop (`all`: every worker),
  // except the calling thread.
  void join(bool all) {
    std::vector<Entry> ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = entries_.begin(); it != entries_.end();) {
        if (it->thread.get_id() != std::this_thread::get_id() && (all || it->exited())) {
          ready.push_back(std::move(*it));
          it = entries_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Entry& e : ready) e.thread.join();
  }

 private:
  std::mutex mu_;
  std::vector<Entry> entries_;
};

StoppedWorkers& stoppedWorkers() {
  static auto* workers = [] {
    process::onFork(StoppedWorkers::lockForFork, StoppedWorkers::unlockAfterFork,
                    StoppedWorkers::disownInChild);
    return new StoppedWorkers();
  }();
  return *workers;
}

void StoppedWorkers::lockForFork() {
  stoppedWorkers().mu_.lock();
}

void StoppedWorkers::unlockAfterFork() {
  stoppedWorkers().mu_.unlock();
}

void StoppedWorkers::disownInChild() {
  StoppedWorkers& w = stoppedWorkers();
  new std::vector<Entry>(std::move(w.entries_));  // never destroyed, never joined
  w.entries_.clear();
  w.mu_.unlock();
}

} // namespace

void joinStoppedWorkers() {
  stoppedWorkers().join(/*all=*/true);
}

CpuExecutor::CpuExecutor(int rank, int64_t timeoutMs) : rank_(rank), timeoutMs_(timeoutMs) {}

CpuExecutor::Hooks CpuExecutor::hooksOf(Transport& transport) {
  return Hooks{[&transport] { transport.flush(); },
               [&transport](const std::string& why) { transport.abandon(why); },
               [&transport] { transport.abort(); },
               [&transport](const std::string& why) { transport.leave(why); }};
}

void CpuExecutor::start(Hooks hooks) {
  started_ = true;
  std::lock_guard<std::mutex> lock(queue_->mu);
  queue_->hooks = std::move(hooks);
  worker_ = std::thread(workerLoop, queue_, this);
  queue_->workerId = worker_.get_id();
}

CpuExecutor::~CpuExecutor() {
  shutdown(Teardown::Destroyed);
}

void CpuExecutor::shutdown(Teardown how) {
  // The first caller does the work; a concurrent or later one returns (a
  // callback on the worker must not wait for a caller joining the worker).
  if (shutDown_.exchange(true)) return;
  const std::string ended = c10::str("rank ", rank_, " ", pastTense(how), " its process group");
  // An abort reaches the peers before the running collective fails here,
  // so that the reason they read is the abort, not that collective's end.
  if (started_ && how == Teardown::Aborted) queue_->hooks.abandon(ended);
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stop = true;
    dropped.swap(queue_->jobs);
  }
  queue_->cv.notify_all();
  if (started_) queue_->hooks.abort();
  for (Job& job : dropped) {
    job.work->fail(std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        c10::str("pyddp: rank ", rank_, ": the process group was ", pastTense(how),
                 " before this ", toString(job.collective.desc.kind), " ran"))));
  }
  if (worker_.joinable()) {
    if (std::this_thread::get_id() == worker_.get_id()) {
      // Destroyed from a future callback: the worker leaves its loop once
      // the callback returns, touching only the shared Queue, and is joined
      // by the next shutdown elsewhere or at exit.
      std::shared_ptr<Queue> queue = queue_;
      stoppedWorkers().add({std::move(worker_), [queue] {
                              std::lock_guard<std::mutex> lock(queue->mu);
                              return queue->exited;
                            }});
    } else {
      worker_.join();
      stoppedWorkers().join(/*all=*/false);
    }
  }
  // Peers waiting on this rank, in a collective it will not join now, fail
  // at once instead of at their timeout. (A collective that was running has
  // told them already, with its own reason.)
  if (started_ && queue_->hooks.leave) {
    queue_->hooks.leave(c10::str(ended, dropped.empty() ? "" : " with collectives queued"));
  }
}

void CpuExecutor::workerLoop(std::shared_ptr<Queue> queue, CpuExecutor* executor) {
  pthread_setname_np(pthread_self(), "pyddp-worker");
  process::markOwnThread();
  std::unique_lock<std::mutex> lock(queue->mu);
  while (true) {
    queue->cv.wait(lock, [&] { return queue->stop || (!queue->jobs.empty() && !queue->busy); });
    if (queue->stop) {
      queue->exited = true;
      return;
    }
    Job job = std::move(queue->jobs.front());
    queue->jobs.pop_front();
    BusyScope busy(lock, *queue);
    executor->run(job);  // `executor` may be gone once this returns
  }
}

bool CpuExecutor::runsHere(const CallOptions& call, bool onWorker) const {
  return !call.asyncOp && (onWorker || (queue_->jobs.empty() && !queue_->busy));
}

uint64_t CpuExecutor::admit(CollectiveKind kind, const CallOptions& call, bool onWorker) {
  PYDDP_CHECK(started_, "rank ", rank_, ": ", toString(kind),
              " before the process group connected");
  PYDDP_CHECK(!queue_->stop, "rank ", rank_, ": ", toString(kind),
              " on a process group that was destroyed");
  uint64_t ticket = 0;
  if (!call.asyncOp && !onWorker) {
    PYDDP_CHECK(queue_->syncTicket == 0, "rank ", rank_, ": ", toString(kind),
                " refused: another thread is inside a synchronous collective on this process "
                "group. A group is used from one thread at a time (as in torch.distributed): "
                "collectives of two threads would pair up across ranks in whatever order the "
                "threads reach them");
    ticket = queue_->syncTicket = queue_->nextTicket++;
  }
  ++issued_;  // not before the refusal: a refused call issues nothing
  return ticket;
}

bool CpuExecutor::runNow(const CollectiveDesc& desc, const CallOptions& call,
                         TransferRef transfer, FinishRef finish) {
  if (!call.workless) return false;
  std::unique_lock<std::mutex> lock(queue_->mu, std::defer_lock);
  lockAsCaller(lock);
  const bool onWorker = std::this_thread::get_id() == queue_->workerId;
  if (!runsHere(call, onWorker)) return false;
  const uint64_t ticket = admit(desc.kind, call, onWorker);
  runWorkless(lock, onWorker, ticket, desc, call.timeout, transfer, finish);
  return true;
}

c10::intrusive_ptr<c10d::Work> CpuExecutor::submit(Collective c, const CallOptions& call) {
  std::unique_lock<std::mutex> lock(queue_->mu, std::defer_lock);
  lockAsCaller(lock);
  const bool onWorker = std::this_thread::get_id() == queue_->workerId;
  const uint64_t ticket = admit(c.desc.kind, call, onWorker);
  const bool here = runsHere(call, onWorker);
  if (here && call.workless) {
    runWorkless(lock, onWorker, ticket, c.desc, c.timeout, c.transfer, c.finish);
    return {};
  }
  // An interrupted waiter gives up on the group: the running collective
  // fails at once (its waits are aborted) and tells the peers why, and
  // no later one runs. A synchronous caller that gave up is no longer
  // inside its call, though its job has yet to be refused.
  std::weak_ptr<Queue> weak = queue_;
  auto giveUp = [weak, ticket](const std::string& why) {
    const auto queue = weak.lock();
    if (!queue) return;
    std::lock_guard<std::mutex> lock(queue->mu);
    if (ticket != 0 && queue->syncTicket == ticket) queue->syncTicket = 0;
    if (queue->stop || !queue->gaveUp.empty()) return;
    queue->gaveUp = why;
    queue->hasGivenUp.store(true, std::memory_order_release);
    try {
      queue->hooks.abandon(why);
    } catch (const std::exception&) {
      // Telling the peers through the store failed (it went with the rank
      // that hosted it): they find out at their timeout; this rank still
      // gives up.
    }
    queue->hooks.abort();
  };
  auto work = c10::make_intrusive<CpuWork>(rank_, c.desc.kind, std::move(c.outputs),
                                           queue_->workerId, nullptr, "", std::move(giveUp));
  Job job{std::move(c), work, ticket};
  if (here) {
    runHere(lock, job, onWorker);
    return work;
  }
  queue_->jobs.push_back(std::move(job));
  queue_->cv.notify_all();
  return work;
}

void CpuExecutor::runHere(std::unique_lock<std::mutex>& lock, Job& job, bool onWorker) {
  if (onWorker) {
    // The worker is busy already, with the job whose callback this is.
    lock.unlock();
    run(job);
  } else {
    BusyScope busy(lock, *queue_);
    run(job);
  }
}

void CpuExecutor::runWorkless(std::unique_lock<std::mutex>& lock, bool onWorker,
                              uint64_t ticket, CollectiveDesc desc,
                              std::chrono::milliseconds timeout, TransferRef transfer,
                              FinishRef finish) {
  std::exception_ptr error;
  if (onWorker) {
    // As in runHere; a call from the worker has no synchronous turn.
    lock.unlock();
    error = runCollective(desc, timeout, transfer, finish, nullptr);
  } else {
    BusyScope busy(lock, *queue_, ticket);
    error = runCollective(desc, timeout, transfer, finish, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void CpuExecutor::endSync(const Job& job) {
  if (job.syncTicket == 0) return;
  std::lock_guard<std::mutex> lock(queue_->mu);
  if (queue_->syncTicket == job.syncTicket) queue_->syncTicket = 0;
}

std::exception_ptr CpuExecutor::runCollective(CollectiveDesc& desc,
                                              std::chrono::milliseconds timeout,
                                              TransferRef transfer, FinishRef finish,
                                              CpuWork* work) {
  desc.seq = nextSeq_++;
  if (work) work->started(desc.seq);
  if (brokenBy_.empty() && queue_->hasGivenUp.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(queue_->mu);
    brokenBy_ = queue_->gaveUp;
  }
  try {
    PYDDP_CHECK_COMM(brokenBy_.empty(), "rank ", rank_, ": ", toString(desc.kind), " #",
                     desc.seq, " refused: an earlier collective failed and left the "
                     "process group unusable (", brokenBy_, "); destroy it and create a new one");
    try {
      const auto bound = timeout.count() > 0 ? timeout : std::chrono::milliseconds(timeoutMs_);
      transfer(desc, Deadline::after(bound));
      if (queue_->hooks.flush) queue_->hooks.flush();
    } catch (const std::exception& e) {
      brokenBy_ = messageOf(e);
      queue_->hooks.abandon(brokenBy_);
      throw;
    }
    finish();
  } catch (const std::exception&) {
    return std::current_exception();
  }
  return nullptr;
}

void CpuExecutor::run(Job& job) {
  Collective& c = job.collective;
  const std::exception_ptr error =
      runCollective(c.desc, c.timeout, c.transfer, c.finish, job.work.get());
  // Before completing: the Work's callbacks may destroy this executor.
  endSync(job);
  if (error) {
    job.work->fail(error);
  } else {
    job.work->complete();
  }
}

} // namespace pyddp
