// The control plane of a group on one host: how its ranks arrive at a
// collective, agree on what it is, notice a peer that gave up or died, and
// tell each other why they gave up. The shm transport runs its data plane
// (slots, staging buffers, process memory) beside it; cuda_ipc, whose data
// is on the GPU, runs the control plane alone.
//
// Each rank creates one POSIX shared-memory segment (shm_segment.h: 0600,
// an unguessable name that bootstrap publishes before the segment exists)
// and maps every peer's read-only:
//
//   [ ControlHeader | the owner's data: dataBytes ]
//
// Ownership: a segment is written only by the rank that created it (single
// writer). Segments are unlinked by every rank as soon as every rank has
// mapped them (connected(), reclaim()), or by a peer when the owner died
// before it could (reclaim()), and unmapped on destruction. A peer's
// segment is mapped only if its name is a pyddp name, fstat() shows what a
// rank of this user made of this size (segmentProblem()), and its header
// names the rank, pid and size of the blob that named it.
//
// Protocol (all counters start at 0 and only increase):
//
// Arrival. To enter collective #seq a rank writes the descriptor of slot
//   desc[seq % kDescriptorRing], then stores the slot's published = seq
//   (release) and arrived = seq (release; read by failure reports). It
//   proceeds once every peer's slot has published >= seq (acquire),
//   comparing each peer's descriptor as soon as it is there. Invariant: no
//   rank passes the arrival of #seq+1 before every rank has left #seq, so a
//   peer's descriptor for #seq stays untouched while read, and a slot holds
//   #seq or #seq - kDescriptorRing while a peer waits on it.
//
// Failure. A rank that gives up on collective #seq writes failureText, then
//   stores failed = seq (release): seq is its newest arrival when it gives
//   up inside a collective (abandon), the one after when it leaves between
//   collectives (leave, at teardown). Only the first reason is written
//   (giving up may run on two threads at once: a failing collective and the
//   group's destruction or an interrupt). A waiter that sees the rank it
//   waits on with failed != 0 (acquire) reads the text and fails too, so an
//   error travels around the ring instead of every rank waiting out its
//   deadline. A rank that gave up and then aborts its own waits reports its
//   own failureText. Every Backoff::kCheckPeriod a waiter also looks at
//   the ranks it does not wait for: one with 0 < failed <= the waiter's
//   seq will not finish this collective (abort() gives up in the newest
//   one it entered, whether or not it did its part), so the waiter fails
//   with its text; one with failed > seq left after doing its part.
//
// Liveness. Every wait spins, then yields, then sleeps (wait_policy.h), and
//   every Backoff::kCheckPeriod looks at the peer's process and the
//   deadline: a dead or absent rank is named within milliseconds of its
//   death or at the timeout.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/blob.h"
#include "common/deadline.h"
#include "common/descriptor.h"
#include "common/interrupt.h"
#include "transport/shm_segment.h"
#include "transport/wait_policy.h"

namespace pyddp {
namespace shm {

constexpr size_t kCacheLine = 64;
// Descriptors are kept for the last kDescriptorRing collectives: a rank can
// be at most one collective ahead of any peer that is still reading its
// descriptor (every collective starts with a full arrival barrier), so 2
// would do; 4 leaves room without cost.
constexpr int kDescriptorRing = 4;
constexpr uint64_t kControlMagic = 0x7079646470736d31ull;  // "pyddpsm1"
// The control header's layout and protocol: builds that read them
// differently do not connect (9: the header split from the shm transport's
// data, and the descriptor's split). The blob says it first, so a peer of
// another version is named as such before its fields are read.
constexpr uint32_t kControlLayoutVersion = 10;
// Room for the reason a rank gave up, shown by the peers that waited on it.
constexpr size_t kFailureTextBytes = 448;

// A monotonically increasing counter on its own cache line, so that the
// flags of different writers never share a line.
struct alignas(kCacheLine) Counter {
  std::atomic<uint64_t> value;
};
static_assert(sizeof(Counter) == kCacheLine);
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "cross-process counters must be lock-free (address-free)");
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "cross-process flags must be lock-free (address-free)");

