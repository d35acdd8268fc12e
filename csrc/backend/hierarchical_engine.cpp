#include "backend/hierarchical_engine.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <regex>
#include <thread>

#include "backend/coalesce.h"
#include "backend/cpu_executor.h"
#include "backend/ring_engine.h"
#include "backend/sparse.h"
#include "common/check.h"
#include "common/descriptor.h"
#include "common/interrupt.h"

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

// Where a rank that gave up says why, for the ranks on other hosts.
constexpr const char* kFailureKey = "failure";
// How often a rank waiting in gloo looks at kFailureKey (a store round
// trip): it bounds how late a failure on another host is noticed.
constexpr auto kFailurePoll = std::chrono::milliseconds(10);
// Pause between looks at a gloo Work.
constexpr auto kGlooPoll = std::chrono::microseconds(50);

c10d::ReduceOp glooOp(RedOp op) {
  switch (op) {
    case RedOp::Product: return c10d::ReduceOp::PRODUCT;
    case RedOp::Min: return c10d::ReduceOp::MIN;
    case RedOp::Max: return c10d::ReduceOp::MAX;
    case RedOp::BitAnd: return c10d::ReduceOp::BAND;
    case RedOp::BitOr: return c10d::ReduceOp::BOR;
    case RedOp::BitXor: return c10d::ReduceOp::BXOR;
    case RedOp::Sum:
    case RedOp::Avg: break;  // AVG divides after a SUM
  }
  return c10d::ReduceOp::SUM;
}

// AVG over the group is a SUM and one division, as a one-host reduction
// finishes it (half types divide in fp32).
void finishAverage(const at::Tensor& buf, RedOp op, int size) {
  if (op != RedOp::Avg) return;
  if (buf.scalar_type() == at::kHalf || buf.scalar_type() == at::kBFloat16) {
    buf.copy_(buf.to(at::kFloat).div_(size));
  } else {
    buf.div_(size);
  }
}

CollectiveDesc makeDesc(CollectiveKind kind, size_t count, DataType dtype, RedOp op = RedOp::Sum,
                        int root = -1) {
  CollectiveDesc d;
  d.kind = kind;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  return d;
}

