#include "backend/transport_engine.h"

#include <chrono>
#include <optional>

#include "algorithms/schedule.h"
#include "backend/bootstrap.h"
#include "backend/coalesce.h"
#include "backend/cpu_executor.h"
#include "backend/monitored_barrier.h"
#include "backend/p2p_executor.h"
#include "backend/sparse.h"
#include "common/check.h"
#include "transport/factory.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/device_executor.h"
#endif

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

// What a queued collective keeps of what its transfer uses
// (TransportEngine::submit), and the same added to the list of its tensors.
at::Tensor owned(const at::Tensor& tensor) {
  return tensor;
}
std::vector<at::Tensor> owned(c10::ArrayRef<at::Tensor> tensors) {
  return tensors.vec();
}
void appendTo(std::vector<at::Tensor>& all, const at::Tensor& tensor) {
  all.push_back(tensor);
}
void appendTo(std::vector<at::Tensor>& all, c10::ArrayRef<at::Tensor> tensors) {
  all.insert(all.end(), tensors.begin(), tensors.end());
}

// A call's finish as the executor runs it: a no-op when it has none.
std::function<void()> finishOf(Results& results) {
  if (results.finish) return std::move(results.finish);
  return [] {};
}

// `desc` with the algorithm of its plan, which every rank compares.
CollectiveDesc planned(CollectiveDesc desc, const algorithms::Plan& plan) {
  desc.algo = plan.algo;
  return desc;
}

// Whether [p, p + bytes) overlaps a block of `blocks` (each `blockBytes`
// long) other than block `rank`: a registered collective would then write
// memory a peer reads.
template <typename Ptr>
bool overlapsPeerBlock(const void* p, size_t bytes, c10::ArrayRef<Ptr> blocks,
                       size_t blockBytes, int rank) {
  const auto* first = static_cast<const char*>(p);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const auto* block = static_cast<const char*>(blocks[b]);
    if (static_cast<int>(b) != rank && first < block + blockBytes && block < first + bytes) {
      return true;
    }
  }
  return false;
}

} // namespace

TransportEngine::TransportEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const GroupOptions& options, c10::Device device,
                       const std::string& transport)
    : Engine(rank, size, device, transport, store), options_(options), cma_(options.cma) {
  options_.validate();
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  PYDDP_CHECK_VALUE(device.is_cpu() || (device.is_cuda() && device.has_index()), "rank ", rank,
                    ": TransportEngine serves the CPU or one CUDA device (cuda:N), not ", device);
  EngineExecutor made = makeExecutor(rank, device, Ms(options_.timeoutMs));
  executor_ = std::move(made.owner);
  cpuExec_ = made.cpu;
  deviceExec_ = made.device;
  void* stream = nullptr;
#ifdef PYDDP_WITH_CUDA
  if (deviceExec_) stream = deviceExec_->stream();
#endif
  const int deviceIndex = device.is_cpu() ? -1 : device.index();
  transport_ = makeTransport(transport, TransportArgs{rank, size, options_, deviceIndex, stream});
  bootstrap::connect(*transport_, *store, rank, size, Ms(options_.timeoutMs));
  const auto directory = std::make_shared<bootstrap::StoreDirectory>(store);
  link_ = transport_->messages(directory, Lane::Collectives);
  userLink_ = transport_->messages(directory, Lane::User);
  if (userLink_) p2p_ = std::make_unique<P2pExecutor>(rank, *userLink_);
  registeredRefusal_ = whyNotReadRegistered();
  processRefusal_ = whyNotReadProcesses();
  caps_ = algorithms::Capabilities{rank,
                                   size,
                                   transport_->peerMemory() != nullptr,
                                   link_ != nullptr,
                                   registeredRefusal_.empty(),
                                   processRefusal_.empty()};
  if (processRefusal_.empty()) kernelScratch_.resize(schedule::kernelScratchBytes(size));
  startExecutor();
}

void TransportEngine::startExecutor() {
  if (cpuExec_) {
    cpuExec_->start(CpuExecutor::hooksOf(*transport_));
    return;
  }
#ifdef PYDDP_WITH_CUDA
  Transport* t = transport_.get();
  deviceExec_->start(DeviceExecutor::Hooks{
      t,
      // cuda_ipc reports device waits that gave up and dead peers; NCCL's
      // hangs end at the deadline.
      [t] { return t->asyncError(); },
      // Waits of kernels still queued end at once instead of at their timeout.
      [t](const std::string&) { t->abort(); },
      t->deviceErrorProbe()});
#endif
}

