#include "backend/nccl_backend.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>

#include "backend/ring_backend.h"
#include "common/check.h"

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

// ncclCommFinalize of an idle communicator takes milliseconds; should it
// wait for peers that are not tearing down, shutdown gives up after this
// and aborts instead, so destroying a group never takes the whole timeout.
constexpr Ms kFinalizeTimeout(10000);

constexpr const char* kStoreKey = "pyddp/nccl/unique_id";

// A tensor NCCL can use: the tensor itself when contiguous, else a
// contiguous copy (made on the current, internal stream) whose result
// copyBack() writes into the original.
at::Tensor dense(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}
void copyBack(const at::Tensor& original, const at::Tensor& computed) {
  if (!original.is_same(computed)) original.copy_(computed);
}

// NCCL allows the rank-sized buffer of all_gather / reduce_scatter only at
// this rank's block of the world-sized one, or apart from it: any other
// overlap gets a private copy.
at::Tensor apart(const at::Tensor& block, const at::Tensor& whole, int rank) {
  const char* expected = static_cast<const char*>(whole.data_ptr()) +
      static_cast<size_t>(rank) * block.numel() * block.element_size();
  if (block.data_ptr() == expected || block.numel() == 0) return block;
  return at::get_overlap_status(block, whole) == at::MemOverlapStatus::No ? block : block.clone();
}

// The group's device, once the arguments are known to be valid.
c10::Device checkedDevice(int rank, int size, int device) {
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  const int devices = c10::cuda::device_count();
  PYDDP_CHECK_COMM(device >= 0 && device < devices, "rank ", rank,
                   ": the NCCL backend needs CUDA device ", device, ", but ", devices,
                   " CUDA devices are visible", devices == 0 ? " (no GPU, or no driver)" : "",
                   "; NCCL ", nccl::versionString(), " runs collectives of CUDA tensors only");
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
}

} // namespace

NcclBackend::NcclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         std::chrono::milliseconds timeout, int device)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      device_(checkedDevice(rank, size, device)),
      checks_(rank, size, device_, "this NCCL process group") {
  PYDDP_CHECK_VALUE(timeout.count() > 0, "timeout must be positive, got ", timeout.count(),
                    " ms");
  std::string id;
  if (rank == 0) {
    id = nccl::newUniqueId();
    store->set(kStoreKey, std::vector<uint8_t>(id.begin(), id.end()));
  } else {
    try {
      store->wait({kStoreKey}, timeout);
    } catch (const std::exception& e) {
      PYDDP_CHECK_COMM(false, "rank 0 did not publish the NCCL unique id within ",
                       timeout.count(), " ms (rank ", rank, " waited for store key '", kStoreKey,
                       "'): ", messageOf(e));
    }
    const std::vector<uint8_t> v = store->get(kStoreKey);
    id.assign(v.begin(), v.end());
  }
  comm_ = std::make_unique<nccl::Communicator>(id, rank, size, device_.index(),
                                               Clock::now() + timeout);
  stream_ = std::make_unique<gpu::CollectiveStream>(device_);
  monitor_ = std::make_unique<gpu::WorkMonitor>(
      rank, device_.index(), [this] { return comm_->asyncError(); },
      [this](const std::string&) { comm_->abort(); });
}

NcclBackend::~NcclBackend() {
  shutdown();
}

void NcclBackend::shutdown() {
  if (shutDown_.exchange(true)) return;
  const bool pending = monitor_->stop(c10::str(
      "rank ", rank_, ": the process group was destroyed before this collective finished"));
  if (pending) {
    comm_->abort();
  } else {
    comm_->destroy(Clock::now() + std::min(timeout_, kFinalizeTimeout));
  }
}

