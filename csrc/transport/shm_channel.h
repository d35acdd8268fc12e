// Point-to-point messages over shared memory (ShmMessages, the shm
// transport's MessageLink): one channel per ordered pair of ranks
// (src -> dst) and lane (the user's messages, or the collectives'), created
// by src on its first send to dst, so a group maps only the channels it
// uses, and no message of one lane waits behind the other's.
//
// A channel is one segment, created by src and mapped read-write by dst:
//
//   [ ChannelHeader | slots: numSlots x (PieceHeader + slotBytes) ]
//
// Ownership: src writes the slots, `posted`, `verdictsRead` and `srcFailed`
// (+ text); dst writes `consumed`, the verdicts, `verdictsPosted` and
// `dstFailed` (+ text). The rest of the header is written once by src
// before the segment is published.
//
// Names. A channel's segment name is src's own shm segment name followed
// by the lane and dst, so every rank of the group can name every channel
// without the store (which may have gone with a dead rank). dst unlinks the
// name as soon as it has mapped the segment; src unlinks it when its group
// is destroyed if dst never did; and if src died first, dst (or any
// survivor, where dst died too) unlinks it when its group is destroyed
// (close()), at the latest when its process exits. So nothing stays in
// /dev/shm unless every rank dies. A channel's segment is mapped only as
// shm_segment.h's Segment::open() allows (a pyddp name, a 0600 file of this
// user of the size the geometry implies).
//
// Protocol. Messages are numbered 1, 2, ... per channel in src's send order
// and stream through the slots piece by piece; every piece carries its
// message's number, tag, dtype, total size and offset (a message of 0
// bytes is one empty piece). Counters only increase.
//  - Pieces: the slot FIFO of slot_fifo.h (its protocol and invariant),
//    src's SlotSender to dst's SlotReceiver over the channel's slots, with
//    the header's `posted` and `consumed`.
//  - Matching (dst): tag_matcher.h's rules and invariants, by one
//    TagMatcher for all the channels of the lane to this rank, told of a
//    message when its first piece is read. A message that no posted
//    receive wants is copied aside until one is posted; a receive that
//    takes it before all its pieces are read claims it, and gets it once
//    they are. While a receive from any source waits, every channel to
//    this rank is read, mapped once its sender made it. What is aside is
//    bounded per channel (asideBudget, PYDDP_P2P_BUFFER_BYTES for the
//    user's lane): a message no receive wants that would exceed it stays
//    in the slots, unread, until a receive for it is posted or what is
//    aside shrinks. Its sender waits; a receive of a later message of the
//    channel waits too (and names the budget if it times out). A message
//    larger than the budget is never put aside: it moves when its receive
//    is posted.
//  - Verdicts (dst -> src), a queue of kVerdictRing entries: when dst
//    matches message m it appends 2m, or 2m + 1 with the reason in its
//    text when the receive wants another size or dtype (then nothing is
//    copied, and both sides fail). dst writes entry n % kVerdictRing once
//    verdictsRead >= n + 1 - kVerdictRing, then stores verdictsPosted =
//    n + 1 (release); src reads it once verdictsPosted >= n + 1 (acquire),
//    then stores verdictsRead = n + 1 (release). Verdicts that do not fit
//    wait in dst's process (In::unsent), and dst keeps driving progress
//    until they are written (busy()): src reads them, since each is the
//    verdict of a send still pending there. Verdicts come in matching
//    order, not message order, so any number of messages may await
//    theirs. A send finishes once all its pieces are posted and its verdict
//    is 2m: only when a receive took it, as gloo's sends.
//  - Failure: a side that gives up on a channel with an operation half
//    done (a timeout, an interrupt, teardown) writes its reason, then stores its failed
//    flag (release); the other side fails every operation on the channel
//    with that reason (acquire). A failed channel stays failed. Verdicts
//    that src can no longer read (it gave up, or died) are dropped.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/config.h"
#include "transport/shm_control.h"
#include "transport/shm_segment.h"
#include "transport/slot_fifo.h"
#include "transport/tag_matcher.h"
#include "transport/transport.h"

