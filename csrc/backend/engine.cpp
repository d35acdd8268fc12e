#include "backend/engine.h"

#include <algorithm>
#include <mutex>

#include "backend/torch_types.h"
#include "common/check.h"

namespace pyddp {

namespace {

// Weak: a group the program destroys or drops goes as it would untracked.
// A weak reference would keep the engine from being destroyed (c10 destroys
// an intrusive_ptr_target once no weak reference is left either, and only
// calls release_resources() when the last strong one goes): an engine takes
// its own entry out in release_resources(), so it is destroyed at once.
struct LiveEngines {
  std::mutex mu;
  std::vector<c10::weak_intrusive_ptr<Engine>> engines;
};

LiveEngines& liveEngines() {
  static auto* live = new LiveEngines();  // never destroyed: engines may outlive statics
  return *live;
}

} // namespace

void trackEngine(const c10::intrusive_ptr<Engine>& engine) {
  LiveEngines& live = liveEngines();
  std::lock_guard<std::mutex> lock(live.mu);
  live.engines.emplace_back(engine);
}

void shutDownLiveEngines() {
  std::vector<c10::intrusive_ptr<Engine>> alive;
  {
    LiveEngines& live = liveEngines();
    std::lock_guard<std::mutex> lock(live.mu);
    for (const auto& e : live.engines) {
      if (auto engine = e.lock()) alive.push_back(std::move(engine));
    }
    live.engines.clear();
  }
  // Outside the lock: a shutdown may run callbacks that make groups.
  for (const auto& engine : alive) engine->shutdown();
}

void Engine::release_resources() {
  LiveEngines& live = liveEngines();
  std::lock_guard<std::mutex> lock(live.mu);
  auto& engines = live.engines;
  engines.erase(std::remove_if(engines.begin(), engines.end(),
                               [this](const auto& e) { return e._unsafe_get_target() == this; }),
                engines.end());
}

Engine::Engine(int rank, int size, c10::Device device, std::string transport)
    : RefusingBackend(rank, size, "pyddp's " + transport + " engine"),
      device_(device),
      transport_(std::move(transport)),
      checks_(rank, size, device, "this group's " + transport_ + " transport") {}

WorkPtr Engine::allReduceSparse(const at::Tensor&, RedOp, const CallOptions&) {
  refuse("allreduce_sparse");
}

Engine::SparseStart Engine::startSparse(const at::Tensor& tensor, RedOp op,
                                        const CallOptions& call) {
  const char* name = "all_reduce";
  const at::Tensor input = sparse::coalescedInput(tensor, op, rank_, device_, name);
  const at::Tensor headers = at::empty({size_ * sparse::kHeaderWords}, at::kLong);
  // A synchronous call the executor queues (behind work still running)
  // returns its Work: done once that Work is.
  const WorkPtr gathered =
      allGatherSingle(headers, sparse::headerOf(input), CallOptions{false, call.timeout, true});
  if (gathered) gathered->wait();
  sparse::Blocks blocks = sparse::plan(headers, rank_, size_, name);
  at::Tensor packed = sparse::pack(input, blocks.bytes);
  return {std::move(blocks), std::move(packed)};
}

WorkPtr Engine::reduceTo(const at::Tensor&, RedOp, int, const CallOptions&) {
  refuse("reduce");
}

WorkPtr Engine::gatherTo(const std::vector<at::Tensor>&, const at::Tensor&, int,
                         const CallOptions&) {
  refuse("gather");
}

WorkPtr Engine::scatterFrom(const at::Tensor&, const std::vector<at::Tensor>&, int,
                            const CallOptions&) {
  refuse("scatter");
}

WorkPtr Engine::allToAllSingle(const at::Tensor&, const at::Tensor&,
                               const std::vector<int64_t>&, const std::vector<int64_t>&,
                               const CallOptions&) {
  refuse("all_to_all_single");
}

WorkPtr Engine::allToAllList(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                             const CallOptions&) {
  refuse("all_to_all");
}

WorkPtr Engine::allReduceCoalesced(const std::vector<at::Tensor>&, RedOp, const CallOptions&) {
  refuse("all_reduce_coalesced");
}

WorkPtr Engine::allGatherCoalesced(const std::vector<at::Tensor>&,
                                   const std::vector<at::Tensor>&, const CallOptions&) {
  refuse("all_gather_into_tensor_coalesced");
}

WorkPtr Engine::allGatherCoalescedLists(const std::vector<std::vector<at::Tensor>>&,
                                        const std::vector<at::Tensor>&, const CallOptions&) {
  refuse("all_gather_coalesced");
}

WorkPtr Engine::reduceScatterCoalesced(const std::vector<at::Tensor>&,
                                       const std::vector<at::Tensor>&, RedOp,
                                       const CallOptions&) {
  refuse("reduce_scatter_tensor_coalesced");
}

WorkPtr Engine::sendTo(const at::Tensor&, int, int64_t, const CallOptions&) {
  refuse("send");
}

WorkPtr Engine::recvFrom(const at::Tensor&, int, int64_t, const CallOptions&) {
  refuse("recv");
}

// --- torch.distributed's entry points -----------------------------------------

const at::Tensor& Engine::single(const std::vector<at::Tensor>& tensors, const char* call,
                                 const char* what) const {
  PYDDP_CHECK_VALUE(tensors.size() == 1, "rank ", rank_, ": ", call, ": got ", tensors.size(),
                    " ", what, " tensors; the pyddp backend takes one tensor per process");
  return tensors[0];
}

RedOp Engine::redOp(const c10d::ReduceOp& op, const char* call) const {
  const auto ours = redOpOf(op);
  PYDDP_CHECK_VALUE(ours.has_value(), "rank ", rank_, ": ", call, ": the pyddp backend does "
                    "not support ReduceOp.", nameOf(op), " (supported: SUM, AVG, PRODUCT, MIN, "
                    "MAX, BAND, BOR, BXOR)");
  return *ours;
}

namespace {

CallOptions callOf(bool asyncOp, std::chrono::milliseconds timeout) {
  return CallOptions{asyncOp, timeout};
}

} // namespace

WorkPtr Engine::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  return allReduce(single(tensors, "allreduce", "input"), redOp(opts.reduceOp, "allreduce"),
                   callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                 const c10d::AllreduceOptions& opts) {
  return allReduceSparse(single(tensors, "allreduce_sparse", "input"),
                         redOp(opts.reduceOp, "allreduce_sparse"),
                         callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                    const c10d::AllreduceCoalescedOptions& opts) {
  return allReduceCoalesced(tensors, redOp(opts.reduceOp, "allreduce_coalesced"),
                            callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  PYDDP_CHECK_VALUE(opts.rootTensor == 0, "rank ", rank_, ": broadcast: rootTensor ",
                    opts.rootTensor, " given; the pyddp backend takes one tensor per process");
  return broadcastFrom(single(tensors, "broadcast", "input"), static_cast<int>(opts.rootRank),
                       callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  PYDDP_CHECK_VALUE(opts.rootTensor == 0, "rank ", rank_, ": reduce: rootTensor ",
                    opts.rootTensor, " given; the pyddp backend takes one tensor per process");
  return reduceTo(single(tensors, "reduce", "input"), redOp(opts.reduceOp, "reduce"),
                  static_cast<int>(opts.rootRank), callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                          std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  PYDDP_CHECK_VALUE(outputs.size() == 1, "rank ", rank_, ": allgather: got ", outputs.size(),
                    " output lists; the pyddp backend takes one per process");
  return allGatherList(outputs[0], single(inputs, "allgather", "input"),
                       callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::_allgather_base(at::Tensor& output, at::Tensor& input,
                                const c10d::AllgatherOptions& opts) {
  return allGatherSingle(output, input, callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllgatherOptions& opts) {
  return allGatherCoalescedLists(outputLists, inputs, callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                std::vector<at::Tensor>& inputs,
                                                const c10d::AllgatherOptions& opts) {
  return allGatherCoalesced(outputs, inputs, callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::gather(std::vector<std::vector<at::Tensor>>& outputs,
                       std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  // torch passes one (possibly empty) output list per process.
  PYDDP_CHECK_VALUE(outputs.size() <= 1, "rank ", rank_, ": gather: got ", outputs.size(),
                    " output lists; the pyddp backend takes one per process");
  static const std::vector<at::Tensor> none;
  return gatherTo(outputs.empty() ? none : outputs[0], single(inputs, "gather", "input"),
                  static_cast<int>(opts.rootRank), callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::scatter(std::vector<at::Tensor>& outputs,
                        std::vector<std::vector<at::Tensor>>& inputs,
                        const c10d::ScatterOptions& opts) {
  // torch passes one (possibly empty) input list per process.
  PYDDP_CHECK_VALUE(inputs.size() <= 1, "rank ", rank_, ": scatter: got ", inputs.size(),
                    " input lists; the pyddp backend takes one per process");
  static const std::vector<at::Tensor> none;
  return scatterFrom(single(outputs, "scatter", "output"), inputs.empty() ? none : inputs[0],
                     static_cast<int>(opts.rootRank), callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::reduce_scatter(std::vector<at::Tensor>& outputs,
                               std::vector<std::vector<at::Tensor>>& inputs,
                               const c10d::ReduceScatterOptions& opts) {
  PYDDP_CHECK_VALUE(inputs.size() == 1, "rank ", rank_, ": reduce_scatter: got ",
                    inputs.size(), " input lists; the pyddp backend takes one per process");
  const at::Tensor& output = single(outputs, "reduce_scatter", "output");
  PYDDP_CHECK_VALUE(static_cast<int>(inputs[0].size()) == size_, "rank ", rank_,
                    ": reduce_scatter: input list has ", inputs[0].size(),
                    " tensors, expected world_size = ", size_);
  const DataType dtype = checks_.tensor(output, "reduce_scatter", "output");
  std::vector<at::Tensor> flat;
  for (const auto& t : inputs[0]) {
    PYDDP_CHECK_TYPE(checks_.tensor(t, "reduce_scatter", "input") == dtype, "rank ", rank_,
                     ": reduce_scatter: input dtype ", t.scalar_type(),
                     " differs from output dtype ", output.scalar_type());
    PYDDP_CHECK_VALUE(t.numel() == output.numel(), "rank ", rank_,
                      ": reduce_scatter: an input has ", t.numel(), " elements, expected ",
                      output.numel(), " (the output's)");
    flat.push_back(t.reshape({-1}));
  }
  // The list becomes one world-sized tensor, read when the call is made (as
  // the single-tensor form reads its input).
  return reduceScatterSingle(output, at::cat(flat), redOp(opts.reduceOp, "reduce_scatter"),
                             callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                     const c10d::ReduceScatterOptions& opts) {
  return reduceScatterSingle(output, input, redOp(opts.reduceOp, "reduce_scatter_tensor"),
                             callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                std::vector<at::Tensor>& inputs,
                                                const c10d::ReduceScatterOptions& opts) {
  return reduceScatterCoalesced(outputs, inputs,
                                redOp(opts.reduceOp, "reduce_scatter_tensor_coalesced"),
                                callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::alltoall_base(at::Tensor& output, at::Tensor& input,
                              std::vector<int64_t>& outputSplits,
                              std::vector<int64_t>& inputSplits,
                              const c10d::AllToAllOptions& opts) {
  return allToAllSingle(output, input, outputSplits, inputSplits,
                        callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                         const c10d::AllToAllOptions& opts) {
  return allToAllList(outputs, inputs, callOf(opts.asyncOp, opts.timeout));
}

// c10d's send and recv are asynchronous: torch waits on the Work.
WorkPtr Engine::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return sendTo(single(tensors, "send", "input"), dstRank, tag, callOf(true, c10d::kUnsetTimeout));
}

WorkPtr Engine::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return recvFrom(single(tensors, "recv", "output"), srcRank, tag,
                  callOf(true, c10d::kUnsetTimeout));
}

WorkPtr Engine::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recvFrom(single(tensors, "recv", "output"), kAnySource, tag,
                  callOf(true, c10d::kUnsetTimeout));
}

WorkPtr Engine::barrier(const c10d::BarrierOptions& opts) {
  return barrierAll(callOf(opts.asyncOp, opts.timeout));
}

} // namespace pyddp
