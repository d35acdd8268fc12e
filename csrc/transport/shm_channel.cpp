#include "transport/shm_channel.h"

#include <algorithm>
#include <cstring>
#include <iomanip>
#include <limits>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "common/blob.h"
#include "common/check.h"
#include "common/interrupt.h"
#include "transport/wait_policy.h"

namespace pyddp {
namespace shm {
namespace {

// How often a receiver whose sender has not made the channel yet asks the
// directory (a store round trip) for it.
constexpr auto kLookupPeriod = std::chrono::milliseconds(1);

// The key of a channel's directory entry that says why its sender could not
// make it, in place of the channel's geometry.
constexpr char kUnmadeKey[] = "unmade";
constexpr char kUnmadeCountKey[] = "unmade_count";  // the sender's failures so far

std::string channelKey(const std::string& lane, int src, int dst) {
  return lane + "/" + std::to_string(src) + "-" + std::to_string(dst);
}

void writeText(char* to, size_t capacity, const std::string& text) {
  const size_t n = std::min(text.size(), capacity - 1);
  std::memcpy(to, text.data(), n);
  to[n] = '\0';
}

// An empty message's pointers may be null (an empty tensor's data_ptr()),
// which memcpy must not be given even for 0 bytes.
void copyBytes(void* to, const void* from, size_t n) {
  if (n > 0) std::memcpy(to, from, n);
}

std::string readText(const char* from, size_t capacity) {
  return std::string(from, strnlen(from, capacity));
}

} // namespace

ShmMessages::ShmMessages(int rank, int size, size_t slotBytes, int numSlots,
                         size_t asideBudget, std::string lane,
                         std::function<std::string(int src, int dst)> channelName,
                         std::shared_ptr<Directory> directory,
                         std::function<std::string(int peer)> deadPeer,
                         std::function<std::string(int peer)> gaveUp)
    : rank_(rank),
      size_(size),
      slotBytes_(slotBytes),
      numSlots_(numSlots),
      asideBudget_(asideBudget),
      lane_(std::move(lane)),
      channelName_(std::move(channelName)),
      directory_(std::move(directory)),
      deadPeer_(std::move(deadPeer)),
      gaveUp_(std::move(gaveUp)),
      outs_(size),
      unmade_(size),
      ins_(size) {}

ShmMessages::~ShmMessages() {
  close();
}

void ShmMessages::close() {
  abort(teardownReason(rank_, ""));
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  for (auto& out : outs_) {
    if (out) out->segment.unlink();  // dst never mapped it: nobody else will
  }
  reclaimDead();
}

void ShmMessages::reclaimDead() noexcept {
  // Best effort, at teardown: no memory to build a name with leaves the
  // rest to the other survivors.
  try {
    std::vector<bool> dead(size_);
    for (int p = 0; p < size_; ++p) dead[p] = p != rank_ && !deadPeer_(p).empty();
    for (int src = 0; src < size_; ++src) {
      if (!dead[src]) continue;
      for (int dst = 0; dst < size_; ++dst) {
        // A live dst other than this rank may still map it, to read what src
        // posted before it died; it reclaims it at its own teardown.
        if (dst == src || (dst != rank_ && !dead[dst])) continue;
        Segment::remove(channelName_(src, dst));
      }
    }
  } catch (...) {
  }
}

std::string ShmMessages::who() const {
  return "rank " + std::to_string(rank_);
}

std::string ShmMessages::describe(const Op& op) const {
  const std::string peer = op.peer == kAnySource ? "any rank" : "rank " + std::to_string(op.peer);
  return std::string(op.send ? "send to " : "recv from ") + peer +
      " (tag " + std::to_string(op.tag) + ", " + std::to_string(op.bytes) + " bytes of " +
      toString(op.dtype) + ")";
}

ShmMessages::Out& ShmMessages::out(int peer) {
  if (outs_[peer]) return *outs_[peer];
  auto o = std::make_unique<Out>();
  const size_t bytes = channelBytes();
  // Every peer can name it: if this rank dies before dst mapped (and
  // unlinked) it, a survivor removes it (reclaimDead()).
  try {
    o->segment = Segment::create(channelName_(rank_, peer), bytes, who());
  } catch (const std::exception& e) {
    // dst's receives from this rank would wait for a channel that is not
    // coming (/dev/shm full): they fail with the reason (connect()). Each
    // failure is numbered, so that dst fails the receives it has posted
    // once per failure, not every receive until a send makes the channel.
    try {
      directory_->publish(channelKey(lane_, rank_, peer),
                          BlobWriter()
                              .put(kUnmadeKey, bare(messageOf(e)))
                              .put(kUnmadeCountKey, ++unmade_[peer])
                              .str());
    } catch (const std::exception&) {
      // The store is gone too: dst's receives time out instead.
    }
    throw;
  }
  auto* h = new (o->segment.base()) ChannelHeader{};
  h->magic = kChannelMagic;
  h->layoutVersion = kChannelLayoutVersion;
  h->src = rank_;
  h->dst = peer;
  h->numSlots = numSlots_;
  h->slotBytes = slotBytes_;
  o->header = h;
  o->pieces = SlotSender(static_cast<char*>(o->segment.base()) + sizeof(ChannelHeader),
                         slotStride(), numSlots_, &h->posted, &h->consumed);
  try {
    directory_->publish(channelKey(lane_, rank_, peer), BlobWriter()
                                                            .put("bytes", bytes)
                                                     .put("slot_bytes", slotBytes_)
                                                     .put("num_slots", numSlots_)
                                                     .str());
  } catch (...) {
    o->segment.unlink();  // never announced: nobody will map it
    throw;
  }
  outs_[peer] = std::move(o);
  return *outs_[peer];
}

size_t ShmMessages::slotStride() const {
  return sizeof(PieceHeader) + slotBytes_;
}

size_t ShmMessages::channelBytes() const {
  return sizeof(ChannelHeader) + static_cast<size_t>(numSlots_) * slotStride();
}

ShmMessages::In& ShmMessages::in(int peer) {
  if (!ins_[peer]) ins_[peer] = std::make_unique<In>();
  return *ins_[peer];
}

bool ShmMessages::connect(int peer, In& in) {
  const auto now = Clock::now();
  if (now < in.nextLookup) return false;
  in.nextLookup = now + kLookupPeriod;
  const std::string what = "rank " + std::to_string(peer) + "'s channel to " + who();
  // A dead sender's channel is looked for by its name alone: the store may
  // have died with it (it hosted it), and what it posted before it died is
  // still good. A channel it never made, or did not finish making, fails
  // the receives with its death.
  const std::string dead = deadPeer_(peer);
  if (dead.empty()) {
    const auto blob = directory_->lookup(channelKey(lane_, peer, rank_));
    if (!blob) return false;
    const BlobReader r(*blob, what);
    if (r.has(kUnmadeKey)) {
      // The sender could not make it, so the messages of its failed sends
      // will not come: the receives posted now fail, once per failure. The
      // channel stays unmapped, for a later send that makes it.
      const auto count = r.get<uint64_t>(kUnmadeCountKey);
      if (count <= in.unmadeSeen) return false;
      in.unmadeSeen = count;
      for (auto& [id, op] : ops_) {
        if (!op.send && op.peer == peer) {
          finish(id, op, State::Failed, who() + ": " + describe(op) + " cannot complete: rank " +
                     std::to_string(peer) + " could not make its channel to this rank: " +
                     r.str(kUnmadeKey));
        }
      }
      return false;
    }
    const auto bytes = r.get<size_t>("bytes");
    const auto slotBytes = r.get<size_t>("slot_bytes");
    const auto numSlots = r.get<int>("num_slots");
    PYDDP_CHECK(slotBytes == slotBytes_ && numSlots == numSlots_ && bytes == channelBytes(),
                who(), ": ", what, " has another geometry (", bytes, " bytes, ", numSlots,
                " slots of ", slotBytes, " bytes): set PYDDP_SLOT_BYTES and PYDDP_NUM_SLOTS "
                "alike on all ranks");
  }
  const auto unmade = [&] {
    return std::runtime_error(who() + ": receives from rank " + std::to_string(peer) +
                              " cannot complete: " + dead +
                              " before it made its channel to this rank");
  };
  try {
    in.segment = Segment::open(channelName_(peer, rank_), channelBytes(), /*writable=*/true,
                               who(), "rank " + std::to_string(peer) + "'s channel");
  } catch (const std::exception&) {
    if (!dead.empty()) throw unmade();
    throw;
  }
  Segment::remove(in.segment.name());  // both ends have it mapped now
  auto* h = static_cast<ChannelHeader*>(in.segment.base());
  const bool whole = h->magic == kChannelMagic && h->layoutVersion == kChannelLayoutVersion &&
      h->src == peer && h->dst == rank_ && h->numSlots == numSlots_ &&
      h->slotBytes == slotBytes_;
  if (!whole && !dead.empty()) throw unmade();
  PYDDP_CHECK(whole, who(), ": ", what, " has an unexpected layout (different pyddp versions?)");
  in.header = h;
  in.pieces = SlotReceiver(static_cast<const char*>(in.segment.base()) + sizeof(ChannelHeader),
                           slotStride(), numSlots_, &h->posted, &h->consumed);
  return true;
}

uint64_t ShmMessages::postSend(int peer, int64_t tag, DataType dtype, const void* data,
                               size_t bytes, Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  // The channel first: making it may throw (the store, /dev/shm), and an
  // operation must not be left behind without its channel.
  Out& o = out(peer);
  const uint64_t id = nextId_++;
  Op& op = ops_[id];
  op = Op{true, peer, tag, dtype, static_cast<char*>(const_cast<void*>(data)), bytes};
  op.deadline = deadline;
  if (o.failed) {
    finish(id, op, State::Failed, o.failure);
  } else {
    o.queue.push_back(id);
  }
  return id;
}

uint64_t ShmMessages::postRecv(int peer, int64_t tag, DataType dtype, void* data, size_t bytes,
                               Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = nextId_++;
  Op& op = ops_[id];
  op = Op{false, peer, tag, dtype, static_cast<char*>(data), bytes};
  op.deadline = deadline;
  if (peer == kAnySource) {
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) in(p);  // progressIn() reads every channel from now on
    }
  } else {
    In& i = in(peer);
    ++i.pending;
    if (i.failed) {
      finish(id, op, State::Failed, i.failure);
      return id;
    }
  }
  const auto taken = matcher_.post(id, peer, tag);
  if (!taken) return id;
  In& from = *ins_[taken->peer];
  if (peer == kAnySource) {
    op.peer = taken->peer;
    ++from.pending;
  }
  takeAside(from, taken->message, id);
  return id;
}

