#include "backend/engine.h"

#include <algorithm>
#include <mutex>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <unistd.h>

#include "backend/coalesce.h"
#include "backend/sparse.h"
#include "backend/torch_types.h"
#include "common/check.h"
#include "common/process_state.h"

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

void lockLiveEngines();
void unlockLiveEngines();
void disownLiveEngines();

LiveEngines& liveEngines() {
  // Never destroyed: engines may outlive statics.
  static auto* live = [] {
    process::onFork(lockLiveEngines, unlockLiveEngines, disownLiveEngines);
    return new LiveEngines();
  }();
  return *live;
}

// What a child of fork() does with the engines it inherited: it keeps a
// reference to each that it never drops, so that none is destroyed there
// (common/process_state.h). The list's lock is held across fork(), so no
// child inherits it held.
void lockLiveEngines() {
  liveEngines().mu.lock();
}
void unlockLiveEngines() {
  liveEngines().mu.unlock();
}
void disownLiveEngines() {
  LiveEngines& live = liveEngines();
  for (const auto& e : live.engines) {
    if (auto engine = e.lock()) engine.release();
  }
  live.mu.unlock();
}

// A tensor to compute in: the tensor itself when contiguous, else a
// contiguous copy whose result copyBack() writes into the original.
at::Tensor dense(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}
std::vector<at::Tensor> dense(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (const auto& t : list) out.push_back(dense(t));
  return out;
}
bool sameTensors(c10::ArrayRef<at::Tensor> a, c10::ArrayRef<at::Tensor> b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].is_same(b[i])) return false;
  }
  return true;
}
// Results into `originals` from their contiguous copies `computed` (the
// same tensors when they were contiguous: nothing to copy).
Results intoOriginals(const at::Tensor& original, const at::Tensor& computed) {
  if (original.is_same(computed)) return Results{original, {}};
  return Results{original, [original, computed] { original.copy_(computed); }};
}
Results intoOriginals(const std::vector<at::Tensor>& originals,
                      const std::vector<at::Tensor>& computed) {
  if (sameTensors(originals, computed)) return Results{originals, {}};
  return Results{originals, [originals, computed] {
                   for (size_t i = 0; i < originals.size(); ++i) {
                     if (!originals[i].is_same(computed[i])) originals[i].copy_(computed[i]);
                   }
                 }};
}

CollectiveDesc describe(CollectiveKind kind, size_t count, DataType dtype, RedOp op = RedOp::Sum,
                        int root = -1, uint64_t split = 0) {
  CollectiveDesc d;
  d.kind = kind;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  d.split = split;
  return d;
}

// The split of a coalesced call: how many tensors, and each one's shape,
// hashed (FNV-1a) into the 63 bits a descriptor word may carry. Ranks that
// split the same total differently would mix their tensors' elements.
uint64_t splitOf(c10::ArrayRef<at::Tensor> tensors) {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(tensors.size());
  for (const auto& t : tensors) {
    mix(static_cast<uint64_t>(t.dim()));
    for (const int64_t d : t.sizes()) mix(static_cast<uint64_t>(d));
  }
  return h & kMaxSplit;
}

// "[3], [2, 4]": the shapes of a coalesced call's tensors.
std::string splitText(c10::ArrayRef<at::Tensor> tensors) {
  std::string text;
  for (const auto& t : tensors) text += (text.empty() ? "" : ", ") + c10::str(t.sizes());
  return text;
}

// How long a rank waits for a peer's split once both found that they
// differ: the peer publishes it as soon as it found it too.
constexpr std::chrono::seconds kSplitWait(5);

} // namespace

void* RankBlocks::data(int r) const {
  if (whole.defined()) {
    return static_cast<char*>(whole.data_ptr()) + r * count * whole.element_size();
  }
  return list[r].data_ptr();
}

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

Engine::Engine(int rank, int size, c10::Device device, std::string transport,
               c10::intrusive_ptr<c10d::Store> store)
    : RefusingBackend(rank, size, "pyddp's " + transport + " engine"),
      device_(device),
      transport_(std::move(transport)),
      checks_(rank, size, device, "this group's " + transport_ + " transport"),
      store_(std::move(store)),
      forkGeneration_(process::forkGeneration()),
      creatorPid_(getpid()) {
  liveEngines();  // its fork handlers are in place before any fork can matter
}