at::Tensor dense(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

void copyBack(const at::Tensor& original, const at::Tensor& computed) {
  if (!original.is_same(computed)) original.copy_(computed);
}

std::vector<at::Tensor> dense(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(dense(t));
  return out;
}

void copyBack(const std::vector<at::Tensor>& originals, const std::vector<at::Tensor>& computed) {
  for (size_t i = 0; i < originals.size(); ++i) copyBack(originals[i], computed[i]);
}

// A point-to-point operation of gloo's: its failure names both ranks and
// the operation, and a message received into a contiguous buffer is copied
// into the caller's tensor once it arrived. Waiting twice waits once: a
// gloo Work's second wait waits for another message (a blocking send
// waited in sendTo() and again in its caller timed out).
class CrossHostP2pWork final : public c10d::Work {
 public:
  CrossHostP2pWork(WorkPtr inner, std::string what, c10d::OpType type,
                   std::function<void()> finish)
      : c10d::Work(-1, type), inner_(std::move(inner)), what_(std::move(what)),
        finish_(std::move(finish)) {}

  bool isCompleted() override { return inner_->isCompleted(); }
  int sourceRank() const override { return inner_->sourceRank(); }

  bool wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!settled_) {
      try {
        inner_->wait(timeout);
        if (finish_) finish_();
      } catch (const std::exception& e) {
        error_ = std::make_exception_ptr(c10::DistBackendError(
            {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
            "pyddp: " + what_ + " failed: " + bare(messageOf(e))));
      }
      settled_ = true;
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  const WorkPtr inner_;
  const std::string what_;
  const std::function<void()> finish_;
  std::mutex mu_;
  bool settled_ = false;     // mu_
  std::exception_ptr error_;  // mu_
};

// " with rank 3" / " with ranks 3, 5": the other members of a gloo group,
// the ranks a failure there can come from.
std::string others(const std::vector<int>& group, int rank) {
  std::string s;
  int n = 0;
  for (int r : group) {
    if (r == rank) continue;
    s += (n++ ? ", " : "") + std::to_string(r);
  }
  return n == 0 ? "" : (n == 1 ? " with rank " : " with ranks ") + s;
}

} // namespace

HierarchicalEngine::HierarchicalEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, const RingOptions& options,
                                       const HostMap& hosts, const CrossHostFactory& gloo)
    : Engine(rank, size, c10::Device(c10::kCPU), "shm+gloo"),
      options_(options),
      hosts_(hosts),
      store_(store),
      host_(hosts.hostOf[rank]),
      local_(hosts.localRank(rank)),
      localSize_(static_cast<int>(hosts.ranksOn[hosts.hostOf[rank]].size())) {
  const Ms timeout(options.timeoutMs);
  const int nHosts = hosts.hosts();
  shape_ = nHosts == size ? Shape::Gloo : hosts.even() ? Shape::Even : Shape::Leaders;
  auto prefixed = [&](const std::string& name) {
    return c10::make_intrusive<c10d::PrefixStore>(name, store);
  };
  // Every rank makes its groups in the same order (every rank, this host,
  // the ranks it shares a cross group with), so no two groups wait on each
  // other.
  flat_ = gloo(prefixed("flat"), rank, size, timeout);
  if (shape_ != Shape::Gloo) {
    localEngine_ = c10::make_intrusive<RingEngine>(prefixed("local" + std::to_string(host_)),
                                                   local_, localSize_, options,
                                                   c10::Device(c10::kCPU), "shm");
  }
  const int crossIndex = shape_ == Shape::Even ? local_ : 0;
  if (shape_ == Shape::Even || (shape_ == Shape::Leaders && local_ == 0)) {
    for (int h = 0; h < nHosts; ++h) crossRanks_.push_back(hosts.ranksOn[h][crossIndex]);
    cross_ = gloo(prefixed("cross" + std::to_string(crossIndex)), host_, nHosts, timeout);
  }
  executor_ = std::make_unique<CpuExecutor>(rank, options.timeoutMs);
  executor_->start(CpuExecutor::Hooks{
      nullptr,
      [this](const std::string& why) {
        store_->set(kFailureKey, std::vector<uint8_t>(why.begin(), why.end()));
        if (localEngine_) localEngine_->abandon(why);
      },
      [] {},
      // Teardown tells nobody: a failure key written as this rank leaves
      // would fail a peer still finishing a gloo collective this rank has
      // done its part of. The local engine's own teardown tells this host.
      nullptr});
}

HierarchicalEngine::~HierarchicalEngine() {
  shutdown();
}

const Executor& HierarchicalEngine::executor() const {
  return *executor_;
}

void HierarchicalEngine::shutdown() {
  if (!executor_) return;
  executor_->shutdown();
  if (localEngine_) localEngine_->shutdown();
}

std::string HierarchicalEngine::describeLayout() const {
  const char* shape = shape_ == Shape::Even      ? "hierarchical (shm inside each host, gloo "
                                                   "between hosts, one gloo group per local rank)"
                      : shape_ == Shape::Leaders ? "hierarchical through host leaders (hosts "
                                                   "have different numbers of ranks)"
                                                 : "gloo (one rank per host)";
  return std::string(shape) + "; " + hosts_.describe();
}

[[noreturn]] void HierarchicalEngine::failed(const std::string& why) {
  C10_THROW_ERROR(DistBackendError, "pyddp: " + bare(why));
}