void TransportEngine::abandon(const std::string& why) {
  transport_->abandon(why);
}

TransportEngine::~TransportEngine() {
  shutDown(Teardown::Destroyed);
}

void TransportEngine::shutDown(Teardown how) {
  if (p2p_) {
    p2p_->shutdown(teardownReason(rank_, transport_ ? transport_->deadPeer() : "", how));
  }
  executor_->shutdown(how);
  if (transport_) transport_->abort();
  // Nothing drives the links any more: what they left in /dev/shm goes
  // now, not when the group is collected.
  if (link_) link_->close();
  if (userLink_) userLink_->close();
}

template <typename Transfer, typename... Uses>
WorkPtr TransportEngine::submit(CollectiveDesc desc, Results& results,
                           std::tuple<const Uses&...> uses, Transfer&& transfer,
                           const CallOptions& call) {
  const auto borrowed = [&](const CollectiveDesc& d, Deadline deadline) {
    namingSplits(results.split, [&] {
      std::apply(
          [&](const Uses&... u) {
            transfer(algorithms::Call{*transport_, d, deadline, rank_, size_}, u...);
          },
          uses);
    });
  };
  const auto finish = [&results] {
    if (results.finish) results.finish();
  };
  if (executor_->runNow(desc, call, borrowed, finish)) return {};
  std::vector<at::Tensor> all;
  std::apply([&](const Uses&... u) { (appendTo(all, u), ...); }, uses);
  auto held = std::apply([](const Uses&... u) { return std::make_tuple(owned(u)...); }, uses);
  return executor_->submit(
      Collective{desc, results.tensors.vec(), std::move(all),
                 [this, transfer = std::forward<Transfer>(transfer), held = std::move(held),
                  split = results.split](const CollectiveDesc& d, Deadline deadline) {
                   namingSplits(split, [&] {
                     std::apply(
                         [&](const auto&... u) {
                           transfer(algorithms::Call{*transport_, d, deadline, rank_, size_},
                                    u...);
                         },
                         held);
                   });
                 },
                 finishOf(results), desc.kind == CollectiveKind::Barrier, call.timeout},
      call);
}

template <typename Transfer>
WorkPtr TransportEngine::submit(CollectiveDesc desc, Results& results, c10::ArrayRef<at::Tensor> uses,
                           Transfer&& transfer, const CallOptions& call) {
  return submit(
      desc, results, std::tuple<const c10::ArrayRef<at::Tensor>&>(uses),
      [transfer = std::forward<Transfer>(transfer)](const algorithms::Call& c,
                                                    c10::ArrayRef<at::Tensor>) { transfer(c); },
      call);
}

kernels::ReduceSpec TransportEngine::spec(DataType dtype, RedOp op) const {
  return kernels::ReduceSpec{dtype, op, size_};
}

MessageLink& TransportEngine::messages(const char* call) const {
  PYDDP_CHECK_TYPE(link_ != nullptr, "rank ", rank_, ": ", call, " moves messages between "
                   "pairs of ranks, which pyddp's ", transport_->name(), " transport does not "
                   "have (CUDA tensors: use the backend \"nccl\")");
  return *link_;
}

std::chrono::milliseconds TransportEngine::timeoutOf(const CallOptions& call) const {
  return call.timeout.count() > 0 ? call.timeout : Ms(options_.timeoutMs);
}

std::string TransportEngine::whyNotReadInPlace() const {
  const PeerMemory* mem = transport_->peerMemory();
  if (!cpuExec_) return "the tensors are not in CPU memory";
  if (options_.algo != Algo::Auto) {
    return std::string("algo is ") + toString(options_.algo) + ", not auto";
  }
  if (!mem) return transport_->name() + std::string(" does not map peers' memory");
  if (mem->capacityBytes() < sizeof(algorithms::TensorWhere)) {
    return "no staging buffers to say where the tensors lie (direct_max_bytes and "
           "two_shot_max_bytes are 0)";
  }
  return "";
}

std::string TransportEngine::whyNotReadRegistered() const {
  const std::string why = whyNotReadInPlace();
  return why.empty() ? transport_->peerMemory()->whyNotMapRegistered() : why;
}