void Engine::refuseIfUnusable(const char* call) const {
  PYDDP_CHECK_COMM(!aborted(), "rank ", rank_, ": ", call, " on a process group that was "
                   "aborted; make a new group (pyddp's ProcessGroup.shrink() and "
                   "torch.distributed.shrink_group() make one of the ranks still alive)");
  PYDDP_CHECK(process::forkGeneration() == forkGeneration_, "rank ", rank_, ": ", call,
              ": this process group was made by process ", creatorPid_, ", of which process ",
              getpid(), " is a fork()ed child; a child owns none of its parent's groups "
              "(their shared memory and threads are the parent's). Make a new group in the "
              "child (or start it with the 'spawn' or 'forkserver' method)");
}

void Engine::shutdown() {
  if (process::forkGeneration() != forkGeneration_) return;
  shutDown(Teardown::Destroyed);
}

void Engine::abort() {
  if (process::forkGeneration() != forkGeneration_) return;
  aborted_.store(true, std::memory_order_release);
  shutDown(Teardown::Aborted);
}

// --- pyddp's entry points: the front end -----------------------------------------

WorkPtr Engine::allReduce(const at::Tensor& tensor, RedOp op, const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("all_reduce");
  if (tensor.is_sparse()) return allReduceSparse(tensor, op, call);
  const DataType dtype = checks_.tensor(tensor, "all_reduce", "tensor");
  checks_.writable(tensor, "all_reduce", "tensor");
  checks_.op(op, dtype, "all_reduce");
  const CollectiveDesc desc = describe(CollectiveKind::AllReduce, tensor.numel(), dtype, op);
  // A contiguous tensor is its own buffer, with nothing to copy back.
  if (tensor.is_contiguous()) return runAllReduce(desc, tensor, Results{tensor, {}}, call);
  const at::Tensor buf = dense(tensor);
  return runAllReduce(desc, buf, intoOriginals(tensor, buf), call);
}

WorkPtr Engine::allReduceSparse(const at::Tensor& tensor, RedOp op, const CallOptions& call) {
  const char* name = "all_reduce";
  if (!device_.is_cpu()) refuse("allreduce_sparse");
  const at::Tensor input = sparse::coalescedInput(tensor, op, rank_, device_, name);
  // The headers' all-gather runs to its end before the blocks' is queued,
  // with nothing between them in this rank's order of calls.
  const at::Tensor headers = at::empty({size_ * sparse::kHeaderWords}, at::kLong);
  const WorkPtr gathered =
      allGatherSingle(headers, sparse::headerOf(input), CallOptions{false, call.timeout, true});
  if (gathered) gathered->wait();
  const sparse::Blocks blocks = sparse::plan(headers, rank_, size_, name);
  const at::Tensor packed = sparse::pack(input, blocks.bytes);
  const at::Tensor out = at::empty({size_ * blocks.bytes}, at::kByte);
  return runAllGather(
      describe(CollectiveKind::AllGather, blocks.bytes, DataType::UInt8), packed,
      RankBlocks{out, {}, static_cast<size_t>(blocks.bytes)},
      Results{tensor, [=] { tensor.copy_(sparse::sum(out, blocks)); }}, call);
}

WorkPtr Engine::allGatherSingle(const at::Tensor& output, const at::Tensor& input,
                                const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("all_gather_single");
  const DataType dtype =
      checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  const size_t count = input.numel();
  const CollectiveDesc desc = describe(CollectiveKind::AllGather, count, dtype);
  if (input.is_contiguous() && output.is_contiguous()) {
    return runAllGather(desc, input, RankBlocks{output, {}, count}, Results{output, {}}, call);
  }
  const at::Tensor out = dense(output);
  return runAllGather(desc, dense(input), RankBlocks{out, {}, count}, intoOriginals(output, out),
                      call);
}

WorkPtr Engine::allGatherList(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                              const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("all_gather");
  const DataType dtype = checks_.tensor(input, "all_gather", "tensor");
  checks_.blockList(outputs, input, "all_gather", "tensor_list");
  const std::vector<at::Tensor> outs = dense(outputs);
  const size_t count = input.numel();
  return runAllGather(describe(CollectiveKind::AllGather, count, dtype), dense(input),
                      RankBlocks{{}, outs, count}, intoOriginals(outputs, outs), call);
}