namespace pyddp {
namespace shm {

constexpr uint64_t kChannelMagic = 0x7079646470326331ull;  // "pyddp2c1"
constexpr uint32_t kChannelLayoutVersion = 2;
// Entries of a channel's verdict queue.
constexpr int kVerdictRing = 64;
constexpr size_t kVerdictTextBytes = 248;
constexpr size_t kChannelFailureTextBytes = 448;

struct alignas(kCacheLine) Verdict {
  uint64_t value;  // 2m accepted, 2m + 1 refused
  char text[kVerdictTextBytes];
};
static_assert(sizeof(Verdict) == 256);

struct alignas(kCacheLine) PieceHeader {
  uint64_t message;
  uint64_t offset;  // of this piece in the message, in bytes
  uint64_t bytes;   // in this piece
  uint64_t total;   // of the message
  int64_t tag;
  int32_t dtype;
};
static_assert(sizeof(PieceHeader) == kCacheLine);
static_assert(offsetof(PieceHeader, tag) == 32 && offsetof(PieceHeader, dtype) == 40);

struct alignas(kCacheLine) ChannelHeader {
  // Written once by src before the segment is published.
  uint64_t magic;
  uint32_t layoutVersion;
  int32_t src;
  int32_t dst;
  int32_t numSlots;
  uint64_t slotBytes;
  Counter posted;     // src: pieces written
  Counter consumed;   // dst: pieces read
  Counter srcFailed;  // src gave up on the channel; text in srcFailureText
  Counter dstFailed;  // dst gave up on the channel; text in dstFailureText
  Counter verdictsPosted;  // dst: verdicts written
  Counter verdictsRead;    // src: verdicts read
  char srcFailureText[kChannelFailureTextBytes];
  char dstFailureText[kChannelFailureTextBytes];
  Verdict verdicts[kVerdictRing];  // dst
};
static_assert(std::is_standard_layout_v<ChannelHeader>);
static_assert(offsetof(ChannelHeader, magic) == 0 && offsetof(ChannelHeader, src) == 12 &&
              offsetof(ChannelHeader, slotBytes) == 24 &&
              offsetof(ChannelHeader, posted) == 64 && offsetof(ChannelHeader, consumed) == 128 &&
              offsetof(ChannelHeader, srcFailed) == 192 &&
              offsetof(ChannelHeader, dstFailed) == 256 &&
              offsetof(ChannelHeader, verdictsPosted) == 320 &&
              offsetof(ChannelHeader, verdictsRead) == 384 &&
              offsetof(ChannelHeader, srcFailureText) == 448 &&
              offsetof(ChannelHeader, dstFailureText) == 896 &&
              offsetof(ChannelHeader, verdicts) == 1344 &&
              sizeof(ChannelHeader) == 1344 + 256 * kVerdictRing);

class ShmMessages final : public MessageLink {
 public:
  // `deadPeer(p)` is "" while rank p's process lives (or cannot be seen),
  // else which rank exited: for naming why an operation cannot finish.
  // `gaveUp(p)` is "" until rank p gave up on the group's collectives (the
  // shm transport's failed flag), then why: wait() (collectives) stops on
  // it, the user's point-to-point operations do not. `lane` names the
  // channels' directory keys ("p2p", "coll"); `channelName(src, dst)` is
  // the segment name of the channel src -> dst of this lane.
  // `asideBudget`: bytes of unexpected messages each channel from a peer
  // may hold aside.
  ShmMessages(int rank, int size, size_t slotBytes, int numSlots, size_t asideBudget,
              std::string lane, std::function<std::string(int src, int dst)> channelName,
              std::shared_ptr<Directory> directory,
              std::function<std::string(int peer)> deadPeer,
              std::function<std::string(int peer)> gaveUp);
  ~ShmMessages() override;

  uint64_t postSend(int peer, int64_t tag, DataType dtype, const void* data, size_t bytes,
                    Clock::time_point deadline) override;
  uint64_t postRecv(int peer, int64_t tag, DataType dtype, void* data, size_t bytes,
                    Clock::time_point deadline) override;
  int sourceOf(uint64_t id) override;
  bool progress() override;
  State poll(uint64_t id, std::string* why) override;
  void release(uint64_t id) override;
  void wait(const std::vector<uint64_t>& ids) override;
  void abort(const std::string& why) override;
  void cancel(uint64_t id, const std::string& why) override;
  bool busy() override;
  // Tells the peers of every channel that this rank is gone, removes the
  // names of its channels that dst never mapped and those that dead ranks
  // left (reclaimDead()). Idempotent; the destructor calls it too.
  void close() override;

