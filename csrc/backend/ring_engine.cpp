#include "backend/ring_engine.h"

#include <chrono>

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

// A tensor to compute in: the tensor itself when contiguous, else a
// contiguous copy whose result copyBack() writes into the original.
at::Tensor dense(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}
void copyBack(const at::Tensor& original, const at::Tensor& computed) {
  if (!original.is_same(computed)) original.copy_(computed);
}

std::vector<at::Tensor> withInput(std::vector<at::Tensor> tensors, const at::Tensor& input) {
  tensors.push_back(input);
  return tensors;
}

std::vector<at::Tensor> denseAll(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> out;
  for (const auto& t : list) out.push_back(dense(t));
  return out;
}

// What a queued collective keeps of what its transfer uses
// (RingEngine::submit), and the same added to the list of its tensors.
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

CollectiveDesc makeDesc(CollectiveKind kind, size_t count, DataType dtype,
                        RedOp op = RedOp::Sum, int root = -1, Algo algo = Algo::Ring) {
  CollectiveDesc d;
  d.kind = kind;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  d.algo = algo;
  return d;
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

RingEngine::RingEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const RingOptions& options, c10::Device device,
                       const std::string& transport)
    : Engine(rank, size, device, transport), options_(options), cma_(options.cma) {
  options_.validate();
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  PYDDP_CHECK_VALUE(device.is_cpu() || (device.is_cuda() && device.has_index()), "rank ", rank,
                    ": RingEngine serves the CPU or one CUDA device (cuda:N), not ", device);
  void* stream = nullptr;
  if (device.is_cpu()) {
    auto cpu = std::make_unique<CpuExecutor>(rank, options_.timeoutMs);
    cpuExec_ = cpu.get();
    executor_ = std::move(cpu);
  } else {
#ifdef PYDDP_WITH_CUDA
    auto dev = std::make_unique<DeviceExecutor>(rank, device, Ms(options_.timeoutMs));
    deviceExec_ = dev.get();
    stream = dev->stream();
    executor_ = std::move(dev);
#endif
  }
  const int deviceIndex = device.is_cpu() ? -1 : device.index();
  transport_ = makeTransport(transport, TransportArgs{rank, size, options_, deviceIndex, stream});
  bootstrap::connect(*transport_, *store, rank, size, Ms(options_.timeoutMs));
  const auto directory = std::make_shared<bootstrap::StoreDirectory>(store);
  link_ = transport_->messages(directory, Lane::Collectives);
  userLink_ = transport_->messages(directory, Lane::User);
  if (userLink_) p2p_ = std::make_unique<P2pExecutor>(rank, *userLink_);
  registeredRefusal_ = whyNotReadRegistered();
  processRefusal_ = whyNotReadProcesses();
  if (processRefusal_.empty()) kernelScratch_.resize(schedule::kernelScratchBytes(size));
  startExecutor();
}

