// The ring verbs over a point-to-point library (NCCL's ncclSend/ncclRecv),
// as groups of one send and one receive (SendRecvRing). They do not need
// the library, so the CPU tests run them over an in-process network
// (testing/sendrecv_sim.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/transport.h"

namespace pyddp {
namespace sendrecv {

// What SendRecvRing needs from the library and the device. Everything is
// ordered as posted, as on one CUDA stream: an operation starts after the
// ones posted before it have finished.
class SendRecvOps {
 public:
  virtual ~SendRecvOps() = default;
  // One group: a send of sendBytes from `send` to rank+1 (none when
  // sendBytes is 0) and a receive of recvBytes from rank-1 into `recv`
  // (none when recvBytes is 0), progressing together (ncclGroupStart/End).
  // As in NCCL, a send may not complete before its receiver posts the
  // matching receive, of the same size.
  virtual void post(const void* send, size_t sendBytes, void* recv, size_t recvBytes) = 0;
  // The kernels of kernels/cpu.h (kernels/cuda.h on a GPU); copy is a
  // no-op when dst == src.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void toPartial(const kernels::ReduceSpec& spec, void* dst, const void* src,
                         size_t count) = 0;
  virtual void reducePartial(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                             const void* local, size_t count) = 0;
  virtual void reduceFinal(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                           const void* local, size_t count) = 0;
};

// The ring verbs over SendRecvOps.
//
// Pairing. Ungrouped, a ring deadlocks: every rank's first send waits for
// a receive its right neighbour has not posted, because that neighbour is
// itself stuck in its own send. So a verb's send is not posted at once: it
// stays pending and goes out in one group with the next verb's receive
// (the schedule's step t+1 receive is independent of its step t send), or
// alone when a send follows a send (chain broadcast), or at flush().
// Invariants: at most one send is pending; every verb posts the pending
// send before it writes anything (so the pending send's source is never
// overwritten before it is read, given the in-order execution of SendRecvOps);
// data dependencies only run from a rank's step t receive to its step t
// (or later) send, so groups never wait on each other in a cycle.
//
// Buffers: received partials land in recvScratch, partials to send are
// built in sendScratch (pieceBytes each), even where partials are
// elements: in an in-place all-reduce whose middle blocks are empty, the
// block a rank starts with comes back to it finished while its send is
// still pending, and a group must not receive into the memory it sends.
// Elements are received into and sent from the caller's buffers directly.
// Empty pieces move nothing: both ends skip them alike.
class SendRecvRing final : public RingLink {
 public:
  SendRecvRing(SendRecvOps& ops, size_t pieceBytes, void* recvScratch, void* sendScratch);

  // Posts the pending send, if any. The engine must call it after the
  // last verb of every collective, before it records the collective done:
  // the verbs cannot know which one is the last (a rank whose last pieces
  // are empty skips their verbs).
  void flush();
  bool sendPending() const { return pending_.bytes != 0; }

  size_t pieceBytes() const override { return pieceBytes_; }
  void send(const void* src, size_t bytes) override;
  void sendCopy(const void* src, void* dst, size_t bytes) override;
  void recv(void* dst, size_t bytes) override;
  void recvCopySend(void* dst, size_t bytes) override;
  // Every hop carries partials (sendPartial converts), so a receive reads
  // partials whatever its Hop.
  void sendPartial(const kernels::ReduceSpec& spec, const void* local, size_t count) override;
  void recvReduceSend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      size_t count) override;
  void recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop, const void* local, void* dst,
                      size_t count) override;
  void recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop, const void* local, void* dst,
                          size_t count) override;

 private:
  struct Pending {
    const void* data = nullptr;
    size_t bytes = 0;
  };
  // Posts the pending send together with a receive into dst.
  void receive(void* dst, size_t bytes);
  // Makes (data, bytes) the pending send; posts an older one alone first.
  void defer(const void* data, size_t bytes);

  SendRecvOps& ops_;
  const size_t pieceBytes_;
  void* const recvScratch_;
  void* const sendScratch_;
  Pending pending_;
};

} // namespace sendrecv
} // namespace pyddp