int ShmMessages::sourceOf(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = ops_.find(id);
  PYDDP_CHECK(it != ops_.end(), who(), ": no message operation #", id);
  return it->second.send ? kAnySource : it->second.peer;
}

void ShmMessages::finish(uint64_t id, Op& op, State state, const std::string& why) {
  if (op.state != State::Pending) return;
  op.state = state;
  op.why = why;
  if (op.send) return;
  matcher_.withdraw(id);
  if (op.peer != kAnySource) {
    In& i = *ins_[op.peer];
    --i.pending;
    if (i.currentOp == id) i.currentOp = 0;
  }
}

bool ShmMessages::judge(In& in, uint64_t m, uint64_t recvId, DataType dtype, size_t total) {
  Op& recv = ops_.at(recvId);
  recv.message = m;
  if (recv.dtype == dtype && recv.bytes == total) {
    in.unsent.emplace_back(2 * m, "");
    flushVerdicts(in);
    return true;
  }
  const std::string why = who() + ": " + describe(recv) + " does not match what rank " +
      std::to_string(recv.peer) + " sent (" + std::to_string(total) + " bytes of " +
      toString(dtype) + "); a send and its recv must agree on size and dtype";
  in.unsent.emplace_back(2 * m + 1, why);
  flushVerdicts(in);
  finish(recvId, recv, State::Failed, why);
  return false;
}