WorkPtr Engine::broadcastFrom(const at::Tensor& tensor, int64_t src, const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("broadcast");
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  const CollectiveDesc desc =
      describe(CollectiveKind::Broadcast, tensor.numel(), dtype, RedOp::Sum, static_cast<int>(src));
  if (tensor.is_contiguous()) return runBroadcast(desc, tensor, Results{tensor, {}}, call);
  const at::Tensor buf = dense(tensor);
  return runBroadcast(desc, buf, intoOriginals(tensor, buf), call);
}

WorkPtr Engine::reduceScatterSingle(const at::Tensor& output, const at::Tensor& input, RedOp op,
                                    const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("reduce_scatter_single");
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  const CollectiveDesc desc =
      describe(CollectiveKind::ReduceScatter, output.numel(), dtype, op);
  if (input.is_contiguous() && output.is_contiguous()) {
    return runReduceScatter(desc, input, output, Results{output, {}}, call);
  }
  const at::Tensor out = dense(output);
  return runReduceScatter(desc, dense(input), out, intoOriginals(output, out), call);
}

WorkPtr Engine::barrierAll(const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("barrier");
  return runBarrier(describe(CollectiveKind::Barrier, 0, DataType::UInt8), call);
}

WorkPtr Engine::reduceTo(const at::Tensor& tensor, RedOp op, int64_t root,
                         const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("reduce");
  const DataType dtype = checks_.tensor(tensor, "reduce", "tensor");
  checks_.writable(tensor, "reduce", "tensor");
  checks_.op(op, dtype, "reduce");
  checks_.root(root, "reduce", "dst");
  // Only the root keeps the result: the other ranks compute into scratch
  // and leave their tensor as it was.
  const at::Tensor in = dense(tensor);
  const bool keep = root == rank_;
  const at::Tensor out = keep ? in : at::empty_like(in);
  return runReduce(describe(CollectiveKind::Reduce, tensor.numel(), dtype, op,
                            static_cast<int>(root)),
                   in, out,
                   keep ? intoOriginals(tensor, out) : Results{tensor, {}}, call);
}

WorkPtr Engine::gatherTo(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                         int64_t root, const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("gather");
  const DataType dtype = checks_.tensor(input, "gather", "tensor");
  checks_.root(root, "gather", "dst");
  if (root == rank_) {
    checks_.blockList(outputs, input, "gather", "gather_list");
  } else {
    PYDDP_CHECK_VALUE(outputs.empty(), "rank ", rank_, ": gather: only the destination rank ",
                      root, " passes a gather_list");
  }
  const std::vector<at::Tensor> outs = dense(outputs);
  const size_t count = input.numel();
  return runGather(describe(CollectiveKind::Gather, count, dtype, RedOp::Sum,
                            static_cast<int>(root)),
                   dense(input), RankBlocks{{}, outs, count}, intoOriginals(outputs, outs), call);
}

WorkPtr Engine::scatterFrom(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                            int64_t root, const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("scatter");
  const DataType dtype = checks_.tensor(output, "scatter", "tensor");
  checks_.writable(output, "scatter", "tensor");
  checks_.root(root, "scatter", "src");
  if (root == rank_) {
    checks_.blockList(inputs, output, "scatter", "scatter_list", /*written=*/false);
  } else {
    PYDDP_CHECK_VALUE(inputs.empty(), "rank ", rank_, ": scatter: only the source rank ", root,
                      " passes a scatter_list");
  }
  const std::vector<at::Tensor> ins = dense(inputs);
  const at::Tensor out = dense(output);
  const size_t count = output.numel();
  return runScatter(describe(CollectiveKind::Scatter, count, dtype, RedOp::Sum,
                             static_cast<int>(root)),
                    RankBlocks{{}, ins, count}, out, intoOriginals(output, out), call);
}

WorkPtr Engine::allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                               const std::vector<int64_t>& outputSplits,
                               const std::vector<int64_t>& inputSplits,
                               const CallOptions& call) {
  const process::ExitGate gate;
  const char* name = "all_to_all_single";
  refuseIfUnusable(name);
  const ArgChecks::AllToAll a = checks_.allToAll(output, input, outputSplits, inputSplits, name);
  const at::Tensor out = dense(output);
  return runAllToAll(describe(CollectiveKind::AllToAll, static_cast<size_t>(a.row), a.dtype),
                     dense(input).view({-1}), out.view({-1}), a, intoOriginals(output, out),
                     call);
}