void RingEngine::startExecutor() {
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

void RingEngine::abandon(const std::string& why) {
  transport_->abandon(why);
}

RingEngine::~RingEngine() {
  shutdown();
}

void RingEngine::shutdown() {
  if (p2p_) p2p_->shutdown(teardownReason(rank_, transport_ ? transport_->deadPeer() : ""));
#ifdef PYDDP_WITH_CUDA
  if (deviceExec_ && transport_ && transport_->peerMemory()) {
    // Peers read this rank's device memory: collectives already queued
    // complete (as a destroy after dist.all_reduce(t) expects), then every
    // rank meets every other before the memory is freed. On failure the
    // abort that follows ends what is left.
    deviceExec_->retire([this](const CollectiveDesc& desc, Deadline deadline) {
      try {
        transport_->enter(desc, deadline);
      } catch (const std::exception&) {
        // A peer that never comes (it failed, or was destroyed without its
        // collectives) is the abort path's to handle.
      }
    });
  }
#endif
  executor_->shutdown();
  if (transport_) transport_->abort();
  // Nothing drives the links any more: what they left in /dev/shm goes
  // now, not when the group is collected.
  if (link_) link_->close();
  if (userLink_) userLink_->close();
}

template <typename Transfer, typename Finish, typename... Uses>
WorkPtr RingEngine::submit(CollectiveDesc desc, c10::ArrayRef<at::Tensor> outputs,
                           std::tuple<const Uses&...> uses, Transfer&& transfer, Finish&& finish,
                           const CallOptions& call) {
  const auto borrowed = [&](const CollectiveDesc& d, Deadline deadline) {
    std::apply(
        [&](const Uses&... u) {
          transfer(algorithms::Call{*transport_, d, deadline, rank_, size_}, u...);
        },
        uses);
  };
  if (executor_->runNow(desc, call, borrowed, finish)) return {};
  std::vector<at::Tensor> all;
  std::apply([&](const Uses&... u) { (appendTo(all, u), ...); }, uses);
  auto held = std::apply([](const Uses&... u) { return std::make_tuple(owned(u)...); }, uses);
  return executor_->submit(
      Collective{desc, outputs.vec(), std::move(all),
                 [this, transfer = std::forward<Transfer>(transfer),
                  held = std::move(held)](const CollectiveDesc& d, Deadline deadline) {
                   std::apply(
                       [&](const auto&... u) {
                         transfer(algorithms::Call{*transport_, d, deadline, rank_, size_}, u...);
                       },
                       held);
                 },
                 std::forward<Finish>(finish), desc.kind == CollectiveKind::Barrier,
                 call.timeout},
      call);
}

template <typename Transfer, typename Finish>
WorkPtr RingEngine::submit(CollectiveDesc desc, c10::ArrayRef<at::Tensor> outputs,
                           c10::ArrayRef<at::Tensor> uses, Transfer&& transfer, Finish&& finish,
                           const CallOptions& call) {
  return submit(
      desc, outputs, std::tuple<const c10::ArrayRef<at::Tensor>&>(uses),
      [transfer = std::forward<Transfer>(transfer)](const algorithms::Call& c,
                                                    c10::ArrayRef<at::Tensor>) { transfer(c); },
      std::forward<Finish>(finish), call);
}

kernels::ReduceSpec RingEngine::spec(DataType dtype, RedOp op) const {
  return kernels::ReduceSpec{dtype, op, size_};
}

MessageLink& RingEngine::messages(const char* call) const {
  PYDDP_CHECK_TYPE(link_ != nullptr, "rank ", rank_, ": ", call, " moves messages between "
                   "pairs of ranks, which pyddp's ", transport_->name(), " transport does not "
                   "have (CUDA tensors: use the backend \"nccl\")");
  return *link_;
}

std::chrono::milliseconds RingEngine::timeoutOf(const CallOptions& call) const {
  return call.timeout.count() > 0 ? call.timeout : Ms(options_.timeoutMs);
}

Algo RingEngine::allReduceAlgo(size_t bytes) const {
  // Transports without mapped peer memory (NCCL) run every size on the ring.
  return transport_->peerMemory() ? options_.allReduceAlgo(bytes) : Algo::Ring;
}

Algo RingEngine::gatherAlgo(size_t stagedBytes) const {
  return transport_->peerMemory() ? options_.gatherAlgo(stagedBytes) : Algo::Ring;
}

std::string RingEngine::whyNotReadInPlace() const {
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

std::string RingEngine::whyNotReadRegistered() const {
  const std::string why = whyNotReadInPlace();
  return why.empty() ? transport_->peerMemory()->whyNotMapRegistered() : why;
}

std::string RingEngine::whyNotReadProcesses() const {
  const std::string why = whyNotReadInPlace();
  return why.empty() ? transport_->peerMemory()->whyNotReadProcesses() : why;
}

bool RingEngine::readsThroughKernel(CollectiveKind kind, size_t bytes) const {
  return processRefusal_.empty() && options_.cma != CmaReads::Never &&
      CmaChooser::chooses(kind) && bytes >= options_.cmaMinBytes;
}

Algo RingEngine::registeredOr(CollectiveKind kind, size_t bytes, Algo fallback) const {
  return (registeredRefusal_.empty() && readsRegistered(kind, bytes)) ||
          readsThroughKernel(kind, bytes)
      ? Algo::Registered
      : fallback;
}

template <typename Run, typename Fallback>
void RingEngine::inPlaceOr(const algorithms::Call& call, const void* mine, size_t bytes,
                           int root, Run&& run, Fallback&& fallback) {
  if (call.desc.algo != Algo::Registered) return fallback(call);
  algorithms::Call c = call;
  PeerMemory* mem = transport_->peerMemory();
  const CollectiveKind kind = c.desc.kind;
  // the size the windows and the chooser go by, as registeredOr() did
  const size_t perRank = c.desc.count * elementSize(c.desc.dtype);
  const bool kernelAllowed = readsThroughKernel(kind, perRank);
  const CmaChooser::Pick pick = kernelAllowed && rank_ == algorithms::kernelVoter(root, size_)
      ? cma_.next(kind, perRank)
      : CmaChooser::Pick{false, false};
  const algorithms::InPlaceReads reads{
      registeredRefusal_.empty() && readsRegistered(kind, perRank), kernelAllowed, pick.kernel};
  const algorithms::RegisteredView view =
      algorithms::arriveRegistered(c, *mem, mine, bytes, root, reads);
  c.arrived = true;
  const Clock::time_point start = pick.timed ? Clock::now() : Clock::time_point{};
  if (view.usable()) {
    run(c, *mem, view);
  } else {
    fallback(c);
  }
  // Timed only if it ran the path picked: a view that maps every tensor
  // took neither.
  if (pick.timed && (pick.kernel ? view.throughKernel : !view.usable())) {
    // the ring's time to where the kernel path's closing meeting ends it
    if (!pick.kernel) mem->awaitRingTaken();
    cma_.observe(kind, perRank, pick.kernel,
                 std::chrono::duration<double, std::nano>(Clock::now() - start).count());
  }
}

void RingEngine::allGatherBlocks(const algorithms::Call& call, Algo algo, DataType dtype,
                                 const void* in, c10::ArrayRef<void*> blocks, size_t count) {
  const size_t bytes = count * elementSize(dtype);
  // An input that overlaps a peer's block of the output would be written
  // while the peers read it: this rank then offers no registered input, and
  // every rank takes the other algorithm.
  const bool overlaps = overlapsPeerBlock(in, bytes, blocks, bytes, rank_);
  inPlaceOr(
      call, overlaps ? nullptr : in, bytes, -1,
      [&](const algorithms::Call& c, PeerMemory& mem, const algorithms::RegisteredView& view) {
        algorithms::registeredAllGather(c, mem, view, dtype, blocks, count);
      },
      [&](const algorithms::Call& c) {
        if (algo == Algo::Direct) {
          algorithms::directAllGather(c, *transport_->peerMemory(), dtype, in, blocks, count);
        } else {
          algorithms::ringAllGather(c, dtype, in, blocks, count);
        }
      });
}

WorkPtr RingEngine::allReduce(const at::Tensor& tensor, RedOp op, const CallOptions& call) {
  if (tensor.is_sparse()) return allReduceSparse(tensor, op, call);
  const DataType dtype = checks_.tensor(tensor, "all_reduce", "tensor");
  checks_.writable(tensor, "all_reduce", "tensor");
  checks_.op(op, dtype, "all_reduce");
  // A contiguous tensor is its own buffer, with nothing to copy back.
  if (tensor.is_contiguous()) return allReduceFlat(tensor, spec(dtype, op), tensor, [] {}, call);
  const at::Tensor buf = dense(tensor);
  return allReduceFlat(buf, spec(dtype, op), tensor, [=] { copyBack(tensor, buf); }, call);
}

WorkPtr RingEngine::allReduceSparse(const at::Tensor& tensor, RedOp op,
                                    const CallOptions& call) {
  const SparseStart start = startSparse(tensor, op, call);
  const sparse::Blocks b = start.blocks;
  const at::Tensor out = at::empty({size_ * b.bytes}, at::kByte);
  return allGatherFlat(start.packed, out, DataType::UInt8,
                       static_cast<size_t>(b.bytes), {tensor},
                       [=] { tensor.copy_(sparse::sum(out, b)); }, call);
}

template <typename Finish>
WorkPtr RingEngine::allReduceFlat(const at::Tensor& buf, const kernels::ReduceSpec& s,
                                  c10::ArrayRef<at::Tensor> outputs, Finish&& finish,
                                  const CallOptions& call) {
  const size_t count = buf.numel();
  const Algo algo = allReduceAlgo(count * elementSize(s.dtype));
  return submit(
      makeDesc(CollectiveKind::AllReduce, count, s.dtype, s.op, -1,
               registeredOr(CollectiveKind::AllReduce, count * elementSize(s.dtype), algo)),
      outputs, std::tie(buf),
      [this, s, count, algo](const algorithms::Call& call, const at::Tensor& buf) {
        void* data = buf.data_ptr();
        inPlaceOr(
            call, data, count * elementSize(s.dtype), -1,
            [&](const algorithms::Call& c, PeerMemory& mem,
                const algorithms::RegisteredView& view) {
              algorithms::registeredAllReduce(c, mem, view, s, data, count,
                                              kernelScratch_.data());
            },
            [&](const algorithms::Call& c) {
              switch (algo) {
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
      std::forward<Finish>(finish), call);
}

WorkPtr RingEngine::reduceTo(const at::Tensor& tensor, RedOp op, int root,
                             const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "reduce", "tensor");
  checks_.writable(tensor, "reduce", "tensor");
  checks_.op(op, dtype, "reduce");
  checks_.root(root, "reduce", "dst");
  const size_t count = tensor.numel();
  const auto s = spec(dtype, op);
  // Only the root keeps the result: the other ranks compute into a copy
  // and leave their tensor as it was.
  const bool keep = root == rank_;
  const at::Tensor in = dense(tensor);
  const at::Tensor out = keep ? in : at::empty_like(in);
  PeerMemory* mem = transport_->peerMemory();
  const Algo algo = allReduceAlgo(count * elementSize(dtype)) == Algo::Direct && mem
      ? Algo::Direct
      : Algo::Ring;
  return submit(
      makeDesc(CollectiveKind::Reduce, count, dtype, op, root, algo), {tensor}, {in, out},
      [=, this](const algorithms::Call& c) {
        if (algo == Algo::Direct) {
          algorithms::directReduce(c, *mem, s, in.data_ptr(), out.data_ptr(), count, root);
        } else if (link_) {
          algorithms::ringReduce(c, *link_, s, in.data_ptr(), out.data_ptr(), count, root);
        } else {
          // Without messages, a reduce is an all-reduce only the root keeps.
          if (!keep) out.copy_(in);
          algorithms::ringAllReduce(c, s, out.data_ptr(), out.data_ptr(), count);
        }
      },
      [=] {
        if (keep) copyBack(tensor, out);
      },
      call);
}

WorkPtr RingEngine::allGatherSingle(const at::Tensor& output, const at::Tensor& input,
                                    const CallOptions& call) {
  const DataType dtype = checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  const size_t count = input.numel();
  if (input.is_contiguous() && output.is_contiguous()) {
    return allGatherFlat(input, output, dtype, count, output, [] {}, call);
  }
  const at::Tensor in = dense(input);
  const at::Tensor out = dense(output);
  return allGatherFlat(in, out, dtype, count, output, [=] { copyBack(output, out); }, call);
}

template <typename Finish>
WorkPtr RingEngine::allGatherFlat(const at::Tensor& in, const at::Tensor& out, DataType dtype,
                                  size_t count, c10::ArrayRef<at::Tensor> outputs,
                                  Finish&& finish, const CallOptions& call) {
  const size_t es = elementSize(dtype);
  const Algo algo = gatherAlgo(count * es);
  return submit(
      makeDesc(CollectiveKind::AllGather, count, dtype, RedOp::Sum, -1,
               registeredOr(CollectiveKind::AllGather, count * es, algo)),
      outputs, std::tie(in, out),
      [this, algo, dtype, count, es](const algorithms::Call& c, const at::Tensor& in,
                                     const at::Tensor& out) {
        algorithms::RankPtrs blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<char*>(out.data_ptr()) + b * count * es;
        }
        allGatherBlocks(c, algo, dtype, in.data_ptr(), blocks, count);
      },
      std::forward<Finish>(finish), call);
}

WorkPtr RingEngine::allGatherList(const std::vector<at::Tensor>& outputs,
                                  const at::Tensor& input, const CallOptions& call) {
  const DataType dtype = checks_.tensor(input, "all_gather", "tensor");
  checks_.blockList(outputs, input, "all_gather", "tensor_list");
  const std::vector<at::Tensor> outs = denseAll(outputs);
  const size_t count = input.numel();
  const at::Tensor in = dense(input);
  const Algo algo = gatherAlgo(count * elementSize(dtype));
  return submit(
      makeDesc(CollectiveKind::AllGather, count, dtype, RedOp::Sum, -1,
               registeredOr(CollectiveKind::AllGather, count * elementSize(dtype), algo)),
      outputs, withInput(outs, in),
      [=, this](const algorithms::Call& c) {
        algorithms::RankPtrs blocks(size_);
        for (int b = 0; b < size_; ++b) blocks[b] = outs[b].data_ptr();
        allGatherBlocks(c, algo, dtype, in.data_ptr(), blocks, count);
      },
      [=] {
        for (size_t b = 0; b < outputs.size(); ++b) copyBack(outputs[b], outs[b]);
      },
      call);
}

WorkPtr RingEngine::gatherTo(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                             int root, const CallOptions& call) {
  const DataType dtype = checks_.tensor(input, "gather", "tensor");
  checks_.root(root, "gather", "dst");
  const size_t count = input.numel();
  const bool keep = root == rank_;
  std::vector<at::Tensor> outs;
  if (keep) {
    checks_.blockList(outputs, input, "gather", "gather_list");
    outs = denseAll(outputs);
  } else {
    PYDDP_CHECK_VALUE(outputs.empty(), "rank ", rank_, ": gather: only the destination rank ",
                      root, " passes a gather_list");
    // Without messages every rank gathers, into scratch but for the root.
    if (!link_) {
      for (int b = 0; b < size_; ++b) outs.push_back(at::empty({input.numel()}, input.options()));
    }
  }
  const at::Tensor in = dense(input);
  return submit(
      makeDesc(CollectiveKind::Gather, count, dtype, RedOp::Sum, root,
               link_ ? Algo::Direct : Algo::Ring),
      outputs, withInput(outs, in),
      [=, this](const algorithms::Call& c) {
        algorithms::RankPtrs blocks;
        for (const auto& o : outs) blocks.push_back(o.data_ptr());
        if (link_) {
          algorithms::directGather(c, *link_, dtype, in.data_ptr(), blocks, count, root);
        } else {
          algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
        }
      },
      [=] {
        if (!keep) return;
        for (size_t b = 0; b < outputs.size(); ++b) copyBack(outputs[b], outs[b]);
      },
      call);
}

WorkPtr RingEngine::broadcastFrom(const at::Tensor& tensor, int src, const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  // A contiguous tensor is its own buffer, with nothing to copy back.
  if (tensor.is_contiguous()) return broadcastFlat(tensor, dtype, src, tensor, [] {}, call);
  const at::Tensor buf = dense(tensor);
  return broadcastFlat(buf, dtype, src, tensor, [=] { copyBack(tensor, buf); }, call);
}

template <typename Finish>
WorkPtr RingEngine::broadcastFlat(const at::Tensor& buf, DataType dtype, int src,
                                  c10::ArrayRef<at::Tensor> outputs, Finish&& finish,
                                  const CallOptions& call) {
  const size_t count = buf.numel();
  return submit(
      makeDesc(CollectiveKind::Broadcast, count, dtype, RedOp::Sum, src,
               registeredOr(CollectiveKind::Broadcast, count * elementSize(dtype), Algo::Ring)),
      outputs, std::tie(buf),
      [this, count, dtype, src](const algorithms::Call& call, const at::Tensor& buf) {
        void* data = buf.data_ptr();
        const size_t bytes = count * elementSize(dtype);
        inPlaceOr(
            call, data, bytes, src,
            [&](const algorithms::Call& c, PeerMemory& mem,
                const algorithms::RegisteredView& view) {
              algorithms::registeredBroadcast(c, mem, view, data, bytes, src);
            },
            [&](const algorithms::Call& c) { algorithms::chainBroadcast(c, data, bytes, src); });
      },
      std::forward<Finish>(finish), call);
}

WorkPtr RingEngine::reduceScatterSingle(const at::Tensor& output, const at::Tensor& input,
                                        RedOp op, const CallOptions& call) {
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  if (input.is_contiguous() && output.is_contiguous()) {
    return reduceScatterFlat(input, output, spec(dtype, op), output.numel(), output, [] {}, call);
  }
  const at::Tensor in = dense(input);
  const at::Tensor out = dense(output);
  return reduceScatterFlat(in, out, spec(dtype, op), output.numel(), output,
                           [=] { copyBack(output, out); }, call);
}

template <typename Finish>
WorkPtr RingEngine::reduceScatterFlat(const at::Tensor& in, const at::Tensor& out,
                                      const kernels::ReduceSpec& s, size_t count,
                                      c10::ArrayRef<at::Tensor> outputs, Finish&& finish,
                                      const CallOptions& call) {
  const size_t es = elementSize(s.dtype);
  const Algo algo = gatherAlgo(size_ * count * es);
  return submit(
      makeDesc(CollectiveKind::ReduceScatter, count, s.dtype, s.op, -1,
               registeredOr(CollectiveKind::ReduceScatter, count * es, algo)),
      outputs, std::tie(in, out),
      [this, algo, s, count, es](const algorithms::Call& call, const at::Tensor& in,
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
            call, overlaps ? nullptr : in.data_ptr(), size_ * count * es, -1,
            [&](const algorithms::Call& c, PeerMemory& mem,
                const algorithms::RegisteredView& view) {
              algorithms::registeredReduceScatter(c, mem, view, s, out.data_ptr(), count,
                                                  kernelScratch_.data());
            },
            [&](const algorithms::Call& c) {
              if (algo == Algo::Direct) {
                algorithms::directReduceScatter(c, *transport_->peerMemory(), s, blocks,
                                                out.data_ptr(), count);
              } else {
                algorithms::ringReduceScatter(c, s, blocks, out.data_ptr(), count);
              }
            });
      },
      std::forward<Finish>(finish), call);
}

WorkPtr RingEngine::barrierAll(const CallOptions& call) {
  return submit(makeDesc(CollectiveKind::Barrier, 0, DataType::UInt8), {}, std::tuple<>(),
                [](const algorithms::Call& c) { algorithms::barrier(c); }, [] {}, call);
}

WorkPtr RingEngine::scatterFrom(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                int root, const CallOptions& call) {
  const DataType dtype = checks_.tensor(output, "scatter", "tensor");
  checks_.writable(output, "scatter", "tensor");
  checks_.root(root, "scatter", "src");
  const size_t count = output.numel();
  std::vector<at::Tensor> blocks;  // the root's, contiguous
  if (rank_ == root) {
    PYDDP_CHECK_VALUE(static_cast<int>(inputs.size()) == size_, "rank ", rank_,
                      ": scatter: the source passes one list of world_size = ", size_,
                      " tensors, got ", inputs.size());
    for (const auto& t : inputs) {
      PYDDP_CHECK_TYPE(checks_.tensor(t, "scatter", "scatter_list entry") == dtype, "rank ",
                       rank_, ": scatter: scatter_list entry dtype ", t.scalar_type(),
                       " differs from the output's ", output.scalar_type());
      PYDDP_CHECK_VALUE(static_cast<size_t>(t.numel()) == count, "rank ", rank_,
                        ": scatter: a scatter_list entry has ", t.numel(),
                        " elements, expected ", count, " (the output's)");
      blocks.push_back(t.contiguous());
    }
  } else {
    PYDDP_CHECK_VALUE(inputs.empty(), "rank ", rank_, ": scatter: only the source rank ",
                      root, " passes a scatter_list");
  }
  const at::Tensor out = dense(output);
  if (link_) {
    return submit(
        makeDesc(CollectiveKind::Scatter, count, dtype, RedOp::Sum, root, Algo::Direct),
        {output}, withInput(blocks, out),
        [=, this](const algorithms::Call& c) {
          algorithms::ConstRankPtrs in;
          for (const auto& b : blocks) in.push_back(b.data_ptr());
          algorithms::directScatter(c, *link_, dtype, in, out.data_ptr(), count, root);
        },
        [=] { copyBack(output, out); }, call);
  }
  // Without messages the root's list travels as one world-sized tensor
  // down the broadcast chain and each rank keeps its block.
  const at::Tensor whole = rank_ == root
      ? at::cat(blocks).reshape({-1})
      : at::empty({static_cast<int64_t>(count) * size_}, output.options());
  const int64_t mine = static_cast<int64_t>(count) * rank_;
  return submit(
      makeDesc(CollectiveKind::Scatter, count, dtype, RedOp::Sum, root), {output}, {whole},
      [=](const algorithms::Call& c) {
        algorithms::chainBroadcast(c, whole.data_ptr(), whole.numel() * elementSize(dtype),
                                   root);
      },
      [=] { output.copy_(whole.narrow(0, mine, count).view(output.sizes())); }, call);
}

WorkPtr RingEngine::allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                                   const std::vector<int64_t>& outputSplits,
                                   const std::vector<int64_t>& inputSplits,
                                   const CallOptions& call) {
  const char* name = "all_to_all_single";
  MessageLink& link = messages(name);
  const auto [dtype, row, out, in] =
      checks_.allToAll(output, input, outputSplits, inputSplits, name);
  const at::Tensor inBuf = dense(input);
  const at::Tensor outBuf = dense(output);
  return submit(
      makeDesc(CollectiveKind::AllToAll, static_cast<size_t>(row), dtype, RedOp::Sum, -1,
               Algo::Direct),
      {output}, {inBuf, outBuf},
      [=, &link](const algorithms::Call& c) {
        algorithms::pairwiseAllToAll(c, link, dtype, inBuf.data_ptr(), in.counts, in.offsets,
                                     outBuf.data_ptr(), out.counts, out.offsets);
      },
      [=] { copyBack(output, outBuf); }, call);
}

WorkPtr RingEngine::allToAllList(const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs, const CallOptions& call) {
  const char* name = "all_to_all";
  MessageLink& link = messages(name);
  PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ &&
                        static_cast<int>(inputs.size()) == size_,
                    "rank ", rank_, ": ", name, ": got ", outputs.size(), " outputs and ",
                    inputs.size(), " inputs, expected world_size = ", size_, " of each");
  const DataType dtype = checks_.tensor(inputs[0], name, "input");
  ArgChecks::Blocks in, out;
  std::vector<at::Tensor> flatIn;
  size_t inAt = 0, outAt = 0;
  for (int k = 0; k < size_; ++k) {
    PYDDP_CHECK_TYPE(checks_.tensor(inputs[k], name, "input") == dtype &&
                         checks_.tensor(outputs[k], name, "output") == dtype,
                     "rank ", rank_, ": ", name, ": every input and output must have dtype ",
                     inputs[0].scalar_type());
    checks_.writable(outputs[k], name, "output");
    in.counts.push_back(inputs[k].numel());
    in.offsets.push_back(inAt);
    inAt += inputs[k].numel();
    out.counts.push_back(outputs[k].numel());
    out.offsets.push_back(outAt);
    outAt += outputs[k].numel();
    flatIn.push_back(inputs[k].reshape({-1}));
  }
  const at::Tensor inBuf = at::cat(flatIn);
  const at::Tensor outBuf = at::empty({static_cast<int64_t>(outAt)}, inBuf.options());
  return submit(
      makeDesc(CollectiveKind::AllToAll, 0, dtype, RedOp::Sum, -1, Algo::Direct), outputs,
      {inBuf, outBuf},
      [=, &link](const algorithms::Call& c) {
        algorithms::pairwiseAllToAll(c, link, dtype, inBuf.data_ptr(), in.counts, in.offsets,
                                     outBuf.data_ptr(), out.counts, out.offsets);
      },
      [=, this] {
        for (int k = 0; k < size_; ++k) {
          const auto block = outBuf.narrow(0, static_cast<int64_t>(out.offsets[k]),
                                           static_cast<int64_t>(out.counts[k]));
          outputs[k].copy_(block.view(outputs[k].sizes()));
        }
      },
      call);
}

WorkPtr RingEngine::allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                                       const CallOptions& call) {
  const DataType dtype = checks_.sameType(tensors, "all_reduce_coalesced", "tensor", true);
  checks_.op(op, dtype, "all_reduce_coalesced");
  const Packed p = packAllReduce(tensors);
  return allReduceFlat(p.input, spec(dtype, op), tensors, p.unpack, call);
}