void HierarchicalEngine::await(const WorkPtr& work, const char* what,
                               const std::vector<int>& group) {
  auto nextLook = Clock::now() + kFailurePoll;
  while (!work->isCompleted()) {
    const auto now = Clock::now();
    if (now >= nextLook) {
      nextLook = now + kFailurePoll;
      std::optional<std::vector<uint8_t>> why;
      try {
        if (store_->check({kFailureKey})) why = store_->get(kFailureKey);
      } catch (const std::exception& e) {
        failed(c10::str("rank ", rank_, ": ", what, " across hosts", others(group, rank_),
                        " stopped: the store failed (the rank that hosts it may have exited): ",
                        bare(messageOf(e))));
      }
      if (why) {
        failed(c10::str("rank ", rank_, ": ", what, " across hosts stopped: another rank gave "
                        "up: ", bare(std::string(why->begin(), why->end()))));
      }
    }
    if (interruptRequested()) {
      failed(c10::str("rank ", rank_, ": interrupted while ", what, " across hosts",
                      others(group, rank_), " was running"));
    }
    if (now >= deadline_) {
      failed(c10::str("rank ", rank_, ": ", what, " across hosts", others(group, rank_),
                      " did not finish within the timeout of ", options_.timeoutMs,
                      " ms: a rank did not arrive"));
    }
    std::this_thread::sleep_for(kGlooPoll);
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    failed(c10::str("rank ", rank_, ": ", what, " across hosts", others(group, rank_),
                    " failed: ", bare(messageOf(e))));
  }
}

WorkPtr HierarchicalEngine::submit(CollectiveDesc desc, std::vector<at::Tensor> outputs,
                                   std::vector<at::Tensor> uses, std::function<void()> run,
                                   const CallOptions& call) {
  return executor_->submit(
      Collective{desc, std::move(outputs), std::move(uses),
                 [this, run = std::move(run)](const CollectiveDesc& d,
                                              Clock::time_point deadline) {
                   deadline_ = deadline;
                   agree(d);
                   run();
                 },
                 [] {}, desc.kind == CollectiveKind::Barrier, call.timeout},
      call);
}

void HierarchicalEngine::local(const std::function<WorkPtr()>& start) {
  try {
    start()->wait();
  } catch (const std::exception& e) {
    failed(translate(messageOf(e)));
  }
}

std::string HierarchicalEngine::translate(const std::string& message) const {
  static const std::regex ranks(R"(\b(rank|ranks) ([0-9]+(?:, [0-9]+)*)\b)");
  const auto& mine = hosts_.ranksOn[host_];
  std::string out;
  auto at = message.cbegin();
  for (std::sregex_iterator it(message.begin(), message.end(), ranks), end; it != end; ++it) {
    out.append(at, (*it)[0].first);
    out += (*it)[1].str() + " ";
    std::string numbers = (*it)[2].str();
    size_t from = 0;
    for (bool first = true;; first = false) {
      const size_t comma = numbers.find(", ", from);
      const int local = std::stoi(numbers.substr(from, comma - from));
      out += (first ? "" : ", ") +
          std::to_string(local < static_cast<int>(mine.size()) ? mine[local] : local);
      if (comma == std::string::npos) break;
      from = comma + 2;
    }
    at = (*it)[0].second;
  }
  out.append(at, message.cend());
  return out;
}