WorkPtr Engine::allToAllList(const std::vector<at::Tensor>& outputs,
                             const std::vector<at::Tensor>& inputs, const CallOptions& call) {
  const process::ExitGate gate;
  const char* name = "all_to_all";
  refuseIfUnusable(name);
  const ArgChecks::AllToAll a = checks_.allToAllLists(outputs, inputs, name);
  std::vector<at::Tensor> flat;
  for (const auto& t : inputs) flat.push_back(t.reshape({-1}));
  const at::Tensor in = at::cat(flat);
  const at::Tensor out =
      at::empty({static_cast<int64_t>(a.out.offsets.back() + a.out.counts.back())},
                in.options());
  return runAllToAll(describe(CollectiveKind::AllToAll, 0, a.dtype), in, out, a,
                     Results{outputs, [=] {
                               for (size_t k = 0; k < outputs.size(); ++k) {
                                 const auto block =
                                     out.narrow(0, static_cast<int64_t>(a.out.offsets[k]),
                                                static_cast<int64_t>(a.out.counts[k]));
                                 outputs[k].copy_(block.view(outputs[k].sizes()));
                               }
                             }},
                     call);
}

WorkPtr Engine::allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                                   const CallOptions& call) {
  const process::ExitGate gate;
  const char* name = "all_reduce_coalesced";
  refuseIfUnusable(name);
  const DataType dtype = checks_.sameType(tensors, name, "tensor", true);
  checks_.op(op, dtype, name);
  const Packed p = packAllReduce(tensors);
  return runAllReduce(
      describe(CollectiveKind::AllReduce, p.input.numel(), dtype, op, -1, splitOf(tensors)),
      p.input, Results{tensors, p.unpack, splitText(tensors)}, call);
}

WorkPtr Engine::allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                   const std::vector<at::Tensor>& inputs,
                                   const CallOptions& call) {
  const process::ExitGate gate;
  const char* name = "all_gather_into_tensor_coalesced";
  refuseIfUnusable(name);
  const DataType dtype = checks_.coalesced(outputs, inputs, name, /*outputIsWhole=*/true);
  const Packed p = packAllGather(outputs, inputs, size_);
  const size_t count = p.input.numel();
  return runAllGather(
      describe(CollectiveKind::AllGather, count, dtype, RedOp::Sum, -1, splitOf(inputs)),
      p.input, RankBlocks{p.output, {}, count}, Results{outputs, p.unpack, splitText(inputs)},
      call);
}

WorkPtr Engine::allGatherCoalescedLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                                        const std::vector<at::Tensor>& inputs,
                                        const CallOptions& call) {
  const process::ExitGate gate;
  const char* name = "all_gather_coalesced";
  refuseIfUnusable(name);
  const DataType dtype = checks_.coalescedLists(outputLists, inputs, name);
  const Packed p = packAllGatherLists(outputLists, inputs, size_);
  std::vector<at::Tensor> outputs;
  for (const auto& list : outputLists) outputs.insert(outputs.end(), list.begin(), list.end());
  const size_t count = p.input.numel();
  return runAllGather(
      describe(CollectiveKind::AllGather, count, dtype, RedOp::Sum, -1, splitOf(inputs)),
      p.input, RankBlocks{p.output, {}, count}, Results{outputs, p.unpack, splitText(inputs)},
      call);
}

WorkPtr Engine::reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& inputs, RedOp op,
                                       const CallOptions& call) {
  const process::ExitGate gate;
  const char* name = "reduce_scatter_tensor_coalesced";
  refuseIfUnusable(name);
  const DataType dtype = checks_.coalesced(outputs, inputs, name, /*outputIsWhole=*/false);
  checks_.op(op, dtype, name);
  const Packed p = packReduceScatter(outputs, inputs, size_);
  return runReduceScatter(describe(CollectiveKind::ReduceScatter, p.output.numel(), dtype, op,
                                   -1, splitOf(outputs)),
                          p.input, p.output,
                          Results{outputs, p.unpack, splitText(outputs)}, call);
}

WorkPtr Engine::sendTo(const at::Tensor& tensor, int64_t dst, int64_t tag,
                       const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("send");
  checks_.tensor(tensor, "send", "tensor");
  checks_.peer(dst, "send", "dst");
  checks_.tag(tag, "send");
  return runSend(dense(tensor), static_cast<int>(dst), tag, call);
}

