#include "backend/nccl_engine.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>

#include "backend/bootstrap.h"
#include "backend/coalesce.h"
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

WorkPtr NcclEngine::launch(CollectiveKind kind, std::vector<at::Tensor> inputs,
                           std::vector<at::Tensor> outputs, const CallOptions& call,
                           Enqueue enqueue) {
  CollectiveDesc desc;
  desc.kind = kind;
  const cudaStream_t stream = executor_->stream();
  return executor_->submit(
      Collective{desc, std::move(outputs), std::move(inputs),
                 [&](const CollectiveDesc&, Clock::time_point deadline) {
                   enqueue(stream, deadline);
                 },
                 [] {}, kind == CollectiveKind::Barrier, call.timeout},
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

WorkPtr NcclEngine::allReduce(const at::Tensor& tensor, RedOp op,
                              const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "all_reduce", "tensor");
  checks_.writable(tensor, "all_reduce", "tensor");
  checks_.op(op, dtype, "all_reduce");
  return launch(CollectiveKind::AllReduce, {tensor}, {tensor}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  comm_->run("ncclAllReduce", [&](ncclComm_t c) {
                    return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                         nccl::dataType(dtype), nccl::redOp(op, size_), c,
                                         stream);
                  }, deadline);
                  copyBack(tensor, buf);
                });
}