void ShmMessages::flushVerdicts(In& in) {
  ChannelHeader* h = in.header;
  while (!in.unsent.empty() &&
         in.verdictsPosted <
             h->verdictsRead.value.load(std::memory_order_acquire) + kVerdictRing) {
    Verdict& v = h->verdicts[in.verdictsPosted % kVerdictRing];
    v.value = in.unsent.front().first;
    writeText(v.text, kVerdictTextBytes, in.unsent.front().second);
    h->verdictsPosted.value.store(++in.verdictsPosted, std::memory_order_release);
    in.unsent.pop_front();
  }
}

bool ShmMessages::admits(int peer, const In& in, const PieceHeader& piece) const {
  return matcher_.wanted(peer, piece.tag) || in.asideBytes + piece.total <= asideBudget_;
}

void ShmMessages::dropAside(In& in, std::map<uint64_t, Aside>::iterator it) {
  in.asideBytes -= it->second.data.size();
  in.aside.erase(it);
}

bool ShmMessages::readVerdicts(Out& o) {
  ChannelHeader* h = o.header;
  const uint64_t posted = h->verdictsPosted.value.load(std::memory_order_acquire);
  if (posted == o.verdictsRead) return false;
  for (; o.verdictsRead < posted; ++o.verdictsRead) {
    const Verdict& v = h->verdicts[o.verdictsRead % kVerdictRing];
    const uint64_t m = v.value / 2;
    std::string text = v.value % 2 == 1 ? readText(v.text, kVerdictTextBytes) : "";
    const auto it = o.verdict.find(m);
    if (it == o.verdict.end()) {
      o.early.emplace(m, std::make_pair(v.value, std::move(text)));
      continue;
    }
    Op& op = ops_.at(it->second);
    if (v.value % 2 == 0) {
      finish(it->second, op, State::Done);
    } else {
      finish(it->second, op, State::Failed, text);
    }
    o.verdict.erase(it);
  }
  h->verdictsRead.value.store(o.verdictsRead, std::memory_order_release);
  return true;
}

