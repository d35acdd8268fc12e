#include "transport/shm_control.h"

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <new>
#include <sstream>

#include "common/check.h"
#include "common/host.h"

namespace pyddp {
namespace shm {

ControlPlane::ControlPlane(int rank, int worldSize, size_t dataBytes)
    : rank_(rank),
      worldSize_(worldSize),
      dataBytes_(dataBytes),
      hostId_(hostId()),
      pidNamespace_(pidNamespace()),
      spinPhase_(Backoff::spinPhaseFor(worldSize)),
      peers_(worldSize) {}

ControlPlane::~ControlPlane() {
  peers_[rank_].segment.unlink();
}

std::string ControlPlane::reserve() {
  peers_[rank_].name = newSegmentName();
  return peers_[rank_].name;
}

void ControlPlane::reclaim(const std::string& reservation) {
  Segment::remove(reservation);
}

void ControlPlane::setup(BlobWriter& blob) {
  Peer& self = peers_[rank_];
  if (self.name.empty()) reserve();
  self.segment = Segment::create(self.name, segmentBytes(), "rank " + std::to_string(rank_));
  auto* h = new (self.segment.base()) ControlHeader{};
  h->magic = kControlMagic;
  h->layoutVersion = kControlLayoutVersion;
  h->rank = rank_;
  h->pid = static_cast<int32_t>(getpid());
  h->dataBytes = dataBytes_;
  own_ = Own{h, static_cast<char*>(self.segment.base()) + sizeof(ControlHeader)};
  self.header = h;
  self.data = own_.data;
  self.pid = h->pid;
  self.pidVisible = true;
  blob.put("layout", kControlLayoutVersion)
      .put("segment", self.name)
      .put("host", hostId_)
      .put("pid_namespace", pidNamespace_)
      .put("pid", self.pid)
      .put("bytes", segmentBytes());
}

std::string ControlPlane::whyNotConnect(int peer, const BlobReader& blob) const {
  // The layout first: a peer of another version may lack the fields below.
  const std::string layout = blob.has("layout") ? blob.str("layout") : "none";
  PYDDP_CHECK(layout == std::to_string(kControlLayoutVersion), "rank ", peer,
              "'s shm bootstrap blob has layout ", layout, ", this rank's ",
              kControlLayoutVersion,
              " (different pyddp versions, or a corrupted or forged store value?)");
  const std::string& host = blob.str("host");
  if (host != hostId_) {
    return "rank " + std::to_string(peer) + " runs on another host (" + host + ", this is " +
        hostId_ + ")";
  }
  return "";
}

void ControlPlane::connect(const std::vector<BlobReader>& blobs) {
  PYDDP_CHECK(static_cast<int>(blobs.size()) == worldSize_, "expected ", worldSize_,
              " bootstrap blobs, got ", blobs.size());
  const std::string who = "rank " + std::to_string(rank_);
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const std::string why = whyNotConnect(peer, blobs[peer]);
    PYDDP_CHECK(why.empty(), who, ": shm transport cannot reach ", why);
  }
  // Store values are not trusted: the segment is mapped with the size this
  // rank computes, and only once the file proves it is a peer's segment of
  // that size (a smaller one would be read past its end).
  const size_t bytes = segmentBytes();
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const BlobReader& b = blobs[peer];
    Peer& p = peers_[peer];
    p.name = b.str("segment");
    p.pid = b.get<int>("pid");
    p.pidVisible = b.str("pid_namespace") == pidNamespace_;
    const auto said = b.get<size_t>("bytes");
    PYDDP_CHECK(said == bytes, who, ": rank ", peer, "'s shm blob says its segment has ", said,
                " bytes, but its geometry makes ", bytes,
                " (a corrupted or forged store value?)");
    const std::string owner = "rank " + std::to_string(peer) + "'s";
    p.segment = Segment::open(p.name, bytes, /*writable=*/false, who, owner);
    p.header = static_cast<const ControlHeader*>(p.segment.base());
    p.data = static_cast<char*>(p.segment.base()) + sizeof(ControlHeader);
    const ControlHeader& h = *p.header;
    PYDDP_CHECK(h.magic == kControlMagic && h.layoutVersion == kControlLayoutVersion, who, ": ",
                owner, " shm segment has an unexpected layout (different pyddp versions, or a "
                "corrupted or forged store value?)");
    PYDDP_CHECK(h.rank == peer && h.pid == p.pid && h.dataBytes == dataBytes_, who,
                ": the shm segment ", p.name, " named by ", owner, " blob is rank ", h.rank,
                "'s (pid ", h.pid, ", ", h.dataBytes, " bytes of data), not rank ", peer,
                "'s (pid ", p.pid, ") of this geometry (a corrupted or forged store value?)");
  }
}

void ControlPlane::connected() {
  peers_[rank_].segment.unlink();
}

std::string ControlPlane::deadPeer() const {
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer != rank_ && !peerAlive(peer)) {
      return "rank " + std::to_string(peer) + " (pid " + std::to_string(peers_[peer].pid) +
             ") exited";
    }
  }
  return "";
}

bool ControlPlane::peerAlive(int rank) const {
  const Peer& p = peers_[rank];
  return !p.pidVisible || processAlive(p.pid);
}

std::string ControlPlane::currentCall() const {
  return std::string(toString(current_.kind)) + " #" + std::to_string(current_.seq);
}

std::string ControlPlane::ownFailure() const {
  return own_.header ? peerFailure(rank_) : "";
}

