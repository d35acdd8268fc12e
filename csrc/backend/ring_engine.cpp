#include "backend/ring_engine.h"

#include "backend/bootstrap.h"
#include "backend/cpu_executor.h"
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

} // namespace

RingEngine::RingEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const RingOptions& options, c10::Device device,
                       const std::string& transport)
    : Engine(rank, size, device, transport), options_(options) {
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
  startExecutor();
}

void RingEngine::startExecutor() {
  if (cpuExec_) {
    cpuExec_->start(*transport_);
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

RingEngine::~RingEngine() {
  shutdown();
}

void RingEngine::shutdown() {
#ifdef PYDDP_WITH_CUDA
  if (deviceExec_ && transport_ && transport_->peerMemory()) {
    // Peers read this rank's device memory: collectives already queued
    // complete (as a destroy after dist.all_reduce(t) expects), then every
    // rank meets every other before the memory is freed. On failure the
    // abort that follows ends what is left.
    deviceExec_->retire([this](const CollectiveDesc& desc, Clock::time_point deadline) {
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
}

c10::intrusive_ptr<c10d::Work> RingEngine::submit(CollectiveDesc desc,
                                                  std::vector<at::Tensor> outputs,
                                                  std::vector<at::Tensor> uses, Transfer transfer,
                                                  std::function<void()> finish, bool asyncOp) {
  return executor_->submit(
      Collective{desc, std::move(outputs), std::move(uses),
                 [this, transfer = std::move(transfer)](const CollectiveDesc& d,
                                                        Clock::time_point deadline) {
                   transfer(algorithms::Call{*transport_, d, deadline, rank_, size_});
                 },
                 std::move(finish), desc.kind == CollectiveKind::Barrier},
      asyncOp);
}

kernels::ReduceSpec RingEngine::spec(DataType dtype, RedOp op) const {
  return kernels::ReduceSpec{dtype, op, size_};
}

c10::intrusive_ptr<c10d::Work> RingEngine::allReduce(const at::Tensor& tensor,
                                                     RedOp op, bool asyncOp) {
  return reduceTo(tensor, op, -1, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::reduceTo(const at::Tensor& tensor, RedOp op,
                                                    int root, bool asyncOp) {
  const char* call = root < 0 ? "all_reduce" : "reduce";
  const DataType dtype = checks_.tensor(tensor, call, "tensor");
  checks_.writable(tensor, call, "tensor");
  checks_.op(op, dtype, call);
  if (root >= 0) checks_.root(root, call, "dst");
  const size_t count = tensor.numel();
  const size_t bytes = count * elementSize(dtype);
  // Transports without mapped peer memory (NCCL) run every size on the ring.
  const Algo algo = transport_->peerMemory() ? options_.allReduceAlgo(bytes) : Algo::Ring;
  const auto s = spec(dtype, op);
  // A reduce is an all-reduce whose result only the root keeps: the other
  // ranks compute into a copy and leave their tensor as it was.
  const bool keep = root < 0 || root == rank_;
  at::Tensor buf = keep ? dense(tensor) : tensor.contiguous().clone();
  return submit(
      makeDesc(root < 0 ? CollectiveKind::AllReduce : CollectiveKind::Reduce, count, dtype,
               op, root, algo),
      {tensor}, {buf},
      [=, this](const algorithms::Call& c) {
        void* data = buf.data_ptr();
        switch (algo) {
          case Algo::Direct:
            algorithms::directAllReduce(c, *transport_->peerMemory(), s, data, data, count);
            break;
          case Algo::TwoShot:
            algorithms::twoShotAllReduce(c, *transport_->peerMemory(), s, data, data, count);
            break;
          default:
            algorithms::ringAllReduce(c, s, data, data, count);
        }
      },
      [=] {
        if (keep) copyBack(tensor, buf);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::allGatherSingle(const at::Tensor& output,
                                                           const at::Tensor& input,
                                                           bool asyncOp) {
  const DataType dtype = checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  const size_t count = input.numel();
  const at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const size_t es = elementSize(dtype);
  return submit(
      makeDesc(CollectiveKind::AllGather, count, dtype), {output}, {in, out},
      [=, this](const algorithms::Call& c) {
        std::vector<void*> blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<char*>(out.data_ptr()) + b * count * es;
        }
        algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
      },
      [=] { copyBack(output, out); }, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::allGatherList(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input, bool asyncOp) {
  return gatherTo(outputs, input, -1, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::gatherTo(const std::vector<at::Tensor>& outputs,
                                                    const at::Tensor& input, int root,
                                                    bool asyncOp) {
  const char* call = root < 0 ? "all_gather" : "gather";
  // The output list's name in torch.distributed's signature.
  const char* list = root < 0 ? "tensor_list" : "gather_list";
  const std::string entry = std::string(list) + " entry";
  const DataType dtype = checks_.tensor(input, call, "input");
  if (root >= 0) checks_.root(root, call, "dst");
  const size_t count = input.numel();
  // A gather is an all-gather whose blocks only the root keeps: the other
  // ranks pass no outputs and gather into scratch tensors.
  const bool keep = root < 0 || root == rank_;
  std::vector<at::Tensor> outs;
  if (keep) {
    PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "rank ", rank_, ": ", call,
                      ": ", list, " has ", outputs.size(),
                      " tensors, expected world_size = ", size_);
    for (const auto& o : outputs) {
      PYDDP_CHECK_TYPE(checks_.tensor(o, call, entry.c_str()) == dtype, "rank ", rank_, ": ", call,
                       ": ", list, " entry dtype ", o.scalar_type(),
                       " differs from input dtype ", input.scalar_type());
      PYDDP_CHECK_VALUE(static_cast<size_t>(o.numel()) == count, "rank ", rank_, ": ", call,
                        ": ", list, " entry has ", o.numel(), " elements, expected ", count,
                        " (the input's)");
      checks_.writable(o, call, entry.c_str());
      outs.push_back(dense(o));
    }
  } else {
    PYDDP_CHECK_VALUE(outputs.empty(), "rank ", rank_, ": gather: only the destination rank ",
                      root, " passes a gather_list");
    for (int b = 0; b < size_; ++b) outs.push_back(at::empty({input.numel()}, input.options()));
  }
  const at::Tensor in = dense(input);
  return submit(
      makeDesc(root < 0 ? CollectiveKind::AllGather : CollectiveKind::Gather, count, dtype,
               RedOp::Sum, root),
      outputs, withInput(outs, in),
      [=, this](const algorithms::Call& c) {
        std::vector<void*> blocks(size_);
        for (int b = 0; b < size_; ++b) blocks[b] = outs[b].data_ptr();
        algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
      },
      [=] {
        if (!keep) return;
        for (size_t b = 0; b < outputs.size(); ++b) copyBack(outputs[b], outs[b]);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::broadcastFrom(const at::Tensor& tensor,
                                                         int src, bool asyncOp) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  const size_t count = tensor.numel();
  at::Tensor buf = dense(tensor);
  return submit(
      makeDesc(CollectiveKind::Broadcast, count, dtype, RedOp::Sum, src), {tensor}, {buf},
      [=](const algorithms::Call& c) {
        algorithms::chainBroadcast(c, buf.data_ptr(), count * elementSize(dtype), src);
      },
      [=] { copyBack(tensor, buf); }, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::reduceScatterSingle(
    const at::Tensor& output, const at::Tensor& input, RedOp op, bool asyncOp) {
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  const size_t count = output.numel();
  const at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const auto s = spec(dtype, op);
  const size_t es = elementSize(dtype);
  return submit(
      makeDesc(CollectiveKind::ReduceScatter, count, dtype, op), {output}, {in, out},
      [=, this](const algorithms::Call& c) {
        std::vector<const void*> blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<const char*>(in.data_ptr()) + b * count * es;
        }
        algorithms::ringReduceScatter(c, s, blocks, out.data_ptr(), count);
      },
      [=] { copyBack(output, out); }, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::barrierAll(bool asyncOp) {
  return submit(makeDesc(CollectiveKind::Barrier, 0, DataType::UInt8), {}, {},
                [](const algorithms::Call& c) { algorithms::barrier(c); }, [] {}, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingEngine::scatterFrom(const at::Tensor& output,
                                                       const std::vector<at::Tensor>& inputs,
                                                       int root, bool asyncOp) {
  const DataType dtype = checks_.tensor(output, "scatter", "output");
  checks_.writable(output, "scatter", "output");
  checks_.root(root, "scatter", "src");
  const size_t count = output.numel();
  // The root's list travels as one world-sized tensor down the broadcast
  // chain and each rank keeps its block: (n-1) times the bytes a tree
  // scatter moves, through the one transport verb set every rank has.
  at::Tensor whole;
  if (rank_ == root) {
    PYDDP_CHECK_VALUE(static_cast<int>(inputs.size()) == size_, "rank ", rank_,
                      ": scatter: the source passes one list of world_size = ", size_,
                      " tensors, got ", inputs.size());
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs) {
      PYDDP_CHECK_TYPE(checks_.tensor(t, "scatter", "input") == dtype, "rank ", rank_,
                       ": scatter: input dtype ", t.scalar_type(), " differs from output dtype ",
                       output.scalar_type());
      PYDDP_CHECK_VALUE(static_cast<size_t>(t.numel()) == count, "rank ", rank_,
                        ": scatter: an input has ", t.numel(), " elements, expected ", count,
                        " (the output's)");
      flat.push_back(t.reshape({-1}));
    }
    whole = at::cat(flat);
  } else {
    PYDDP_CHECK_VALUE(inputs.empty(), "rank ", rank_, ": scatter: only the source rank ",
                      root, " passes inputs");
    whole = at::empty({static_cast<int64_t>(count) * size_}, output.options());
  }
  const int64_t mine = static_cast<int64_t>(count) * rank_;
  return submit(
      makeDesc(CollectiveKind::Scatter, count, dtype, RedOp::Sum, root), {output}, {whole},
      [=](const algorithms::Call& c) {
        algorithms::chainBroadcast(c, whole.data_ptr(), whole.numel() * elementSize(dtype),
                                   root);
      },
      [=] { output.copy_(whole.narrow(0, mine, count).view(output.sizes())); }, asyncOp);
}

} // namespace pyddp