void ShmMessages::takeAside(In& in, uint64_t message, uint64_t recvId) {
  const auto it = in.aside.find(message);
  Aside& a = it->second;
  Op& recv = ops_.at(recvId);
  const bool accepted = judge(in, message, recvId, a.dtype, a.data.size());
  if (accepted && a.arrived < a.data.size()) {
    a.claimedBy = recvId;
    return;
  }
  if (accepted) {
    copyBytes(recv.data, a.data.data(), a.data.size());
    recv.moved = a.data.size();
    finish(recvId, recv, State::Done);
  }
  dropAside(in, it);  // refused: the rest of its pieces are dropped
}

void ShmMessages::arrive(int peer, In& in, const PieceHeader& piece) {
  in.current = piece.message;
  in.currentOp = 0;
  const DataType dtype = static_cast<DataType>(piece.dtype);
  const auto recvId = matcher_.arrive(peer, piece.message, piece.tag);
  if (!recvId) {
    Aside& a = in.aside[piece.message];
    a.dtype = dtype;
    a.data.resize(piece.total);
    in.asideBytes += piece.total;
    return;
  }
  Op& recv = ops_.at(*recvId);
  if (recv.peer == kAnySource) {
    recv.peer = peer;
    ++in.pending;
  }
  if (judge(in, piece.message, *recvId, dtype, piece.total)) in.currentOp = *recvId;
}