void HierarchicalEngine::agree(const CollectiveDesc& desc) {
  const DescWords words = encodeWords(desc);
  // int64 MAX orders the words as uint64 MAX does: every encoded field
  // and its complement stay below 2^63 (see common/descriptor.h).
  at::Tensor t = at::empty({kDescWords}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(t.data_ptr(), words.data(), sizeof(words));
  if (localEngine_) {
    local([&] { return localEngine_->allReduce(t, RedOp::Max, CallOptions{}); });
  }
  c10d::Backend* across = shape_ == Shape::Gloo ? flat_.get() : cross_.get();
  if (across) {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    await(across->allreduce(v, opts), "the descriptor check",
          shape_ == Shape::Gloo ? std::vector<int>() : crossRanks_);
  }
  // Leaders tell their host what the hosts agreed on.
  if (shape_ == Shape::Leaders) {
    local([&] { return localEngine_->broadcastFrom(t, 0, CallOptions{}); });
  }
  DescWords reduced;
  std::memcpy(reduced.data(), t.data_ptr(), sizeof(reduced));
  const std::string why = mismatch(desc, reduced, rank_);
  PYDDP_CHECK_COMM(why.empty(), why);
}

void HierarchicalEngine::allReduceSteps(const at::Tensor& buf, RedOp op) {
  c10d::AllreduceOptions opts;
  opts.reduceOp = glooOp(op);
  if (shape_ == Shape::Gloo) {
    std::vector<at::Tensor> v{buf};
    await(flat_->allreduce(v, opts), "all_reduce", {});
    return;
  }
  const RedOp localOp = op == RedOp::Avg ? RedOp::Sum : op;
  if (shape_ == Shape::Leaders) {
    // to the leader, among the leaders, from the leader
    local([&] { return localEngine_->reduceTo(buf, localOp, 0, CallOptions{}); });
    if (cross_) {
      std::vector<at::Tensor> v{buf};
      await(cross_->allreduce(v, opts), "all_reduce among host leaders", crossRanks_);
    }
    local([&] { return localEngine_->broadcastFrom(buf, 0, CallOptions{}); });
    return;
  }
  // Even: the tensor in localSize_ shards (padded), each all-reduced across
  // hosts by the ranks holding it.
  const int64_t count = buf.numel();
  const int64_t shard = (count + localSize_ - 1) / localSize_;
  at::Tensor padded = buf;
  if (shard * localSize_ != count) {
    padded = at::zeros({shard * localSize_}, buf.options());
    padded.narrow(0, 0, count).copy_(buf);
  }
  at::Tensor mine = at::empty({shard}, buf.options());
  // reduce-scatter inside the host
  local([&] { return localEngine_->reduceScatterSingle(mine, padded, localOp, CallOptions{}); });
  // all-reduce of my shard across hosts
  std::vector<at::Tensor> v{mine};
  await(cross_->allreduce(v, opts), "all_reduce of a shard", crossRanks_);
  // all-gather inside the host
  local([&] { return localEngine_->allGatherSingle(padded, mine, CallOptions{}); });
  if (!padded.is_same(buf)) buf.copy_(padded.narrow(0, 0, count));
}

void HierarchicalEngine::allGatherSteps(const at::Tensor& out, const at::Tensor& in) {
  if (shape_ != Shape::Even) {
    await(flat_->_allgather_base(const_cast<at::Tensor&>(out), const_cast<at::Tensor&>(in),
                                 c10d::AllgatherOptions()),
          "all_gather", {});
    return;
  }
  // across hosts among the ranks of my local rank, then inside the host;
  // block (j, h) of `all` is the input of local rank j on host h
  const int64_t count = in.numel();
  const int nHosts = hosts_.hosts();
  at::Tensor across = at::empty({nHosts * count}, in.options());
  at::Tensor inCopy = in;
  await(cross_->_allgather_base(across, inCopy, c10d::AllgatherOptions()),
        "all_gather across hosts", crossRanks_);
  at::Tensor all = at::empty({localSize_ * nHosts * count}, in.options());
  local([&] { return localEngine_->allGatherSingle(all, across, CallOptions{}); });
  // into rank order
  for (int j = 0; j < localSize_; ++j) {
    for (int h = 0; h < nHosts; ++h) {
      const int r = hosts_.ranksOn[h][j];
      out.narrow(0, r * count, count).copy_(all.narrow(0, (j * nHosts + h) * count, count));
    }
  }
}

void HierarchicalEngine::broadcastSteps(const at::Tensor& buf, int src) {
  std::vector<at::Tensor> v{buf};
  c10d::BroadcastOptions opts;
  if (shape_ == Shape::Gloo) {
    opts.rootRank = src;
    await(flat_->broadcast(v, opts), "broadcast", {});
    return;
  }
  const int srcHost = hosts_.hostOf[src];
  const int srcLocal = hosts_.localRank(src);
  opts.rootRank = srcHost;
  if (shape_ == Shape::Even) {
    // across hosts among the ranks of src's local rank, then inside each host
    if (local_ == srcLocal) {
      await(cross_->broadcast(v, opts), "broadcast across hosts", crossRanks_);
    }
    local([&] { return localEngine_->broadcastFrom(buf, srcLocal, CallOptions{}); });
    return;
  }
  // inside src's host (so its leader has it), among the leaders, then
  // inside each other host from its leader
  if (host_ == srcHost) {
    local([&] { return localEngine_->broadcastFrom(buf, srcLocal, CallOptions{}); });
  }
  if (cross_) await(cross_->broadcast(v, opts), "broadcast among host leaders", crossRanks_);
  if (host_ != srcHost) {
    local([&] { return localEngine_->broadcastFrom(buf, 0, CallOptions{}); });
  }
}

WorkPtr HierarchicalEngine::allReduce(const at::Tensor& tensor, RedOp op,
                                      const CallOptions& call) {
  if (tensor.is_sparse()) return allReduceSparse(tensor, op, call);
  const DataType dtype = checks_.tensor(tensor, "all_reduce", "tensor");
  checks_.writable(tensor, "all_reduce", "tensor");
  checks_.op(op, dtype, "all_reduce");
  const at::Tensor buf = dense(tensor).view({-1});
  return submit(makeDesc(CollectiveKind::AllReduce, tensor.numel(), dtype, op), {tensor}, {buf},
                [=, this] {
                  allReduceSteps(buf, op);
                  finishAverage(buf, op, size_);
                  copyBack(tensor, buf.view(tensor.sizes()));
                },
                call);
}

WorkPtr HierarchicalEngine::allReduceSparse(const at::Tensor& tensor, RedOp op,
                                            const CallOptions& call) {
  const SparseStart start = startSparse(tensor, op, call);
  const sparse::Blocks b = start.blocks;
  const at::Tensor in = start.packed;
  const at::Tensor out = at::empty({size_ * b.bytes}, at::kByte);
  return submit(makeDesc(CollectiveKind::AllGather, b.bytes, DataType::UInt8), {tensor},
                {in, out},
                [=, this] {
                  allGatherSteps(out, in);
                  tensor.copy_(sparse::sum(out, b));
                },
                call);
}

WorkPtr HierarchicalEngine::allGatherSingle(const at::Tensor& output, const at::Tensor& input,
                                            const CallOptions& call) {
  const DataType dtype = checks_.single("all_gather_single", output, input, true);
  const at::Tensor in = dense(input).view({-1});
  const at::Tensor out = dense(output).view({-1});
  return submit(makeDesc(CollectiveKind::AllGather, input.numel(), dtype), {output}, {in, out},
                [=, this] {
                  allGatherSteps(out, in);
                  copyBack(output, out.view(output.sizes()));
                },
                call);
}

WorkPtr HierarchicalEngine::allGatherList(const std::vector<at::Tensor>& outputs,
                                          const at::Tensor& input, const CallOptions& call) {
  const DataType dtype = checks_.tensor(input, "all_gather", "tensor");
  checks_.blockList(outputs, input, "all_gather", "tensor_list");
  const at::Tensor in = dense(input).view({-1});
  const int64_t count = input.numel();
  const at::Tensor out = at::empty({count * size_}, input.options());
  return submit(makeDesc(CollectiveKind::AllGather, count, dtype), outputs, {in, out},
                [=, this] {
                  allGatherSteps(out, in);
                  for (int r = 0; r < size_; ++r) {
                    outputs[r].copy_(out.narrow(0, r * count, count).view(outputs[r].sizes()));
                  }
                },
                call);
}

WorkPtr HierarchicalEngine::broadcastFrom(const at::Tensor& tensor, int src,
                                          const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  const at::Tensor buf = dense(tensor).view({-1});
  return submit(makeDesc(CollectiveKind::Broadcast, tensor.numel(), dtype, RedOp::Sum, src),
                {tensor}, {buf},
                [=, this] {
                  broadcastSteps(buf, src);
                  copyBack(tensor, buf.view(tensor.sizes()));
                },
                call);
}

WorkPtr HierarchicalEngine::reduceScatterSingle(const at::Tensor& output,
                                                const at::Tensor& input, RedOp op,
                                                const CallOptions& call) {
  const DataType dtype = checks_.single("reduce_scatter_single", output, input, false);
  checks_.op(op, dtype, "reduce_scatter_single");
  const int64_t count = output.numel();
  // An all-reduce of which this rank keeps its block: the shard steps of
  // the even layout are a reduce-scatter already, but their shards follow
  // the host, not the rank.
  const at::Tensor whole = input.contiguous().view({-1}).clone();
  return submit(makeDesc(CollectiveKind::ReduceScatter, count, dtype, op), {output}, {whole},
                [=, this] {
                  allReduceSteps(whole, op);
                  finishAverage(whole, op, size_);
                  output.copy_(whole.narrow(0, rank_ * count, count).view(output.sizes()));
                },
                call);
}

WorkPtr HierarchicalEngine::barrierAll(const CallOptions& call) {
  return submit(makeDesc(CollectiveKind::Barrier, 0, DataType::UInt8), {}, {},
                // The descriptor check already met every rank.
                [] {}, call);
}

WorkPtr HierarchicalEngine::onFlat(CollectiveDesc desc, std::vector<at::Tensor> outputs,
                                   std::vector<at::Tensor> uses,
                                   std::function<WorkPtr(c10d::Backend&)> start,
                                   std::function<void()> finish, const CallOptions& options) {
  const char* what = toString(desc.kind);
  return submit(desc, std::move(outputs), std::move(uses),
                [=, this] {
                  await(start(*flat_), what, {});
                  if (finish) finish();
                },
                options);
}

WorkPtr HierarchicalEngine::reduceTo(const at::Tensor& tensor, RedOp op, int root,
                                     const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "reduce", "tensor");
  checks_.writable(tensor, "reduce", "tensor");
  checks_.op(op, dtype, "reduce");
  checks_.root(root, "reduce", "dst");
  const at::Tensor buf = dense(tensor).clone();
  return onFlat(makeDesc(CollectiveKind::Reduce, tensor.numel(), dtype, op, root), {tensor},
                {buf},
                [=](c10d::Backend& g) {
                  std::vector<at::Tensor> v{buf};
                  c10d::ReduceOptions opts;
                  opts.reduceOp = glooOp(op);
                  opts.rootRank = root;
                  return g.reduce(v, opts);
                },
                [=, this] {
                  if (rank_ != root) return;
                  finishAverage(buf, op, size_);
                  tensor.copy_(buf);
                },
                call);
}

