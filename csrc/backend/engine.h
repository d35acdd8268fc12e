// Engine: what runs one process group's collectives for the tensors of one
// device. It is a c10d::Backend, so torch.distributed can use it, with
// pyddp's own entry points, which the Python ProcessGroup calls; torch's
// entry points (allreduce, _allgather_base, alltoall_base, send, ...) are
// mapped onto pyddp's here, once for every engine, and the others refuse
// (RefusingBackend), naming the user's call.
//
// pyddp's entry points are the one front end of every engine: they check
// the arguments, make the tensors contiguous, pack a coalesced call into
// one buffer and describe the collective, then hand that plan to the
// engine's run* (protected, below). TransportEngine (pyddp's algorithms over a
// transport), HierarchicalEngine (groups across hosts) and NcclEngine
// (NCCL's own collectives) implement run*; the engine registry
// (engine_registry.h) makes them.
#pragma once

#include <c10/util/ArrayRef.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "backend/arg_checks.h"
#include "backend/executor.h"
#include "backend/refusing_backend.h"
#include "common/descriptor.h"
#include "common/types.h"

namespace pyddp {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// A gathered buffer as an engine writes it: world_size blocks of `count`
// elements, rank r's in block r, either of one contiguous tensor (`whole`)
// or one contiguous tensor each (`list`, when `whole` is undefined).
struct RankBlocks {
  at::Tensor whole;
  c10::ArrayRef<at::Tensor> list;
  size_t count = 0;

  // Block r's first byte.
  void* data(int r) const;
};

// What a call's results are, once its engine ran it.
struct Results {
  // The user's tensors: the Work's result and its future's value.
  c10::ArrayRef<at::Tensor> tensors;
  // Copies the collective's buffers into `tensors` after it; empty when the
  // buffers are `tensors` themselves.
  std::function<void()> finish;
  // A coalesced call's split as the caller wrote it ("[3], [5]": the
  // tensors' shapes), which an error names when ranks split a call of the
  // same size differently; "" for other calls.
  std::string split;
};

class Engine : public RefusingBackend {
 public:
  static constexpr int kAnySource = -1;

  // `transport` names what moves the bytes ("shm", "cuda_ipc", "nccl"),
  // for users and messages; `store` is the group's own.
  Engine(int rank, int size, c10::Device device, std::string transport,
         c10::intrusive_ptr<c10d::Store> store);

  c10::Device device() const { return device_; }
  const std::string& transport() const { return transport_; }

  // Whether a synchronous call may keep the GIL until it starts to wait
  // (HoldsGil in bindings.cpp): only if no thread it meets takes the GIL
  // while holding a lock the call needs. torch's ProcessGroups' threads may
  // (gloo's drops a finished work, whose tensors may take the GIL, with its
  // queue locked: an engine that calls gloo deadlocked on it).
  virtual bool spinsWithGil() const { return false; }

