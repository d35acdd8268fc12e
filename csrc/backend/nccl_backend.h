// NcclBackend: NCCL's own collectives behind pyddp's process-group methods
// (the names and signatures of RingBackend's, so the Python ProcessGroup
// can hold either), for CUDA tensors on one device per rank. It is the
// baseline and test oracle of pyddp's GPU paths, and the path across hosts.
// A c10d::Backend. Collectives are enqueued from the caller's thread onto
// an internal stream, with the stream semantics of backend/cuda_stream.h;
// a WorkMonitor thread fails collectives that outlive the timeout (and
// aborts the communicator, so that their kernels exit). Unlike the shm
// path, ranks' calls are not compared (as in torch's ProcessGroupNCCL): a
// mismatch hangs on the device until the timeout, then fails every
// pending collective. Only compiled in CUDA builds.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>

#include "backend/arg_checks.h"
#include "backend/cuda_stream.h"
#include "transport/nccl.h"

namespace pyddp {

class NcclBackend final : public c10d::Backend {
 public:
  // Creates this rank's communicator on cuda:<device>; NCCL's unique id
  // travels through `store` (rank 0 sets it; the store must be this
  // group's own, e.g. a PrefixStore). Blocks until every rank has joined,
  // at most `timeout`, which also bounds every collective. Several ranks
  // on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1.
  NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              std::chrono::milliseconds timeout, int device);
  ~NcclBackend() override;

  const std::string getBackendName() const override { return "pyddp-nccl"; }
  c10::Device device() const { return device_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // One collective each, enqueued behind the work already queued on the
  // caller's current stream; returns at once with a Work (CudaWork). With
  // asyncOp=false the caller's current stream waits for the collective
  // before this returns; the host does not, except for barrier.
  c10::intrusive_ptr<c10d::Work> allReduce(const at::Tensor& tensor, RedOp op, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> allGatherSingle(const at::Tensor& output,
                                                 const at::Tensor& input, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> allGatherList(const std::vector<at::Tensor>& outputs,
                                               const at::Tensor& input, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> broadcastFrom(const at::Tensor& tensor, int src, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> reduceScatterSingle(const at::Tensor& output,
                                                     const at::Tensor& input, RedOp op,
                                                     bool asyncOp);
  c10::intrusive_ptr<c10d::Work> barrierAll(bool asyncOp);

  // Fails the collectives still running and ends the communicator
  // (gracefully when idle, else aborting it). Idempotent; the destructor
  // calls it.
  void shutdown();

 private:
  // Enqueues the collective's work on scope.stream(); every host wait is
  // bounded by deadline.
  using Enqueue = std::function<void(const gpu::StreamScope& scope, Clock::time_point deadline)>;

  // Numbers the collective, runs `enqueue` inside a StreamScope (inputs
  // and outputs protected with record_stream), and hands the Work to the
  // monitor. A failure while enqueuing leaves this rank out of step with
  // its peers: the group is failed and refuses later collectives.
  c10::intrusive_ptr<c10d::Work> launch(CollectiveKind kind,
                                        const std::vector<at::Tensor>& inputs,
                                        std::vector<at::Tensor> outputs, bool hostBlocking,
                                        bool asyncOp, const Enqueue& enqueue);

  const std::chrono::milliseconds timeout_;
  const c10::Device device_;
  const ArgChecks checks_;
  // Destroyed in reverse order: the monitor (whose hooks use the
  // communicator) goes first.
  std::unique_ptr<nccl::Communicator> comm_;
  std::unique_ptr<gpu::CollectiveStream> stream_;
  std::unique_ptr<gpu::WorkMonitor> monitor_;
  // Serialises launches: the order of sequence numbers is the order on
  // the stream, which every rank must share.
  std::mutex mu_;
  uint64_t nextSeq_ = 1;  // mu_
  std::atomic<bool> shutDown_{false};
};

} // namespace pyddp
