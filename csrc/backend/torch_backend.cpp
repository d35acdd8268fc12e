#include "backend/torch_backend.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <utility>

#include "common/check.h"

#ifdef PYDDP_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace pyddp {
namespace {

// Why a CUDA build cannot make an engine for `device` in this process, ""
// if it may try: torch sees no such GPU (no GPU, no driver, or
// CUDA_VISIBLE_DEVICES hides it), where the engine would fail at the device
// with CUDA's own error. A build without CUDA is refused by makeEngine.
std::string whyNotVisible(c10::Device device) {
#ifdef PYDDP_WITH_CUDA
  const int count = c10::cuda::device_count();
  if (device.index() < count) return "";
  return c10::str("torch sees ", count, " CUDA device", count == 1 ? "" : "s", " in this process, "
                  "so it cannot serve ", device, " tensors (check the GPU driver and "
                  "CUDA_VISIBLE_DEVICES)");
#else
  return "";
#endif
}

// The devices of a call's tensors, first tensor first: the first, and the
// first other one seen (if any). An undefined tensor has none; the engine's
// checks name it.
struct CallDevices {
  std::optional<c10::Device> first;
  std::optional<c10::Device> other;

  void add(const at::Tensor& t) {
    if (!t.defined()) return;
    if (!first) {
      first = t.device();
    } else if (!other && t.device() != *first) {
      other = t.device();
    }
  }
  void add(const std::vector<at::Tensor>& list) {
    for (const auto& t : list) add(t);
  }
  void add(const std::vector<std::vector<at::Tensor>>& lists) {
    for (const auto& list : lists) add(list);
  }
};

} // namespace

TorchBackend::TorchBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                           const GroupOptions& options, const std::string& cpuBackend,
                           CrossHostFactory crossHost, EngineListener onEngine)
    : RefusingBackend(rank, size, "the pyddp backend"),
      store_(std::move(store)),
      options_(options),
      cpuBackend_(cpuBackend),
      crossHost_(std::move(crossHost)),
      onEngine_(std::move(onEngine)),
      cpu_([this, &cpuBackend] {
        EngineChoice choice = make(c10::Device(c10::kCPU), cpuBackend);
        if (onEngine_) onEngine_(choice);
        return choice.engine;
      }()) {}

EngineChoice TorchBackend::make(c10::Device device, const std::string& backend) const {
  const auto store = c10::make_intrusive<c10d::PrefixStore>(
      c10::DeviceTypeName(device.type(), /*lower_case=*/true), store_);
  return makeEngine(store, rank_, size_, options_, device, backend, crossHost_);
}

Engine& TorchBackend::engineFor(c10::Device device, std::string_view op) {
  if (device.is_cpu()) return *cpu_;
  PYDDP_CHECK_TYPE(device.is_cuda(), "rank ", rank_, ": ", describeCall(op), ": tensors on ",
                   device, "; the pyddp backend serves CPU and CUDA tensors");
  if (Engine* cuda = cuda_.load(std::memory_order_acquire)) {
    if (cuda->device() == device) return *cuda;
  }
  return cudaEngine(device, op);
}

Engine& TorchBackend::cudaEngine(c10::Device device, std::string_view op) {
  EngineChoice made;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cudaDevice_) {
      PYDDP_CHECK_TYPE(*cudaDevice_ == device, "rank ", rank_, ": ", describeCall(op),
                       ": tensors on ", device, ", but this group's CUDA tensors are on ",
                       *cudaDevice_, " (its first CUDA call's device); a group serves one CUDA "
                       "device per process: make a group per device, or move the tensors "
                       "to ", *cudaDevice_);
      if (cudaOwner_) return *cudaOwner_;
      std::rethrow_exception(cudaFailure_);
    }
    PYDDP_CHECK(!shutDown_, "rank ", rank_, ": ", describeCall(op),
                " on a process group that was destroyed");
    cudaDevice_ = device;
    try {
      const std::string why = whyNotVisible(device);
      PYDDP_CHECK_TYPE(why.empty(), "rank ", rank_, ": ", why);
      made = make(device, "auto");
    } catch (...) {
      cudaFailure_ = std::current_exception();
      throw;
    }
    cudaOwner_ = made.engine;
    cuda_.store(cudaOwner_.get(), std::memory_order_release);
  }
  if (onEngine_) onEngine_(made);
  return *made.engine;
}

