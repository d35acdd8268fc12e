// Engine: what runs one process group's collectives for the tensors of one
// device. It is a c10d::Backend, so torch.distributed can use it, with
// pyddp's own entry points, which the Python ProcessGroup calls. torch's
// entry points (allreduce, _allgather_base, alltoall_base, send, ...) are
// mapped onto pyddp's here, once for every engine; the others refuse
// (RefusingBackend), naming the user's call. RingEngine (pyddp's
// algorithms over a transport) and NcclEngine (NCCL's own collectives)
// implement it; the engine registry (engine_registry.h) makes them.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "backend/arg_checks.h"
#include "backend/executor.h"
#include "backend/refusing_backend.h"
#include "backend/sparse.h"
#include "common/types.h"

namespace pyddp {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

class Engine : public RefusingBackend {
 public:
  static constexpr int kAnySource = -1;

  // `transport` names what moves the bytes ("shm", "cuda_ipc", "nccl"),
  // for users and messages.
  Engine(int rank, int size, c10::Device device, std::string transport);

  c10::Device device() const { return device_; }
  const std::string& transport() const { return transport_; }

  // Whether a synchronous call may keep the GIL until it starts to wait
  // (HoldsGil in bindings.cpp): only if no thread it meets takes the GIL
  // while holding a lock the call needs. torch's ProcessGroups' threads may
  // (gloo's drops a finished work, whose tensors may take the GIL, with its
  // queue locked: an engine that calls gloo deadlocked on it).
  virtual bool spinsWithGil() const { return false; }

  // pyddp's entry points. Every rank calls the collectives in the same
  // order; an engine that lacks one refuses it (TypeError) before anything
  // is queued, naming the call.
  virtual WorkPtr allReduce(const at::Tensor& tensor, RedOp op, const CallOptions& call) = 0;
  virtual WorkPtr allGatherSingle(const at::Tensor& output, const at::Tensor& input,
                                  const CallOptions& call) = 0;
  virtual WorkPtr allGatherList(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                                const CallOptions& call) = 0;
  virtual WorkPtr broadcastFrom(const at::Tensor& tensor, int src, const CallOptions& call) = 0;
  virtual WorkPtr reduceScatterSingle(const at::Tensor& output, const at::Tensor& input,
                                      RedOp op, const CallOptions& call) = 0;
  virtual WorkPtr barrierAll(const CallOptions& call) = 0;
  // A sparse COO tensor summed over the ranks (backend/sparse.h): every
  // rank's tensor becomes the same coalesced sum. all_reduce's engines
  // send sparse tensors here.
  virtual WorkPtr allReduceSparse(const at::Tensor& tensor, RedOp op, const CallOptions& call);
  // `tensor` of rank `root` = the reduction; other ranks' tensors are left
  // as they were.
  virtual WorkPtr reduceTo(const at::Tensor& tensor, RedOp op, int root,
                           const CallOptions& call);
  // `outputs` (root only; empty elsewhere) = every rank's input.
  virtual WorkPtr gatherTo(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                           int root, const CallOptions& call);
  // `output` = inputs[rank] of rank `root` (which alone passes inputs).
  virtual WorkPtr scatterFrom(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                              int root, const CallOptions& call);
  // Block k of `input` goes to rank k; block k of `output` comes from rank
  // k. Blocks are outputSplits[k] / inputSplits[k] rows (dim 0), or equal
  // when the splits are empty. Rank r's outputSplits[k] must equal rank k's
  // inputSplits[r].
  virtual WorkPtr allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                                 const std::vector<int64_t>& outputSplits,
                                 const std::vector<int64_t>& inputSplits,
                                 const CallOptions& call);
  // outputs[k] comes from rank k's inputs[rank].
  virtual WorkPtr allToAllList(const std::vector<at::Tensor>& outputs,
                               const std::vector<at::Tensor>& inputs, const CallOptions& call);
  // One collective over the concatenation of the tensors (one dtype).
  virtual WorkPtr allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                                     const CallOptions& call);
  // outputs[i] = every rank's inputs[i], in rank order.
  virtual WorkPtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                     const std::vector<at::Tensor>& inputs,
                                     const CallOptions& call);
  // outputLists[r][i] = rank r's inputs[i] (torch's all_gather_coalesced).
  virtual WorkPtr allGatherCoalescedLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                                          const std::vector<at::Tensor>& inputs,
                                          const CallOptions& call);
  // outputs[i] = block rank of inputs[i] reduced over the ranks.
  virtual WorkPtr reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs, RedOp op,
                                         const CallOptions& call);
  // Point-to-point, outside the order of collectives: messages between two
  // ranks with the same tag are received in the order they were sent.
  // recvFrom's `src` may be kAnySource: the first message with the tag
  // from any rank; the Work's sourceRank() names the sender.
  virtual WorkPtr sendTo(const at::Tensor& tensor, int dst, int64_t tag,
                         const CallOptions& call);
  virtual WorkPtr recvFrom(const at::Tensor& tensor, int src, int64_t tag,
                           const CallOptions& call);

  // Fails what is still pending and releases the engine's resources.
  // Idempotent; safe from a future callback.
  void shutdown() override = 0;
  // c10 calls it when the last strong reference goes while a weak one
  // remains (trackEngine's): the engine leaves the list of live engines,
  // so that it is destroyed now rather than at the next shutDownLiveEngines().
  void release_resources() override;

  // torch.distributed's entry points: one tensor (list) per process, mapped
  // onto the calls above, with c10d's per-call timeout. Operations not
  // overridden here are refused by RefusingBackend.
  WorkPtr allreduce(std::vector<at::Tensor>& tensors,
                    const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& tensors,
                           const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr broadcast(std::vector<at::Tensor>& tensors,
                    const c10d::BroadcastOptions& opts) override;
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override;
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override;
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs,
                    std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input,
                          const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override;
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs,
                         std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input,
                        std::vector<int64_t>& outputSplits, std::vector<int64_t>& inputSplits,
                        const c10d::AllToAllOptions& opts) override;
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override;
  WorkPtr send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;

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

  // A sparse all-reduce's first all-gather (backend/sparse.h), as every
  // engine runs it: `tensor` coalesced and every rank's header gathered
  // through allGatherSingle, run to the end before this returns. The
  // caller queues the blocks' all-gather next, with nothing between.
  struct SparseStart {
    sparse::Blocks blocks;
    at::Tensor packed;  // this rank's block, blocks.bytes long
  };
  SparseStart startSparse(const at::Tensor& tensor, RedOp op, const CallOptions& call);

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

// Every engine makeEngine() made that is still alive, for the exit hook:
// pyddp shuts them all down before the interpreter finalises. torch does
// not always destroy the groups a program leaves behind (under torch 2.14
// they live to the end of the process), and an engine never shut down
// leaves its channels in /dev/shm, which its peers reclaim only if they
// outlive it.
void trackEngine(const c10::intrusive_ptr<Engine>& engine);
// Shuts down every tracked engine still alive (Engine::shutdown; idempotent)
// and forgets them.
void shutDownLiveEngines();

} // namespace pyddp
