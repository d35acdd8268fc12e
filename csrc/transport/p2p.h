// The parts of a transport over a point-to-point library (NCCL's
// ncclSend/ncclRecv) that do not need the library, so that the CPU tests
// run them (over transport/p2p_sim.h): the ring verbs as groups of one send
// and one receive (P2pRing), and the check that every rank called the same
// collective, as a MAX all-reduce of an encoded descriptor.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/types.h"
#include "transport/transport.h"

namespace pyddp {
namespace p2p {

// What P2pRing needs from the library and the device. Everything is
// ordered as posted, as on one CUDA stream: an operation starts after the
// ones posted before it have finished.
class P2pOps {
 public:
  virtual ~P2pOps() = default;
  // One group: a send of sendBytes from `send` to rank+1 (none when
  // sendBytes is 0) and a receive of recvBytes from rank-1 into `recv`
  // (none when recvBytes is 0), progressing together (ncclGroupStart/End).
  // As in NCCL, a send may not complete before its receiver posts the
  // matching receive, of the same size.
  virtual void post(const void* send, size_t sendBytes, void* recv, size_t recvBytes) = 0;
  // The kernels of kernels/cpu.h (kernels/cuda.h on a GPU).
  virtual void toPartial(const kernels::ReduceSpec& spec, void* dst, const void* src,
                         size_t count) = 0;
  virtual void reducePartial(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                             const void* local, size_t count) = 0;
  virtual void reduceFinal(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                           const void* local, size_t count) = 0;
};

// The ring verbs over P2pOps.
//
// Pairing. Ungrouped, a ring deadlocks: every rank's first send waits for
// a receive its right neighbour has not posted, because that neighbour is
// itself stuck in its own send. So a verb's send is not posted at once: it
// stays pending and goes out in one group with the next verb's receive
// (the schedule's step t+1 receive is independent of its step t send), or
// alone when a send follows a send (chain broadcast), or at flush().
// Invariants: at most one send is pending; every verb posts the pending
// send before it writes anything (so the pending send's source is never
// overwritten before it is read, given the in-order execution of P2pOps);
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
class P2pRing final : public RingLink {
 public:
  P2pRing(P2pOps& ops, size_t pieceBytes, void* recvScratch, void* sendScratch);

  // Posts the pending send, if any. The backend must call it after the
  // last verb of every collective, before it records the collective done:
  // the verbs cannot know which one is the last (a rank whose last pieces
  // are empty skips their verbs).
  void flush();
  bool sendPending() const { return pending_.bytes != 0; }

  size_t pieceBytes() const override { return pieceBytes_; }
  void send(const void* src, size_t bytes) override;
  void recv(void* dst, size_t bytes) override;
  void recvCopySend(void* dst, size_t bytes) override;
  void sendPartial(const kernels::ReduceSpec& spec, const void* local, size_t count) override;
  void recvReduceSend(const kernels::ReduceSpec& spec, const void* local,
                      size_t count) override;
  void recvReduceCopy(const kernels::ReduceSpec& spec, const void* local, void* dst,
                      size_t count) override;
  void recvReduceCopySend(const kernels::ReduceSpec& spec, const void* local, void* dst,
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

  P2pOps& ops_;
  const size_t pieceBytes_;
  void* const recvScratch_;
  void* const sendScratch_;
  Pending pending_;
};

// Descriptor agreement. Each field x of a rank's descriptor is encoded as
// the pair (x, ~x); after an element-wise MAX all-reduce of every rank's
// words, a field's pair holds its maximum and its complemented minimum over
// the ranks, so every rank learns whether all ranks agree and, if not, the
// range of each field that differs.
constexpr int kDescFields = 7;  // seq, count, kind, dtype, op, root, algo
constexpr int kDescWords = 2 * kDescFields;
using DescWords = std::array<uint64_t, kDescWords>;

DescWords encodeDesc(const CollectiveDesc& desc);
// "" when every rank called `mine`, given the MAX all-reduce of every
// rank's encodeDesc(); else the error message, naming this rank's call and
// the range of every field that differs.
std::string descMismatch(const CollectiveDesc& mine, const DescWords& reducedMax, int rank);
// "all_reduce(count=..., dtype=..., op=...)".
std::string describe(const CollectiveDesc& desc);

} // namespace p2p
} // namespace pyddp
