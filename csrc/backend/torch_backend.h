// TorchBackend: the c10d::Backend that torch.distributed's "pyddp" backend
// gives torch for a group. torch calls the backend's creator once per group
// and registers the one object it returns for every device type that the
// group maps to "pyddp" (ProcessGroup::setBackend keeps one backend of c10d's
// custom type), while an engine serves the tensors of one device. So this
// backend holds the group's engines, as pyddp's Python ProcessGroup does,
// and sends each call to the engine of its tensors' device: the CPU engine,
// made with the group, and the CUDA engine, made at the group's first call
// on CUDA tensors (pyddp/torch_backend.py is the creator).
//
// Lazy creation. Every rank issues a group's calls in the same order, so
// every rank reaches the first CUDA call at the same place in it, and the
// CUDA engine's bootstrap meets there. One thread makes the engine, under
// mu_; a call from another thread on CUDA tensors waits for it. Once made
// the engine is published through cuda_ (an atomic pointer, read without
// the lock) and never replaced. When it cannot be made (a build without
// CUDA, a GPU that torch does not see, an engine that every candidate
// refused, a peer that never came), the error is kept and every later CUDA
// call raises it at once: its peers failed alike, and meeting again would
// wait for ranks that have given up. CPU calls go on. The first CUDA call
// also fixes the group's CUDA device: tensors on another CUDA device are
// refused.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/engine.h"
#include "backend/engine_registry.h"
#include "backend/refusing_backend.h"
#include "common/config.h"

namespace pyddp {

class TorchBackend final : public RefusingBackend {
 public:
  // Told of each engine the backend makes, once it serves (for the log).
  // It runs on the thread of the call that made the engine, outside the
  // backend's lock; it must not call the backend.
  using EngineListener = std::function<void(const EngineChoice&)>;

  // Makes the CPU engine of `cpuBackend` (a backend name of
  // engine_registry.h) at once, blocking until every rank has connected.
  // `store` is the group's own; the engine of each device type meets under
  // "<type>/" of it. `crossHost` makes the groups between hosts.
  TorchBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
               const GroupOptions& options, const std::string& cpuBackend,
               CrossHostFactory crossHost, EngineListener onEngine);

  const std::string getBackendName() const override { return "pyddp"; }

  // The engine of `device`'s tensors, made for a CUDA device at its first
  // call (see above); `op` is the c10d entry point the tensors came to, for
  // messages. The engine lives as long as this backend.
  Engine& engineFor(c10::Device device, std::string_view op);
  // The engines made so far, the CPU's first.
  std::vector<c10::intrusive_ptr<Engine>> engines() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  // Meets on every engine made so far, the CPU's first, as pyddp's
  // ProcessGroup.barrier does: when it returns, the work queued on each
  // engine before it is done (the last engine's as the options ask).
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // The CPU engine's (gloo's protocol, on the CPU as gloo's).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  // The collectives issued to every engine (Engine's count, summed): ranks
  // that made the same calls agree, whichever engines they went to.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override;

  // Shut every engine down (Engine::shutdown); no engine is made after.
  // An engine being made meanwhile is waited for (within the group's
  // timeout), then shut down too.
  void shutdown() override;
  // The same, through Engine::abort: peers blocked on this rank fail at once.
  void abort() override;

  // torch.distributed.shrink_group: a backend of this group's ranks but
  // `ranksToExclude`, renumbered in their order, with this one's options and
  // backend name, meeting on a store of its own under this one's
  // ("shrink<n>/", n counting this backend's shrinks alike on every rank).
  // Every survivor calls it with the same list; with SHRINK_ABORT this
  // backend is aborted first, so that a survivor still blocked in it fails
  // at once. pyddp finds the ranks to exclude itself (ProcessGroup.shrink).
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
      const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) override;

 private:
  // The engine of the one device of `tensors` (tensors, lists of them,
  // lists of lists), the CPU's when there are none; refuses tensors of
  // two devices in one call.
  template <typename... Tensors>
  Engine& route(std::string_view op, const Tensors&... tensors);
  Engine& cudaEngine(c10::Device device, std::string_view op);
  EngineChoice make(c10::Device device, const std::string& backend) const;

  const c10::intrusive_ptr<c10d::Store> store_;
  const GroupOptions options_;
  const std::string cpuBackend_;
  const CrossHostFactory crossHost_;
  const EngineListener onEngine_;
  const c10::intrusive_ptr<Engine> cpu_;

  // Guards what follows, and makes the CUDA engine.
  mutable std::mutex mu_;
  // The CUDA engine; set once, under mu_, and never replaced.
  c10::intrusive_ptr<Engine> cudaOwner_;
  // The device of the group's first CUDA call.
  std::optional<c10::Device> cudaDevice_;
  // Why the CUDA engine could not be made; raised by every later CUDA call.
  std::exception_ptr cudaFailure_;
  bool shutDown_ = false;
  // shrink()s so far.
  int shrinks_ = 0;
  // cudaOwner_'s engine once it serves, for calls that take no lock.
  std::atomic<Engine*> cuda_{nullptr};
};

} // namespace pyddp