 private:
  struct Op {
    bool send = false;
    int peer = -1;
    int64_t tag = 0;
    DataType dtype = DataType::UInt8;
    char* data = nullptr;
    size_t bytes = 0;
    size_t moved = 0;      // bytes posted (send) or copied (recv)
    uint64_t message = 0;  // the channel's number for it, once known
    Clock::time_point deadline;
    State state = State::Pending;
    std::string why;
  };
  // The bytes of a message that arrived before a receive wanted it.
  struct Aside {
    DataType dtype = DataType::UInt8;
    std::vector<char> data;
    size_t arrived = 0;
    uint64_t claimedBy = 0;  // the receive that took it before it all arrived
  };
  // This rank's end of the channel to `peer` (this rank is src).
  struct Out {
    Segment segment;
    ChannelHeader* header = nullptr;
    SlotSender pieces;
    uint64_t nextMessage = 1;
    uint64_t verdictsRead = 0;             // mirrors header->verdictsRead
    std::deque<uint64_t> queue;            // sends not fully posted, in order
    std::map<uint64_t, uint64_t> verdict;  // message -> send awaiting its verdict
    // Verdicts read for messages not fully posted yet: message -> (value, text).
    std::map<uint64_t, std::pair<uint64_t, std::string>> early;
    bool failed = false;
    std::string failure;
  };
  // This rank's end of the channel from `peer` (this rank is dst).
  struct In {
    Segment segment;
    ChannelHeader* header = nullptr;
    Clock::time_point nextLookup{};
    SlotReceiver pieces;
    // The message whose pieces are arriving: into a receive (currentOp),
    // aside (its entry of `aside`), or nowhere (refused).
    uint64_t current = 0;
    uint64_t currentOp = 0;
    std::map<uint64_t, Aside> aside;  // by message
    size_t asideBytes = 0;     // of the messages in `aside`
    // The next message wants no posted receive and does not fit the budget.
    bool stalled = false;
    uint64_t verdictsPosted = 0;  // mirrors header->verdictsPosted
    std::deque<std::pair<uint64_t, std::string>> unsent;  // verdicts not yet written
    size_t pending = 0;        // receives from this peer not finished
    bool failed = false;
    std::string failure;
    uint64_t unmadeSeen = 0;  // the sender's failures to make it that failed receives
  };

  std::string who() const;
  std::string describe(const Op& op) const;

  // Channel ends, made on first use. mu_ held.
  Out& out(int peer);
  In& in(int peer);
  // Bytes of one slot: a piece's header and payload.
  size_t slotStride() const;
  size_t channelBytes() const;
  bool connect(int peer, In& in);