// One descriptor per cache line, with the number of the collective it
// describes: a rank rewrites the slot of its next collective while peers
// may still read the previous one, and a waiter polls the line it then
// reads (one cache miss per peer, where a separate flag costs two).
struct alignas(kCacheLine) DescriptorSlot {
  std::atomic<uint64_t> published;  // desc.seq once desc is written; 0 before
  CollectiveDesc desc;
};
static_assert(sizeof(DescriptorSlot) == kCacheLine);
static_assert(offsetof(DescriptorSlot, published) == 0 && offsetof(DescriptorSlot, desc) == 8);

struct alignas(kCacheLine) ControlHeader {
  // Written once before the segment is published, read-only afterwards.
  uint64_t magic;
  uint32_t layoutVersion;
  int32_t rank;
  int32_t pid;
  uint32_t reserved;
  uint64_t dataBytes;
  Counter arrived;  // newest collective this rank entered
  Counter failed;   // collective this rank gave up on; 0 = none
  DescriptorSlot desc[kDescriptorRing];
  char failureText[kFailureTextBytes];
};
// The exact layout, pinned: another build of pyddp that maps this segment
// must agree on every offset (the magic and layoutVersion say whether it
// does).
static_assert(std::is_standard_layout_v<ControlHeader>);
static_assert(offsetof(ControlHeader, magic) == 0 &&
              offsetof(ControlHeader, layoutVersion) == 8 && offsetof(ControlHeader, rank) == 12 &&
              offsetof(ControlHeader, pid) == 16 && offsetof(ControlHeader, dataBytes) == 24 &&
              offsetof(ControlHeader, arrived) == 64 && offsetof(ControlHeader, failed) == 128 &&
              offsetof(ControlHeader, desc) == 192 &&
              offsetof(ControlHeader, failureText) == 448 && sizeof(ControlHeader) == 896);

class ControlPlane {
 public:
  // `dataBytes`: what each rank's segment holds after its header, for the
  // data plane beside this one (0: none). `name` names the transport in
  // messages ("shm").
  ControlPlane(int rank, int worldSize, size_t dataBytes);
  // Unlinks this rank's segment name if bootstrap did not (it failed).
  ~ControlPlane();
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  // Bootstrap (transport.h): the segment's name, published before it
  // exists; the segment made and its fields put in `blob`; a peer of
  // another host refused; every peer's segment mapped and checked, from
  // the fields of its blob; the own name unlinked once every rank has
  // connected; a dead rank's reservation removed.
  std::string reserve();
  void setup(BlobWriter& blob);
  std::string whyNotConnect(int peer, const BlobReader& blob) const;
  void connect(const std::vector<BlobReader>& blobs);
  void connected();
  static void reclaim(const std::string& reservation);

  char* ownData() const { return own_.data; }
  const char* peerData(int rank) const { return peers_[rank].data; }
  const std::string& segmentName(int rank) const { return peers_[rank].name; }
  // A peer's pid, and whether it lives in this pid namespace (its pid can
  // be looked at).
  int pid(int rank) const { return peers_[rank].pid; }
  bool pidVisible(int rank) const { return peers_[rank].pidVisible; }