WorkPtr HierarchicalEngine::gatherTo(const std::vector<at::Tensor>& outputs,
                                     const at::Tensor& input, int root, const CallOptions& call) {
  const DataType dtype = checks_.tensor(input, "gather", "tensor");
  checks_.root(root, "gather", "dst");
  if (rank_ == root) {
    checks_.blockList(outputs, input, "gather", "gather_list");
  } else {
    PYDDP_CHECK_VALUE(outputs.empty(), "rank ", rank_, ": gather: only the destination rank ",
                      root, " passes a gather_list");
  }
  // gloo takes contiguous tensors only.
  const at::Tensor in = dense(input);
  const std::vector<at::Tensor> outBufs = dense(outputs);
  std::vector<at::Tensor> uses = outBufs;
  uses.push_back(in);
  return onFlat(makeDesc(CollectiveKind::Gather, input.numel(), dtype, RedOp::Sum, root),
                outputs, uses,
                [=](c10d::Backend& g) {
                  std::vector<std::vector<at::Tensor>> outs;
                  if (!outBufs.empty()) outs.push_back(outBufs);
                  std::vector<at::Tensor> ins{in};
                  c10d::GatherOptions opts;
                  opts.rootRank = root;
                  return g.gather(outs, ins, opts);
                },
                [=] { copyBack(outputs, outBufs); }, call);
}

