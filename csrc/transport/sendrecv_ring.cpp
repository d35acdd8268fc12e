#include "transport/sendrecv_ring.h"

#include "common/check.h"

namespace pyddp {
namespace sendrecv {

SendRecvRing::SendRecvRing(SendRecvOps& ops, size_t pieceBytes, void* recvScratch,
                           void* sendScratch)
    : ops_(ops), pieceBytes_(pieceBytes), recvScratch_(recvScratch), sendScratch_(sendScratch) {}

void SendRecvRing::flush() {
  if (!sendPending()) return;
  const Pending p = pending_;
  pending_ = {};
  ops_.post(p.data, p.bytes, nullptr, 0);
}

void SendRecvRing::receive(void* dst, size_t bytes) {
  PYDDP_CHECK(bytes <= pieceBytes_, "ring piece of ", bytes, " bytes exceeds the ",
              pieceBytes_, "-byte pieces of this link");
  const Pending p = pending_;
  pending_ = {};
  if (p.bytes != 0 || bytes != 0) ops_.post(p.data, p.bytes, dst, bytes);
}

void SendRecvRing::defer(const void* data, size_t bytes) {
  PYDDP_CHECK(bytes <= pieceBytes_, "ring piece of ", bytes, " bytes exceeds the ",
              pieceBytes_, "-byte pieces of this link");
  flush();
  pending_ = {data, bytes};
}

void SendRecvRing::send(const void* src, size_t bytes) {
  defer(src, bytes);
}

void SendRecvRing::sendCopy(const void* src, void* dst, size_t bytes) {
  defer(src, bytes);
  ops_.copy(dst, src, bytes);
}

void SendRecvRing::recv(void* dst, size_t bytes) {
  receive(dst, bytes);
}

void SendRecvRing::recvCopySend(void* dst, size_t bytes) {
  receive(dst, bytes);
  defer(dst, bytes);
}

void SendRecvRing::sendPartial(const kernels::ReduceSpec& spec, const void* local, size_t count) {
  flush();  // the pending send may be reading sendScratch_
  if (count) ops_.toPartial(spec, sendScratch_, local, count);
  defer(sendScratch_, count * kernels::partialSize(spec.dtype));
}

void SendRecvRing::recvReduceSend(const kernels::ReduceSpec& spec, Hop, const void* local,
                             size_t count) {
  const size_t bytes = count * kernels::partialSize(spec.dtype);
  receive(recvScratch_, bytes);
  if (count) ops_.reducePartial(spec, sendScratch_, recvScratch_, local, count);
  defer(sendScratch_, bytes);
}

void SendRecvRing::recvReduceCopy(const kernels::ReduceSpec& spec, Hop, const void* local,
                                  void* dst, size_t count) {
  receive(recvScratch_, count * kernels::partialSize(spec.dtype));
  if (count) ops_.reduceFinal(spec, dst, recvScratch_, local, count);
}

void SendRecvRing::recvReduceCopySend(const kernels::ReduceSpec& spec, Hop, const void* local,
                                 void* dst, size_t count) {
  receive(recvScratch_, count * kernels::partialSize(spec.dtype));
  if (count) ops_.reduceFinal(spec, dst, recvScratch_, local, count);
  defer(dst, count * elementSize(spec.dtype));
}

} // namespace sendrecv
} // namespace pyddp