bool ShmMessages::progressOut(int peer, Out& o) {
  if (o.failed) return false;
  ChannelHeader* h = o.header;
  bool moved = false;
  // Verdicts first: a receiver that took a message and then gave up on the
  // channel (its group was destroyed) did take that message.
  const bool dstFailed = h->dstFailed.value.load(std::memory_order_acquire) != 0;
  moved |= readVerdicts(o);
  if (dstFailed) {
    failOut(peer, o, readText(h->dstFailureText, kChannelFailureTextBytes), false);
    return true;
  }
  // pieces of the queued sends, in order
  while (!o.queue.empty()) {
    const uint64_t id = o.queue.front();
    Op& op = ops_.at(id);
    if (op.message == 0) {
      op.message = o.nextMessage++;
    } else {
      // Refused after its first piece: the receiver drops the rest, and
      // moves on at the next message's first piece.
      const auto early = o.early.find(op.message);
      if (early != o.early.end() && early->second.first % 2 == 1) {
        finish(id, op, State::Failed, early->second.second);
        o.early.erase(early);
        o.queue.pop_front();
        moved = true;
        continue;
      }
    }
    if (!o.pieces.canSend()) break;
    char* s = o.pieces.slot();
    const size_t n = std::min(slotBytes_, op.bytes - op.moved);
    *reinterpret_cast<PieceHeader*>(s) =
        PieceHeader{op.message, op.moved, n, op.bytes, op.tag, static_cast<int32_t>(op.dtype)};
    copyBytes(s + sizeof(PieceHeader), op.data + op.moved, n);
    op.moved += n;
    o.pieces.post();
    moved = true;
    if (op.moved == op.bytes) {
      o.queue.pop_front();
      const auto early = o.early.find(op.message);
      if (early == o.early.end()) {
        o.verdict.emplace(op.message, id);
      } else if (early->second.first % 2 == 0) {
        finish(id, op, State::Done);
        o.early.erase(early);
      } else {
        finish(id, op, State::Failed, early->second.second);
        o.early.erase(early);
      }
    }
  }
  return moved;
}

bool ShmMessages::progressIn(int peer, In& in) {
  if (in.failed || (in.pending == 0 && !matcher_.anyWaiting() && in.unsent.empty())) {
    return false;
  }
  if (!in.header) {
    // A channel that cannot be mapped (its sender unlinked it at teardown,
    // the store failed, or a forged value) fails its receives, not the
    // thread that drives progress.
    bool connected = false;
    try {
      connected = connect(peer, in);
    } catch (const std::exception& e) {
      failIn(peer, in, bare(messageOf(e)), false);
      return true;
    }
    if (!connected) return false;
  }
  ChannelHeader* h = in.header;
  // Pieces posted before the sender gave up are still good: read them
  // first.
  const bool srcFailed = h->srcFailed.value.load(std::memory_order_acquire) != 0;
  if (srcFailed) {
    in.unsent.clear();  // nobody reads them
  } else {
    flushVerdicts(in);
  }
  bool moved = false;
  in.stalled = false;
  while ((in.pending > 0 || matcher_.anyWaiting()) && in.pieces.canReceive()) {
    const char* s = in.pieces.slot();
    const PieceHeader piece = *reinterpret_cast<const PieceHeader*>(s);
    if (piece.message != in.current) {
      if (!admits(peer, in, piece)) {
        in.stalled = true;
        break;
      }
      arrive(peer, in, piece);
    }
    const char* payload = s + sizeof(PieceHeader);
    if (in.currentOp != 0) {
      Op& recv = ops_.at(in.currentOp);
      copyBytes(recv.data + piece.offset, payload, piece.bytes);
      recv.moved += piece.bytes;
      if (recv.moved == recv.bytes) finish(in.currentOp, recv, State::Done);
    } else if (const auto it = in.aside.find(in.current); it != in.aside.end()) {
      Aside& a = it->second;
      copyBytes(a.data.data() + piece.offset, payload, piece.bytes);
      a.arrived += piece.bytes;
      if (a.arrived == a.data.size() && a.claimedBy != 0) {
        Op& recv = ops_.at(a.claimedBy);
        copyBytes(recv.data, a.data.data(), a.data.size());
        recv.moved = a.data.size();
        finish(a.claimedBy, recv, State::Done);
        dropAside(in, it);
      }
    }
    in.pieces.release();
    moved = true;
  }
  if (srcFailed && in.pending > 0) {
    failIn(peer, in, readText(h->srcFailureText, kChannelFailureTextBytes), false);
    return true;
  }
  return moved;
}

void ShmMessages::failOut(int peer, Out& o, const std::string& why, bool tellPeer) {
  if (o.failed) return;
  o.failed = true;
  o.failure = why;
  if (tellPeer && o.header) {
    writeText(o.header->srcFailureText, kChannelFailureTextBytes, why);
    o.header->srcFailed.value.store(1, std::memory_order_release);
  }
  for (auto& [id, op] : ops_) {
    if (op.send && op.peer == peer) finish(id, op, State::Failed, why);
  }
  o.queue.clear();
  o.verdict.clear();
  o.early.clear();
}