std::string ControlPlane::peerFailure(int peer) const {
  const ControlHeader& h = header(peer);
  if (h.failed.value.load(std::memory_order_acquire) == 0) return "";
  return std::string(h.failureText, strnlen(h.failureText, kFailureTextBytes));
}

void ControlPlane::failIfStuck(int peer, bool peerWasAlive, Clock::time_point now) const {
  const std::string call = currentCall();
  if (aborted_.load(std::memory_order_relaxed)) {
    // Given up first (interrupted): that is the reason, not the abort.
    const std::string mine = ownFailure();
    PYDDP_CHECK_COMM(mine.empty(), mine);
    PYDDP_CHECK_COMM(false, "rank ", rank_, ": the process group was destroyed while ", call,
                     " waited for rank ", peer);
  }
  failIfGaveUp(peer, std::numeric_limits<uint64_t>::max());
  // A rank other than the one waited for that gave up in this collective
  // (abort() gives up in the newest one it entered, done or not) or an
  // earlier one will not finish it either: a waiter learns of it at its next
  // look, not when the failure has travelled around the ring or at the
  // deadline. One that left after this collective (failed > seq) has done
  // its part of it.
  for (int k = 0; k < worldSize_; ++k) {
    if (k != rank_ && k != peer) failIfGaveUp(k, current_.seq, peer);
  }
  PYDDP_CHECK_COMM(peerWasAlive, "rank ", peer, " (pid ", peers_[peer].pid,
                   ") exited; rank ", rank_, " was waiting for it in ", call);
  // The peer waited for may only be late; a rank that exited before it
  // arrived at this collective will never arrive, so it is named now rather
  // than when the late one comes. Its process is looked at before its
  // arrival, as above: a rank that arrived and then exited may have done
  // its part.
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_ || k == peer || peerAlive(k)) continue;
    PYDDP_CHECK_COMM(header(k).arrived.value.load(std::memory_order_acquire) >= current_.seq,
                     "rank ", k, " (pid ", peers_[k].pid, ") exited before it arrived at ",
                     call, "; rank ", rank_, " was waiting for rank ", peer);
  }
  if (now < deadline_) return;
  std::vector<int> missing;
  for (int k = 0; k < worldSize_; ++k) {
    if (header(k).arrived.value.load(std::memory_order_acquire) < current_.seq) {
      missing.push_back(k);
    }
  }
  std::ostringstream who;
  for (size_t i = 0; i < missing.size(); ++i) who << (i ? ", " : "") << missing[i];
  PYDDP_CHECK_COMM(missing.empty(), "rank", (missing.size() > 1 ? "s " : " "),
                   who.str(), " did not arrive at ", call, " within the timeout of ",
                   timeoutMs_, " ms (rank ", rank_, " waited)");
  PYDDP_CHECK_COMM(false, call, " timed out after ", timeoutMs_, " ms on rank ",
                   rank_, " waiting for rank ", peer,
                   " (every rank entered the collective)");
}

void ControlPlane::failIfGaveUp(int peer, uint64_t upTo, int waitedFor) const {
  const ControlHeader& h = header(peer);
  const uint64_t failedIn = h.failed.value.load(std::memory_order_acquire);
  if (failedIn != 0 && failedIn <= upTo) {
    const std::string whom = waitedFor < 0 || waitedFor == peer
        ? std::string("it")
        : "rank " + std::to_string(waitedFor);
    PYDDP_CHECK_COMM(false, "rank ", peer, " gave up on collective #", failedIn,
                     " while rank ", rank_, " waited for ", whom, " in ", currentCall(), ": ",
                     std::string(h.failureText, strnlen(h.failureText, kFailureTextBytes)));
  }
}

bool ControlPlane::giveUp(const std::string& why, bool onNext) {
  if (own_.header == nullptr || gaveUp_.exchange(true)) return false;
  ControlHeader& h = own();
  const size_t n = std::min(why.size(), kFailureTextBytes - 1);
  std::memcpy(h.failureText, why.data(), n);
  h.failureText[n] = '\0';
  // arrived, not current_: this may run on another thread than enter().
  const uint64_t seq = h.arrived.value.load(std::memory_order_relaxed) + (onNext ? 1 : 0);
  h.failed.value.store(std::max<uint64_t>(seq, 1), std::memory_order_release);
  return true;
}

void ControlPlane::publish(const CollectiveDesc& desc) {
  const int slot = static_cast<int>(desc.seq % kDescriptorRing);
  ControlHeader& h = own();
  h.desc[slot].desc = desc;
  h.desc[slot].published.store(desc.seq, std::memory_order_release);
  h.arrived.value.store(desc.seq, std::memory_order_release);
}

std::string ControlPlane::differs(const CollectiveDesc& mine, int peer) const {
  const DescriptorSlot& theirs = header(peer).desc[mine.seq % kDescriptorRing];
  if (theirs.published.load(std::memory_order_acquire) != mine.seq) return "";
  return mismatch(mine, rank_, theirs.desc, peer);
}

void ControlPlane::enter(const CollectiveDesc& desc, Deadline deadline) {
  current_ = desc;
  deadline_ = deadline.at;
  timeoutMs_ = deadline.timeout.count();
  const int slot = static_cast<int>(desc.seq % kDescriptorRing);
  publish(desc);
  // Every rank compares every peer's descriptor, so a mismatch fails on all
  // ranks.
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_) continue;
    const DescriptorSlot& theirs = header(k).desc[slot];
    waitFor(k, spinPhase_,
            [&] { return theirs.published.load(std::memory_order_acquire) >= desc.seq; });
    checkSame(desc, rank_, theirs.desc, k);
  }
}

} // namespace shm
} // namespace pyddp
