// NcclEngine: NCCL's own collectives for CUDA tensors on one device per
// rank. It is the baseline and test oracle of pyddp's GPU paths, and the
// path across hosts. Collectives are enqueued from the caller's thread onto
// an internal stream (backend/device_executor.h). Unlike RingEngine, ranks'
// calls are not compared (as in torch's ProcessGroupNCCL): a mismatch hangs
// on the device until the timeout, then fails every pending collective.
// Several ranks on one GPU need NCCL >= 2.30 with
// NCCL_MULTI_RANK_GPU_ENABLE=1. Only compiled in CUDA builds.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>

#include "backend/device_executor.h"
#include "backend/engine.h"
#include "transport/nccl_comm.h"

namespace pyddp {

class NcclEngine final : public Engine {
 public:
  // Creates this rank's communicator on `device`; NCCL's unique id travels
  // through `store` (which must be this group's own, e.g. a PrefixStore).
  // Blocks until every rank has joined, at most `timeout`, which also
  // bounds every collective.
  NcclEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout, c10::Device device);
  ~NcclEngine() override;

  const std::string getBackendName() const override { return "pyddp-nccl"; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  WorkPtr allReduce(const at::Tensor& tensor, RedOp op, const CallOptions& call) override;
  WorkPtr allGatherSingle(const at::Tensor& output, const at::Tensor& input,
                          const CallOptions& call) override;
  WorkPtr allGatherList(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                        const CallOptions& call) override;
  WorkPtr broadcastFrom(const at::Tensor& tensor, int src, const CallOptions& call) override;
  WorkPtr reduceScatterSingle(const at::Tensor& output, const at::Tensor& input, RedOp op,
                              const CallOptions& call) override;
  WorkPtr barrierAll(const CallOptions& call) override;
  WorkPtr reduceTo(const at::Tensor& tensor, RedOp op, int root,
                   const CallOptions& call) override;
  WorkPtr gatherTo(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root,
                   const CallOptions& call) override;
  WorkPtr scatterFrom(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root,
                      const CallOptions& call) override;
  WorkPtr allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                         const std::vector<int64_t>& outputSplits,
                         const std::vector<int64_t>& inputSplits,
                         const CallOptions& call) override;
  WorkPtr allToAllList(const std::vector<at::Tensor>& outputs,
                       const std::vector<at::Tensor>& inputs, const CallOptions& call) override;
  WorkPtr allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                             const CallOptions& call) override;
  WorkPtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs,
                             const CallOptions& call) override;
  WorkPtr reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs, RedOp op,
                                 const CallOptions& call) override;
  WorkPtr sendTo(const at::Tensor& tensor, int dst, int64_t tag,
                 const CallOptions& call) override;
  WorkPtr recvFrom(const at::Tensor& tensor, int src, int64_t tag,
                   const CallOptions& call) override;

  // Fails the collectives still running and ends the communicator
  // (gracefully when idle, else aborting it). Idempotent; the destructor
  // calls it.
  void shutdown() override;

 protected:
  const Executor& executor() const override { return *executor_; }

 private:
  // Enqueues the collective's NCCL calls on `stream`; every host wait is
  // bounded by deadline.
  using Enqueue = std::function<void(cudaStream_t stream, Clock::time_point deadline)>;
  WorkPtr launch(CollectiveKind kind, std::vector<at::Tensor> inputs,
                 std::vector<at::Tensor> outputs, const CallOptions& call, Enqueue enqueue);
  // NCCL calls in one group (ncclGroupStart/End), so they progress together.
  void group(const char* what, const std::function<ncclResult_t(ncclComm_t)>& calls,
             Clock::time_point deadline);
  // One grouped send and receive per peer: block k of `in` to rank k, block
  // k of `out` from rank k (this rank's own block included).
  void exchange(const char* what, DataType dtype, const at::Tensor& in,
                const ArgChecks::Blocks& sends, const at::Tensor& out,
                const ArgChecks::Blocks& recvs, cudaStream_t stream,
                Clock::time_point deadline);

  const std::chrono::milliseconds timeout_;
  // Destroyed in reverse order: the executor (whose monitor uses the
  // communicator, and whose stream NCCL's kernels run on) goes first.
  std::unique_ptr<nccl::Communicator> comm_;
  std::unique_ptr<DeviceExecutor> executor_;
  std::atomic<bool> shutDown_{false};
};

} // namespace pyddp