  // pyddp's entry points: the one front end of every engine. Each checks
  // its arguments (a refused call leaves the group usable), makes its
  // tensors contiguous and packs coalesced lists into one buffer, describes
  // the collective, and hands that plan to the engine (run*, below). Every
  // rank calls the collectives in the same order.
  WorkPtr allReduce(const at::Tensor& tensor, RedOp op, const CallOptions& call);
  WorkPtr allGatherSingle(const at::Tensor& output, const at::Tensor& input,
                          const CallOptions& call);
  WorkPtr allGatherList(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                        const CallOptions& call);
  WorkPtr broadcastFrom(const at::Tensor& tensor, int64_t src, const CallOptions& call);
  WorkPtr reduceScatterSingle(const at::Tensor& output, const at::Tensor& input, RedOp op,
                              const CallOptions& call);
  WorkPtr barrierAll(const CallOptions& call);
  // `tensor` of rank `root` = the reduction; other ranks' tensors are left
  // as they were.
  WorkPtr reduceTo(const at::Tensor& tensor, RedOp op, int64_t root, const CallOptions& call);
  // `outputs` (root only; empty elsewhere) = every rank's input.
  WorkPtr gatherTo(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int64_t root,
                   const CallOptions& call);
  // `output` = inputs[rank] of rank `root` (which alone passes inputs).
  WorkPtr scatterFrom(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                      int64_t root,
                      const CallOptions& call);
  // Block k of `input` goes to rank k; block k of `output` comes from rank
  // k. Blocks are outputSplits[k] / inputSplits[k] rows (dim 0), or equal
  // when the splits are empty. Rank r's outputSplits[k] must equal rank k's
  // inputSplits[r].
  WorkPtr allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                         const std::vector<int64_t>& outputSplits,
                         const std::vector<int64_t>& inputSplits, const CallOptions& call);
  // outputs[k] comes from rank k's inputs[rank].
  WorkPtr allToAllList(const std::vector<at::Tensor>& outputs,
                       const std::vector<at::Tensor>& inputs, const CallOptions& call);
  // One collective over the concatenation of the tensors (one dtype). Every
  // rank must split it alike: the tensors' shapes are part of what ranks
  // compare (CollectiveDesc::split).
  WorkPtr allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                             const CallOptions& call);
  // outputs[i] = every rank's inputs[i], in rank order.
  WorkPtr allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs, const CallOptions& call);
  // outputLists[r][i] = rank r's inputs[i] (torch's all_gather_coalesced).
  WorkPtr allGatherCoalescedLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                                  const std::vector<at::Tensor>& inputs,
                                  const CallOptions& call);
  // outputs[i] = block rank of inputs[i] reduced over the ranks.
  WorkPtr reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs, RedOp op,
                                 const CallOptions& call);
  // Ranks (src, dst, root) and tags come as the caller gave them, and are
  // checked before they are narrowed.
  // Point-to-point, outside the order of collectives: messages between two
  // ranks with the same tag are received in the order they were sent.
  // recvFrom's `src` may be kAnySource: the first message with the tag
  // from any rank; the Work's sourceRank() names the sender.
  WorkPtr sendTo(const at::Tensor& tensor, int64_t dst, int64_t tag, const CallOptions& call);
  WorkPtr recvFrom(const at::Tensor& tensor, int64_t src, int64_t tag,
                   const CallOptions& call);

  // Fails what is still pending and releases the engine's resources.
  // Idempotent; safe from a future callback. In a child of fork() it does
  // nothing: the group is the parent's.
  void shutdown() final;
  // shutdown(), failing more and sooner: peers blocked on this rank fail at
  // once (even in a collective this rank has done its part of), pending
  // calls here fail, and every later call is refused, each saying the
  // group was aborted. Safe from any thread while a call is in flight, and
  // from a signal handler run inside a wait. Idempotent; a later
  // shutdown() does nothing more.
  void abort() final;
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
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
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) final;

  // c10d's sequence number, which torch's ProcessGroupWrapper
  // (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares across ranks before each
  // collective it forwards. As ProcessGroupGloo's, it starts at 0 (set is a
  // no-op) and counts the collectives issued to this engine
  // (Executor::issued), so ranks that made the same calls agree however
  // far each one's queue has run.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return executor().issued(); }

 protected:
  // What an engine runs: a call's plan, checked. Buffers are contiguous,
  // of the descriptor's dtype and on the engine's device; `desc` holds the
  // kind, count, dtype, op, root and split (the engine picks the algorithm,
  // its executor the sequence number). An engine that lacks an operation
  // leaves it to these defaults, which refuse it (TypeError) naming the
  // call. A synchronous call (call.asyncOp false) is done when run returns,
  // or when the Work it returns is.
  virtual WorkPtr runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf,
                               Results results, const CallOptions& call) = 0;
  // `input`: desc.count elements; `output`: world_size blocks of them.
  virtual WorkPtr runAllGather(const CollectiveDesc& desc, const at::Tensor& input,
                               const RankBlocks& output, Results results,
                               const CallOptions& call) = 0;
  virtual WorkPtr runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf,
                               Results results, const CallOptions& call) = 0;
  // `input`: world_size blocks of desc.count elements; `output`: one.
  virtual WorkPtr runReduceScatter(const CollectiveDesc& desc, const at::Tensor& input,
                                   const at::Tensor& output, Results results,
                                   const CallOptions& call) = 0;
  virtual WorkPtr runBarrier(const CollectiveDesc& desc, const CallOptions& call) = 0;
  // `output` = the reduction on the root, scratch elsewhere (the same
  // tensor as `input` on the root when it may be written in place);
  // `input` is not written.
  virtual WorkPtr runReduce(const CollectiveDesc& desc, const at::Tensor& input,
                            const at::Tensor& output, Results results, const CallOptions& call);
  // `output`: the root's world_size blocks (no blocks elsewhere).
  virtual WorkPtr runGather(const CollectiveDesc& desc, const at::Tensor& input,
                            const RankBlocks& output, Results results, const CallOptions& call);
  // `input`: the root's world_size blocks (no blocks elsewhere).
  virtual WorkPtr runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                             const at::Tensor& output, Results results, const CallOptions& call);
  // One-dimensional `input` and `output`; block k of each by the counts
  // and offsets (elements) of `a`.
  virtual WorkPtr runAllToAll(const CollectiveDesc& desc, const at::Tensor& input,
                              const at::Tensor& output, const ArgChecks::AllToAll& a,
                              Results results, const CallOptions& call);
  // `tensor` contiguous.
  virtual WorkPtr runSend(const at::Tensor& tensor, int dst, int64_t tag,
                          const CallOptions& call);
  // `buf` is `tensor`, or a contiguous copy results.finish copies back.
  virtual WorkPtr runRecv(const at::Tensor& buf, int src, int64_t tag, Results results,
                          const CallOptions& call);
  virtual void runMonitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks);
  // What shutdown() and abort() do in the process that made the engine.
  virtual void shutDown(Teardown how) = 0;

  // The executor that numbers this engine's collectives.
  virtual const Executor& executor() const = 0;

  // `transfer()`, and if it throws a DescMismatch over the split of a
  // coalesced call (`split`, this rank's), the same error naming each
  // rank's split: every rank that found the mismatch publishes its own
  // under the group's store and reads those of the ranks it differs from.
  template <typename Transfer>
  void namingSplits(const std::string& split, Transfer&& transfer) const {
    try {
      transfer();
    } catch (const DescMismatch& e) {
      if (split.empty() || !e.splitDiffers()) throw;
      throwNamingSplits(e, split);
    }
  }

  // The front end's first step on every call: refuses a call from a child
  // of fork() (the group is the parent's), and a call after abort().
  void refuseIfUnusable(const char* call) const;
  c10d::Store& groupStore() const { return *store_; }

  const c10::Device device_;
  const std::string transport_;
  const ArgChecks checks_;

 private:
  WorkPtr allReduceSparse(const at::Tensor& tensor, RedOp op, const CallOptions& call);
  // torch.distributed's arguments: the one tensor of a per-process list,
  // and pyddp's operator for a c10d::ReduceOp.
  const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* call,
                           const char* what) const;
  RedOp redOp(const c10d::ReduceOp& op, const char* call) const;
  [[noreturn]] void throwNamingSplits(const DescMismatch& e, const std::string& mine) const;

  const c10::intrusive_ptr<c10d::Store> store_;
  const uint64_t forkGeneration_;
  const int creatorPid_;
  std::atomic<bool> aborted_{false};
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
