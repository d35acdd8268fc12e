// The Work of one CPU collective: c10d's Work (wait / is_completed /
// exception, bound by torch) plus a future completed with the output
// tensors, which is what torch DDP's comm hooks and get_future() use.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/types.h"

namespace pyddp {

class CpuWork final : public c10d::Work {
 public:
  // Moves bytes on behalf of a waiter; returns whether anything moved.
  using Driver = std::function<bool()>;
  // Makes this rank give up on the operation, telling the peers why.
  using GiveUp = std::function<void(const std::string& why)>;

  // `workerId` is the thread that runs the group's queued collectives and
  // their future callbacks (backend/cpu_executor.h). With a `driver`, a
  // waiter calls it until the Work completes instead of sleeping until
  // another thread completes it (point-to-point: no hand-off on the
  // latency path). `what` names the operation in errors when it has no
  // sequence number ("send to rank 1 (tag 0)"). `giveUp` is called when a
  // waiter is interrupted (common/interrupt.h) before the Work completed.
  CpuWork(int rank, CollectiveKind kind, std::vector<at::Tensor> outputs,
          std::thread::id workerId, Driver driver = nullptr, std::string what = "",
          GiveUp giveUp = nullptr);
  // The last reference may go on the worker thread (its Job's), after the
  // caller's thread dropped its own in torch's binding, whose reference
  // count ThreadSanitizer does not see. Every accessor of the caller's
  // thread ends holding mutex_, and so does this: the accesses are then
  // ordered before the delete as ThreadSanitizer sees it too.
  ~CpuWork() override;

  // The collective got its sequence number and reached the transport.
  void started(uint64_t seq) { seq_.store(seq, std::memory_order_relaxed); }
  // Done, and the future completed too (so get_future().value() is ready).
  bool isCompleted() override;

  // Returns once the collective is done and its future is completed, so
  // get_future().value() is ready; rethrows the collective's error. A
  // timeout error names the rank and the call. An interrupted waiter
  // (common/interrupt.h) gives up on the group and throws.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;

  void complete();
  void fail(std::exception_ptr error);
  // A receive's sender, before complete(): what sourceRank() returns.
  void setSourceRank(int rank) { source_.store(rank, std::memory_order_relaxed); }
  // The sender of a completed receive (torch's Work._source_rank()).
  int sourceRank() const override;

 private:
  // "all_reduce #3", or "all_reduce (queued)" before it started.
  std::string describe() const;

  // Block until completed_ for at most `timeout` (kNoTimeout: no limit);
  // return whether it completed. mutex_ held. drive() moves the bytes
  // itself (driver_), sleep() waits for the thread that does. Both give up
  // and throw when the waiter is interrupted.
  bool drive(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout);
  bool sleep(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout);
  // Throws, having given up (giveUp_), when this thread's caller wants out.
  // mutex_ not held: the check may take the GIL, which a thread asking
  // isCompleted() may hold.
  void giveUpIfInterrupted();

  const CollectiveKind kind_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<int> source_{-1};
  const std::thread::id workerId_;
  const Driver driver_;
  const std::string what_;
  const GiveUp giveUp_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace pyddp
