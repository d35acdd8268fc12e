// Shared-memory transport: CPU tensors between processes on one host.
//
// Each rank creates one POSIX shared-memory segment and maps every peer's.
// Ownership: a segment's header fields and buffers are written only by the
// rank that created it (single writer), and read by the others.
//
//   [ SegmentHeader | ring slots: numSlots x slotBytes | staging: 2 x directBytes ]
//
// (directBytes: RingOptions::stagingBytes(), rounded up to a cache line.)
//
// Segments are created 0600 under an unguessable name that bootstrap
// publishes before the segment exists (reserve()), unlinked by every rank as
// soon as every rank has mapped them (connected() and reclaim()), or by a
// peer when the owner died before it could (reclaim()), and unmapped on
// destruction. A peer's segment is mapped only if its name is a pyddp name,
// fstat() shows what a rank of this user made for this geometry
// (shm_segment.h's segmentProblem()), and its header names the rank, pid
// and geometry of the blob that named it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/config.h"
#include "common/descriptor.h"
#include "transport/registered.h"
#include "transport/slot_stores.h"
#include "transport/transport.h"

namespace pyddp {
namespace shm {

constexpr size_t kCacheLine = 64;
// Descriptors are kept for the last kDescriptorRing collectives: a rank can
// be at most one collective ahead of any peer that is still reading its
// descriptor (every collective starts with a full arrival barrier), so 2
// would do; 4 leaves room without cost.
constexpr int kDescriptorRing = 4;
constexpr uint64_t kMagic = 0x7079646470736d31ull;  // "pyddpsm1"
// The layout and the protocol below: builds that read the same flags
// differently (3: an arrival may publish a staged round; 4: the round an
// arrival publishes may hold a registered::Ref; 5: mapsRegistered and the
// probe named in the blob; 6: readsProcesses, the cross-memory attach probe,
// cma and cma_min_bytes in the blob, and the round an arrival publishes holds
// an algorithms::TensorWhere; 7: writing and refusesWrites; 8: the
// descriptor's split) do not connect:
// the blob says its layout first, so a peer of another version is named as
// such before its fields are read.
constexpr uint32_t kLayoutVersion = 8;
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

// Synchronisation protocol (all counters start at 0 and only increase):
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
// Direct rounds (PeerMemory). Rounds are numbered over the life of the
//   group. In round R a rank writes staging buffer R % 2, stores staged = R
//   (release) and waits until every peer's staged >= R (acquire); then it
//   reads every rank's buffer R % 2. Invariant: a rank writes buffer R % 2
//   only after seeing every peer at round R-1, and a peer reads round R-2's
//   buffers before it publishes R-1, so no buffer is overwritten while read.
//   A collective's first round may be published with its arrival instead
//   (enterStaged): the rank stages buffer R % 2 before it publishes the
//   descriptor, so a peer's published >= seq also says it staged round R,
//   and staged is not stored (the next exchange() stores R+1, which says
//   both). A peer may give up after it published; a waiter reads its failed
//   (acquire) once the descriptors agree and fails if failed is in 1..seq,
//   so a rank that comes late does not take the data of a collective its
//   peers gave up on, while a peer that finished #seq and left is no reason
//   to fail it.
//
// Failure. A rank that gives up on collective #seq writes failureText, then
//   stores failed = seq (release): seq is its newest arrival when it gives
//   up inside a collective (abandon), the one after when it leaves between
//   collectives (leave, at teardown). Only the first reason is written
//   (abandon() may run on two threads at once: a failing collective and the
//   group's destruction or an interrupt). A waiter that sees the rank it
//   waits on with failed != 0 (acquire) reads the text and fails too, so an
//   error travels around the ring instead of every rank waiting out its
//   deadline. A rank that gave up and then aborts its own waits reports its
//   own failureText.
//
// Writes into a peer (writeProcess: a broadcast's root writes part of each
//   receiver's tensor through the kernel while the receiver reads the
//   rest). A receiver that gives up may hand its tensor back to its caller,
//   who may free it: no write may land after that. The writer stores
//   writing = seq (seq_cst), then loads the receiver's refusesWrites
//   (seq_cst) and writes only if it is 0; it stores writing = 0 (release)
//   once the system call returned. A rank that gives up, on every call
//   (abandon may run on two threads, and the second must not return
//   before the write either), stores refusesWrites = 1 (seq_cst), then
//   loads each peer's writing (seq_cst) and waits while it is not 0 and
//   the peer's process has not exited. Invariant: of the two stores, the
//   one first in the single total order is seen by the other side's load,
//   so either the writer does not write or the receiver waits for the
//   write to end. The wait is as long as one system call of the writer's,
//   unless it is stopped (a signal, a debugger): the receiver then waits
//   with it, as its tensor may still be written.
//
// Ring link (this rank -> rank+1). Pieces are numbered over the life of the
//   group. To send piece k the sender waits until the receiver's
//   consumed >= k + 1 - numSlots (slot k % numSlots is free), writes the
//   slot, then stores posted = k + 1 (release). To receive piece k the
//   receiver waits until the sender's posted >= k + 1 (acquire), reads the
//   slot, then stores consumed = k + 1 (release). A slot written with
//   streaming stores (slot_stores.h) is fenced (sfence) before posted is
//   stored: a release store does not order them. Fused verbs hold one
//   received slot while claiming a send slot; numSlots >= 2 keeps the ring
//   free of that circular wait.
struct alignas(kCacheLine) SegmentHeader {
  // Written once before the segment is published, read-only afterwards.
  uint64_t magic;
  uint32_t layoutVersion;
  int32_t rank;
  int32_t pid;
  int32_t numSlots;
  uint64_t slotBytes;
  uint64_t directBytes;
  // 1 once this rank has mapped every peer's registered memory probe
  // (connect()); 0 if it could not. Written before the rank tells the store
  // it connected, read by peers after every rank has (connected()).
  std::atomic<uint32_t> mapsRegistered;
  // 1 once this rank has read every peer's cross-memory attach probe and
  // written it back (connect()); 0 if it could not. Written and read as
  // mapsRegistered.
  std::atomic<uint32_t> readsProcesses;
  Counter arrived;   // newest collective this rank entered
  Counter staged;    // direct rounds this rank has staged
  Counter posted;    // ring pieces this rank has written to its slots
  Counter consumed;  // ring pieces this rank has read from its left peer
  Counter failed;    // collective this rank gave up on; 0 = none
  // Writes into a peer (above): the collective whose write this rank is
  // in, 0 = none; 1 once this rank gave up, 0 before.
  Counter writing;
  Counter refusesWrites;
  DescriptorSlot desc[kDescriptorRing];
  char failureText[kFailureTextBytes];
};
// The exact layout, pinned: another build of pyddp that maps this segment
// must agree on every offset (the magic and layoutVersion say whether it
// does).
static_assert(std::is_standard_layout_v<SegmentHeader>);
static_assert(offsetof(SegmentHeader, magic) == 0 &&
              offsetof(SegmentHeader, layoutVersion) == 8 && offsetof(SegmentHeader, rank) == 12 &&
              offsetof(SegmentHeader, pid) == 16 && offsetof(SegmentHeader, numSlots) == 20 &&
              offsetof(SegmentHeader, slotBytes) == 24 &&
              offsetof(SegmentHeader, directBytes) == 32 &&
              offsetof(SegmentHeader, mapsRegistered) == 40 &&
              offsetof(SegmentHeader, readsProcesses) == 44 &&
              offsetof(SegmentHeader, arrived) == 64 &&
              offsetof(SegmentHeader, staged) == 128 && offsetof(SegmentHeader, posted) == 192 &&
              offsetof(SegmentHeader, consumed) == 256 && offsetof(SegmentHeader, failed) == 320 &&
              offsetof(SegmentHeader, writing) == 384 &&
              offsetof(SegmentHeader, refusesWrites) == 448 &&
              offsetof(SegmentHeader, desc) == 512 && offsetof(SegmentHeader, failureText) == 768 &&
              sizeof(SegmentHeader) == 1216);

class ShmMessages;

class ShmTransport final : public Transport,
                          public RingLink,
                          public LocalOps,
                          public PeerMemory {
 public:
  ShmTransport(int rank, int worldSize, const RingOptions& options);
  ~ShmTransport() override;
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Transport
  const char* name() const override { return "shm"; }
  std::string reserve() override;
  std::string setup() override;
  void reclaim(const std::string& reservation) override;
  std::string whyNotConnect(int peer, const std::string& blob) const override;
  void connect(const std::vector<std::string>& blobs) override;
  void connected() override;
  void enter(const CollectiveDesc& desc, Deadline deadline) override;
  RingLink& ring() override { return *this; }
  LocalOps& local() override { return *this; }
  PeerMemory* peerMemory() override { return this; }
  void abandon(const std::string& why) override;
  void leave(const std::string& why) override;
  // Also fails the pending point-to-point operations (messages()), with
  // the reason this rank gave up if it did.
  void abort() override;
  // Also for transports that wait elsewhere (on a GPU).
  std::string deadPeer() const override;
  // Point-to-point channels between pairs of ranks (shm_channel.h), one set
  // per lane.
  MessageLink* messages(std::shared_ptr<Directory> directory, Lane lane) override;

  // RingLink
  size_t pieceBytes() const override { return slotBytes_; }
  void send(const void* src, size_t bytes) override;
  void sendCopy(const void* src, void* dst, size_t bytes) override;
  void recv(void* dst, size_t bytes) override;
  void recvCopySend(void* dst, size_t bytes) override;
  void sendPartial(const kernels::ReduceSpec& spec, const void* local,
                   size_t count) override;
  void recvReduceSend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      size_t count) override;
  void recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      void* dst, size_t count) override;
  void recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                          void* dst, size_t count) override;

  // LocalOps, on the CPU
  void copy(void* dst, const void* src, size_t bytes) override;
  // With the stores stagingStores_ picks.
  void stage(void* dst, const void* src, size_t bytes) override;
  void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
               size_t count) override;

  // PeerMemory
  size_t capacityBytes() const override { return directBytes_; }
  void* stagingBuffer() override;
  void exchange() override;
  void enterStaged(const CollectiveDesc& desc, Deadline deadline) override;
  const void* peerBuffer(int rank) const override;
  // Agreed while connecting: "" when every rank mapped a page of registered
  // memory of every peer (a probe each rank makes in setup()).
  std::string whyNotMapRegistered() const override { return registeredRefusal_; }
  const void* registeredTensor(int rank, const registered::Ref& ref, size_t bytes) override;
  // Agreed while connecting: "" when every rank read every peer's probe
  // word through process_vm_readv and wrote it back through
  // process_vm_writev (connect()).
  std::string whyNotReadProcesses() const override { return processRefusal_; }
  void readProcess(int rank, void* dst, uint64_t address, size_t bytes) override;
  void writeProcess(int rank, uint64_t address, const void* src, size_t bytes) override;
  void awaitRingTaken() override;
  // Copies made by readProcess() and writeProcess() (one that wrote any
  // byte) in this process so far: tests see through them which path a
  // collective took.
  static uint64_t processReads();
  static uint64_t processWrites();
  // For tests of the protocol of writes into a peer: writeProcess() sleeps
  // `beforeCheck` between storing writing and loading the peer's
  // refusesWrites, and `beforeCopy` after it (both 0 outside tests).
  static void pauseWrites(std::chrono::milliseconds beforeCheck,
                          std::chrono::milliseconds beforeCopy);

 private:
  struct Segment {
    void* base = nullptr;
    size_t bytes = 0;
    SegmentHeader* header = nullptr;
    char* slots = nullptr;
    char* staging = nullptr;
    int pid = 0;
    bool pidVisible = false;  // same pid namespace: liveness can be checked
    registered::PeerMaps tensors;  // the peer's registered tensors mapped here
    // The peer's process, pinned (pidfd_open) where pidVisible: unlike its
    // pid, never another process's once it exits. -1: none.
    int pidfd = -1;
  };

  // Points `s` at a mapping of `bytes` at `base`. Peers' segments are
  // mapped read-only: the MMU enforces single writers.
  void attach(Segment& s, void* base, size_t bytes) const;
  const SegmentHeader& header(int rank) const { return *segments_[rank].header; }

  // Ring halves of the verbs.
  char* claimSendSlot();
  // Copies what a peer reads next (a piece into a claimed slot, a staged
  // chunk) with the stores `stores` picks; `local`: src is this rank's own
  // memory, not a peer's slot. Returns whether the stores were streaming
  // (dst is then not in this core's cache).
  bool writeShared(SlotStoreChooser& stores, void* dst, const void* src, size_t bytes,
                   bool local);
  void postSend();
  const char* awaitRecvSlot();
  void releaseRecv();

  // Blocks until ready() holds; `peer` is the rank whose progress it needs.
  // `spinPhase`: spinPhase_ to wait for a peer to arrive, pieceSpinPhase_
  // for a slot.
  template <typename Ready>
  void waitFor(int peer, Clock::duration spinPhase, Ready&& ready);
  // Throws if waiting on `peer` cannot end: the group is being destroyed,
  // the peer gave up or died (peerWasAlive is false: it was gone before its
  // flag was found unset), another rank died before it arrived at the
  // collective, or the deadline passed. The message names the ranks to
  // blame.
  void failIfStuck(int peer, bool peerWasAlive, Clock::time_point now) const;
  // Fails with the peer's reason if it gave up on a collective up to #upTo.
  void failIfGaveUp(int peer, uint64_t upTo) const;
  // On the newest collective this rank entered, or on the next one.
  void giveUp(const std::string& why, bool onNext);
  // The second half of giving up: no peer starts a write into this process
  // from now on, and none is under way on return (protocol above).
  void refuseWrites();
  bool peerAlive(int rank) const;
  // Fails, naming the first cause, unless a copy through the kernel from
  // (or, `write`, into) rank `rank`'s process of `bytes` copied them all
  // (`done`; `err`: errno) while the rank was alive and had not given up.
  void checkCopied(int rank, bool write, size_t done, size_t bytes, int err) const;
  // Whether rank `rank`'s pinned process (Segment::pidfd) has not exited.
  bool peerStillIn(int rank) const;
  // Sets `refusal` (if "") naming the first rank whose header says it could
  // not pass a probe (`succeeded` != 1): it "cannot `what`".
  void agreeOnProbes(std::atomic<uint32_t> SegmentHeader::*succeeded, const char* what,
                     std::string& refusal) const;
  // Why this rank cannot read every peer's probe word through the kernel
  // and write it back ("" if it can), pinning each peer's process on the
  // way. By rank: the word's address in the peer's process, and what it
  // holds.
  struct ProcessProbe {
    uint64_t address = 0;
    uint64_t token = 0;
  };
  std::string whyNotReadPeers(const std::vector<ProcessProbe>& probes);
  // "all_reduce #3": the collective waits are in, for messages.
  std::string currentCall() const;
  // The segment name of `lane`'s channel src -> dst: src's segment name
  // followed by the lane and dst, so every rank can name it.
  std::string channelName(Lane lane, int src, int dst) const;
  size_t segmentBytes() const;

  const int rank_;
  const int worldSize_;
  const size_t slotBytes_;
  const int numSlots_;
  const size_t directBytes_;
  const size_t p2pBufferBytes_;
  const CmaReads cma_;
  const size_t cmaMinBytes_;
  const std::string hostId_;
  const std::string pidNamespace_;
  // How long a wait spins before it yields (Backoff::spinPhaseFor,
  // pieceSpinPhaseFor): none with more ranks than cores.
  const Clock::duration spinPhase_;
  const Clock::duration pieceSpinPhase_;

  std::string ownName_;   // chosen by reserve()
  std::vector<std::string> segmentNames_;  // by rank, once connected
  bool linked_ = false;  // own segment name still exists in /dev/shm
  // A page of registered memory the peers map while connecting; released
  // once every rank has connected.
  void* probe_ = nullptr;
  // Why this group does not read registered tensors in place ("" if it does).
  std::string registeredRefusal_ = "the group is not connected";
  // A word the peers read through process_vm_readv (and write back
  // unchanged) while connecting, to learn whether the kernel lets them; it
  // holds a value of this rank's choosing, named in the blob.
  uint64_t processProbe_ = 0;
  // Why this group does not read peers' plain tensors through the kernel
  // ("" if it does).
  std::string processRefusal_ = "the group is not connected";
  std::vector<Segment> segments_;  // by rank; segments_[rank_] is our own
  std::atomic<bool> aborted_{false};
  std::atomic<bool> abandoned_{false};  // the failure text is (being) written
  // Made by the first messages() of each lane, which the engine calls
  // before any other thread sees this transport (abort() reads them from
  // any thread).
  std::unique_ptr<ShmMessages> messages_;
  std::unique_ptr<ShmMessages> collectiveMessages_;

  // For the ring's slots, and for the staging buffers: each kind's
  // estimate is per byte, and the smaller staged writes need a higher ratio.
  SlotStoreChooser stores_;
  SlotStoreChooser stagingStores_;
  uint64_t sent_ = 0;      // mirrors our posted counter
  uint64_t received_ = 0;  // mirrors our consumed counter
  uint64_t rounds_ = 0;    // direct rounds staged (staged says those of exchange())
  CollectiveDesc current_;
  Clock::time_point deadline_;
  int64_t timeoutMs_ = 0;  // of the current collective (the group's, or its call's)
};

} // namespace shm
} // namespace pyddp