std::string TransportEngine::whyNotReadProcesses() const {
  const std::string why = whyNotReadInPlace();
  return why.empty() ? transport_->peerMemory()->whyNotReadProcesses() : why;
}

template <typename Run, typename Fallback>
void TransportEngine::inPlaceOr(const algorithms::Call& call, const algorithms::Plan& selected,
                           const void* mine, size_t bytes, int root, Run&& run,
                           Fallback&& fallback) {
  if (selected.algo != Algo::Registered) return fallback(call);
  algorithms::Call c = call;
  PeerMemory* mem = transport_->peerMemory();
  const algorithms::Plan plan = algorithms::vote(selected, cma_);
  const algorithms::RegisteredView view =
      algorithms::arriveRegistered(c, *mem, mine, bytes, root, plan.reads);
  c.arrived = true;
  const Clock::time_point start = plan.timed ? Clock::now() : Clock::time_point{};
  if (view.usable()) {
    run(c, *mem, view);
  } else {
    fallback(c);
  }
  if (!plan.votes) return;
  // Timed only if it ran the path voted for: a view that maps every tensor
  // took neither.
  std::optional<double> nanoseconds;
  if (plan.timed && (plan.reads.kernelVote ? view.throughKernel : !view.usable())) {
    // the ring's time to where the kernel path's closing meeting ends it
    if (!plan.reads.kernelVote) mem->awaitRingTaken();
    nanoseconds = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  }
  cma_.record(plan, nanoseconds);
}

void TransportEngine::allGatherBlocks(const algorithms::Call& call, const algorithms::Plan& plan,
                                 DataType dtype, const void* in, c10::ArrayRef<void*> blocks,
                                 size_t count) {
  const size_t bytes = count * elementSize(dtype);
  // An input that overlaps a peer's block of the output would be written
  // while the peers read it: this rank then offers no registered input, and
  // every rank takes the other algorithm.
  const bool overlaps = overlapsPeerBlock(in, bytes, blocks, bytes, rank_);
  inPlaceOr(
      call, plan, overlaps ? nullptr : in, bytes, -1,
      [&](const algorithms::Call& c, PeerMemory& mem, const algorithms::RegisteredView& view) {
        algorithms::registeredAllGather(c, mem, view, dtype, blocks, count);
      },
      [&](const algorithms::Call& c) {
        if (plan.staged == Algo::Direct) {
          algorithms::directAllGather(c, *transport_->peerMemory(), dtype, in, blocks, count);
        } else {
          algorithms::ringAllGather(c, dtype, in, blocks, count);
        }
      });
}

WorkPtr TransportEngine::runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf,
                                 Results results, const CallOptions& call) {
  const kernels::ReduceSpec s = spec(desc.dtype, desc.op);
  const size_t count = desc.count;
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  return submit(
      planned(desc, plan), results, std::tie(buf),
      [this, s, count, plan](const algorithms::Call& call, const at::Tensor& buf) {
        void* data = buf.data_ptr();
        inPlaceOr(
            call, plan, data, plan.bytes, -1,
            [&](const algorithms::Call& c, PeerMemory& mem,
                const algorithms::RegisteredView& view) {
              algorithms::registeredAllReduce(c, mem, view, s, data, count,
                                              kernelScratch_.data());
            },
            [&](const algorithms::Call& c) {
              switch (plan.staged) {
                case Algo::Direct:
                  algorithms::directAllReduce(c, *transport_->peerMemory(), s, data, data, count);
                  break;
                case Algo::TwoShot:
                  algorithms::twoShotAllReduce(c, *transport_->peerMemory(), s, data, data,
                                               count);
                  break;
                default:
                  algorithms::ringAllReduce(c, s, data, data, count);
              }
            });
      },
      call);
}

WorkPtr TransportEngine::runReduce(const CollectiveDesc& desc, const at::Tensor& in,
                              const at::Tensor& out, Results results, const CallOptions& call) {
  const size_t count = desc.count;
  const int root = desc.root;
  const auto s = spec(desc.dtype, desc.op);
  PeerMemory* mem = transport_->peerMemory();
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  const bool keep = root == rank_;
  return submit(
      planned(desc, plan), results, {in, out},
      [=, this](const algorithms::Call& c) {
        if (plan.algo == Algo::Direct) {
          algorithms::directReduce(c, *mem, s, in.data_ptr(), out.data_ptr(), count, root);
        } else if (plan.messages) {
          algorithms::ringReduce(c, *link_, s, in.data_ptr(), out.data_ptr(), count, root);
        } else {
          // Without messages, a reduce is an all-reduce only the root keeps.
          if (!keep) out.copy_(in);
          algorithms::ringAllReduce(c, s, out.data_ptr(), out.data_ptr(), count);
        }
      },
      call);
}

