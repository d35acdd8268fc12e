// CpuExecutor: runs an engine's CPU collectives. One worker thread runs
// queued collectives in call order, as ProcessGroupGloo does, so a caller
// gets its Work at once and DDP overlaps communication with backward. A
// synchronous call with nothing queued runs on the caller's thread instead,
// saving two thread hand-offs per small message.
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
    // Teardown: every current and later wait fails.
    std::function<void()> abort;
  };

  // Starts the worker; what the hooks use stays alive until shutdown() has
  // returned.
  void start(Hooks hooks);
  // The hooks of a connected transport.
  static Hooks hooksOf(Transport& transport);

  c10::intrusive_ptr<c10d::Work> submit(Collective c, bool asyncOp) override;
  // Stops the worker and makes a running collective fail within
  // milliseconds (the transport aborts its waits); queued collectives fail.
  // Safe from a future callback, which runs on the worker itself.
  void shutdown() override;

 private:
  struct Job {
    Collective collective;
    c10::intrusive_ptr<CpuWork> work;
  };
  // Queue and worker state, shared with the worker thread so that it stays
  // valid when the group is destroyed from one of its own future callbacks
  // (which run on the worker thread).
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> jobs;  // mu
    bool busy = false;     // mu; a job is running (worker or caller)
    bool stop = false;     // mu
    std::thread::id workerId;
  };

  void run(Job& job);
  static void workerLoop(std::shared_ptr<Queue> queue, CpuExecutor* executor);

  const int rank_;
  const int64_t timeoutMs_;
  Hooks hooks_;
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

} // namespace pyddp