void ShmMessages::failIn(int peer, In& in, const std::string& why, bool tellPeer) {
  if (in.failed) return;
  in.failed = true;
  in.failure = why;
  if (tellPeer && in.header) {
    writeText(in.header->dstFailureText, kChannelFailureTextBytes, why);
    in.header->dstFailed.value.store(1, std::memory_order_release);
  }
  for (auto& [id, op] : ops_) {
    if (!op.send && op.peer == peer) finish(id, op, State::Failed, why);
  }
  matcher_.dropPeer(peer);
  in.aside.clear();
  in.asideBytes = 0;
  in.unsent.clear();
}

void ShmMessages::expire(Clock::time_point now) {
  std::unordered_map<int, std::string> deadPeers;  // each peer looked at once
  for (int peer = 0; peer < size_; ++peer) {
    In* i = ins_[peer].get();
    if (!i || i->unsent.empty()) continue;
    deadPeers[peer] = deadPeer_(peer);
    if (!deadPeers[peer].empty()) i->unsent.clear();  // nobody reads them
  }
  // A receive from any source fails once a sender it may have waited for
  // is dead and nothing it posted is left to read: the message may have
  // been that rank's, as a named receive from it would fail now too.
  std::optional<std::string> deadSenders;
  for (auto& [id, op] : ops_) {
    if (op.state != State::Pending) continue;
    if (op.peer == kAnySource) {
      if (!deadSenders) deadSenders = drainedDeadSenders(deadPeers);
      if (!deadSenders->empty()) {
        finish(id, op, State::Failed, who() + ": " + describe(op) + " cannot complete: " +
               *deadSenders);
      } else if (now >= op.deadline) {
        finish(id, op, State::Failed, who() + ": " + describe(op) + " did not complete within "
               "its timeout: no rank sent a message with its tag");
      }
      continue;
    }
    if (!deadPeers.count(op.peer)) deadPeers[op.peer] = deadPeer_(op.peer);
    const std::string& dead = deadPeers[op.peer];
    const bool late = now >= op.deadline;
    if (op.send) {
      // A send whose receiver died cannot get its verdict.
      if (!late && dead.empty()) continue;
    } else {
      // A receive may still take what its sender posted before it died.
      const In& i = *ins_[op.peer];
      const bool drained = !i.header || !i.pieces.canReceive();
      if (!late && (dead.empty() || !drained)) continue;
    }
    std::string cause = dead;
    if (cause.empty() && op.send) {
      cause = "rank " + std::to_string(op.peer) + " has not received it";
    } else if (cause.empty() && ins_[op.peer]->stalled) {
      const In& i = *ins_[op.peer];
      cause = "rank " + std::to_string(op.peer) + " sent messages ahead of it that no " +
          "receive was posted for, and they fill this rank's buffer for unexpected messages (" +
          std::to_string(i.asideBytes) + " bytes held, the limit is " +
          std::to_string(asideBudget_) + ", PYDDP_P2P_BUFFER_BYTES): post their receives "
          "first, or raise the limit";
    } else if (cause.empty()) {
      cause = "rank " + std::to_string(op.peer) + " has not sent it";
    }
    const std::string why = who() + ": " + describe(op) +
        (late ? " did not complete within its timeout: " : " cannot complete: ") + cause;
    giveUp(id, op, why, !dead.empty());
  }
}

std::string ShmMessages::drainedDeadSenders(std::unordered_map<int, std::string>& deadPeers) {
  std::string dead;
  int count = 0;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    if (!deadPeers.count(peer)) deadPeers[peer] = deadPeer_(peer);
    if (deadPeers[peer].empty()) continue;
    // Still to read: a channel not looked up yet, or pieces posted and unread.
    const In* i = ins_[peer].get();
    const bool drained = !i || i->failed || (i->header && !i->pieces.canReceive());
    if (!drained) continue;
    dead += (dead.empty() ? "" : "; ") + deadPeers[peer];
    ++count;
  }
  if (count == 0) return "";
  return dead + (count == 1 ? "; the message may have been that rank's"
                             : "; the message may have been one of theirs") +
      (count == size_ - 1 ? ", and no live rank is left to send it" : "");
}

