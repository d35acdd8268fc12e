// TransportEngine: pyddp's algorithms (algorithms/) over one transport, for the
// tensors of one device: shm for the CPU; cuda_ipc, or NCCL send/recv for
// rings across hosts, for a CUDA device. Each entry point checks its
// arguments (a refused call leaves the group usable), plans the collective
// (algorithms/select.h: its algorithm, its copy path) and hands it to its
// executor: a worker thread for the CPU
// (backend/cpu_executor.h), the internal stream of a CUDA device
// (backend/device_executor.h). Point-to-point operations, and the
// collectives built on messages (all-to-all, gather, scatter, reduce), use
// the transport's MessageLink where it has one (shm).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/select.h"
#include "backend/cma_chooser.h"
#include "backend/engine.h"
#include "backend/executor.h"
#include "common/config.h"
#include "transport/transport.h"

namespace pyddp {

class CpuExecutor;
class DeviceExecutor;
class P2pExecutor;

class TransportEngine final : public Engine {
 public:
  // Blocks until every rank has connected `transport` (a name from
  // transport/factory.h that serves `device`), bounded by
  // options.timeoutMs; a refusal by any rank fails every rank alike,
  // naming it.
  TransportEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             const GroupOptions& options, c10::Device device, const std::string& transport);
  ~TransportEngine() override;

  const std::string getBackendName() const override { return "pyddp"; }
  const GroupOptions& options() const { return options_; }
  // Why this engine never reads registered tensors in place ("" if it may,
  // at the sizes algorithms::readsRegistered() takes): "" on every rank or on none when
  // the ranks' options agree.
  const std::string& registeredRefusal() const { return registeredRefusal_; }
  // Why this engine never reads peers' plain tensors through the kernel
  // (cross-memory attach; "" if it may, for the collectives of
  // algorithms::readsInPlace, of at least options().cmaMinBytes per rank),
  // agreed as registeredRefusal().
  const std::string& processRefusal() const { return processRefusal_; }

  // On the CPU the calls meet only pyddp's own threads (cpu_executor.h).
  bool spinsWithGil() const override { return cpuExec_ != nullptr; }

  // gloo's protocol over this engine's messages (backend/monitored_barrier.h).
  void runMonitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  // This rank gave up (an engine that composes this one failed elsewhere):
  // peers waiting on it fail at once with `why`.
  void abandon(const std::string& why);

 protected:
  const Executor& executor() const override { return *executor_; }

