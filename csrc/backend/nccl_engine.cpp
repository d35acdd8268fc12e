#include "backend/nccl_engine.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/cat.h>
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
    : Engine(rank, size, checkedDevice(rank, size, device), "nccl", store), timeout_(timeout) {
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
  shutDown(Teardown::Destroyed);
}

void NcclEngine::shutDown(Teardown how) {
  if (shutDown_.exchange(true)) return;
  const bool pending = executor_->stop(c10::str("the process group was ", pastTense(how)));
  if (!comm_) return;
  if (pending || how == Teardown::Aborted) {
    comm_->abort();
  } else {
    comm_->destroy(Clock::now() + std::min(timeout_, kFinalizeTimeout));
  }
}

WorkPtr NcclEngine::launch(const CollectiveDesc& desc, std::vector<at::Tensor> uses,
                           Results& results, const CallOptions& call, Enqueue enqueue) {
  const cudaStream_t stream = executor_->stream();
  std::function<void()> finish = results.finish ? std::move(results.finish)
                                                : std::function<void()>([] {});
  return executor_->submit(
      Collective{desc, results.tensors.vec(), std::move(uses),
                 [&](const CollectiveDesc&, Clock::time_point deadline) {
                   enqueue(stream, deadline);
                 },
                 std::move(finish), desc.kind == CollectiveKind::Barrier, call.timeout},
      call);
}

void NcclEngine::group(const char* what, const std::function<ncclResult_t(ncclComm_t)>& calls,
                       Clock::time_point deadline) {
  comm_->run(what, [&](ncclComm_t c) {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) r = calls(c);
    // Always close the group: an open one would swallow this thread's next NCCL calls.
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  }, deadline);
}