void ShmMessages::giveUp(uint64_t id, Op& op, const std::string& why, bool peerDead) {
  // Half a message in the channel leaves it out of step: the peer must
  // learn, and the channel is done.
  if (op.peer == kAnySource) {
    finish(id, op, State::Failed, why);  // nothing moved yet
  } else if (op.send) {
    Out& o = *outs_[op.peer];
    if (op.message != 0 || peerDead) {
      failOut(op.peer, o, why, true);
      // A dead receiver never maps the channel: its name goes now, as this
      // rank may fail on and never reach its teardown.
      if (peerDead) o.segment.unlink();
    } else {
      o.queue.erase(std::find(o.queue.begin(), o.queue.end(), id));
      finish(id, op, State::Failed, why);
    }
  } else {
    In& i = *ins_[op.peer];
    if (op.message != 0 || peerDead) {
      failIn(op.peer, i, why, true);
    } else {
      finish(id, op, State::Failed, why);
    }
  }
}

std::string ShmMessages::peerGaveUp(const std::vector<uint64_t>& ids, int* peer) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t id : ids) {
    const auto it = ops_.find(id);
    if (it == ops_.end() || it->second.state != State::Pending ||
        it->second.peer == kAnySource) {
      continue;
    }
    std::string why = gaveUp_(it->second.peer);
    if (why.empty()) continue;
    *peer = it->second.peer;
    return who() + ": " + describe(it->second) + " cannot complete: " + why;
  }
  return "";
}

bool ShmMessages::pendingWith(const std::vector<uint64_t>& ids, int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t id : ids) {
    const auto it = ops_.find(id);
    if (it != ops_.end() && it->second.state == State::Pending && it->second.peer == peer) {
      return true;
    }
  }
  return false;
}

std::string ShmMessages::interrupted(const std::vector<uint64_t>& ids) {
  if (!interruptRequested()) return "";
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t id : ids) {
    const auto it = ops_.find(id);
    if (it != ops_.end() && it->second.state == State::Pending) {
      return who() + ": interrupted while waiting for " + describe(it->second);
    }
  }
  return "";
}

void ShmMessages::giveUpOn(const std::vector<uint64_t>& ids, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  for (uint64_t id : ids) {
    const auto it = ops_.find(id);
    if (it != ops_.end() && it->second.state == State::Pending) {
      giveUp(id, it->second, why, false);
    }
  }
}

bool ShmMessages::busy() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& i : ins_) {
    if (i && !i->unsent.empty()) return true;
  }
  return false;
}

void ShmMessages::cancel(uint64_t id, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = ops_.find(id);
  if (it != ops_.end() && it->second.state == State::Pending) {
    giveUp(id, it->second, why, false);
  }
}

bool ShmMessages::progress() {
  std::lock_guard<std::mutex> lock(mu_);
  bool moved = false;
  for (int peer = 0; peer < size_; ++peer) {
    if (outs_[peer]) moved |= progressOut(peer, *outs_[peer]);
    if (ins_[peer]) moved |= progressIn(peer, *ins_[peer]);
  }
  const auto now = Clock::now();
  if (now >= nextExpiry_) {
    expire(now);
    nextExpiry_ = now + Backoff::kCheckPeriod;
  }
  return moved;
}

MessageLink::State ShmMessages::poll(uint64_t id, std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = ops_.find(id);
  PYDDP_CHECK(it != ops_.end(), who(), ": no message operation #", id);
  if (why) *why = it->second.why;
  return it->second.state;
}

void ShmMessages::release(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = ops_.find(id);
  if (it != ops_.end() && it->second.state != State::Pending) ops_.erase(it);
}