c10::intrusive_ptr<c10d::Work> NcclBackend::launch(CollectiveKind kind,
                                                   const std::vector<at::Tensor>& inputs,
                                                   std::vector<at::Tensor> outputs,
                                                   bool hostBlocking, bool asyncOp,
                                                   const Enqueue& enqueue) {
  c10::intrusive_ptr<gpu::CudaWork> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    PYDDP_CHECK(!shutDown_.load(), "rank ", rank_, ": ", toString(kind),
                " on a process group that was destroyed");
    const std::string failure = monitor_->failure();
    PYDDP_CHECK_COMM(failure.empty(), "rank ", rank_, ": ", toString(kind),
                     " refused: an earlier collective failed and left the process group "
                     "unusable (", failure, "); destroy it and create a new one");
    const std::string what = c10::str(toString(kind), " #", nextSeq_++);
    work = c10::make_intrusive<gpu::CudaWork>(rank_, kind, what, device_, outputs,
                                              hostBlocking);
    try {
      gpu::StreamScope scope(*stream_);
      for (const auto& t : inputs) scope.use(t);
      for (const auto& t : outputs) scope.use(t);
      enqueue(scope, Clock::now() + timeout_);
      work->enqueued(stream_->stream());
    } catch (const std::exception& e) {
      // The peers run this collective without us, or the communicator is
      // half-way through a call: either way this group cannot go on.
      monitor_->fail(c10::str("rank ", rank_, ": ", what, " failed: ", messageOf(e)));
      throw;
    }
    monitor_->watch(work, timeout_);
  }
  if (!asyncOp) work->wait();
  return work;
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allReduce(const at::Tensor& tensor, RedOp op,
                                                      bool asyncOp) {
  const DataType dtype = checks_.tensor(tensor, "all_reduce", "tensor");
  checks_.writable(tensor, "all_reduce", "tensor");
  checks_.op(op, dtype, "all_reduce");
  return launch(CollectiveKind::AllReduce, {tensor}, {tensor}, false, asyncOp,
                [&](const gpu::StreamScope& scope, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  comm_->run("ncclAllReduce", [&](ncclComm_t c) {
                    return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(dtype), nccl::redOp(op), c,
                                         scope.stream());
                  }, deadline);
                  copyBack(tensor, buf);
                });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allGatherSingle(const at::Tensor& output,
                                                            const at::Tensor& input,
                                                            bool asyncOp) {
  const DataType dtype = checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  return launch(CollectiveKind::AllGather, {input}, {output}, false, asyncOp,
                [&](const gpu::StreamScope& scope, Clock::time_point deadline) {
                  const at::Tensor out = dense(output);
                  const at::Tensor in = apart(dense(input), out, rank_);
                  if (in.numel() == 0) return;
                  comm_->run("ncclAllGather", [&](ncclComm_t c) {
                    return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(),
                                         nccl::dataType(dtype), c, scope.stream());
                  }, deadline);
                  copyBack(output, out);
                });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::allGatherList(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input, bool asyncOp) {
  const DataType dtype = checks_.tensor(input, "all_gather", "input");
  PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "rank ", rank_,
                    ": all_gather: tensor_list has ", outputs.size(),
                    " tensors, expected world_size = ", size_);
  const int64_t count = input.numel();
  for (const auto& o : outputs) {
    PYDDP_CHECK_TYPE(checks_.tensor(o, "all_gather", "tensor_list entry") == dtype, "rank ", rank_,
                     ": all_gather: tensor_list entry dtype ", o.scalar_type(),
                     " differs from input dtype ", input.scalar_type());
    PYDDP_CHECK_VALUE(o.numel() == count, "rank ", rank_, ": all_gather: tensor_list entry has ",
                      o.numel(), " elements, expected ", count, " (the input's)");
    checks_.writable(o, "all_gather", "tensor_list entry");
  }
  return launch(CollectiveKind::AllGather, {input}, outputs, false, asyncOp,
                [&](const gpu::StreamScope& scope, Clock::time_point deadline) {
                  if (count == 0) return;
                  const at::Tensor in = dense(input);
                  // NCCL gathers into one buffer; the entries may live anywhere.
                  const at::Tensor flat = at::empty({count * size_}, input.options());
                  comm_->run("ncclAllGather", [&](ncclComm_t c) {
                    return ncclAllGather(in.data_ptr(), flat.data_ptr(), count,
                                         nccl::dataType(dtype), c, scope.stream());
                  }, deadline);
                  for (int b = 0; b < size_; ++b) {
                    outputs[b].copy_(flat.narrow(0, b * count, count).view(outputs[b].sizes()));
                  }
                });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::broadcastFrom(const at::Tensor& tensor, int src,
                                                          bool asyncOp) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  return launch(CollectiveKind::Broadcast, {tensor}, {tensor}, false, asyncOp,
                [&](const gpu::StreamScope& scope, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  comm_->run("ncclBroadcast", [&](ncclComm_t c) {
                    return ncclBroadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(dtype), src, c, scope.stream());
                  }, deadline);
                  copyBack(tensor, buf);
                });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::reduceScatterSingle(const at::Tensor& output,
                                                                const at::Tensor& input,
                                                                RedOp op, bool asyncOp) {
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  return launch(CollectiveKind::ReduceScatter, {input}, {output}, false, asyncOp,
                [&](const gpu::StreamScope& scope, Clock::time_point deadline) {
                  const at::Tensor in = dense(input);
                  const at::Tensor out = apart(dense(output), in, rank_);
                  if (out.numel() == 0) return;
                  comm_->run("ncclReduceScatter", [&](ncclComm_t c) {
                    return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                             nccl::dataType(dtype), nccl::redOp(op), c,
                                             scope.stream());
                  }, deadline);
                  copyBack(output, out);
                });
}

c10::intrusive_ptr<c10d::Work> NcclBackend::barrierAll(bool asyncOp) {
  return launch(CollectiveKind::Barrier, {}, {}, /*hostBlocking=*/true, asyncOp,
                [&](const gpu::StreamScope& scope, Clock::time_point deadline) {
                  const at::Tensor one =
                      at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
                  comm_->run("ncclAllReduce (barrier)", [&](ncclComm_t c) {
                    return ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum, c,
                                         scope.stream());
                  }, deadline);
                });
}

} // namespace pyddp