WorkPtr NcclEngine::allGatherSingle(const at::Tensor& output,
                                    const at::Tensor& input,
                                    const CallOptions& call) {
  const DataType dtype = checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  return launch(CollectiveKind::AllGather, {input}, {output}, call,
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

WorkPtr NcclEngine::allGatherList(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input, const CallOptions& call) {
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
  return launch(CollectiveKind::AllGather, {input}, outputs, call,
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

WorkPtr NcclEngine::broadcastFrom(const at::Tensor& tensor, int src,
                                  const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  return launch(CollectiveKind::Broadcast, {tensor}, {tensor}, call,
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

WorkPtr NcclEngine::reduceScatterSingle(const at::Tensor& output,
                                        const at::Tensor& input,
                                        RedOp op, const CallOptions& call) {
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  return launch(CollectiveKind::ReduceScatter, {input}, {output}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor in = dense(input);
                  const at::Tensor out = apart(dense(output), in, rank_);
                  if (out.numel() == 0) return;
                  comm_->run("ncclReduceScatter", [&](ncclComm_t c) {
                    return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(),
                                             nccl::dataType(dtype), nccl::redOp(op, size_), c,
                                             stream);
                  }, deadline);
                  copyBack(output, out);
                });
}

WorkPtr NcclEngine::barrierAll(const CallOptions& call) {
  return launch(CollectiveKind::Barrier, {}, {}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor one =
                      at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
                  comm_->run("ncclAllReduce (barrier)", [&](ncclComm_t c) {
                    return ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum, c,
                                         stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::reduceTo(const at::Tensor& tensor, RedOp op, int root,
                             const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "reduce", "tensor");
  checks_.writable(tensor, "reduce", "tensor");
  checks_.op(op, dtype, "reduce");
  checks_.root(root, "reduce", "dst");
  return launch(CollectiveKind::Reduce, {tensor}, {tensor}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  // NCCL writes the receive buffer on the root only.
                  comm_->run("ncclReduce", [&](ncclComm_t c) {
                    return ncclReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                      nccl::dataType(dtype), nccl::redOp(op, size_), root, c,
                                      stream);
                  }, deadline);
                  if (rank_ == root) copyBack(tensor, buf);
                });
}

WorkPtr NcclEngine::gatherTo(const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                             int root, const CallOptions& call) {
  const DataType dtype = checks_.tensor(input, "gather", "tensor");
  checks_.root(root, "gather", "dst");
  if (rank_ == root) {
    checks_.blockList(outputs, input, "gather", "gather_list");
  } else {
    PYDDP_CHECK_VALUE(outputs.empty(), "rank ", rank_, ": gather: only the destination rank ",
                      root, " passes a gather_list");
  }
  return launch(CollectiveKind::Gather, {input}, outputs, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor in = dense(input);
                  const size_t count = in.numel();
                  std::vector<at::Tensor> outs;
                  for (const auto& o : outputs) outs.push_back(dense(o));
                  if (count == 0) return;
                  group("ncclSend/ncclRecv (gather)", [&](ncclComm_t c) {
                    if (rank_ != root) {
                      return ncclSend(in.data_ptr(), count, nccl::dataType(dtype), root, c,
                                      stream);
                    }
                    for (int k = 0; k < size_; ++k) {
                      if (k == rank_) continue;
                      const ncclResult_t r = ncclRecv(outs[k].data_ptr(), count,
                                                      nccl::dataType(dtype), k, c, stream);
                      if (r != ncclSuccess) return r;
                    }
                    return ncclSuccess;
                  }, deadline);
                  if (rank_ != root) return;
                  outs[root].copy_(in);
                  for (size_t k = 0; k < outputs.size(); ++k) copyBack(outputs[k], outs[k]);
                });
}

WorkPtr NcclEngine::scatterFrom(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                int root, const CallOptions& call) {
  const DataType dtype = checks_.tensor(output, "scatter", "tensor");
  checks_.writable(output, "scatter", "tensor");
  checks_.root(root, "scatter", "src");
  if (rank_ == root) {
    checks_.blockList(inputs, output, "scatter", "scatter_list");
  } else {
    PYDDP_CHECK_VALUE(inputs.empty(), "rank ", rank_, ": scatter: only the source rank ", root,
                      " passes a scatter_list");
  }
  std::vector<at::Tensor> uses = inputs;
  uses.push_back(output);
  return launch(CollectiveKind::Scatter, uses, {output}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor out = dense(output);
                  const size_t count = out.numel();
                  std::vector<at::Tensor> ins;
                  for (const auto& t : inputs) ins.push_back(dense(t));
                  if (count == 0) return;
                  group("ncclSend/ncclRecv (scatter)", [&](ncclComm_t c) {
                    if (rank_ != root) {
                      return ncclRecv(out.data_ptr(), count, nccl::dataType(dtype), root, c,
                                      stream);
                    }
                    for (int k = 0; k < size_; ++k) {
                      if (k == rank_) continue;
                      const ncclResult_t r = ncclSend(ins[k].data_ptr(), count,
                                                      nccl::dataType(dtype), k, c, stream);
                      if (r != ncclSuccess) return r;
                    }
                    return ncclSuccess;
                  }, deadline);
                  if (rank_ == root) out.copy_(ins[root]);
                  copyBack(output, out);
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

WorkPtr NcclEngine::allToAllSingle(const at::Tensor& output, const at::Tensor& input,
                                   const std::vector<int64_t>& outputSplits,
                                   const std::vector<int64_t>& inputSplits,
                                   const CallOptions& call) {
  const char* name = "all_to_all_single";
  const auto [dtype, row, recvs, sends] =
      checks_.allToAll(output, input, outputSplits, inputSplits, name);
  return launch(CollectiveKind::AllToAll, {input}, {output}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor in = dense(input);
                  const at::Tensor out = dense(output);
                  exchange("ncclSend/ncclRecv (all_to_all_single)", dtype, in, sends, out, recvs,
                           stream, deadline);
                  copyBack(output, out);
                });
}

WorkPtr NcclEngine::allToAllList(const std::vector<at::Tensor>& outputs,
                                 const std::vector<at::Tensor>& inputs, const CallOptions& call) {
  const char* name = "all_to_all";
  PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ &&
                        static_cast<int>(inputs.size()) == size_,
                    "rank ", rank_, ": ", name, ": got ", outputs.size(), " outputs and ",
                    inputs.size(), " inputs, expected world_size = ", size_, " of each");
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  PYDDP_CHECK_TYPE(checks_.sameType(outputs, name, "output", true) == dtype, "rank ", rank_,
                   ": ", name, ": outputs and inputs differ in dtype");
  ArgChecks::Blocks sends, recvs;
  size_t inAt = 0, outAt = 0;
  for (int k = 0; k < size_; ++k) {
    sends.counts.push_back(inputs[k].numel());
    sends.offsets.push_back(inAt);
    inAt += inputs[k].numel();
    recvs.counts.push_back(outputs[k].numel());
    recvs.offsets.push_back(outAt);
    outAt += outputs[k].numel();
  }
  return launch(CollectiveKind::AllToAll, inputs, outputs, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  std::vector<at::Tensor> flat;
                  for (const auto& t : inputs) flat.push_back(t.reshape({-1}));
                  const at::Tensor in = at::cat(flat);
                  const at::Tensor out = at::empty({static_cast<int64_t>(outAt)}, in.options());
                  exchange("ncclSend/ncclRecv (all_to_all)", dtype, in, sends, out, recvs,
                           stream, deadline);
                  for (int k = 0; k < size_; ++k) {
                    outputs[k].copy_(out.narrow(0, static_cast<int64_t>(recvs.offsets[k]),
                                                static_cast<int64_t>(recvs.counts[k]))
                                         .view(outputs[k].sizes()));
                  }
                });
}

WorkPtr NcclEngine::allReduceCoalesced(const std::vector<at::Tensor>& tensors, RedOp op,
                                       const CallOptions& call) {
  const DataType dtype = checks_.sameType(tensors, "all_reduce_coalesced", "tensor", true);
  checks_.op(op, dtype, "all_reduce_coalesced");
  return launch(CollectiveKind::AllReduce, tensors, tensors, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const Packed p = packAllReduce(tensors);
                  if (p.input.numel() == 0) return;
                  comm_->run("ncclAllReduce (coalesced)", [&](ncclComm_t c) {
                    return ncclAllReduce(p.input.data_ptr(), p.input.data_ptr(), p.input.numel(),
                                         nccl::dataType(dtype), nccl::redOp(op, size_), c, stream);
                  }, deadline);
                  p.unpack();
                });
}

WorkPtr NcclEngine::allGatherCoalesced(const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& inputs,
                                       const CallOptions& call) {
  const char* name = "all_gather_into_tensor_coalesced";
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  PYDDP_CHECK_TYPE(checks_.sameType(outputs, name, "output", true) == dtype, "rank ", rank_,
                   ": ", name, ": outputs and inputs differ in dtype");
  PYDDP_CHECK_VALUE(outputs.size() == inputs.size(), "rank ", rank_, ": ", name, ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  return launch(CollectiveKind::AllGather, inputs, outputs, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const Packed p = packAllGather(outputs, inputs, size_);
                  if (p.input.numel() == 0) return;
                  comm_->run("ncclAllGather (coalesced)", [&](ncclComm_t c) {
                    return ncclAllGather(p.input.data_ptr(), p.output.data_ptr(),
                                         p.input.numel(), nccl::dataType(dtype), c, stream);
                  }, deadline);
                  p.unpack();
                });
}

WorkPtr NcclEngine::reduceScatterCoalesced(const std::vector<at::Tensor>& outputs,
                                           const std::vector<at::Tensor>& inputs, RedOp op,
                                           const CallOptions& call) {
  const char* name = "reduce_scatter_tensor_coalesced";
  const DataType dtype = checks_.sameType(inputs, name, "input", false);
  PYDDP_CHECK_TYPE(checks_.sameType(outputs, name, "output", true) == dtype, "rank ", rank_,
                   ": ", name, ": outputs and inputs differ in dtype");
  checks_.op(op, dtype, name);
  PYDDP_CHECK_VALUE(outputs.size() == inputs.size(), "rank ", rank_, ": ", name, ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  return launch(CollectiveKind::ReduceScatter, inputs, outputs, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const Packed p = packReduceScatter(outputs, inputs, size_);
                  if (p.output.numel() == 0) return;
                  comm_->run("ncclReduceScatter (coalesced)", [&](ncclComm_t c) {
                    return ncclReduceScatter(p.input.data_ptr(), p.output.data_ptr(),
                                             p.output.numel(), nccl::dataType(dtype),
                                             nccl::redOp(op, size_), c, stream);
                  }, deadline);
                  p.unpack();
                });
}

// NCCL matches a pair's sends and receives by the order they were posted:
// the tag is not sent, so messages between two ranks must be posted in the
// same order on both (as with torch's NCCL backend).
WorkPtr NcclEngine::sendTo(const at::Tensor& tensor, int dst, int64_t tag,
                           const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "send", "tensor");
  checks_.peer(dst, "send", "dst");
  checks_.tag(tag, "send");
  return launch(CollectiveKind::Send, {tensor}, {}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  group("ncclSend", [&](ncclComm_t c) {
                    return ncclSend(buf.data_ptr(), buf.numel(), nccl::dataType(dtype), dst, c,
                                    stream);
                  }, deadline);
                });
}

WorkPtr NcclEngine::recvFrom(const at::Tensor& tensor, int src, int64_t tag,
                             const CallOptions& call) {
  const DataType dtype = checks_.tensor(tensor, "recv", "tensor");
  checks_.writable(tensor, "recv", "tensor");
  checks_.peer(src, "recv", "src");
  checks_.tag(tag, "recv");
  return launch(CollectiveKind::Recv, {}, {tensor}, call,
                [&](cudaStream_t stream, Clock::time_point deadline) {
                  const at::Tensor buf = dense(tensor);
                  if (buf.numel() == 0) return;
                  group("ncclRecv", [&](ncclComm_t c) {
                    return ncclRecv(buf.data_ptr(), buf.numel(), nccl::dataType(dtype), src, c,
                                    stream);
                  }, deadline);
                  copyBack(tensor, buf);
                });
}

} // namespace pyddp
