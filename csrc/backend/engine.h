// Engine: what runs one process group's collectives for the tensors of one
// device. It is a c10d::Backend, so torch.distributed can use it, with
// pyddp's own entry points, which the Python ProcessGroup calls. torch's
// entry points (allreduce, _allgather_base, ...) are mapped onto pyddp's
// here, once for every engine; the others refuse (RefusingBackend), naming
// the user's call. RingEngine (pyddp's algorithms over a transport) and
// NcclEngine (NCCL's own collectives) implement it; the engine registry
// (engine_registry.h) makes them.
#pragma once

#include <string>
#include <vector>

#include "backend/arg_checks.h"
#include "backend/executor.h"
#include "backend/refusing_backend.h"
#include "common/types.h"

namespace pyddp {

class Engine : public RefusingBackend {
 public:
  // `transport` names what moves the bytes ("shm", "cuda_ipc", "nccl"),
  // for users and messages.
  Engine(int rank, int size, c10::Device device, std::string transport);

  c10::Device device() const { return device_; }
  const std::string& transport() const { return transport_; }

  // pyddp's entry points: one collective each; the Work returns at once
  // when asyncOp, else once done (on a CUDA device: once the caller's
  // current stream waits for it).
  virtual c10::intrusive_ptr<c10d::Work> allReduce(const at::Tensor& tensor, RedOp op,
                                                   bool asyncOp) = 0;
  virtual c10::intrusive_ptr<c10d::Work> allGatherSingle(const at::Tensor& output,
                                                         const at::Tensor& input,
                                                         bool asyncOp) = 0;
  virtual c10::intrusive_ptr<c10d::Work> allGatherList(const std::vector<at::Tensor>& outputs,
                                                       const at::Tensor& input,
                                                       bool asyncOp) = 0;
  virtual c10::intrusive_ptr<c10d::Work> broadcastFrom(const at::Tensor& tensor, int src,
                                                       bool asyncOp) = 0;
  virtual c10::intrusive_ptr<c10d::Work> reduceScatterSingle(const at::Tensor& output,
                                                             const at::Tensor& input, RedOp op,
                                                             bool asyncOp) = 0;
  virtual c10::intrusive_ptr<c10d::Work> barrierAll(bool asyncOp) = 0;
  // Rooted collectives; an engine that lacks one refuses it.
  // reduceTo: `tensor` of rank `root` = the reduction; other ranks' tensors
  // are left as they were. gatherTo: `outputs` (root only; empty elsewhere)
  // = every rank's input. scatterFrom: output = block rank of `inputs`
  // (root only; empty elsewhere).
  virtual c10::intrusive_ptr<c10d::Work> reduceTo(const at::Tensor& tensor, RedOp op, int root,
                                                  bool asyncOp);
  virtual c10::intrusive_ptr<c10d::Work> gatherTo(const std::vector<at::Tensor>& outputs,
                                                  const at::Tensor& input, int root,
                                                  bool asyncOp);
  virtual c10::intrusive_ptr<c10d::Work> scatterFrom(const at::Tensor& output,
                                                     const std::vector<at::Tensor>& inputs,
                                                     int root, bool asyncOp);

  // Fails what is still pending and releases the engine's resources.
  // Idempotent; safe from a future callback.
  void shutdown() override = 0;

  // torch.distributed's entry points: one tensor (list) per process, mapped
  // onto the calls above. Operations not overridden here are refused by
  // RefusingBackend.
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

  // c10d's sequence number, which torch's ProcessGroupWrapper
  // (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares across ranks before each
  // collective it forwards. As ProcessGroupGloo's, it starts at 0 (set is a
  // no-op) and counts the collectives issued to this engine
  // (Executor::issued), so ranks that made the same calls agree however
  // far each one's queue has run.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return executor().issued(); }

 protected:
  // The executor that numbers this engine's collectives.
  virtual const Executor& executor() const = 0;

  const c10::Device device_;
  const std::string transport_;
  const ArgChecks checks_;

 private:
  // torch.distributed's arguments: the one tensor of a per-process list,
  // and pyddp's operator for a c10d::ReduceOp.
  const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* call,
                           const char* what) const;
  RedOp redOp(const c10d::ReduceOp& op, const char* call) const;
};

} // namespace pyddp