WorkPtr HierarchicalEngine::scatterFrom(const at::Tensor& output,
                                        const std::vector<at::Tensor>& inputs, int root,
                                        const CallOptions& call) {
  const DataType dtype = checks_.tensor(output, "scatter", "tensor");
  checks_.writable(output, "scatter", "tensor");
  checks_.root(root, "scatter", "src");
  if (rank_ == root) {
    checks_.blockList(inputs, output, "scatter", "scatter_list");
  } else {
    PYDDP_CHECK_VALUE(inputs.empty(), "rank ", rank_, ": scatter: only the source rank ", root,
                      " passes a scatter_list");
  }
  // gloo takes contiguous tensors only.
  const at::Tensor out = dense(output);
  const std::vector<at::Tensor> inBufs = dense(inputs);
  std::vector<at::Tensor> uses = inBufs;
  uses.push_back(out);
  return onFlat(makeDesc(CollectiveKind::Scatter, output.numel(), dtype, RedOp::Sum, root),
                {output}, uses,
                [=](c10d::Backend& g) {
                  std::vector<at::Tensor> outs{out};
                  std::vector<std::vector<at::Tensor>> ins;
                  if (!inBufs.empty()) ins.push_back(inBufs);
                  c10d::ScatterOptions opts;
                  opts.rootRank = root;
                  return g.scatter(outs, ins, opts);
                },
                [=] { copyBack(output, out); }, call);
}