std::vector<c10::intrusive_ptr<Engine>> TorchBackend::engines() const {
  std::vector<c10::intrusive_ptr<Engine>> all{cpu_};
  if (Engine* cuda = cuda_.load(std::memory_order_acquire)) {
    all.push_back(c10::intrusive_ptr<Engine>::unsafe_reclaim_from_nonowning(cuda));
  }
  return all;
}

template <typename... Tensors>
Engine& TorchBackend::route(std::string_view op, const Tensors&... tensors) {
  CallDevices devices;
  (devices.add(tensors), ...);
  PYDDP_CHECK_TYPE(!devices.other, "rank ", rank_, ": ", describeCall(op), ": tensors on ",
                   *devices.first, " and on ", *devices.other,
                   " in one call; the pyddp backend runs a call on the tensors of one device");
  return engineFor(devices.first.value_or(c10::Device(c10::kCPU)), op);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  return route("broadcast", tensors).broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  return route("allreduce", tensors).allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  return route("allreduce_sparse", tensors).allreduce_sparse(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  return route("allreduce_coalesced", tensors).allreduce_coalesced(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  return route("reduce", tensors).reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return route("allgather", inputs, outputs).allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::_allgather_base(at::Tensor& output,
                                                             at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  return route("_allgather_base", input, output)._allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return route("allgather_coalesced", inputs, outputs).allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return route("allgather_into_tensor_coalesced", inputs, outputs)
      .allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::GatherOptions& opts) {
  return route("gather", inputs, outputs).gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return route("scatter", outputs, inputs).scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return route("reduce_scatter", outputs, inputs).reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return route("_reduce_scatter_base", input, output)._reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return route("reduce_scatter_tensor_coalesced", inputs, outputs)
      .reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  return route("alltoall_base", input, output)
      .alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  return route("alltoall", inputs, outputs).alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                  int tag) {
  return route("send", tensors).send(tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                  int tag) {
  return route("recv", tensors).recv(tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                           int tag) {
  return route("recvAnysource", tensors).recvAnysource(tensors, tag);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::barrier(const c10d::BarrierOptions& opts) {
  const auto all = engines();
  c10d::BarrierOptions before = opts;
  before.asyncOp = false;
  for (size_t i = 0; i + 1 < all.size(); ++i) {
    if (const auto work = all[i]->barrier(before)) work->wait();
  }
  return all.back()->barrier(opts);
}

void TorchBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  cpu_->monitoredBarrier(opts, waitAllRanks);
}

uint64_t TorchBackend::getSequenceNumberForGroup() {
  uint64_t issued = 0;
  for (const auto& engine : engines()) issued += engine->getSequenceNumberForGroup();
  return issued;
}

void TorchBackend::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutDown_ = true;
  }
  for (const auto& engine : engines()) engine->shutdown();
}

// torch.distributed's SHRINK_ABORT (distributed_c10d.py).
constexpr int kShrinkAbort = 0x01;

c10::intrusive_ptr<c10d::Backend> TorchBackend::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
  PYDDP_CHECK_TYPE(!optsOverride, "rank ", rank_, ": shrink_group: pg_options are not "
                   "taken; the shrunk group keeps its parent's pyddp options");
  int below = 0;
  for (const int64_t r : ranksToExclude) {
    PYDDP_CHECK(r != rank_, "rank ", rank_, ": shrink_group: this rank is among the ranks "
                "to exclude; only the ranks that stay call it");
    if (r < rank_) ++below;
  }
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    n = shrinks_++;
  }
  if (shrinkFlags & kShrinkAbort) abort();
  const auto store =
      c10::make_intrusive<c10d::PrefixStore>("shrink" + std::to_string(n), store_);
  return c10::make_intrusive<TorchBackend>(store, rank_ - below,
                                           size_ - static_cast<int>(ranksToExclude.size()),
                                           options_, cpuBackend_, crossHost_, onEngine_);
}

void TorchBackend::abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutDown_ = true;
  }
  for (const auto& engine : engines()) engine->abort();
}

} // namespace pyddp