WorkPtr NcclEngine::runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf,
                                 Results results, const CallOptions& call) {
  return launch(desc, {buf}, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (buf.numel() == 0) return;
                  comm_->run("ncclAllReduce", [&](ncclComm_t c) {
                    return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(desc.dtype),
                                         nccl::redOp(desc.op, size_), c, stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::runAllGather(const CollectiveDesc& desc, const at::Tensor& input,
                                 const RankBlocks& output, Results results,
                                 const CallOptions& call) {
  const int64_t count = static_cast<int64_t>(desc.count);
  // NCCL gathers into one buffer; a list's blocks may lie anywhere.
  const at::Tensor out = output.whole.defined()
      ? output.whole
      : at::empty({count * size_}, input.options());
  std::vector<at::Tensor> uses = output.list.vec();
  uses.push_back(input);
  uses.push_back(out);
  return launch(desc, uses, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (count == 0) return;
                  const at::Tensor in = apart(input, out, rank_);
                  comm_->run("ncclAllGather", [&](ncclComm_t c) {
                    return ncclAllGather(in.data_ptr(), out.data_ptr(), count,
                                         nccl::dataType(desc.dtype), c, stream);
                  }, deadline);
                  for (size_t b = 0; b < output.list.size(); ++b) {
                    output.list[b].view({-1}).copy_(out.narrow(0, b * count, count));
                  }
                });
}

WorkPtr NcclEngine::runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf,
                                 Results results, const CallOptions& call) {
  return launch(desc, {buf}, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (buf.numel() == 0) return;
                  comm_->run("ncclBroadcast", [&](ncclComm_t c) {
                    return ncclBroadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(desc.dtype), desc.root, c, stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::runReduceScatter(const CollectiveDesc& desc, const at::Tensor& input,
                                     const at::Tensor& output, Results results,
                                     const CallOptions& call) {
  return launch(desc, {input, output}, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor out = apart(output, input, rank_);
                  if (out.numel() == 0) return;
                  comm_->run("ncclReduceScatter", [&](ncclComm_t c) {
                    return ncclReduceScatter(input.data_ptr(), out.data_ptr(), out.numel(),
                                             nccl::dataType(desc.dtype),
                                             nccl::redOp(desc.op, size_), c, stream);
                  }, deadline);
                  if (!out.is_same(output)) output.copy_(out);
                });
}

WorkPtr NcclEngine::runBarrier(const CollectiveDesc& desc, const CallOptions& call) {
  Results none;
  return launch(desc, {}, none, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor one =
                      at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
                  comm_->run("ncclAllReduce (barrier)", [&](ncclComm_t c) {
                    return ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum, c,
                                         stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::runReduce(const CollectiveDesc& desc, const at::Tensor& input,
                              const at::Tensor& output, Results results,
                              const CallOptions& call) {
  return launch(desc, {input, output}, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (input.numel() == 0) return;
                  // NCCL writes the receive buffer on the root only.
                  comm_->run("ncclReduce", [&](ncclComm_t c) {
                    return ncclReduce(input.data_ptr(), output.data_ptr(), input.numel(),
                                      nccl::dataType(desc.dtype), nccl::redOp(desc.op, size_),
                                      desc.root, c, stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::runGather(const CollectiveDesc& desc, const at::Tensor& input,
                              const RankBlocks& output, Results results,
                              const CallOptions& call) {
  const int root = desc.root;
  std::vector<at::Tensor> uses = output.list.vec();
  uses.push_back(input);
  return launch(desc, uses, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const size_t count = input.numel();
                  if (count == 0) return;
                  group("ncclSend/ncclRecv (gather)", [&](ncclComm_t c) {
                    if (rank_ != root) {
                      return ncclSend(input.data_ptr(), count, nccl::dataType(desc.dtype), root,
                                      c, stream);
                    }
                    for (int k = 0; k < size_; ++k) {
                      if (k == rank_) continue;
                      const ncclResult_t r = ncclRecv(output.list[k].data_ptr(), count,
                                                      nccl::dataType(desc.dtype), k, c, stream);
                      if (r != ncclSuccess) return r;
                    }
                    return ncclSuccess;
                  }, deadline);
                  if (rank_ == root) output.list[root].copy_(input.view(output.list[root].sizes()));
                });
}

WorkPtr NcclEngine::runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                               const at::Tensor& output, Results results,
                               const CallOptions& call) {
  const int root = desc.root;
  std::vector<at::Tensor> uses = input.list.vec();
  uses.push_back(output);
  return launch(desc, uses, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const size_t count = output.numel();
                  if (count == 0) return;
                  group("ncclSend/ncclRecv (scatter)", [&](ncclComm_t c) {
                    if (rank_ != root) {
                      return ncclRecv(output.data_ptr(), count, nccl::dataType(desc.dtype), root,
                                      c, stream);
                    }
                    for (int k = 0; k < size_; ++k) {
                      if (k == rank_) continue;
                      const ncclResult_t r = ncclSend(input.list[k].data_ptr(), count,
                                                      nccl::dataType(desc.dtype), k, c, stream);
                      if (r != ncclSuccess) return r;
                    }
                    return ncclSuccess;
                  }, deadline);
                  if (rank_ == root) output.copy_(input.list[root].view(output.sizes()));
                });
}

void NcclEngine::exchange(const char* what, DataType dtype, const at::Tensor& in,
                          const ArgChecks::Blocks& sends, const at::Tensor& out,
                          const ArgChecks::Blocks& recvs, cudaStream_t stream,
                          Clock::time_point deadline) {
  const size_t es = elementSize(dtype);
  auto* inBytes = static_cast<char*>(in.data_ptr());
  auto* outBytes = static_cast<char*>(out.data_ptr());
  group(what, [&](ncclComm_t c) {
    for (int k = 0; k < size_; ++k) {
      ncclResult_t r = ncclSuccess;
      if (sends.counts[k]) {
        r = ncclSend(inBytes + sends.offsets[k] * es, sends.counts[k], nccl::dataType(dtype), k,
                     c, stream);
      }
      if (r == ncclSuccess && recvs.counts[k]) {
        r = ncclRecv(outBytes + recvs.offsets[k] * es, recvs.counts[k], nccl::dataType(dtype), k,
                     c, stream);
      }
      if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
  }, deadline);
}

WorkPtr NcclEngine::runAllToAll(const CollectiveDesc& desc, const at::Tensor& input,
                                const at::Tensor& output, const ArgChecks::AllToAll& a,
                                Results results, const CallOptions& call) {
  return launch(desc, {input, output}, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  exchange(desc.count == 0 ? "ncclSend/ncclRecv (all_to_all)"
                                           : "ncclSend/ncclRecv (all_to_all_single)",
                           desc.dtype, input, a.in, output, a.out, stream, deadline);
                });
}

// NCCL matches a pair's sends and receives by the order they were posted:
// the tag is not sent, so messages between two ranks must be posted in the
// same order on both (as with torch's NCCL backend).
WorkPtr NcclEngine::runSend(const at::Tensor& tensor, int dst, int64_t,
                            const CallOptions& call) {
  CollectiveDesc desc;
  desc.kind = CollectiveKind::Send;
  Results none;
  const DataType dtype = checks_.tensor(tensor, "send", "tensor");
  return launch(desc, {tensor}, none, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (tensor.numel() == 0) return;
                  group("ncclSend", [&](ncclComm_t c) {
                    return ncclSend(tensor.data_ptr(), tensor.numel(), nccl::dataType(dtype),
                                    dst, c, stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::runRecv(const at::Tensor& buf, int src, int64_t, Results results,
                            const CallOptions& call) {
  PYDDP_CHECK_TYPE(src != kAnySource, "rank ", rank_, ": recv: the nccl engine has no receive "
                   "from any source (NCCL has none); name the src rank");
  CollectiveDesc desc;
  desc.kind = CollectiveKind::Recv;
  const DataType dtype = checks_.tensor(buf, "recv", "tensor");
  return launch(desc, {buf}, results, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  if (buf.numel() == 0) return;
                  group("ncclRecv", [&](ncclComm_t c) {
                    return ncclRecv(buf.data_ptr(), buf.numel(), nccl::dataType(dtype), src, c,
                                    stream);
                  }, deadline);
                });
}

} // namespace pyddp