WorkPtr HierarchicalEngine::allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                                           const std::vector<int64_t>& outputSplits,
                                           const std::vector<int64_t>& inputSplits,
                                           const CallOptions& call) {
  const char* name = "all_to_all_single";
  const auto [dtype, row, out, in] =
      checks_.allToAll(output, input, outputSplits, inputSplits, name);
  // gloo takes contiguous tensors only.
  const at::Tensor inBuf = dense(input);
  const at::Tensor outBuf = dense(output);
  return onFlat(makeDesc(CollectiveKind::AllToAll, static_cast<size_t>(row), dtype), {output},
                {inBuf, outBuf},
                [=](c10d::Backend& g) {
                  at::Tensor out = outBuf, in = inBuf;
                  std::vector<int64_t> outSplits = outputSplits, inSplits = inputSplits;
                  return g.alltoall_base(out, in, outSplits, inSplits, c10d::AllToAllOptions());
                },
                [=] { copyBack(output, outBuf); }, call);
}

WorkPtr HierarchicalEngine::allToAllList(const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs,
                                         const CallOptions& call) {
  PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ &&
                        static_cast<int>(inputs.size()) == size_,
                    "rank ", rank_, ": all_to_all: got ", outputs.size(), " outputs and ",
                    inputs.size(), " inputs, expected world_size = ", size_, " of each");
  const DataType dtype = checks_.sameType(inputs, "all_to_all", "input", false);
  checks_.sameType(outputs, "all_to_all", "output", true);
  // gloo's list form wants blocks of one size: one flat buffer each way,
  // blocks of any size (splits of one-element rows).
  std::vector<int64_t> outSplits, inSplits;
  std::vector<at::Tensor> flat;
  for (int k = 0; k < size_; ++k) {
    inSplits.push_back(inputs[k].numel());
    outSplits.push_back(outputs[k].numel());
    flat.push_back(inputs[k].reshape({-1}));
  }
  const at::Tensor in = at::cat(flat);
  const at::Tensor out = at::empty({std::accumulate(outSplits.begin(), outSplits.end(),
                                                    int64_t{0})},
                                   in.options());
  return onFlat(makeDesc(CollectiveKind::AllToAll, 0, dtype), outputs, {in, out},
                [=](c10d::Backend& g) {
                  at::Tensor o = out, i = in;
                  std::vector<int64_t> os = outSplits, is = inSplits;
                  return g.alltoall_base(o, i, os, is, c10d::AllToAllOptions());
                },
                [=, this] {
                  int64_t at = 0;
                  for (int k = 0; k < size_; ++k) {
                    outputs[k].copy_(out.narrow(0, at, outSplits[k]).view(outputs[k].sizes()));
                    at += outSplits[k];
                  }
                },
                call);
}

WorkPtr HierarchicalEngine::allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                                               const CallOptions& call) {
  const DataType dtype = checks_.sameType(tensors, "all_reduce_coalesced", "tensor", true);
  checks_.op(op, dtype, "all_reduce_coalesced");
  const Packed p = packAllReduce(tensors);
  return submit(makeDesc(CollectiveKind::AllReduce, p.input.numel(), dtype, op), tensors,
                {p.input},
                [=, this] {
                  allReduceSteps(p.input, op);
                  finishAverage(p.input, op, size_);
                  p.unpack();
                },
                call);
}