WorkPtr Engine::recvFrom(const at::Tensor& tensor, int64_t src, int64_t tag,
                         const CallOptions& call) {
  const process::ExitGate gate;
  refuseIfUnusable("recv");
  checks_.tensor(tensor, "recv", "tensor");
  checks_.writable(tensor, "recv", "tensor");
  if (src != kAnySource) checks_.peer(src, "recv", "src");
  checks_.tag(tag, "recv");
  const at::Tensor buf = dense(tensor);
  return runRecv(buf, static_cast<int>(src), tag, intoOriginals(tensor, buf), call);
}

void Engine::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const process::ExitGate gate;
  refuseIfUnusable("monitored_barrier");
  runMonitoredBarrier(opts, waitAllRanks);
}

void Engine::throwNamingSplits(const DescMismatch& e, const std::string& mine) const {
  const std::string prefix = "split/" + std::to_string(e.mine().seq) + "/";
  std::string said = bare(e.what_without_backtrace());
  try {
    store_->set(prefix + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
    said += "; the tensors' shapes: rank " + std::to_string(rank_) + " [" + mine + "]";
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || (e.peer() >= 0 && r != e.peer())) continue;
      const std::string key = prefix + std::to_string(r);
      std::string theirs = "(not known)";
      try {
        store_->wait({key}, kSplitWait);
        const std::vector<uint8_t> v = store_->get(key);
        theirs = "[" + std::string(v.begin(), v.end()) + "]";
      } catch (const std::exception&) {
        // A rank that agreed with this one's split, or that did not get
        // this far, publishes none.
      }
      said += ", rank " + std::to_string(r) + " " + theirs;
    }
  } catch (const std::exception&) {
    // The store is gone: the mismatch is still the error.
    throw e;
  }
  C10_THROW_ERROR(DistBackendError, "pyddp: " + said);
}

// --- what an engine does not run ------------------------------------------------

WorkPtr Engine::runReduce(const CollectiveDesc&, const at::Tensor&, const at::Tensor&, Results,
                          const CallOptions&) {
  refuse("reduce");
}

WorkPtr Engine::runGather(const CollectiveDesc&, const at::Tensor&, const RankBlocks&, Results,
                          const CallOptions&) {
  refuse("gather");
}

WorkPtr Engine::runScatter(const CollectiveDesc&, const RankBlocks&, const at::Tensor&, Results,
                           const CallOptions&) {
  refuse("scatter");
}

WorkPtr Engine::runAllToAll(const CollectiveDesc& desc, const at::Tensor&, const at::Tensor&,
                            const ArgChecks::AllToAll&, Results, const CallOptions&) {
  refuse(desc.count == 0 ? "all_to_all" : "all_to_all_single");
}

WorkPtr Engine::runSend(const at::Tensor&, int, int64_t, const CallOptions&) {
  refuse("send");
}

WorkPtr Engine::runRecv(const at::Tensor&, int, int64_t, Results, const CallOptions&) {
  refuse("recv");
}

void Engine::runMonitoredBarrier(const c10d::BarrierOptions&, bool) {
  refuse("monitoredBarrier");
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
  return broadcastFrom(single(tensors, "broadcast", "input"), opts.rootRank,
                       callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  PYDDP_CHECK_VALUE(opts.rootTensor == 0, "rank ", rank_, ": reduce: rootTensor ",
                    opts.rootTensor, " given; the pyddp backend takes one tensor per process");
  return reduceTo(single(tensors, "reduce", "input"), redOp(opts.reduceOp, "reduce"),
                  opts.rootRank, callOf(opts.asyncOp, opts.timeout));
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
                  opts.rootRank, callOf(opts.asyncOp, opts.timeout));
}

WorkPtr Engine::scatter(std::vector<at::Tensor>& outputs,
                        std::vector<std::vector<at::Tensor>>& inputs,
                        const c10d::ScatterOptions& opts) {
  // torch passes one (possibly empty) input list per process.
  PYDDP_CHECK_VALUE(inputs.size() <= 1, "rank ", rank_, ": scatter: got ", inputs.size(),
                    " input lists; the pyddp backend takes one per process");
  static const std::vector<at::Tensor> none;
  return scatterFrom(single(outputs, "scatter", "output"), inputs.empty() ? none : inputs[0],
                     opts.rootRank, callOf(opts.asyncOp, opts.timeout));
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
