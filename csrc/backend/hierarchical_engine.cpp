#include "backend/hierarchical_engine.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <regex>
#include <thread>

#include "backend/cpu_executor.h"
#include "backend/transport_engine.h"
#include "common/check.h"
#include "common/descriptor.h"
#include "common/interrupt.h"
#include "common/process_state.h"

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

// A call's finish as the executor runs it: a no-op when it has none.
std::function<void()> finishOf(Results& results) {
  if (results.finish) return std::move(results.finish);
  return [] {};
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
    const process::ExitGate gate;
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
                                       int size, const GroupOptions& options,
                                       const HostMap& hosts, const CrossHostFactory& gloo)
    : Engine(rank, size, c10::Device(c10::kCPU), "shm+gloo", store),
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
    localEngine_ = c10::make_intrusive<TransportEngine>(prefixed("local" + std::to_string(host_)),
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
  shutDown(Teardown::Destroyed);
}

const Executor& HierarchicalEngine::executor() const {
  return *executor_;
}

void HierarchicalEngine::shutDown(Teardown how) {
  if (!executor_) return;
  stopping_.store(true, std::memory_order_relaxed);
  executor_->shutdown(how);
  if (!localEngine_) return;
  if (how == Teardown::Aborted) {
    localEngine_->abort();
  } else {
    localEngine_->shutdown();
  }
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
    if (stopping_.load(std::memory_order_relaxed)) {
      failed(c10::str("rank ", rank_, ": the process group was ",
                      aborted() ? "aborted" : "destroyed", " while ", what,
                      " across hosts", others(group, rank_), " was running"));
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

WorkPtr HierarchicalEngine::submit(const CollectiveDesc& desc, Results& results,
                                   std::vector<at::Tensor> uses, std::function<void()> run,
                                   const CallOptions& call) {
  return executor_->submit(
      Collective{desc, results.tensors.vec(), std::move(uses),
                 [this, run = std::move(run), split = results.split](
                     const CollectiveDesc& d, Clock::time_point deadline) {
                   deadline_ = deadline;
                   namingSplits(split, [&] { agree(d); });
                   run();
                 },
                 finishOf(results), desc.kind == CollectiveKind::Barrier, call.timeout},
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
  // int64 MAX orders the words as uint64 MAX does: each word has the same
  // top bit on every rank (see kMaxSplit in common/descriptor.h).
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
  checkSame(desc, reduced, rank_);
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

WorkPtr HierarchicalEngine::runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf,
                                         Results results, const CallOptions& call) {
  const RedOp op = desc.op;
  const at::Tensor flat = buf.view({-1});
  return submit(desc, results, {flat},
                [=, this] {
                  allReduceSteps(flat, op);
                  finishAverage(flat, op, size_);
                },
                call);
}

WorkPtr HierarchicalEngine::runAllGather(const CollectiveDesc& desc, const at::Tensor& input,
                                         const RankBlocks& output, Results results,
                                         const CallOptions& call) {
  const at::Tensor in = input.view({-1});
  const int64_t count = static_cast<int64_t>(desc.count);
  if (output.whole.defined()) {
    const at::Tensor out = output.whole.view({-1});
    return submit(desc, results, {in, out}, [=, this] { allGatherSteps(out, in); }, call);
  }
  // gloo gathers into one buffer; the blocks may lie anywhere.
  const at::Tensor out = at::empty({count * size_}, input.options());
  const std::vector<at::Tensor> blocks = output.list.vec();
  return submit(desc, results, {in, out},
                [=, this] {
                  allGatherSteps(out, in);
                  for (int r = 0; r < size_; ++r) {
                    blocks[r].view({-1}).copy_(out.narrow(0, r * count, count));
                  }
                },
                call);
}

WorkPtr HierarchicalEngine::runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf,
                                         Results results, const CallOptions& call) {
  const int src = desc.root;
  const at::Tensor flat = buf.view({-1});
  return submit(desc, results, {flat}, [=, this] { broadcastSteps(flat, src); }, call);
}

WorkPtr HierarchicalEngine::runReduceScatter(const CollectiveDesc& desc, const at::Tensor& input,
                                             const at::Tensor& output, Results results,
                                             const CallOptions& call) {
  const RedOp op = desc.op;
  const int64_t count = static_cast<int64_t>(desc.count);
  // An all-reduce of which this rank keeps its block: the shard steps of
  // the even layout are a reduce-scatter already, but their shards follow
  // the host, not the rank.
  const at::Tensor whole = input.view({-1}).clone();
  const at::Tensor out = output.view({-1});
  return submit(desc, results, {whole, out},
                [=, this] {
                  allReduceSteps(whole, op);
                  finishAverage(whole, op, size_);
                  out.copy_(whole.narrow(0, rank_ * count, count));
                },
                call);
}

WorkPtr HierarchicalEngine::runBarrier(const CollectiveDesc& desc, const CallOptions& call) {
  Results none;
  // The descriptor check already met every rank.
  return submit(desc, none, {}, [] {}, call);
}

WorkPtr HierarchicalEngine::onFlat(const CollectiveDesc& desc, Results& results,
                                   std::vector<at::Tensor> uses,
                                   std::function<WorkPtr(c10d::Backend&)> start,
                                   const CallOptions& options) {
  const char* what = toString(desc.kind);
  return submit(desc, results, std::move(uses), [=, this] { await(start(*flat_), what, {}); },
                options);
}

WorkPtr HierarchicalEngine::runReduce(const CollectiveDesc& desc, const at::Tensor& input,
                                      const at::Tensor& output, Results results,
                                      const CallOptions& call) {
  const RedOp op = desc.op;
  const int root = desc.root;
  // gloo's reduce may use a non-root's buffer as scratch: it reduces a copy.
  const at::Tensor buf = input.clone();
  Results done{results.tensors, [buf, output, op, root, this, finish = finishOf(results)] {
                 if (rank_ != root) return;
                 finishAverage(buf, op, size_);
                 output.copy_(buf);
                 finish();
               }};
  return onFlat(desc, done, {buf, output},
                [=](c10d::Backend& g) {
                  std::vector<at::Tensor> v{buf};
                  c10d::ReduceOptions opts;
                  opts.reduceOp = glooOp(op);
                  opts.rootRank = root;
                  return g.reduce(v, opts);
                },
                call);
}

WorkPtr HierarchicalEngine::runGather(const CollectiveDesc& desc, const at::Tensor& input,
                                      const RankBlocks& output, Results results,
                                      const CallOptions& call) {
  const int root = desc.root;
  const std::vector<at::Tensor> outBufs = output.list.vec();
  std::vector<at::Tensor> uses = outBufs;
  uses.push_back(input);
  return onFlat(desc, results, uses,
                [=](c10d::Backend& g) {
                  std::vector<std::vector<at::Tensor>> outs;
                  if (!outBufs.empty()) outs.push_back(outBufs);
                  std::vector<at::Tensor> ins{input};
                  c10d::GatherOptions opts;
                  opts.rootRank = root;
                  return g.gather(outs, ins, opts);
                },
                call);
}

WorkPtr HierarchicalEngine::runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                                       const at::Tensor& output, Results results,
                                       const CallOptions& call) {
  const int root = desc.root;
  const std::vector<at::Tensor> inBufs = input.list.vec();
  std::vector<at::Tensor> uses = inBufs;
  uses.push_back(output);
  return onFlat(desc, results, uses,
                [=](c10d::Backend& g) {
                  std::vector<at::Tensor> outs{output};
                  std::vector<std::vector<at::Tensor>> ins;
                  if (!inBufs.empty()) ins.push_back(inBufs);
                  c10d::ScatterOptions opts;
                  opts.rootRank = root;
                  return g.scatter(outs, ins, opts);
                },
                call);
}

WorkPtr HierarchicalEngine::runAllToAll(const CollectiveDesc& desc, const at::Tensor& input,
                                        const at::Tensor& output, const ArgChecks::AllToAll& a,
                                        Results results, const CallOptions& call) {
  // One-element rows: gloo's splits are the blocks' element counts.
  std::vector<int64_t> outSplits(a.out.counts.begin(), a.out.counts.end());
  std::vector<int64_t> inSplits(a.in.counts.begin(), a.in.counts.end());
  return onFlat(desc, results, {input, output},
                [=](c10d::Backend& g) {
                  at::Tensor o = output, i = input;
                  std::vector<int64_t> os = outSplits, is = inSplits;
                  return g.alltoall_base(o, i, os, is, c10d::AllToAllOptions());
                },
                call);
}

// Point-to-point goes to gloo at once: it is not in the order of the
// collectives (as on a one-host group).
WorkPtr HierarchicalEngine::runSend(const at::Tensor& tensor, int dst, int64_t tag,
                                    const CallOptions& call) {
  std::vector<at::Tensor> v{tensor};
  WorkPtr work = c10::make_intrusive<CrossHostP2pWork>(
      flat_->send(v, dst, static_cast<int>(tag)),
      c10::str("rank ", rank_, ": send to rank ", dst, " (tag ", tag, ") across hosts"),
      c10d::OpType::SEND, nullptr);
  if (!call.asyncOp) work->wait();
  return work;
}

WorkPtr HierarchicalEngine::runRecv(const at::Tensor& buf, int src, int64_t tag,
                                    Results results, const CallOptions& call) {
  std::vector<at::Tensor> v{buf};
  const bool any = src == kAnySource;
  WorkPtr work = c10::make_intrusive<CrossHostP2pWork>(
      any ? flat_->recvAnysource(v, static_cast<int>(tag))
          : flat_->recv(v, src, static_cast<int>(tag)),
      c10::str("rank ", rank_, ": recv from ", any ? "any rank" : c10::str("rank ", src),
               " (tag ", tag, ") across hosts"),
      c10d::OpType::RECV, std::move(results.finish));
  if (!call.asyncOp) work->wait();
  return work;
}

void HierarchicalEngine::runMonitoredBarrier(const c10d::BarrierOptions& opts,
                                             bool waitAllRanks) {
  flat_->monitoredBarrier(opts, waitAllRanks);
}

} // namespace pyddp
