// NcclEngine: NCCL's own collectives for CUDA tensors on one device per
// rank. It is the baseline and test oracle of pyddp's GPU paths, and the
// path across hosts. Collectives are enqueued from the caller's thread onto
// an internal stream (backend/device_executor.h). Unlike TransportEngine, ranks'
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
  // Fails the collectives still running and ends the communicator
  // (gracefully when idle, else aborting it). Idempotent; the destructor
  // calls it.
  void shutDown(Teardown how) override;

 private:
  // Enqueues the collective's NCCL calls on `stream`; every host wait is
  // bounded by deadline.
  // `uses` are the tensors the calls read or write besides the results'.
  using Enqueue = std::function<void(cudaStream_t stream, Clock::time_point deadline)>;
  WorkPtr launch(const CollectiveDesc& desc, std::vector<at::Tensor> uses, Results& results,
                 const CallOptions& call, Enqueue enqueue);
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
