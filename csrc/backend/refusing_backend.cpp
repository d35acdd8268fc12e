#include "backend/refusing_backend.h"

#include <c10/util/Exception.h>

#include <utility>

namespace pyddp {
namespace {

struct UserCalls {
  std::string_view op;     // c10d::Backend's entry point
  std::string_view calls;  // what a user writes to reach it
};

// Every c10d::Backend entry point RefusingBackend overrides, with the
// torch.distributed calls (torch 2.13) that end in it.
constexpr UserCalls kUserCalls[] = {
    {"broadcast", "torch.distributed.broadcast or broadcast_object_list"},
    {"allreduce", "torch.distributed.all_reduce"},
    {"allreduce_sparse", "torch.distributed.all_reduce of a sparse tensor"},
    {"allreduce_coalesced",
     "torch.distributed.all_reduce_coalesced, or all_reduce inside _coalescing_manager"},
    {"reduce", "torch.distributed.reduce"},
    {"allgather", "torch.distributed.all_gather or all_gather_object"},
    {"_allgather_base", "torch.distributed.all_gather_into_tensor"},
    {"allgather_coalesced", "torch.distributed.all_gather_coalesced"},
    {"allgather_into_tensor_coalesced",
     "torch.distributed.all_gather_into_tensor inside _coalescing_manager, or "
     "_functional_collectives.all_gather_into_tensor_coalesced"},
    {"gather", "torch.distributed.gather or gather_object"},
    {"scatter", "torch.distributed.scatter or scatter_object_list"},
    {"reduce_scatter", "torch.distributed.reduce_scatter"},
    {"_reduce_scatter_base", "torch.distributed.reduce_scatter_tensor"},
    {"reduce_scatter_tensor_coalesced",
     "torch.distributed.reduce_scatter_tensor inside _coalescing_manager, or "
     "_functional_collectives.reduce_scatter_tensor_coalesced"},
    {"alltoall_base", "torch.distributed.all_to_all_single"},
    {"alltoall", "torch.distributed.all_to_all"},
    {"monitoredBarrier", "torch.distributed.monitored_barrier"},
    {"send", "torch.distributed.send, isend, send_object_list or batch_isend_irecv"},
    {"recv", "torch.distributed.recv, irecv, recv_object_list or batch_isend_irecv"},
    {"recvAnysource", "torch.distributed.recv or irecv without src"},
    {"barrier", "torch.distributed.barrier"},
    {"startCoalescing",
     "torch.distributed._coalescing_manager with a device, or batch_isend_irecv"},
    {"endCoalescing",
     "torch.distributed._coalescing_manager with a device, or batch_isend_irecv"},
};

} // namespace

std::string describeCall(std::string_view op) {
  for (const auto& entry : kUserCalls) {
    if (entry.op == op) return c10::str(entry.calls, " (c10d's ", op, ")");
  }
  return std::string(op);
}

RefusingBackend::RefusingBackend(int rank, int size, std::string refuser)
    : c10d::Backend(rank, size), refuser_(std::move(refuser)) {}

void RefusingBackend::refuse(std::string_view op) const {
  C10_THROW_ERROR(NotImplementedError,
                  c10::str("pyddp: rank ", rank_, ": ", describeCall(op), ": ", refuser_,
                           " does not support it"));
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::broadcast(std::vector<at::Tensor>&,
                                                          const c10d::BroadcastOptions&) {
  refuse("broadcast");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::allreduce(std::vector<at::Tensor>&,
                                                          const c10d::AllreduceOptions&) {
  refuse("allreduce");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::allreduce_sparse(
    std::vector<at::Tensor>&, const c10d::AllreduceOptions&) {
  refuse("allreduce_sparse");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::allreduce_coalesced(
    std::vector<at::Tensor>&, const c10d::AllreduceCoalescedOptions&) {
  refuse("allreduce_coalesced");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::reduce(std::vector<at::Tensor>&,
                                                       const c10d::ReduceOptions&) {
  refuse("reduce");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::allgather(std::vector<std::vector<at::Tensor>>&,
                                                          std::vector<at::Tensor>&,
                                                          const c10d::AllgatherOptions&) {
  refuse("allgather");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::_allgather_base(at::Tensor&, at::Tensor&,
                                                                const c10d::AllgatherOptions&) {
  refuse("_allgather_base");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
    const c10d::AllgatherOptions&) {
  refuse("allgather_coalesced");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>&, std::vector<at::Tensor>&, const c10d::AllgatherOptions&) {
  refuse("allgather_into_tensor_coalesced");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::gather(std::vector<std::vector<at::Tensor>>&,
                                                       std::vector<at::Tensor>&,
                                                       const c10d::GatherOptions&) {
  refuse("gather");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::scatter(std::vector<at::Tensor>&,
                                                        std::vector<std::vector<at::Tensor>>&,
                                                        const c10d::ScatterOptions&) {
  refuse("scatter");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::reduce_scatter(
    std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
    const c10d::ReduceScatterOptions&) {
  refuse("reduce_scatter");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::_reduce_scatter_base(
    at::Tensor&, at::Tensor&, const c10d::ReduceScatterOptions&) {
  refuse("_reduce_scatter_base");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>&, std::vector<at::Tensor>&, const c10d::ReduceScatterOptions&) {
  refuse("reduce_scatter_tensor_coalesced");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::alltoall_base(at::Tensor&, at::Tensor&,
                                                              std::vector<int64_t>&,
                                                              std::vector<int64_t>&,
                                                              const c10d::AllToAllOptions&) {
  refuse("alltoall_base");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::alltoall(std::vector<at::Tensor>&,
                                                         std::vector<at::Tensor>&,
                                                         const c10d::AllToAllOptions&) {
  refuse("alltoall");
}

void RefusingBackend::monitoredBarrier(const c10d::BarrierOptions&, bool) {
  refuse("monitoredBarrier");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::send(std::vector<at::Tensor>&, int, int) {
  refuse("send");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::recv(std::vector<at::Tensor>&, int, int) {
  refuse("recv");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  refuse("recvAnysource");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::barrier(const c10d::BarrierOptions&) {
  refuse("barrier");
}

void RefusingBackend::startCoalescing() {
  refuse("startCoalescing");
}

c10::intrusive_ptr<c10d::Work> RefusingBackend::endCoalescing() {
  refuse("endCoalescing");
}

} // namespace pyddp
