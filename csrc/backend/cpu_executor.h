// CpuExecutor: runs an engine's CPU collectives. One worker thread runs
// queued collectives in call order, as ProcessGroupGloo does, so a caller
// gets its Work at once and DDP overlaps communication with backward. A
// synchronous call with nothing queued runs on the caller's thread instead,
// saving two thread hand-offs per small message.
//
// A group is used from one thread at a time, as in torch.distributed: the
// order of collectives is what pairs them across ranks, and two threads'
// calls have none. A synchronous call made while another thread's
// synchronous call is in flight is refused (the worker thread, running a
// future callback, is exempt: its calls are ordered by the collective that
// completed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "backend/cpu_work.h"
#include "backend/executor.h"
#include "transport/transport.h"

namespace pyddp {

class CpuExecutor final : public Executor {
 public:
  // `timeoutMs` bounds every collective.
  CpuExecutor(int rank, int64_t timeoutMs);
  ~CpuExecutor() override;

  // What the executor tells the peers through, given by the engine.
  struct Hooks {
    // After each collective's transfer (NCCL's ring posts a held-back send).
    std::function<void()> flush;
    // A transfer failed: this rank is out of step; peers should fail at once.
    std::function<void(const std::string& why)> abandon;
    // Teardown, or a waiter was interrupted: every current and later wait
    // fails.
    std::function<void()> abort;
    // Teardown, once the worker stopped: peers waiting in a collective this
    // rank will not join fail at once. Null where peers cannot be told
    // without racing a collective they are still finishing (gloo's), so
    // they find out at their timeout.
    std::function<void(const std::string& why)> leave;
  };

  // Starts the worker; what the hooks use stays alive until shutdown() has
  // returned.
  void start(Hooks hooks);
  // The hooks of a connected transport.
  static Hooks hooksOf(Transport& transport);

  c10::intrusive_ptr<c10d::Work> submit(Collective c, const CallOptions& call) override;
  bool runNow(const CollectiveDesc& desc, const CallOptions& call, TransferRef transfer,
              FinishRef finish) override;
  // Stops the worker and makes a running collective fail within
  // milliseconds (the transport aborts its waits); queued collectives fail;
  // then marks this rank as having given up, so peers waiting on it fail at
  // once. Safe from a future callback, which runs on the worker itself: the
  // worker is then joined later (joinStoppedWorkers()).
  void shutdown(Teardown how) override;

 private:
  struct Job {
    Collective collective;
    c10::intrusive_ptr<CpuWork> work;
    // A synchronous call of a thread other than the worker: its turn
    // (Queue::syncTicket while in flight); 0 otherwise.
    uint64_t syncTicket;
  };
  // Queue and worker state, shared with the worker thread and with the
  // Works (which may outlive the executor) so that it stays valid when the
  // group is destroyed from one of its own future callbacks (which run on
  // the worker thread).
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> jobs;  // mu
    bool busy = false;     // mu; a job is running (worker or caller)
    bool stop = false;     // mu; what the hooks use may be gone once set
    std::thread::id workerId;
    // Set by start(), then only read: under mu by a Work's give-up (which
    // checks stop first), without it by the running job and shutdown().
    Hooks hooks;
    // mu; the synchronous call in flight (another thread's is refused):
    // its ticket, from nextTicket; 0 while none. Cleared when its job ends
    // or its waiter gives up; a ticket, not a thread id, so that a late
    // end of an abandoned call cannot clear a newer call's turn.
    uint64_t syncTicket = 0;
    uint64_t nextTicket = 1;
    // mu; why this rank gave up on the group (an interrupted waiter).
    std::string gaveUp;
    // Set once gaveUp is, so that a collective looks at it without the lock.
    std::atomic<bool> hasGivenUp{false};
    bool exited = false;  // mu; the worker left its loop
  };

  // Whether a call runs at once on the calling thread (queue_->mu held): a
  // synchronous one with nothing ahead of it (keeping call order), or one
  // from a future callback (on the worker, inside the job that just
  // finished its transfer): queueing that one would deadlock.
  bool runsHere(const CallOptions& call, bool onWorker) const;
  // Refuses a call the group cannot take (not connected, destroyed, another
  // thread's synchronous call in flight), else counts it as issued; returns
  // its turn as the synchronous caller (0: none). The caller holds
  // queue_->mu.
  uint64_t admit(CollectiveKind kind, const CallOptions& call, bool onWorker);
  // Runs one collective as the next in sequence; returns its error.
  std::exception_ptr runCollective(CollectiveDesc& desc, std::chrono::milliseconds timeout,
                                   TransferRef transfer, FinishRef finish, CpuWork* work);
  void run(Job& job);
  // Runs a synchronous job on the calling thread (`lock` holds the queue).
  void runHere(std::unique_lock<std::mutex>& lock, Job& job, bool onWorker);
  // Runs a workless call on the calling thread (`lock` holds the queue,
  // `ticket` is its turn); throws its error.
  void runWorkless(std::unique_lock<std::mutex>& lock, bool onWorker, uint64_t ticket,
                   CollectiveDesc desc, std::chrono::milliseconds timeout, TransferRef transfer,
                   FinishRef finish);
  // The job's synchronous call is over: another thread may make one.
  void endSync(const Job& job);
  static void workerLoop(std::shared_ptr<Queue> queue, CpuExecutor* executor);

  const int rank_;
  const int64_t timeoutMs_;
  bool started_ = false;
  std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  // Touched by the running job only (busy serialises jobs, and a callback's
  // nested call runs after its parent's transfer):
  // the sequence number of the next collective to run, 1, 2, ... in the
  // order collectives reach the transport, which every rank shares even
  // when a future callback runs a collective ahead of queued ones;
  uint64_t nextSeq_ = 1;
  // the failure that left the transport out of step with the peers.
  std::string brokenBy_;
  std::atomic<bool> shutDown_{false};
  std::thread worker_;
};

// Joins the workers that were stopped from one of their own future
// callbacks, except the calling thread's. pyddp calls it at interpreter
// exit, before Python finalises: such a worker may still be releasing
// Python objects (the callback, tensors), and a thread that takes the GIL
// once finalisation began is ended by pthread_exit through noexcept
// destructors, which is std::terminate.
void joinStoppedWorkers();

} // namespace pyddp