WorkPtr RingEngine::allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& inputs,
                                       const CallOptions& call) {
  const char* name = "all_gather_into_tensor_coalesced";
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  PYDDP_CHECK_TYPE(checks_.sameType(outputs, name, "output", true) == dtype, "rank ", rank_, ": ",
                   name, ": outputs and inputs differ in dtype");
  PYDDP_CHECK_VALUE(outputs.size() == inputs.size(), "rank ", rank_, ": ", name, ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    PYDDP_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_, "rank ", rank_, ": ", name,
                      ": output ", i, " has ", outputs[i].numel(), " elements, expected ",
                      inputs[i].numel() * size_, " (world_size x input ", i, ")");
  }
  const Packed p = packAllGather(outputs, inputs, size_);
  return allGatherFlat(p.input, p.output, dtype, p.input.numel(), outputs, p.unpack, call);
}

WorkPtr RingEngine::allGatherCoalescedLists(
    const std::vector<std::vector<at::Tensor>>& outputLists,
    const std::vector<at::Tensor>& inputs, const CallOptions& call) {
  const DataType dtype = checks_.coalescedLists(outputLists, inputs, "all_gather_coalesced");
  const Packed p = packAllGatherLists(outputLists, inputs, size_);
  std::vector<at::Tensor> outputs;
  for (const auto& list : outputLists) outputs.insert(outputs.end(), list.begin(), list.end());
  return allGatherFlat(p.input, p.output, dtype, p.input.numel(), outputs, p.unpack, call);
}

