#include "backend/nccl_engine.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>

#include "backend/bootstrap.h"
#include "common/blob.h"
#include "common/check.h"

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

// ncclCommFinalize of an idle communicator takes milliseconds; should it
// wait for peers that are not tearing down, shutdown gives up after this
// and aborts instead, so destroying a group never takes the whole timeout.
constexpr Ms kFinalizeTimeout(10000);

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
c10::Device checkedDevice(int rank, int size, c10::Device device) {
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  const int devices = c10::cuda::device_count();
  PYDDP_CHECK_COMM(device.is_cuda() && device.index() >= 0 && device.index() < devices, "rank ",
                   rank, ": the NCCL engine needs CUDA device ", static_cast<int>(device.index()),
                   ", but ", devices, " CUDA devices are visible",
                   devices == 0 ? " (no GPU, or no driver)" : "", "; NCCL ",
                   nccl::versionString(), " runs collectives of CUDA tensors only");
  return device;
}

} // namespace

NcclEngine::NcclEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       Ms timeout, c10::Device device)
    : Engine(rank, size, checkedDevice(rank, size, device), "nccl"), timeout_(timeout) {
  PYDDP_CHECK_VALUE(timeout.count() > 0, "timeout must be positive, got ", timeout.count(),
                    " ms");
  executor_ = std::make_unique<DeviceExecutor>(rank, device_, timeout);
  // Rank 0 makes the communicator's unique id; every rank learns it.
  const std::string mine = rank == 0 ? BlobWriter().putBytes("unique_id", nccl::newUniqueId()).str()
                                     : "";
  const auto blobs = bootstrap::allGather(*store, "nccl_id", mine, rank, size, timeout);
  const std::string id = BlobReader(blobs[0], "rank 0's NCCL unique id").bytes("unique_id");
  comm_ = std::make_unique<nccl::Communicator>(id, rank, size, device_.index(),
                                               Clock::now() + timeout);
  executor_->start(DeviceExecutor::Hooks{
      nullptr, [this] { return comm_->asyncError(); },
      [this](const std::string&) { comm_->abort(); }, nullptr});
}

NcclEngine::~NcclEngine() {
  shutdown();
}

void NcclEngine::shutdown() {
  if (shutDown_.exchange(true)) return;
  const bool pending = executor_->stop("the process group was destroyed");
  if (!comm_) return;
  if (pending) {
    comm_->abort();
  } else {
    comm_->destroy(Clock::now() + std::min(timeout_, kFinalizeTimeout));
  }
}

c10::intrusive_ptr<c10d::Work> NcclEngine::launch(CollectiveKind kind,
                                                  std::vector<at::Tensor> inputs,
                                                  std::vector<at::Tensor> outputs, bool asyncOp,
                                                  Enqueue enqueue) {
  CollectiveDesc desc;
  desc.kind = kind;
  const cudaStream_t stream = executor_->stream();
  return executor_->submit(
      Collective{desc, std::move(outputs), std::move(inputs),
                 [&](const CollectiveDesc&, Clock::time_point deadline) {
                   enqueue(stream, deadline);
                 },
                 [] {}, kind == CollectiveKind::Barrier},
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> NcclEngine::allReduce(const at::Tensor& tensor, RedOp op,
                                                     bool asyncOp) {
  const DataType dtype = checks_.tensor(tensor, "all_reduce", "tensor");
  checks_.writable(tensor, "all_reduce", "tensor");
  checks_.op(op, dtype, "all_reduce");
  return launch(CollectiveKind::AllReduce, {tensor}, {tensor}, asyncOp,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  comm_->run("ncclAllReduce", [&](ncclComm_t c) {
                    return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(dtype), nccl::redOp(op), c,
                                         stream);
                  }, deadline);
                  copyBack(tensor, buf);
                });
}

c10::intrusive_ptr<c10d::Work> NcclEngine::allGatherSingle(const at::Tensor& output,
                                                           const at::Tensor& input,
                                                           bool asyncOp) {
  const DataType dtype = checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  return launch(CollectiveKind::AllGather, {input}, {output}, asyncOp,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor out = dense(output);
                  const at::Tensor in = apart(dense(input), out, rank_);
                  if (in.numel() == 0) return;
                  comm_->run("ncclAllGather", [&](ncclComm_t c) {
                    return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(),
                                         nccl::dataType(dtype), c, stream);
                  }, deadline);
                  copyBack(output, out);
                });
}

c10::intrusive_ptr<c10d::Work> NcclEngine::allGatherList(
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
  return launch(CollectiveKind::AllGather, {input}, outputs, asyncOp,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (count == 0) return;
                  const at::Tensor in = dense(input);
                  // NCCL gathers into one buffer; the entries may live anywhere.
                  const at::Tensor flat = at::empty({count * size_}, input.options());
                  comm_->run("ncclAllGather", [&](ncclComm_t c) {
                    return ncclAllGather(in.data_ptr(), flat.data_ptr(), count,
                                         nccl::dataType(dtype), c, stream);
                  }, deadline);
                  for (int b = 0; b < size_; ++b) {
                    outputs[b].copy_(flat.narrow(0, b * count, count).view(outputs[b].sizes()));
                  }
                });
}

c10::intrusive_ptr<c10d::Work> NcclEngine::broadcastFrom(const at::Tensor& tensor, int src,
                                                         bool asyncOp) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  return launch(CollectiveKind::Broadcast, {tensor}, {tensor}, asyncOp,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  comm_->run("ncclBroadcast", [&](ncclComm_t c) {
                    return ncclBroadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(dtype), src, c, stream);
                  }, deadline);
                  copyBack(tensor, buf);
                });
}

c10::intrusive_ptr<c10d::Work> NcclEngine::reduceScatterSingle(const at::Tensor& output,
                                                               const at::Tensor& input,
                                                               RedOp op, bool asyncOp) {
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  return launch(CollectiveKind::ReduceScatter, {input}, {output}, asyncOp,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor in = dense(input);
                  const at::Tensor out = apart(dense(output), in, rank_);
                  if (out.numel() == 0) return;
                  comm_->run("ncclReduceScatter", [&](ncclComm_t c) {
                    return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                             nccl::dataType(dtype), nccl::redOp(op), c,
                                             stream);
                  }, deadline);
                  copyBack(output, out);
                });
}

c10::intrusive_ptr<c10d::Work> NcclEngine::barrierAll(bool asyncOp) {
  return launch(CollectiveKind::Barrier, {}, {}, asyncOp,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor one =
                      at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
                  comm_->run("ncclAllReduce (barrier)", [&](ncclComm_t c) {
                    return ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum, c,
                                         stream);
                  }, deadline);
                });
}

} // namespace pyddp
