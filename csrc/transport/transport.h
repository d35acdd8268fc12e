// The transport interface: how bytes move between ranks, without knowing
// which collective or schedule moves them. Algorithms (algorithms/) are
// written against these classes only. Every transport implements Transport,
// RingLink and LocalOps with the same method names: shm (CPU, one host),
// cuda_ipc (GPU memory mapped between processes, one host) and nccl (NCCL
// send/recv through transport/sendrecv_ring.h, any hosts). PeerMemory is
// for transports that map every peer's memory (shm, cuda_ipc).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/deadline.h"
#include "common/descriptor.h"
#include "kernels/cpu.h"
#include "transport/registered.h"

namespace pyddp {

// Which hop of a reduction a receive reads: First reads what the left
// neighbour's sendPartial sent, Later what its recvReduceSend sent.
enum class Hop { First, Later };

// The hop a reduction's ring step receives: its step 0 reads a sendPartial.
inline Hop hopOfStep(int step) { return step == 0 ? Hop::First : Hop::Later; }

// One direction of the ring: this rank sends to rank+1 and receives from
// rank-1. Each verb moves one piece (at most pieceBytes()) and returns when
// this rank's part is done; pieces are matched by order, so both ends must
// issue the same sequence of pieces (the schedule guarantees it).
class RingLink {
 public:
  virtual ~RingLink() = default;
  virtual size_t pieceBytes() const = 0;

  // Send `bytes` of src.
  virtual void send(const void* src, size_t bytes) = 0;
  // Send `bytes` of src and copy them to dst (unless dst == src), while
  // the piece is in this core's cache: a rank's own block of an all-gather,
  // whose input is then read from memory once.
  virtual void sendCopy(const void* src, void* dst, size_t bytes) = 0;
  // Receive into dst.
  virtual void recv(void* dst, size_t bytes) = 0;
  // Receive into dst and forward the same bytes.
  virtual void recvCopySend(void* dst, size_t bytes) = 0;

  // Reductions travel as partial results (kernels::partialSize per element)
  // until the last hop finishes them into elements. The first hop carries
  // the sender's own elements, exact as elements: a transport may send them
  // so (kernels::Incoming::Elements), at half a half type's partial bytes,
  // and the receive told Hop::First reads them so.
  // Start a reduction: send local elements, the first hop (as partials or
  // as elements, the transport's choice).
  virtual void sendPartial(const kernels::ReduceSpec& spec, const void* local,
                           size_t count) = 0;
  // Forward received partials op local elements, still partial.
  virtual void recvReduceSend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                              size_t count) = 0;
  // dst = finish(received partials op local).
  virtual void recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                              void* dst, size_t count) = 0;
  // dst = finish(received partials op local), and forward those elements.
  virtual void recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop,
                                  const void* local, void* dst, size_t count) = 0;
};

// Work a rank does alone on memory it can address (its tensors, its staging
// buffer, peers' mapped buffers): run on the CPU by shm, enqueued on the
// transport's stream by the GPU transports. Algorithms never touch the
// bytes themselves.
class LocalOps {
 public:
  virtual ~LocalOps() = default;
  // dst = src, bytes long (a no-op when dst == src or bytes == 0: an empty
  // tensor's pointer may be null, which memcpy must not be given).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // The same into a staging buffer (PeerMemory), which peers read next: the
  // transport may pick the stores that suit its readers.
  virtual void stage(void* dst, const void* src, size_t bytes) { copy(dst, src, bytes); }
  // dst = finish(src[0] op ... op src[nsrc-1]), in source order; dst may be
  // one of the sources (the registered all-reduce reduces in place).
  virtual void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src,
                       int nsrc, size_t count) = 0;
};