  WorkPtr runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf, Results results,
                       const CallOptions& call) override;
  WorkPtr runAllGather(const CollectiveDesc& desc, const at::Tensor& input,
                       const RankBlocks& output, Results results,
                       const CallOptions& call) override;
  WorkPtr runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf, Results results,
                       const CallOptions& call) override;
  WorkPtr runReduceScatter(const CollectiveDesc& desc, const at::Tensor& input,
                           const at::Tensor& output, Results results,
                           const CallOptions& call) override;
  WorkPtr runBarrier(const CollectiveDesc& desc, const CallOptions& call) override;
  // With messages (shm), only the root receives: reduce is the ring's
  // reduce phase and one block per rank to the root (direct for small
  // messages), gather and scatter one message per rank. Without, reduce
  // and gather compute into scratch on every rank, and scatter sends the
  // root's whole list down the broadcast chain.
  WorkPtr runReduce(const CollectiveDesc& desc, const at::Tensor& input,
                    const at::Tensor& output, Results results,
                    const CallOptions& call) override;
  WorkPtr runGather(const CollectiveDesc& desc, const at::Tensor& input,
                    const RankBlocks& output, Results results,
                    const CallOptions& call) override;
  WorkPtr runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                     const at::Tensor& output, Results results,
                     const CallOptions& call) override;
  WorkPtr runAllToAll(const CollectiveDesc& desc, const at::Tensor& input,
                      const at::Tensor& output, const ArgChecks::AllToAll& a, Results results,
                      const CallOptions& call) override;
  WorkPtr runSend(const at::Tensor& tensor, int dst, int64_t tag,
                  const CallOptions& call) override;
  WorkPtr runRecv(const at::Tensor& buf, int src, int64_t tag, Results results,
                  const CallOptions& call) override;
  // Stops the executors; a running collective fails within milliseconds
  // and queued ones fail. On a device whose peers read this rank's memory,
  // queued collectives finish first and every rank meets every other, so no
  // peer reads memory freed here. Idempotent; the destructor calls it.
  void shutDown(Teardown how) override;

 private:
  // Hands a collective to the executor: `transfer(const algorithms::Call&,
  // uses...)` runs the algorithm on the tensors `uses` refers to (each an
  // at::Tensor or a c10::ArrayRef of them), then `results.finish` the
  // local work after it. A call the executor runs at once borrows all of
  // them (Executor::runNow): on the small-message path it allocates nothing
  // and copies no tensor handle. Each copy is an atomic increment, and the
  // first of a tensor that Python holds takes the GIL to count a reference
  // to its PyObject (c10::intrusive_ptr): a 1-rank 4 KiB all_reduce took
  // 361 ns a call with the seven copies it made before and 267 without
  // (loops of each build). One it declines (with a Work, behind queued
  // work, on a device) is copied into a Collective that owns them.
  template <typename Transfer, typename... Uses>
  WorkPtr submit(CollectiveDesc desc, Results& results, std::tuple<const Uses&...> uses,
                 Transfer&& transfer, const CallOptions& call);
  // The same for a `transfer(const algorithms::Call&)` that holds copies of
  // the tensors it uses, which `uses` lists for the executor.
  template <typename Transfer>
  WorkPtr submit(CollectiveDesc desc, Results& results, c10::ArrayRef<at::Tensor> uses,
                 Transfer&& transfer, const CallOptions& call);
  // Starts the executor for device_ once transport_ is connected.
  void startExecutor();
  kernels::ReduceSpec spec(DataType dtype, RedOp op) const;
  void allGatherBlocks(const algorithms::Call& c, const algorithms::Plan& plan, DataType dtype,
                       const void* in, c10::ArrayRef<void*> blocks, size_t count);
  // Set once connected: whyNotReadInPlace(), or every peer's registered
  // memory mapped.
  std::string whyNotReadRegistered() const;
  // The same, with every peer's process read through the kernel.
  std::string whyNotReadProcesses() const;
  // What both need: the CPU, algo auto, a transport that maps peers'
  // memory with staging room for an algorithms::TensorWhere.
  std::string whyNotReadInPlace() const;
  // For a collective whose plan says Registered: arrives with where `mine`
  // (`bytes` long: for a reduce-scatter, its whole input) lies, with its
  // vote where it votes (cma_'s pick), and runs `run(c, mem, view)` if every
  // tensor it reads can be reached in place, else `fallback(c)` with `c`
  // marked arrived; then tells cma_ how a plan it voted on went. Other
  // plans run `fallback(call)`.
  template <typename Run, typename Fallback>
  void inPlaceOr(const algorithms::Call& call, const algorithms::Plan& selected, const void* mine,
                 size_t bytes, int root, Run&& run, Fallback&& fallback);
  std::chrono::milliseconds timeoutOf(const CallOptions& call) const;
  // The transport's messages, or a TypeError naming `call`.
  MessageLink& messages(const char* call) const;

  const GroupOptions options_;
  // Declared before the transport, so destroyed after it: a device
  // transport enqueues on the executor's stream.
  std::unique_ptr<Executor> executor_;
  CpuExecutor* cpuExec_ = nullptr;        // executor_, for the CPU
  DeviceExecutor* deviceExec_ = nullptr;  // executor_, for a CUDA device
  std::unique_ptr<Transport> transport_;
  // transport_'s, where it has messages: the collectives' and the user's.
  MessageLink* link_ = nullptr;
  MessageLink* userLink_ = nullptr;
  std::unique_ptr<P2pExecutor> p2p_;
  std::atomic<uint64_t> monitoredBarriers_{0};  // calls so far, for their tags
  std::string registeredRefusal_;  // whyNotReadRegistered(), once connected
  std::string processRefusal_;     // whyNotReadProcesses(), once connected
  algorithms::Capabilities caps_;  // what select() plans with, once connected
  // The voter's choice of the kernel copy, fed the times of the plans it
  // voted on. Used by one collective at a time (the executor's, or a
  // synchronous caller's holding the engine's turn).
  CmaChooser cma_;
  // Where a reduction copies the pieces it reads through the kernel
  // (schedule::kernelScratchBytes; empty where the group reads none),
  // owned and used as cma_.
  std::vector<std::byte> kernelScratch_;
};

} // namespace pyddp
