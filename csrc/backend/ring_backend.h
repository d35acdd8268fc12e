// RingBackend: pyddp's ring and direct collectives for the tensors of one
// device, a c10d::Backend so it can also serve torch.distributed.
//
// CPU: the shm transport, and one worker thread that runs queued
// collectives in call order, as ProcessGroupGloo does; a synchronous call
// with nothing queued runs on the caller's thread instead, saving two
// thread hand-offs per small message.
//
// CUDA (CUDA builds): the cuda_ipc transport. Collectives are enqueued from
// the caller's thread onto an internal stream with the stream semantics of
// backend/cuda_stream.h (as NcclBackend's), and a WorkMonitor fails the
// ones whose device-side waits gave up or that outlive the timeout.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "algorithms/collectives.h"
#include "backend/arg_checks.h"
#include "backend/work.h"
#include "common/config.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/cuda_stream.h"
#include "common/cuda_device.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"
#endif

namespace pyddp {

class RingBackend final : public c10d::Backend {
 public:
  // Blocks until every rank has connected (bounded by options.timeoutMs).
  // `device` is the CPU (transport shm) or one CUDA device (transport
  // cuda_ipc, or "nccl": NCCL send/recv, for rings across hosts); every
  // rank's transport must reach every peer, else every rank fails naming
  // the refusal.
  RingBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              const RingOptions& options, c10::Device device = c10::Device(c10::kCPU),
              const std::string& transport = "");
  ~RingBackend() override;

  const std::string getBackendName() const override { return "pyddp"; }
  const RingOptions& options() const { return options_; }
  c10::Device device() const { return device_; }

  // One collective each; returns at once when asyncOp, else when done.
  c10::intrusive_ptr<c10d::Work> allReduce(const at::Tensor& tensor, RedOp op,
                                           bool asyncOp);
  c10::intrusive_ptr<c10d::Work> allGatherSingle(const at::Tensor& output,
                                                 const at::Tensor& input,
                                                 bool asyncOp);
  c10::intrusive_ptr<c10d::Work> allGatherList(const std::vector<at::Tensor>& outputs,
                                               const at::Tensor& input,
                                               bool asyncOp);
  c10::intrusive_ptr<c10d::Work> broadcastFrom(const at::Tensor& tensor, int src,
                                               bool asyncOp);
  c10::intrusive_ptr<c10d::Work> reduceScatterSingle(const at::Tensor& output,
                                                     const at::Tensor& input,
                                                     RedOp op, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> barrierAll(bool asyncOp);

  // Stops the worker and makes a running collective fail within
  // milliseconds; queued collectives fail. Idempotent; the destructor calls it.
  void shutdown() override;

  // torch.distributed's entry points (init_process_group("pyddp")): one
  // tensor (list) per process, mapped onto the calls above. Operations not
  // overridden here fail with c10d's "Backend pyddp does not support <op>".
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  // Moves the bytes; runs inside the transport, so a failure leaves the
  // transport out of step with the peers.
  using Transfer = std::function<void(const algorithms::Call&)>;
  // Local work after the transfer (copying results back into the tensors).
  using Finish = std::function<void()>;
  struct Job {
    CollectiveDesc desc;
    Transfer transfer;
    Finish finish;
    c10::intrusive_ptr<RingWork> work;
  };
  // Queue and worker state, shared with the worker thread so that it stays
  // valid when the group is destroyed from one of its own future callbacks
  // (which run on the worker thread).
  struct Executor {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> queue;  // mu
    bool busy = false;      // mu; a job is running (worker or caller)
    bool stop = false;      // mu
    std::thread::id workerId;
  };

  // all_reduce (root -1) or reduce to root; all_gather (root -1) or gather
  // to root, where only the root passes outputs.
  c10::intrusive_ptr<c10d::Work> reduceTo(const at::Tensor& tensor, RedOp op, int root,
                                          bool asyncOp);
  c10::intrusive_ptr<c10d::Work> gatherTo(const std::vector<at::Tensor>& outputs,
                                          const at::Tensor& input, int root, bool asyncOp);

  // `uses` are the other tensors the transfer reads or writes (inputs,
  // scratch): a device collective protects them from the caching allocator.
  // The transport named (or device_'s default); a device transport also
  // gets stream_.
  std::unique_ptr<Transport> makeTransport(const std::string& name);
  // Device mode: blocks until the internal stream has drained, or the
  // deadline passes (returns false then).
  bool drainDevice(Clock::time_point deadline) const;
  // Device mode: the WorkMonitor that fails collectives whose device waits
  // gave up or that outlive the timeout.
  void startMonitor();
  // Device mode, at shutdown: let queued collectives finish and meet every
  // peer, so that no rank frees memory a peer still reads.
  void retireDevice();

  c10::intrusive_ptr<c10d::Work> submit(CollectiveDesc desc,
                                        std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> uses, Transfer transfer,
                                        Finish finish, bool asyncOp);
  // submit() for a CUDA device: enqueued at once, on the caller's thread.
  c10::intrusive_ptr<c10d::Work> submitToDevice(CollectiveDesc desc,
                                                std::vector<at::Tensor> outputs,
                                                const std::vector<at::Tensor>& uses,
                                                const Transfer& transfer, const Finish& finish,
                                                bool asyncOp);
  void run(Job& job);
  static void workerLoop(std::shared_ptr<Executor> exec, RingBackend* backend);

  kernels::ReduceSpec spec(DataType dtype, RedOp op) const;
  // torch.distributed's arguments: the one tensor of a per-process list,
  // and pyddp's operator for a c10d::ReduceOp.
  const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* call,
                           const char* what) const;
  RedOp redOp(const c10d::ReduceOp& op, const char* call) const;

  const RingOptions options_;
  const c10::Device device_;
  const ArgChecks checks_;
#ifdef PYDDP_WITH_CUDA
  // Device mode only; declared before the transport that enqueues on it.
  std::unique_ptr<gpu::CollectiveStream> stream_;
#endif
  std::unique_ptr<Transport> transport_;
#ifdef PYDDP_WITH_CUDA
  ipc::CudaIpcTransport* ipc_ = nullptr;  // transport_, when it is cuda_ipc
  // Declared after the transport, so destroyed first: its hooks use it.
  std::unique_ptr<gpu::WorkMonitor> monitor_;
  std::mutex deviceMu_;  // serialises device launches: their stream order is their seq order
#endif
  std::shared_ptr<Executor> exec_ = std::make_shared<Executor>();
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