WorkPtr HierarchicalEngine::allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs,
                                               const CallOptions& call) {
  const char* name = "all_gather_into_tensor_coalesced";
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  checks_.sameType(outputs, name, "output", true);
  return allGatherPacked(packAllGather(outputs, inputs, size_), dtype, outputs, call);
}

WorkPtr HierarchicalEngine::allGatherCoalescedLists(
    const std::vector<std::vector<at::Tensor>>& outputLists,
    const std::vector<at::Tensor>& inputs, const CallOptions& call) {
  const DataType dtype = checks_.coalescedLists(outputLists, inputs, "all_gather_coalesced");
  std::vector<at::Tensor> outputs;
  for (const auto& list : outputLists) outputs.insert(outputs.end(), list.begin(), list.end());
  return allGatherPacked(packAllGatherLists(outputLists, inputs, size_), dtype, outputs, call);
}

WorkPtr HierarchicalEngine::allGatherPacked(const Packed& p, DataType dtype,
                                            std::vector<at::Tensor> outputs,
                                            const CallOptions& call) {
  return submit(makeDesc(CollectiveKind::AllGather, p.input.numel(), dtype), std::move(outputs),
                {p.input, p.output},
                [=, this] {
                  allGatherSteps(p.output, p.input);
                  p.unpack();
                },
                call);
}

WorkPtr HierarchicalEngine::reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                                   const std::vector<at::Tensor>& inputs,
                                                   RedOp op, const CallOptions& call) {
  const char* name = "reduce_scatter_tensor_coalesced";
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  checks_.sameType(outputs, name, "output", true);
  checks_.op(op, dtype, name);
  const Packed p = packReduceScatter(outputs, inputs, size_);
  const int64_t count = p.output.numel();
  const at::Tensor whole = p.input.clone();
  return submit(makeDesc(CollectiveKind::ReduceScatter, count, dtype, op), outputs, {whole},
                [=, this] {
                  allReduceSteps(whole, op);
                  finishAverage(whole, op, size_);
                  p.output.copy_(whole.narrow(0, rank_ * count, count));
                  p.unpack();
                },
                call);
}

// Point-to-point goes to gloo at once: it is not in the order of the
// collectives (as on a one-host group).
WorkPtr HierarchicalEngine::sendTo(const at::Tensor& tensor, int dst, int64_t tag,
                                   const CallOptions& call) {
  checks_.tensor(tensor, "send", "tensor");
  checks_.peer(dst, "send", "dst");
  checks_.tag(tag, "send");
  std::vector<at::Tensor> v{dense(tensor)};
  WorkPtr work = c10::make_intrusive<CrossHostP2pWork>(
      flat_->send(v, dst, static_cast<int>(tag)),
      c10::str("rank ", rank_, ": send to rank ", dst, " (tag ", tag, ") across hosts"),
      c10d::OpType::SEND, nullptr);
  if (!call.asyncOp) work->wait();
  return work;
}

WorkPtr HierarchicalEngine::recvFrom(const at::Tensor& tensor, int src, int64_t tag,
                                     const CallOptions& call) {
  checks_.tensor(tensor, "recv", "tensor");
  checks_.writable(tensor, "recv", "tensor");
  if (src != kAnySource) checks_.peer(src, "recv", "src");
  checks_.tag(tag, "recv");
  // gloo takes contiguous tensors only.
  const at::Tensor buf = dense(tensor);
  std::vector<at::Tensor> v{buf};
  const bool any = src == kAnySource;
  WorkPtr work = c10::make_intrusive<CrossHostP2pWork>(
      any ? flat_->recvAnysource(v, static_cast<int>(tag))
          : flat_->recv(v, src, static_cast<int>(tag)),
      c10::str("rank ", rank_, ": recv from ", any ? "any rank" : c10::str("rank ", src),
               " (tag ", tag, ") across hosts"),
      c10d::OpType::RECV, [tensor, buf] { copyBack(tensor, buf); });
  if (!call.asyncOp) work->wait();
  return work;
}

void HierarchicalEngine::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  flat_->monitoredBarrier(opts, waitAllRanks);
}

} // namespace pyddp