  // Arrival at collective `desc` (desc.seq: 1, 2, ...): fails unless every
  // rank called the same, or when a rank gives up, dies or does not come
  // by `deadline`.
  void enter(const CollectiveDesc& desc, Deadline deadline);
  // Publishes this rank's descriptor of collective `desc` without waiting
  // for the peers (the fused collectives agree on the device, and read the
  // descriptors here only to say how ranks differed).
  void publish(const CollectiveDesc& desc);
  // How this rank's `mine` differs from what rank `peer` published for the
  // same collective; "" if the same or not published (yet).
  std::string differs(const CollectiveDesc& mine, int peer) const;
  // Blocks until ready() holds; `peer` is the rank whose progress it needs.
  // `spinPhase`: spinPhase() to wait for a peer to arrive, a shorter one
  // for a peer inside the same collective.
  template <typename Ready>
  void waitFor(int peer, Clock::duration spinPhase, Ready&& ready);
  Clock::duration spinPhase() const { return spinPhase_; }
  // Fails with the peer's reason if it gave up on a collective up to #upTo
  // (`waitedFor`: the rank this one waits for, when not `peer`).
  void failIfGaveUp(int peer, uint64_t upTo, int waitedFor = -1) const;
  // The collective of the newest enter(), and its bounds, for messages.
  const CollectiveDesc& current() const { return current_; }
  std::string currentCall() const;

  // This rank gives up on its newest collective (or, `onNext`, on the next
  // one): peers waiting on it fail with `why`. Only the first call writes
  // its reason; true for that one.
  bool giveUp(const std::string& why, bool onNext);
  // This rank's waits fail from now on (teardown).
  void abort() { aborted_.store(true, std::memory_order_relaxed); }
  // The reason this rank gave up; "" if it did not.
  std::string ownFailure() const;
  // The reason `peer` gave up, and the collective it gave up on; "" and 0
  // if it did not.
  std::string peerFailure(int peer) const;
  uint64_t failedIn(int peer) const {
    return header(peer).failed.value.load(std::memory_order_acquire);
  }
  // "rank 2 (pid P) exited" for the first peer whose process is gone; "".
  std::string deadPeer() const;
  bool peerAlive(int rank) const;

 private:
  struct Peer {
    Segment segment;
    const ControlHeader* header = nullptr;
    char* data = nullptr;
    std::string name;
    int pid = 0;
    bool pidVisible = false;  // same pid namespace: liveness can be checked
  };

  const ControlHeader& header(int rank) const { return *peers_[rank].header; }
  ControlHeader& own() const { return *own_.header; }
  size_t segmentBytes() const { return sizeof(ControlHeader) + dataBytes_; }
  // Throws if waiting on `peer` cannot end: the group is being destroyed,
  // the peer gave up or died (peerWasAlive is false: it was gone before its
  // flag was found unset), another rank died before it arrived at the
  // collective, or the deadline passed. The message names the ranks to
  // blame.
  void failIfStuck(int peer, bool peerWasAlive, Clock::time_point now) const;

  struct Own {
    ControlHeader* header = nullptr;
    char* data = nullptr;
  };

  const int rank_;
  const int worldSize_;
  const size_t dataBytes_;
  const std::string hostId_;
  const std::string pidNamespace_;
  // How long a wait for a peer's arrival spins before it yields
  // (Backoff::spinPhaseFor): none with more ranks than cores.
  const Clock::duration spinPhase_;
  Own own_;
  std::vector<Peer> peers_;  // by rank; peers_[rank_] holds this rank's own segment
  std::atomic<bool> aborted_{false};
  std::atomic<bool> gaveUp_{false};  // the failure text is (being) written
  CollectiveDesc current_;
  Clock::time_point deadline_;
  int64_t timeoutMs_ = 0;  // of the current collective (the group's, or its call's)
};

template <typename Ready>
void ControlPlane::waitFor(int peer, Clock::duration spinPhase, Ready&& ready) {
  if (ready()) return;
  Backoff backoff(spinPhase);
  while (!ready()) {
    const bool due = backoff.pause();
    if (backoff.pastSpinning() && interruptRequested()) {
      PYDDP_CHECK_COMM(false, "rank ", rank_, ": interrupted while ", currentCall(),
                       " waited for rank ", peer);
    }
    if (due) {
      // Look at the peer before looking at the flag: a peer that posted
      // and then exited has done its part.
      const bool alive = peerAlive(peer);
      if (ready()) return;
      failIfStuck(peer, alive, backoff.now());
    }
  }
}

} // namespace shm
} // namespace pyddp