// Memory of every rank mapped into this process, for direct (one-shot and
// two-shot) algorithms, used in rounds: a rank writes its data to
// stagingBuffer(), calls exchange() (or enterStaged(), for a first round
// staged before the collective arrived), and then reads every rank's data of
// that round through peerBuffer() until its next round. Between two rounds,
// stagingBuffer() is already the next round's buffer, which no peer reads
// until that round.
class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  virtual size_t capacityBytes() const = 0;
  virtual void* stagingBuffer() = 0;
  // Publishes this rank's staged data; returns once every rank has.
  virtual void exchange() = 0;
  // Transport::enter() and the collective's first exchange() in one
  // meeting: publishes this rank's descriptor with its staged data and
  // returns once every rank has published the same descriptor and its data.
  // Fails, as enter() does, on a mismatch, and on a peer that gave up on the
  // collective after it staged.
  virtual void enterStaged(const CollectiveDesc& desc, Deadline deadline) = 0;
  virtual const void* peerBuffer(int rank) const = 0;
  // Registered memory (transport/registered.h), for CPU tensors: why not
  // every rank can map every peer's ("" on every rank or on none), and rank
  // `rank`'s tensor that `ref` names, `bytes` long, mapped here (throws if
  // it cannot be).
  virtual std::string whyNotMapRegistered() const {
    return "the transport does not map peers' memory";
  }
  virtual const void* registeredTensor(int rank, const registered::Ref& ref, size_t bytes) {
    PYDDP_CHECK(false, "this transport does not map registered memory");
  }
  // Cross-memory attach, for CPU tensors: why not every rank can read every
  // peer's memory through the kernel ("" on every rank or on none), and a
  // copy of `bytes` at `address` in rank `rank`'s process into `dst`, which
  // fails (naming the rank) unless rank `rank` was alive and still in this
  // collective when the copy ended: the bytes are then those its tensor
  // held, not memory it had already let go.
  virtual std::string whyNotReadProcesses() const {
    return "the transport does not read peers' processes";
  }
  virtual void readProcess(int rank, void* dst, uint64_t address, size_t bytes) {
    PYDDP_CHECK(false, "this transport does not read peers' processes");
  }
  // The other way (the kernel lets a process write another's memory where
  // it lets it read it): `bytes` of src into `address` in rank `rank`'s
  // process, a tensor it offered in this collective. Fails (naming the
  // rank) if the rank gave up or died first; a rank that gives up returns
  // only once no write into its memory is under way (shm.h, "Writes into a
  // peer").
  virtual void writeProcess(int rank, uint64_t address, const void* src, size_t bytes) {
    PYDDP_CHECK(false, "this transport does not write peers' processes");
  }
  // For the rank that times the ring's path against the kernel's
  // (backend/cma_chooser.h): returns once the next rank has read every ring
  // piece this rank sent. The ring lets a rank return before then, the
  // kernel path's closing meeting does not.
  virtual void awaitRingTaken() {
    PYDDP_CHECK(false, "this transport does not read peers' processes");
  }
};

// Where connections made after bootstrap (point-to-point channels, made on
// first use) publish what a peer needs to reach them: the engine gives a
// view of the group's store. lookup() does not wait.
class Directory {
 public:
  virtual ~Directory() = default;
  virtual void publish(const std::string& key, const std::string& value) = 0;
  virtual std::optional<std::string> lookup(const std::string& key) = 0;
};

// Point-to-point messages between two ranks: the verbs of send/recv and of
// the pairwise exchanges of all-to-all, gather and scatter. A message is
// `bytes` of one dtype with a tag; messages between a pair of ranks with
// the same tag are received in the order they were sent (FIFO per pair
// and tag); across tags, in any order. A send finishes once its receive has
// taken it; a receive that wants another size or dtype fails, and so does
// the send.
//
// A receive from kAnySource takes the first message with its tag from any
// rank; it and the receives from one rank take that rank's messages in the
// order they were posted, so FIFO per pair and tag holds.
//
// Verbs do not wait: post*() queues an operation, progress() moves what
// can move now. Whoever waits drives progress: the engine's progress
// thread, or a thread in wait(). Every method is thread-safe. Operations
// are numbered by the link; a finished operation is kept until release().
class MessageLink {
 public:
  enum class State { Pending, Done, Failed };

  virtual ~MessageLink() = default;
  // `data` must stay valid (and, for a send, unchanged) until the
  // operation finished. Operations past `deadline` fail, naming the peer.
  virtual uint64_t postSend(int peer, int64_t tag, DataType dtype, const void* data,
                            size_t bytes, Clock::time_point deadline) = 0;
  static constexpr int kAnySource = -1;
  // `peer` is a rank, or kAnySource.
  virtual uint64_t postRecv(int peer, int64_t tag, DataType dtype, void* data, size_t bytes,
                            Clock::time_point deadline) = 0;
  // The rank a receive took its message from; -1 while it has none, and
  // for a send.
  virtual int sourceOf(uint64_t id) = 0;
  // Moves what can move now; returns whether anything did (waiters back
  // off when nothing does).
  virtual bool progress() = 0;
  // The operation's state; for Failed, why.
  virtual State poll(uint64_t id, std::string* why) = 0;
  // Forgets a finished operation.
  virtual void release(uint64_t id) = 0;
  // Blocks, driving progress, until every operation of `ids` finished;
  // throws the first failure (DistBackendError). Releases them. For the
  // collectives built on messages: it also ends, giving up on what is
  // pending, when the caller is interrupted or a peer of a pending
  // operation gave up on the group's collectives.
  virtual void wait(const std::vector<uint64_t>& ids) = 0;
  // Fails every pending operation with `why`, and tells the peers.
  virtual void abort(const std::string& why) = 0;
  // Gives up on one pending operation (its waiter was interrupted) as on
  // one past its deadline: it fails with `why`, and so does its channel,
  // telling the peer, when part of its message has moved.
  virtual void cancel(uint64_t id, const std::string& why) = 0;
  // Whether progress() still has work of its own with no operation pending
  // here (a peer's pending send waits for what this end must still write):
  // whoever drives progress keeps driving it.
  virtual bool busy() { return false; }
  // The group is being destroyed: fails what is pending (as abort()) and
  // removes what this end, or a dead peer, left in the operating system's
  // namespaces. Idempotent.
  virtual void close() {}
};