void ShmMessages::wait(const std::vector<uint64_t>& ids) {
  Backoff backoff;
  bool lookAtPeers = false;
  while (true) {
    // A peer's give-up is read before moving what can move: what it did
    // before giving up (a verdict, the last piece) is then seen first.
    int quitter = -1;
    const std::string gaveUp = lookAtPeers ? peerGaveUp(ids, &quitter) : "";
    const bool moved = progress();
    std::string failure;
    bool pending = false;
    for (uint64_t id : ids) {
      std::string why;
      const State state = poll(id, &why);
      pending |= state == State::Pending;
      if (state == State::Failed && failure.empty()) failure = why;
    }
    if (failure.empty() && pending) {
      // The peer's give-up counts only while an operation with it is still
      // pending: progress() may have finished them all (it gave up after
      // its part, e.g. by destroying its group), and the operations left
      // with other peers go on.
      failure = !gaveUp.empty() && pendingWith(ids, quitter) ? gaveUp : interrupted(ids);
      // The collective is abandoned: its operations half done fail their
      // channels, so the peers waiting on them learn at once.
      if (!failure.empty()) giveUpOn(ids, failure);
    }
    // Verdicts this rank owes are the peers' pending sends: they are written
    // before it returns, unless it is interrupted.
    if (failure.empty() && !pending && busy() && !interruptRequested()) {
      if (moved) {
        backoff.restart();
      } else {
        backoff.pause();
      }
      continue;
    }
    if (!failure.empty() || !pending) {
      for (uint64_t id : ids) {
        if (poll(id, nullptr) != State::Pending) release(id);
      }
      PYDDP_CHECK_COMM(failure.empty(), failure);
      return;
    }
    if (moved) {
      backoff.restart();
      lookAtPeers = false;
    } else {
      lookAtPeers = backoff.pause();
    }
  }
}

void ShmMessages::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int peer = 0; peer < size_; ++peer) {
    if (outs_[peer]) failOut(peer, *outs_[peer], why, true);
    if (ins_[peer]) failIn(peer, *ins_[peer], why, true);
  }
  // What is left pending is the receives from any source not matched yet.
  for (auto& [id, op] : ops_) {
    if (!op.send && op.peer == kAnySource) finish(id, op, State::Failed, why);
  }
}

MessageLanes::MessageLanes(int rank, int worldSize, ControlPlane& control,
                           const GroupOptions& options)
    : control_(control),
      rank_(rank),
      worldSize_(worldSize),
      slotBytes_(options.slotBytes),
      numSlots_(options.numSlots),
      p2pBufferBytes_(options.p2pBufferBytes) {}

MessageLanes::~MessageLanes() {
  // The channels first: their teardown asks the control plane about peers.
  user_.reset();
  collectives_.reset();
}

std::string MessageLanes::channelName(Lane lane, int src, int dst) const {
  std::ostringstream name;
  name << control_.segmentName(src) << (lane == Lane::User ? '1' : '2') << std::hex
       << std::setw(8) << std::setfill('0') << dst;
  return name.str();
}

MessageLink* MessageLanes::messages(std::shared_ptr<Directory> directory, Lane lane) {
  auto& messages = lane == Lane::User ? user_ : collectives_;
  if (!messages) {
    // The collectives' messages are bounded by their algorithms; only the
    // user's may wait unreceived without end.
    messages = std::make_unique<ShmMessages>(
        rank_, worldSize_, slotBytes_, numSlots_,
        lane == Lane::User ? p2pBufferBytes_ : std::numeric_limits<size_t>::max(),
        lane == Lane::User ? "p2p" : "coll",
        [this, lane](int src, int dst) { return channelName(lane, src, dst); },
        std::move(directory),
        [this](int peer) {
          return control_.peerAlive(peer) ? std::string()
                                          : "rank " + std::to_string(peer) + " (pid " +
                  std::to_string(control_.pid(peer)) + ") exited";
        },
        [this](int peer) {
          const std::string why = control_.peerFailure(peer);
          if (why.empty()) return why;
          return "rank " + std::to_string(peer) + " gave up on collective #" +
              std::to_string(control_.failedIn(peer)) + ": " + why;
        });
  }
  return messages.get();
}

void MessageLanes::abort() {
  const std::string mine = control_.ownFailure();
  const std::string why = mine.empty() ? teardownReason(rank_, control_.deadPeer()) : mine;
  if (user_) user_->abort(why);
  if (collectives_) collectives_->abort(why);
}

void MessageLanes::close() {
  if (user_) user_->close();
  if (collectives_) collectives_->close();
}

} // namespace shm
} // namespace pyddp
