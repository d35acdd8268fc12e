// RingEngine: pyddp's ring and direct collectives (algorithms/) over one
// transport, for the tensors of one device: shm for the CPU; cuda_ipc, or
// NCCL send/recv for rings across hosts, for a CUDA device. Each entry
// point checks its arguments (a refused call leaves the group usable),
// picks the algorithm and hands the collective to its executor: a worker
// thread for the CPU (backend/cpu_executor.h), the internal stream of a
// CUDA device (backend/device_executor.h).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <string>

#include "algorithms/collectives.h"
#include "backend/engine.h"
#include "backend/executor.h"
#include "common/config.h"
#include "transport/transport.h"

namespace pyddp {

class CpuExecutor;
class DeviceExecutor;

class RingEngine final : public Engine {
 public:
  // Blocks until every rank has connected `transport` (a name from
  // transport/factory.h that serves `device`), bounded by
  // options.timeoutMs; a refusal by any rank fails every rank alike,
  // naming it.
  RingEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             const RingOptions& options, c10::Device device, const std::string& transport);
  ~RingEngine() override;

  const std::string getBackendName() const override { return "pyddp"; }
  const RingOptions& options() const { return options_; }

  c10::intrusive_ptr<c10d::Work> allReduce(const at::Tensor& tensor, RedOp op,
                                           bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> allGatherSingle(const at::Tensor& output,
                                                 const at::Tensor& input, bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> allGatherList(const std::vector<at::Tensor>& outputs,
                                               const at::Tensor& input, bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> broadcastFrom(const at::Tensor& tensor, int src,
                                               bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> reduceScatterSingle(const at::Tensor& output,
                                                     const at::Tensor& input, RedOp op,
                                                     bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> barrierAll(bool asyncOp) override;
  // reduce and gather move as much as all_reduce and all_gather (the other
  // ranks compute into scratch); scatter sends the root's whole list down
  // the broadcast chain: one transport verb set serves them all.
  c10::intrusive_ptr<c10d::Work> reduceTo(const at::Tensor& tensor, RedOp op, int root,
                                          bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> gatherTo(const std::vector<at::Tensor>& outputs,
                                          const at::Tensor& input, int root,
                                          bool asyncOp) override;
  c10::intrusive_ptr<c10d::Work> scatterFrom(const at::Tensor& output,
                                             const std::vector<at::Tensor>& inputs, int root,
                                             bool asyncOp) override;

  // Stops the executor; a running collective fails within milliseconds and
  // queued ones fail. On a device whose peers read this rank's memory,
  // queued collectives finish first and every rank meets every other, so no
  // peer reads memory freed here. Idempotent; the destructor calls it.
  void shutdown() override;

 protected:
  const Executor& executor() const override { return *executor_; }

 private:
  using Transfer = std::function<void(const algorithms::Call& call)>;
  // Hands a collective to the executor; `transfer` runs the algorithm.
  c10::intrusive_ptr<c10d::Work> submit(CollectiveDesc desc, std::vector<at::Tensor> outputs,
                                        std::vector<at::Tensor> uses, Transfer transfer,
                                        std::function<void()> finish, bool asyncOp);
  // Starts the executor for device_ once transport_ is connected.
  void startExecutor();
  kernels::ReduceSpec spec(DataType dtype, RedOp op) const;

  const RingOptions options_;
  // Declared before the transport, so destroyed after it: a device
  // transport enqueues on the executor's stream.
  std::unique_ptr<Executor> executor_;
  CpuExecutor* cpuExec_ = nullptr;        // executor_, for the CPU
  DeviceExecutor* deviceExec_ = nullptr;  // executor_, for a CUDA device
  std::unique_ptr<Transport> transport_;
};

} // namespace pyddp