// What a rank tells its peers when it tears its group down: the first cause
// it knows of, a peer that exited (`dead`, from deadPeer()), then the
// teardown itself, which would otherwise be all its peers hear of (they
// hear of the teardown before they look at the dead rank themselves).
inline std::string teardownReason(int rank, const std::string& dead,
                                  Teardown how = Teardown::Destroyed) {
  const std::string ended =
      "rank " + std::to_string(rank) + " " + pastTense(how) + " its process group";
  return dead.empty() ? ended : dead + "; then " + ended;
}

// Which of a transport's message links: the user's point-to-point
// messages, or those of the collectives built on messages. They move on
// channels of their own, so that neither waits behind the other's
// unreceived messages and no user tag can reach a collective's message.
enum class Lane { User, Collectives };

// What connects this rank to all others in two phases (backend/bootstrap.h):
// setup() returns a small blob that the engine all-gathers through the
// store, connect() maps or opens what the blobs name, and connected()
// (after every rank has connected) releases what bootstrap needed. A
// transport, or the shared memory of the fused collectives
// (fused_memory.h).
class Connectable {
 public:
  virtual ~Connectable() = default;
  virtual const char* name() const = 0;

  // Names what setup() will create that outlives this process if it dies
  // (shm: the segment's name), before it exists: bootstrap publishes it
  // first, so that a peer can remove it (reclaim()) if this rank dies before
  // it could. "" when setup() creates nothing of the kind.
  virtual std::string reserve() { return ""; }
  virtual std::string setup() = 0;
  // Removes what a peer reserved, once nobody will open it again: every
  // rank has finished connect(), or the peer died during bootstrap. Ignores
  // what is already gone and anything this transport would not have named.
  virtual void reclaim(const std::string& reservation) {}
  // Empty when this rank can reach `peer` through this transport; else why not.
  virtual std::string whyNotConnect(int peer, const std::string& blob) const = 0;
  virtual void connect(const std::vector<std::string>& blobs) = 0;
  virtual void connected() = 0;
};

// How bytes move between the ranks of a group, without knowing which
// collective moves them: a Connectable with the verbs of the algorithms.
class Transport : public Connectable {
 public:
  // Start a collective: publish this rank's descriptor, wait until every
  // rank has entered the same collective (deadline bounds the wait) and
  // check all descriptors agree. Every later wait of the collective is
  // bounded by the same deadline.
  virtual void enter(const CollectiveDesc& desc, Deadline deadline) = 0;

  virtual RingLink& ring() = 0;
  virtual LocalOps& local() = 0;
  // Called after each collective's verbs: posts what the last verb may
  // have held back (NCCL's ring pairs each send with the next receive).
  virtual void flush() {}
  // nullptr when peers' memory is not mapped into this process.
  virtual PeerMemory* peerMemory() = 0;

  // This rank gave up on the current collective: peers waiting on it fail
  // at once with `why` instead of at their deadline. The first reason
  // stays; safe to call from any thread.
  virtual void abandon(const std::string& why) = 0;
  // This rank leaves the group between collectives (teardown): peers that
  // wait for it in a collective it did not enter fail at once with `why`;
  // a peer still finishing one this rank has done its part of does not.
  virtual void leave(const std::string& why) { abandon(why); }
  // Makes every current and later wait of this rank fail (group teardown).
  // Safe to call from any thread.
  virtual void abort() = 0;
  // "" while every peer's process lives (or cannot be seen from here), else
  // which rank exited, as "rank 2 (pid 4242) exited": the cause a teardown
  // names first (teardownReason). Safe to call from any thread.
  virtual std::string deadPeer() const { return ""; }

  // For transports whose waits run on a device, where the host does not
  // see them fail: a wait that gave up or a peer that exited, as a message;
  // "" while none. Safe to call from any thread.
  virtual std::string asyncError() const { return ""; }
  // For the Work of one device collective: a function that, called once
  // the collective's done event has fired, returns the error the device
  // recorded while running it ("" when none). It owns what it reads, so it
  // may outlive the transport. Null where the device records no errors.
  virtual std::function<std::string()> deviceErrorProbe() const { return nullptr; }

  // Point-to-point messages over this transport, made on first use of a
  // pair of ranks through `directory`; nullptr for transports without
  // them. The link is the transport's and lives as long as it.
  virtual MessageLink* messages(std::shared_ptr<Directory> directory, Lane lane) {
    return nullptr;
  }
};

} // namespace pyddp