  bool progressOut(int peer, Out& out);
  bool progressIn(int peer, In& in);
  // Matches message (from a piece header) to a receive, or puts it aside.
  void arrive(int peer, In& in, const PieceHeader& piece);
  // `recv` takes `message`, put aside in `in`.
  void takeAside(In& in, uint64_t message, uint64_t recv);
  // Refuses or accepts message m for receive `recvId`; returns whether
  // accepted.
  bool judge(In& in, uint64_t m, uint64_t recvId, DataType dtype, size_t total);
  // Writes what of in.unsent the verdict queue has room for.
  void flushVerdicts(In& in);
  // Whether the unexpected message `piece` starts may be read now: a
  // posted receive (from its sender or from any source) wants it, or it
  // fits the aside budget.
  bool admits(int peer, const In& in, const PieceHeader& piece) const;
  void dropAside(In& in, std::map<uint64_t, Aside>::iterator it);
  // What the sends of `out` learn from the verdict queue.
  bool readVerdicts(Out& out);
  void finish(uint64_t id, Op& op, State state, const std::string& why = "");
  // Fails every pending operation of the channel; tells the peer when
  // `tellPeer` (this side gave up).
  void failOut(int peer, Out& out, const std::string& why, bool tellPeer);
  void failIn(int peer, In& in, const std::string& why, bool tellPeer);
  // Removes the channels that dead ranks made for this rank, or for another
  // dead rank, from /dev/shm (teardown).
  void reclaimDead() noexcept;
  // Fails operations past their deadline. mu_ held.
  void expire(Clock::time_point now);
  // Why a receive from any source cannot complete: the dead senders whose
  // channels hold nothing left to read, each as deadPeer_ says it; "" if
  // none. Fills `deadPeers` (deadPeer_ by rank) as it asks. mu_ held.
  std::string drainedDeadSenders(std::unordered_map<int, std::string>& deadPeers);
  // Fails pending operation `id` with `why`; with its channel (telling the
  // peer) when part of its message moved or the peer is dead, since the
  // channel is then out of step. mu_ held.
  void giveUp(uint64_t id, Op& op, const std::string& why, bool peerDead);
  // What wait() stops on: "" while nothing, else why. A peer of a pending
  // operation of `ids` that gave up (which one in `peer`); the caller's
  // interrupt.
  std::string peerGaveUp(const std::vector<uint64_t>& ids, int* peer);
  // Whether an operation of `ids` with `peer` is still pending.
  bool pendingWith(const std::vector<uint64_t>& ids, int peer);
  std::string interrupted(const std::vector<uint64_t>& ids);
  // Gives up on the pending operations of `ids` with `why`.
  void giveUpOn(const std::vector<uint64_t>& ids, const std::string& why);

  const int rank_;
  const int size_;
  const size_t slotBytes_;
  const int numSlots_;
  const size_t asideBudget_;
  const std::string lane_;
  const std::function<std::string(int, int)> channelName_;
  const std::shared_ptr<Directory> directory_;
  const std::function<std::string(int)> deadPeer_;
  const std::function<std::string(int)> gaveUp_;

  std::mutex mu_;
  uint64_t nextId_ = 1;
  std::unordered_map<uint64_t, Op> ops_;
  std::vector<std::unique_ptr<Out>> outs_;  // by peer, made on first use
  std::vector<uint64_t> unmade_;  // by peer: channels this rank failed to make, so far
  std::vector<std::unique_ptr<In>> ins_;
  // Receives not matched yet (a receive from any source has kAnySource
  // for its Op's peer until then), and the messages put aside, across ins_.
  TagMatcher matcher_;
  Clock::time_point nextExpiry_{};
  bool closed_ = false;
};

// Both lanes of messages (transport.h's Lane) between the ranks of one
// control plane's group, each made on first use: the shm transport's, and
// the fused engine's (backend/fused_engine.h), whose memory runs the same
// control plane. The control plane names the channels (its segment names)
// and says which peers exited or gave up.
class MessageLanes {
 public:
  // `control` (rank `rank` of `worldSize`) outlives the lanes; `options`
  // gives the channels' slots and the user's lane's aside budget.
  MessageLanes(int rank, int worldSize, ControlPlane& control, const GroupOptions& options);
  ~MessageLanes();
  MessageLanes(const MessageLanes&) = delete;
  MessageLanes& operator=(const MessageLanes&) = delete;

  // The lane's link, made by the first call (which must come before any
  // other thread sees these lanes: abort() reads them from any thread).
  MessageLink* messages(std::shared_ptr<Directory> directory, Lane lane);
  // Fails every pending operation of both lanes, with the reason this rank
  // gave up if it did, else its teardown.
  void abort();
  // MessageLink::close() of both lanes.
  void close();

 private:
  // The segment name of `lane`'s channel src -> dst: src's control segment
  // name followed by the lane and dst, so every rank can name it.
  std::string channelName(Lane lane, int src, int dst) const;

  ControlPlane& control_;
  const int rank_;
  const int worldSize_;
  const size_t slotBytes_;
  const int numSlots_;
  const size_t p2pBufferBytes_;
  std::unique_ptr<ShmMessages> user_;
  std::unique_ptr<ShmMessages> collectives_;
};

} // namespace shm
} // namespace pyddp