WorkPtr RingEngine::reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                           const std::vector<at::Tensor>& inputs, RedOp op,
                                           const CallOptions& call) {
  const char* name = "reduce_scatter_tensor_coalesced";
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  PYDDP_CHECK_TYPE(checks_.sameType(outputs, name, "output", true) == dtype, "rank ", rank_, ": ",
                   name, ": outputs and inputs differ in dtype");
  checks_.op(op, dtype, name);
  PYDDP_CHECK_VALUE(outputs.size() == inputs.size(), "rank ", rank_, ": ", name, ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    PYDDP_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_, "rank ", rank_, ": ",
                      name, ": input ", i, " has ", inputs[i].numel(), " elements, expected ",
                      outputs[i].numel() * size_, " (world_size x output ", i, ")");
  }
  const Packed p = packReduceScatter(outputs, inputs, size_);
  return reduceScatterFlat(p.input, p.output, spec(dtype, op), p.output.numel(), outputs,
                           p.unpack, call);
}

WorkPtr RingEngine::sendTo(const at::Tensor& tensor, int dst, int64_t tag,
                           const CallOptions& call) {
  messages("send");
  checks_.tensor(tensor, "send", "tensor");
  checks_.peer(dst, "send", "dst");
  checks_.tag(tag, "send");
  auto work = p2p_->send(tensor.contiguous(), dst, tag, timeoutOf(call));
  if (!call.asyncOp) work->wait();
  return work;
}

WorkPtr RingEngine::recvFrom(const at::Tensor& tensor, int src, int64_t tag,
                             const CallOptions& call) {
  messages("recv");
  checks_.tensor(tensor, "recv", "tensor");
  checks_.writable(tensor, "recv", "tensor");
  static_assert(kAnySource == MessageLink::kAnySource);
  if (src != kAnySource) checks_.peer(src, "recv", "src");
  checks_.tag(tag, "recv");
  const at::Tensor buf = dense(tensor);
  auto work = p2p_->recv(tensor, buf, src, tag, timeoutOf(call),
                         [=] { copyBack(tensor, buf); });
  if (!call.asyncOp) work->wait();
  return work;
}

void RingEngine::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  messages("monitored_barrier");
  const Ms groupTimeout(options_.timeoutMs);
  const Ms timeout = opts.timeout == c10d::kUnsetTimeout ? groupTimeout : opts.timeout;
  monitored::barrier(*p2p_, rank_, size_, monitoredBarriers_++, timeout, groupTimeout,
                     waitAllRanks);
}

} // namespace pyddp