WorkPtr TransportEngine::runAllGather(const CollectiveDesc& desc, const at::Tensor& in,
                                 const RankBlocks& output, Results results,
                                 const CallOptions& call) {
  const DataType dtype = desc.dtype;
  const size_t count = desc.count;
  const size_t es = elementSize(dtype);
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  const CollectiveDesc d = planned(desc, plan);
  if (output.whole.defined()) {
    return submit(
        d, results, std::tie(in, output.whole),
        [this, plan, dtype, count, es](const algorithms::Call& c, const at::Tensor& in,
                                       const at::Tensor& out) {
          algorithms::RankPtrs blocks(size_);
          for (int b = 0; b < size_; ++b) {
            blocks[b] = static_cast<char*>(out.data_ptr()) + b * count * es;
          }
          allGatherBlocks(c, plan, dtype, in.data_ptr(), blocks, count);
        },
        call);
  }
  std::vector<at::Tensor> uses = output.list.vec();
  uses.push_back(in);
  return submit(d, results, uses,
                [=, this, outs = output.list.vec()](const algorithms::Call& c) {
                  algorithms::RankPtrs blocks(size_);
                  for (int b = 0; b < size_; ++b) blocks[b] = outs[b].data_ptr();
                  allGatherBlocks(c, plan, dtype, in.data_ptr(), blocks, count);
                },
                call);
}

WorkPtr TransportEngine::runGather(const CollectiveDesc& desc, const at::Tensor& in,
                              const RankBlocks& output, Results results,
                              const CallOptions& call) {
  const DataType dtype = desc.dtype;
  const size_t count = desc.count;
  const int root = desc.root;
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  std::vector<at::Tensor> outs = output.list.vec();
  // Without messages every rank gathers, into scratch but for the root.
  if (!plan.messages && root != rank_) {
    for (int b = 0; b < size_; ++b) outs.push_back(at::empty({in.numel()}, in.options()));
  }
  std::vector<at::Tensor> uses = outs;
  uses.push_back(in);
  return submit(
      planned(desc, plan), results, uses,
      [=, this](const algorithms::Call& c) {
        algorithms::RankPtrs blocks;
        for (const auto& o : outs) blocks.push_back(o.data_ptr());
        if (plan.messages) {
          algorithms::directGather(c, *link_, dtype, in.data_ptr(), blocks, count, root);
        } else {
          algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
        }
      },
      call);
}

WorkPtr TransportEngine::runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf,
                                 Results results, const CallOptions& call) {
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  const int src = desc.root;
  return submit(
      planned(desc, plan), results, std::tie(buf),
      [this, plan, src](const algorithms::Call& call, const at::Tensor& buf) {
        void* data = buf.data_ptr();
        const size_t bytes = plan.bytes;
        inPlaceOr(
            call, plan, data, bytes, src,
            [&](const algorithms::Call& c, PeerMemory& mem,
                const algorithms::RegisteredView& view) {
              algorithms::registeredBroadcast(c, mem, view, data, bytes, src);
            },
            [&](const algorithms::Call& c) { algorithms::chainBroadcast(c, data, bytes, src); });
      },
      call);
}

WorkPtr TransportEngine::runReduceScatter(const CollectiveDesc& desc, const at::Tensor& in,
                                     const at::Tensor& out, Results results,
                                     const CallOptions& call) {
  const kernels::ReduceSpec s = spec(desc.dtype, desc.op);
  const size_t count = desc.count;
  const size_t es = elementSize(s.dtype);
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  return submit(
      planned(desc, plan), results, std::tie(in, out),
      [this, plan, s, count, es](const algorithms::Call& call, const at::Tensor& in,
                                 const at::Tensor& out) {
        algorithms::ConstRankPtrs blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<const char*>(in.data_ptr()) + b * count * es;
        }
        // An output that overlaps a peer's block of the input would be
        // written while that peer reads it: as in allGatherBlocks.
        const bool overlaps =
            overlapsPeerBlock<const void*>(out.data_ptr(), count * es, blocks, count * es, rank_);
        inPlaceOr(
            call, plan, overlaps ? nullptr : in.data_ptr(), size_ * count * es, -1,
            [&](const algorithms::Call& c, PeerMemory& mem,
                const algorithms::RegisteredView& view) {
              algorithms::registeredReduceScatter(c, mem, view, s, out.data_ptr(), count,
                                                  kernelScratch_.data());
            },
            [&](const algorithms::Call& c) {
              if (plan.staged == Algo::Direct) {
                algorithms::directReduceScatter(c, *transport_->peerMemory(), s, blocks,
                                                out.data_ptr(), count);
              } else {
                algorithms::ringReduceScatter(c, s, blocks, out.data_ptr(), count);
              }
            });
      },
      call);
}

