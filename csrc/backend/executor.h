// How an engine runs its collectives. A collective reaches an executor as a
// Collective: its descriptor (the executor numbers it), the tensors it
// returns and uses, how it moves the bytes and the local work that
// finishes it. Executors run collectives one at a time in call order;
// every rank issues the same collectives in the same order, so that order
// is their sequence numbers, the same on every rank.
//
// CpuExecutor (CPU tensors: a worker thread, or the caller's thread) and
// DeviceExecutor (CUDA tensors: enqueued on an internal stream) implement
// it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/deadline.h"
#include "common/descriptor.h"

namespace pyddp {

struct Collective {
  CollectiveDesc desc;              // seq is set by the executor
  std::vector<at::Tensor> outputs;  // the Work's result and its future's value
  // The other tensors the transfer reads or writes (inputs, scratch): a
  // device executor protects them from the caching allocator.
  std::vector<at::Tensor> uses;
  // Moves the bytes, inside the transport: a failure leaves this rank out
  // of step with its peers, and the engine refuses later collectives.
  std::function<void(const CollectiveDesc& desc, Deadline deadline)> transfer;
  // Local work after the transfer (copying results back into the tensors).
  std::function<void()> finish;
  // wait() blocks the host until done (a barrier), also on a device.
  bool hostBlocking = false;
  // Bounds the collective's waits; zero or less: the engine's timeout.
  std::chrono::milliseconds timeout{0};
};

// What every entry point takes besides its tensors, as c10d's options do.
struct CallOptions {
  // The caller waits for the Work itself; else the call is done when the
  // entry point returns (on a CUDA device: the caller's current stream
  // waits for it), or, when it returns a Work the executor queued behind
  // running work, once that Work is.
  bool asyncOp = false;
  // Bounds this call's waits; c10d::kUnsetTimeout: the group's timeout.
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout;
  // A synchronous caller that needs no Work (pyddp's Python layer, which
  // returns None): an executor that ran the collective at once may return
  // a null Work, sparing the Work and its future on the small-message path.
  bool workless = false;
};

class Executor {
 public:
  using TransferRef =
      c10::function_ref<void(const CollectiveDesc& desc, Deadline deadline)>;
  using FinishRef = c10::function_ref<void()>;

  virtual ~Executor() = default;
  // Runs or queues c and returns its Work: done when it ran on the calling
  // thread (or null, when call.workless allows it), pending when it was
  // queued, which a synchronous caller then waits for.
  virtual c10::intrusive_ptr<c10d::Work> submit(Collective c, const CallOptions& call) = 0;
  // The small-message path: a workless synchronous call that this executor
  // would run at once on the caller's thread runs here, borrowing its
  // transfer and finish for the call's length, so nothing is copied into a
  // Collective or allocated; true once it ran (its error thrown). False,
  // having done nothing, when the collective must go through submit().
  virtual bool runNow(const CollectiveDesc& /*desc*/, const CallOptions& /*call*/,
                      TransferRef /*transfer*/, FinishRef /*finish*/) {
    return false;
  }
  // Fails queued collectives and ends a running one within milliseconds,
  // saying the group was `how`-ed; Aborted tells the peers first, so that
  // what they hear is the abort. Idempotent.
  virtual void shutdown(Teardown how) = 0;

  // How many collectives submit() has accepted. Counted when a collective
  // is issued, not when it runs, so every rank that made the same calls
  // has the same count, whatever its queue holds: c10d's sequence number
  // (Engine::getSequenceNumberForGroup).
  uint64_t issued() const { return issued_.load(std::memory_order_relaxed); }

 protected:
  std::atomic<uint64_t> issued_{0};
};

class CpuExecutor;
class DeviceExecutor;

// An engine's executor for `device`: the CPU worker, or a CUDA device's
// internal stream (CUDA builds only; none otherwise). `cpu` or `device`
// points at it, the other is null.
struct EngineExecutor {
  std::unique_ptr<Executor> owner;
  CpuExecutor* cpu = nullptr;
  DeviceExecutor* device = nullptr;
};
EngineExecutor makeExecutor(int rank, c10::Device device, std::chrono::milliseconds timeout);

} // namespace pyddp