WorkPtr TransportEngine::runBarrier(const CollectiveDesc& desc, const CallOptions& call) {
  Results none;
  return submit(desc, none, std::tuple<>(),
                [](const algorithms::Call& c) { algorithms::barrier(c); }, call);
}

WorkPtr TransportEngine::runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                               const at::Tensor& out, Results results, const CallOptions& call) {
  const DataType dtype = desc.dtype;
  const size_t count = desc.count;
  const int root = desc.root;
  const std::vector<at::Tensor> blocks = input.list.vec();  // the root's
  const algorithms::Plan plan = algorithms::select(desc, caps_, options_);
  if (plan.messages) {
    std::vector<at::Tensor> uses = blocks;
    uses.push_back(out);
    return submit(
        planned(desc, plan), results, uses,
        [=, this](const algorithms::Call& c) {
          algorithms::ConstRankPtrs in;
          for (const auto& b : blocks) in.push_back(b.data_ptr());
          algorithms::directScatter(c, *link_, dtype, in, out.data_ptr(), count, root);
        },
        call);
  }
  // Without messages the root's list travels as one world-sized tensor
  // down the broadcast chain and each rank keeps its block.
  const at::Tensor whole = rank_ == root
      ? at::cat(blocks).reshape({-1})
      : at::empty({static_cast<int64_t>(count) * size_}, out.options());
  const int64_t mine = static_cast<int64_t>(count) * rank_;
  Results kept{results.tensors,
               [whole, out, mine, count, finish = finishOf(results)] {
                 out.view({-1}).copy_(whole.narrow(0, mine, count));
                 finish();
               }};
  return submit(planned(desc, plan), kept, {whole},
                [=](const algorithms::Call& c) {
                  algorithms::chainBroadcast(c, whole.data_ptr(),
                                             whole.numel() * elementSize(dtype), root);
                },
                call);
}

WorkPtr TransportEngine::runAllToAll(const CollectiveDesc& desc, const at::Tensor& in,
                                const at::Tensor& out, const ArgChecks::AllToAll& a,
                                Results results, const CallOptions& call) {
  MessageLink& link = messages(desc.count == 0 ? "all_to_all" : "all_to_all_single");
  const DataType dtype = desc.dtype;
  return submit(
      planned(desc, algorithms::select(desc, caps_, options_)), results, {in, out},
      [=, &link](const algorithms::Call& c) {
        algorithms::pairwiseAllToAll(c, link, dtype, in.data_ptr(), a.in.counts, a.in.offsets,
                                     out.data_ptr(), a.out.counts, a.out.offsets);
      },
      call);
}

WorkPtr TransportEngine::runSend(const at::Tensor& tensor, int dst, int64_t tag,
                            const CallOptions& call) {
  messages("send");
  auto work = p2p_->send(tensor, dst, tag, timeoutOf(call));
  if (!call.asyncOp) work->wait();
  return work;
}

WorkPtr TransportEngine::runRecv(const at::Tensor& buf, int src, int64_t tag, Results results,
                            const CallOptions& call) {
  messages("recv");
  static_assert(kAnySource == MessageLink::kAnySource);
  auto work = p2p_->recv(results.tensors[0], buf, src, tag, timeoutOf(call),
                         finishOf(results));
  if (!call.asyncOp) work->wait();
  return work;
}

void TransportEngine::runMonitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  messages("monitored_barrier");
  const Ms groupTimeout(options_.timeoutMs);
  const Ms timeout = opts.timeout == c10d::kUnsetTimeout ? groupTimeout : opts.timeout;
  monitored::barrier(*p2p_, rank_, size_, monitoredBarriers_++, timeout, groupTimeout,
                     waitAllRanks);
}

} // namespace pyddp
