#include "transport/shm.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iomanip>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "common/blob.h"
#include "common/check.h"
#include "common/host.h"
#include "common/interrupt.h"
#include "transport/shm_channel.h"
#include "transport/shm_segment.h"
#include "transport/wait_policy.h"

namespace pyddp {
namespace shm {
namespace {

std::string errnoText() {
  return std::strerror(errno);
}

// What a rank publishes about its segment. The geometry travels with it so
// that every rank can refuse a mismatch before mapping anything.
struct Blob {
  std::string segment;
  std::string hostId;
  std::string pidNamespace;  // pids of ranks in other namespaces mean nothing here
  int pid = 0;
  size_t bytes = 0;
  size_t slotBytes = 0;
  int numSlots = 0;
  size_t directBytes = 0;
  registered::Ref probe;  // serial 0: the rank could not make one
  int cma = 0;  // CmaReads
  size_t cmaMinBytes = 0;
  uint64_t processProbe = 0;  // the probe word's address in the rank's process
  uint64_t processToken = 0;  // what it holds
};

std::string encodeBlob(const Blob& b) {
  return BlobWriter()
      .put("layout", kLayoutVersion)
      .put("segment", b.segment)
      .put("host", b.hostId)
      .put("pid_namespace", b.pidNamespace)
      .put("pid", b.pid)
      .put("bytes", b.bytes)
      .put("slot_bytes", b.slotBytes)
      .put("num_slots", b.numSlots)
      .put("staging_bytes", b.directBytes)
      .put("probe_serial", b.probe.serial)
      .put("probe_inode", b.probe.inode)
      .put("probe_bytes", b.probe.mapBytes)
      .put("probe_fd", b.probe.fd)
      .put("cma", b.cma)
      .put("cma_min_bytes", b.cmaMinBytes)
      .put("process_probe", b.processProbe)
      .put("process_token", b.processToken)
      .str();
}

Blob decodeBlob(const std::string& text, int peer) {
  const BlobReader r(text, "rank " + std::to_string(peer) + "'s shm bootstrap blob");
  // The layout first: a peer of another version may lack the fields below.
  const std::string layout = r.has("layout") ? r.str("layout") : "none";
  PYDDP_CHECK(layout == std::to_string(kLayoutVersion), "rank ", peer,
              "'s shm bootstrap blob has layout ", layout, ", this rank's ", kLayoutVersion,
              " (different pyddp versions, or a corrupted or forged store value?)");
  Blob b{r.str("segment"),         r.str("host"),
         r.str("pid_namespace"),   r.get<int>("pid"),
         r.get<size_t>("bytes"),   r.get<size_t>("slot_bytes"),
         r.get<int>("num_slots"),  r.get<size_t>("staging_bytes")};
  b.probe = registered::Ref{r.get<uint64_t>("probe_serial"), r.get<uint64_t>("probe_inode"),
                            r.get<uint64_t>("probe_bytes"), 0, b.pid, r.get<int32_t>("probe_fd")};
  b.cma = r.get<int>("cma");
  b.cmaMinBytes = r.get<size_t>("cma_min_bytes");
  b.processProbe = r.get<uint64_t>("process_probe");
  b.processToken = r.get<uint64_t>("process_token");
  return b;
}

// What a slot holds: sendPartial sends elements, recvReduceSend partials.
kernels::Incoming incoming(Hop hop) {
  return hop == Hop::First ? kernels::Incoming::Elements : kernels::Incoming::Partials;
}

} // namespace

ShmTransport::ShmTransport(int rank, int worldSize, const RingOptions& options)
    : rank_(rank),
      worldSize_(worldSize),
      slotBytes_(options.slotBytes),
      numSlots_(options.numSlots),
      directBytes_(roundUp(options.stagingBytes(), kCacheLine)),
      p2pBufferBytes_(options.p2pBufferBytes),
      cma_(options.cma),
      cmaMinBytes_(options.cmaMinBytes),
      hostId_(hostId()),
      pidNamespace_(pidNamespace()),
      spinPhase_(Backoff::spinPhaseFor(worldSize)),
      pieceSpinPhase_(Backoff::pieceSpinPhaseFor(worldSize)),
      segments_(worldSize),
      stores_(options.slotStores),
      stagingStores_(options.slotStores, SlotStoreChooser::kMinChosenStagedBytes,
                     SlotStoreChooser::kStagedStreamingAdvantage) {
  options.validate();
}

ShmTransport::~ShmTransport() {
  // The channels first: their teardown asks this transport about peers.
  messages_.reset();
  collectiveMessages_.reset();
  if (linked_) shm_unlink(ownName_.c_str());
  if (probe_) registered::release(probe_);
  for (auto& s : segments_) {
    if (s.base) munmap(s.base, s.bytes);
    if (s.pidfd >= 0) close(s.pidfd);
  }
}

void ShmTransport::attach(Segment& s, void* base, size_t bytes) const {
  s.base = base;
  s.bytes = bytes;
  s.header = static_cast<SegmentHeader*>(base);
  s.slots = static_cast<char*>(base) + sizeof(SegmentHeader);
  s.staging = s.slots + static_cast<size_t>(numSlots_) * slotBytes_;
}

size_t ShmTransport::segmentBytes() const {
  return sizeof(SegmentHeader) + static_cast<size_t>(numSlots_) * slotBytes_ + 2 * directBytes_;
}

std::string ShmTransport::reserve() {
  ownName_ = newSegmentName();
  return ownName_;
}

void ShmTransport::reclaim(const std::string& reservation) {
  shm::Segment::remove(reservation);  // shm_segment.h's, not ShmTransport::Segment
}

std::string ShmTransport::setup() {
  const size_t bytes = segmentBytes();
  if (ownName_.empty()) reserve();
  // The name was published as ours: another one would not be reclaimed if
  // this rank died. 128 random bits that exist already mean someone made
  // them on purpose.
  const int fd = shm_open(ownName_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  const int openErrno = errno;
  PYDDP_CHECK(fd >= 0, "rank ", rank_, ": shm_open(", ownName_, ") failed: ",
              std::strerror(openErrno),
              openErrno == EEXIST ? " (a random name that exists already: who made it?)" : "");
  linked_ = true;
  // posix_fallocate, not ftruncate: on tmpfs a too-small /dev/shm then fails
  // here with ENOSPC instead of with SIGBUS at the first touch of a page.
  const int sizeErr = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = sizeErr == 0
      ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
      : MAP_FAILED;
  const int mapErrno = errno;
  close(fd);
  PYDDP_CHECK(sizeErr == 0, "rank ", rank_, ": allocating a ", bytes,
              "-byte shm segment failed: ", std::strerror(sizeErr),
              " (is /dev/shm large enough? lower PYDDP_SLOT_BYTES or PYDDP_NUM_SLOTS)");
  PYDDP_CHECK(base != MAP_FAILED, "rank ", rank_, ": mmap of shm segment failed: ",
              std::strerror(mapErrno));

  Segment& own = segments_[rank_];
  attach(own, base, bytes);
  auto* h = new (base) SegmentHeader{};
  h->magic = kMagic;
  h->layoutVersion = kLayoutVersion;
  h->rank = rank_;
  h->pid = static_cast<int32_t>(getpid());
  h->numSlots = numSlots_;
  h->slotBytes = slotBytes_;
  h->directBytes = directBytes_;
  own.pid = h->pid;
  own.pidVisible = true;
  Blob blob{ownName_, hostId_, pidNamespace_, h->pid, bytes, slotBytes_, numSlots_, directBytes_};
  blob.cma = static_cast<int>(cma_);
  blob.cmaMinBytes = cmaMinBytes_;
  processProbe_ = std::random_device()() | 1;
  blob.processProbe = reinterpret_cast<uintptr_t>(&processProbe_);
  blob.processToken = processProbe_;
  // A page of registered memory for the peers to try (connect()): a rank
  // that cannot make one still connects, and the group reads through
  // staging.
  try {
    probe_ = registered::allocate(1);
    blob.probe = registered::locate(probe_, 1);
  } catch (const std::exception& e) {
    registeredRefusal_ = "rank " + std::to_string(rank_) + " cannot make registered memory: " +
        e.what();
  }
  return encodeBlob(blob);
}

std::string ShmTransport::whyNotConnect(int peer, const std::string& blob) const {
  const Blob b = decodeBlob(blob, peer);
  if (b.hostId != hostId_) {
    return "rank " + std::to_string(peer) + " runs on another host (" + b.hostId +
        ", this is " + hostId_ + ")";
  }
  return "";
}

void ShmTransport::connect(const std::vector<std::string>& blobs) {
  PYDDP_CHECK(static_cast<int>(blobs.size()) == worldSize_, "expected ",
              worldSize_, " bootstrap blobs, got ", blobs.size());
  std::vector<Blob> peers(worldSize_);
  segmentNames_.assign(worldSize_, "");
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    peers[peer] = decodeBlob(blobs[peer], peer);
    segments_[peer].pid = peers[peer].pid;
    segmentNames_[peer] = peers[peer].segment;
    segments_[peer].pidVisible = peers[peer].pidNamespace == pidNamespace_;
  }
  // Refuse before mapping anything, so every rank fails with the same reason.
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const std::string why = whyNotConnect(peer, blobs[peer]);
    PYDDP_CHECK(why.empty(), "rank ", rank_, ": shm transport cannot reach ", why);
    const Blob& b = peers[peer];
    PYDDP_CHECK_VALUE(
        b.slotBytes == slotBytes_ && b.numSlots == numSlots_ && b.directBytes == directBytes_ &&
            b.cma == static_cast<int>(cma_) && b.cmaMinBytes == cmaMinBytes_,
        "rank ", rank_, " and rank ", peer,
        " use different shm geometry (slot_bytes ", slotBytes_, " vs ", b.slotBytes,
        ", num_slots ", numSlots_, " vs ", b.numSlots, ", staging bytes ", directBytes_,
        " vs ", b.directBytes, ", cma ", static_cast<int>(cma_), " vs ", b.cma,
        ", cma_min_bytes ", cmaMinBytes_, " vs ", b.cmaMinBytes,
        "): set PYDDP_SLOT_BYTES, PYDDP_NUM_SLOTS, PYDDP_DIRECT_MAX_BYTES, PYDDP_CMA and "
        "PYDDP_CMA_MIN_BYTES alike on all ranks");
  }
  // Store values are not trusted: the segment is mapped with the size this
  // rank computes, and only once the file proves it is a peer's segment of
  // that size (a smaller one would be read past its end).
  const size_t bytes = segmentBytes();
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const Blob& b = peers[peer];
    PYDDP_CHECK(b.bytes == bytes, "rank ", rank_, ": rank ", peer, "'s shm blob says its ",
                "segment has ", b.bytes, " bytes, but its geometry makes ", bytes,
                " (a corrupted or forged store value?)");
    PYDDP_CHECK(isSegmentName(b.segment), "rank ", rank_, ": rank ", peer, "'s shm blob names ",
                "'", b.segment, "', not a pyddp segment (a corrupted or forged store value?)");
    const int fd = shm_open(b.segment.c_str(), O_RDONLY, 0);
    PYDDP_CHECK(fd >= 0, "rank ", rank_, ": cannot open rank ", peer,
                "'s shm segment ", b.segment, ": ", errnoText(),
                " (do the ranks share /dev/shm?)");
    struct stat st {};
    const bool statted = fstat(fd, &st) == 0;
    const int statErrno = errno;
    const std::string problem = statted
        ? segmentProblem(st.st_uid, st.st_mode, st.st_size, bytes, geteuid())
        : std::string("fstat failed: ") + std::strerror(statErrno);
    void* base = problem.empty() ? mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0)
                                 : MAP_FAILED;
    const int mapErrno = errno;
    close(fd);
    PYDDP_CHECK(problem.empty(), "rank ", rank_, ": refusing rank ", peer, "'s shm segment ",
                b.segment, ": ", problem, " (a corrupted or forged store value?)");
    PYDDP_CHECK(base != MAP_FAILED, "rank ", rank_, ": mmap of rank ", peer,
                "'s shm segment failed: ", std::strerror(mapErrno));
    attach(segments_[peer], base, bytes);
    const SegmentHeader& h = header(peer);
    PYDDP_CHECK(h.magic == kMagic && h.layoutVersion == kLayoutVersion,
                "rank ", rank_, ": rank ", peer,
                "'s shm segment has an unexpected layout (different pyddp versions, or a "
                "corrupted or forged store value?)");
    PYDDP_CHECK(h.rank == peer && h.pid == b.pid && h.numSlots == numSlots_ &&
                    h.slotBytes == slotBytes_ && h.directBytes == directBytes_,
                "rank ", rank_, ": the shm segment ", b.segment, " named by rank ", peer,
                "'s blob is rank ", h.rank, "'s (pid ", h.pid, ", ", h.numSlots, " slots of ",
                h.slotBytes, " bytes), not rank ", peer, "'s (pid ", b.pid,
                ") of this geometry (a corrupted or forged store value?)");
  }
  // Whether this rank can map every peer's registered memory: tried on
  // each peer's probe, told to the peers through the header.
  const auto whyNotMapPeers = [&]() -> std::string {
    for (int peer = 0; peer < worldSize_; ++peer) {
      if (peer == rank_) continue;
      const Blob& b = peers[peer];
      if (!segments_[peer].pidVisible) {
        return "rank " + std::to_string(peer) + " runs in another pid namespace";
      }
      if (b.probe.serial == 0) {
        return "rank " + std::to_string(peer) + " cannot make registered memory";
      }
      std::string why = registered::whyNotMappable(b.probe, b.pid, peer);
      if (!why.empty()) return why;
    }
    return "";
  };
  if (probe_) registeredRefusal_ = whyNotMapPeers();
  segments_[rank_].header->mapsRegistered.store(registeredRefusal_.empty() ? 1 : 0,
                                                 std::memory_order_release);
  std::vector<ProcessProbe> probes(worldSize_);
  for (int peer = 0; peer < worldSize_; ++peer) {
    probes[peer] = ProcessProbe{peers[peer].processProbe, peers[peer].processToken};
  }
  processRefusal_ = whyNotReadPeers(probes);
  segments_[rank_].header->readsProcesses.store(processRefusal_.empty() ? 1 : 0,
                                                 std::memory_order_release);
}

std::string ShmTransport::whyNotReadPeers(const std::vector<ProcessProbe>& probes) {
  if (cma_ == CmaReads::Never) return "cma (PYDDP_CMA) is never";
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    Segment& s = segments_[peer];
    const std::string who = "rank " + std::to_string(peer) + " (pid " + std::to_string(s.pid) + ")";
    if (!s.pidVisible) return who + " runs in another pid namespace";
    s.pidfd = static_cast<int>(syscall(SYS_pidfd_open, s.pid, 0));
    if (s.pidfd < 0) return "cannot pin " + who + " (pidfd_open): " + errnoText();
    uint64_t token = 0;
    iovec local{&token, sizeof token};
    iovec remote{reinterpret_cast<void*>(probes[peer].address), sizeof token};
    const ssize_t got = process_vm_readv(s.pid, &local, 1, &remote, 1, 0);
    if (got != sizeof token) {
      return "process_vm_readv of " + who + " failed: " +
          (got < 0 ? errnoText() : "it read " + std::to_string(got) + " bytes of 8") +
          " (the kernel lets a process read another's memory only where it could ptrace it: "
          "the same user, and kernel.yama.ptrace_scope 0 or a container that allows it)";
    }
    if (token != probes[peer].token) {
      return "process_vm_readv of " + who + " read another value than its blob names";
    }
    // And back, as a broadcast's root writes its peers' tensors: the kernel
    // checks the same rights, but a seccomp filter may let reads through
    // and not writes. The same value: a peer reading the word meanwhile
    // sees no change.
    const ssize_t put = process_vm_writev(s.pid, &local, 1, &remote, 1, 0);
    if (put != sizeof token) {
      return "process_vm_writev of " + who + " failed: " +
          (put < 0 ? errnoText() : "it wrote " + std::to_string(put) + " bytes of 8");
    }
  }
  return "";
}

void ShmTransport::connected() {
  if (linked_) {
    shm_unlink(ownName_.c_str());
    linked_ = false;
  }
  // Every rank has tried every probe: the group maps registered tensors,
  // and reads plain ones through the kernel, only if all could.
  agreeOnProbes(&SegmentHeader::mapsRegistered, "map every peer's registered memory",
                registeredRefusal_);
  agreeOnProbes(&SegmentHeader::readsProcesses, "read every peer's memory through the kernel",
                processRefusal_);
  registered::release(probe_);
  probe_ = nullptr;
}

void ShmTransport::agreeOnProbes(std::atomic<uint32_t> SegmentHeader::*succeeded,
                                 const char* what, std::string& refusal) const {
  for (int peer = 0; peer < worldSize_ && refusal.empty(); ++peer) {
    if ((header(peer).*succeeded).load(std::memory_order_acquire) != 1) {
      refusal = "rank " + std::to_string(peer) + " cannot " + what;
    }
  }
}

std::string ShmTransport::channelName(Lane lane, int src, int dst) const {
  const std::string& base = src == rank_ ? ownName_ : segmentNames_.at(src);
  std::ostringstream name;
  name << base << (lane == Lane::User ? '1' : '2') << std::hex << std::setw(8)
       << std::setfill('0') << dst;
  return name.str();
}

MessageLink* ShmTransport::messages(std::shared_ptr<Directory> directory, Lane lane) {
  auto& messages = lane == Lane::User ? messages_ : collectiveMessages_;
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
          return peerAlive(peer) ? std::string()
                                 : "rank " + std::to_string(peer) + " (pid " +
                  std::to_string(segments_[peer].pid) + ") exited";
        },
        [this](int peer) {
          const SegmentHeader& h = header(peer);
          const uint64_t failedIn = h.failed.value.load(std::memory_order_acquire);
          return failedIn == 0 ? std::string()
                               : "rank " + std::to_string(peer) + " gave up on collective #" +
                  std::to_string(failedIn) + ": " +
                  std::string(h.failureText, strnlen(h.failureText, kFailureTextBytes));
        });
  }
  return messages.get();
}

std::string ShmTransport::deadPeer() const {
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer != rank_ && !peerAlive(peer)) {
      return "rank " + std::to_string(peer) + " (pid " + std::to_string(segments_[peer].pid) +
             ") exited";
    }
  }
  return "";
}

bool ShmTransport::peerAlive(int rank) const {
  const Segment& s = segments_[rank];
  return !s.pidVisible || processAlive(s.pid);
}

std::string ShmTransport::currentCall() const {
  return std::string(toString(current_.kind)) + " #" + std::to_string(current_.seq);
}

void ShmTransport::failIfStuck(int peer, bool peerWasAlive, Clock::time_point now) const {
  const std::string call = currentCall();
  if (aborted_.load(std::memory_order_relaxed)) {
    // Given up first (interrupted): that is the reason, not the abort.
    const SegmentHeader& own = header(rank_);
    PYDDP_CHECK_COMM(own.failed.value.load(std::memory_order_acquire) == 0,
                     std::string(own.failureText, strnlen(own.failureText, kFailureTextBytes)));
    PYDDP_CHECK_COMM(false, "rank ", rank_, ": the process group was destroyed while ", call,
                     " waited for rank ", peer);
  }
  failIfGaveUp(peer, std::numeric_limits<uint64_t>::max());
  PYDDP_CHECK_COMM(peerWasAlive, "rank ", peer, " (pid ", segments_[peer].pid,
                   ") exited; rank ", rank_, " was waiting for it in ", call);
  // The peer waited for may only be late; a rank that exited before it
  // arrived at this collective will never arrive, so it is named now rather
  // than when the late one comes. Its process is looked at before its
  // arrival, as above: a rank that arrived and then exited may have done
  // its part.
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_ || k == peer || peerAlive(k)) continue;
    PYDDP_CHECK_COMM(header(k).arrived.value.load(std::memory_order_acquire) >= current_.seq,
                     "rank ", k, " (pid ", segments_[k].pid, ") exited before it arrived at ",
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

void ShmTransport::failIfGaveUp(int peer, uint64_t upTo) const {
  const SegmentHeader& h = header(peer);
  const uint64_t failedIn = h.failed.value.load(std::memory_order_acquire);
  if (failedIn != 0 && failedIn <= upTo) {
    PYDDP_CHECK_COMM(false, "rank ", peer, " gave up on collective #", failedIn,
                     " while rank ", rank_, " waited for it in ", currentCall(), ": ",
                     std::string(h.failureText, strnlen(h.failureText, kFailureTextBytes)));
  }
}

template <typename Ready>
void ShmTransport::waitFor(int peer, Clock::duration spinPhase, Ready&& ready) {
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

void ShmTransport::abandon(const std::string& why) {
  giveUp(why, /*onNext=*/false);
}

void ShmTransport::leave(const std::string& why) {
  const std::string dead = deadPeer();
  giveUp(dead.empty() ? why : dead + "; then " + why, /*onNext=*/true);
}

void ShmTransport::giveUp(const std::string& why, bool onNext) {
  if (segments_[rank_].header == nullptr) return;
  if (abandoned_.exchange(true)) {
    // A second caller, too, returns only once no write into this process
    // is under way.
    refuseWrites();
    return;
  }
  SegmentHeader& own = *segments_[rank_].header;
  const size_t n = std::min(why.size(), kFailureTextBytes - 1);
  std::memcpy(own.failureText, why.data(), n);
  own.failureText[n] = '\0';
  // arrived, not current_: this may run on another thread than enter().
  const uint64_t seq = own.arrived.value.load(std::memory_order_relaxed) + (onNext ? 1 : 0);
  own.failed.value.store(std::max<uint64_t>(seq, 1), std::memory_order_release);
  refuseWrites();
}

void ShmTransport::refuseWrites() {
  if (segments_[rank_].header == nullptr) return;
  segments_[rank_].header->refusesWrites.value.store(1, std::memory_order_seq_cst);
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_ || segments_[k].header == nullptr) continue;
    const auto& writing = header(k).writing.value;
    Backoff backoff;
    while (writing.load(std::memory_order_seq_cst) != 0 && peerStillIn(k)) backoff.pause();
  }
}

void ShmTransport::abort() {
  aborted_.store(true, std::memory_order_relaxed);
  const SegmentHeader* own = segments_[rank_].header;
  const bool gaveUp = own && own->failed.value.load(std::memory_order_acquire) != 0;
  const std::string why = gaveUp ? std::string(own->failureText,
                                               strnlen(own->failureText, kFailureTextBytes))
                                 : teardownReason(rank_, deadPeer());
  if (messages_) messages_->abort(why);
  if (collectiveMessages_) collectiveMessages_->abort(why);
}

void ShmTransport::enter(const CollectiveDesc& desc, Deadline deadline) {
  current_ = desc;
  deadline_ = deadline.at;
  timeoutMs_ = deadline.timeout.count();
  const int slot = static_cast<int>(desc.seq % kDescriptorRing);
  SegmentHeader& own = *segments_[rank_].header;
  own.desc[slot].desc = desc;
  own.desc[slot].published.store(desc.seq, std::memory_order_release);
  own.arrived.value.store(desc.seq, std::memory_order_release);
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

char* ShmTransport::claimSendSlot() {
  const uint64_t k = sent_;
  const int right = (rank_ + 1) % worldSize_;
  if (k >= static_cast<uint64_t>(numSlots_)) {
    const auto& consumed = header(right).consumed.value;
    const uint64_t need = k + 1 - numSlots_;
    waitFor(right, pieceSpinPhase_,
            [&] { return consumed.load(std::memory_order_acquire) >= need; });
  }
  return segments_[rank_].slots + (k % numSlots_) * slotBytes_;
}

void ShmTransport::awaitRingTaken() {
  const int right = (rank_ + 1) % worldSize_;
  const auto& consumed = header(right).consumed.value;
  waitFor(right, pieceSpinPhase_,
          [&] { return consumed.load(std::memory_order_acquire) >= sent_; });
}

void ShmTransport::postSend() {
  ++sent_;
  segments_[rank_].header->posted.value.store(sent_, std::memory_order_release);
}

const char* ShmTransport::awaitRecvSlot() {
  const uint64_t k = received_;
  const int left = (rank_ + worldSize_ - 1) % worldSize_;
  const auto& posted = header(left).posted.value;
  waitFor(left, pieceSpinPhase_, [&] { return posted.load(std::memory_order_acquire) >= k + 1; });
  return segments_[left].slots + (k % numSlots_) * slotBytes_;
}

void ShmTransport::releaseRecv() {
  ++received_;
  segments_[rank_].header->consumed.value.store(received_, std::memory_order_release);
}

bool ShmTransport::writeShared(SlotStoreChooser& stores, void* dst, const void* src,
                               size_t bytes, bool local) {
  const SlotStoreChooser::Pick pick = stores.next(bytes, local);
  const auto start = pick.timed ? Clock::now() : Clock::time_point();
  if (pick.streaming) {
    kernels::streamingCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
  if (pick.timed) {
    stores.observe(pick.streaming, bytes,
                   std::chrono::duration<double, std::nano>(Clock::now() - start).count());
  }
  return pick.streaming;
}

void ShmTransport::send(const void* src, size_t bytes) {
  writeShared(stores_, claimSendSlot(), src, bytes, /*local=*/true);
  postSend();
}

void ShmTransport::sendCopy(const void* src, void* dst, size_t bytes) {
  char* slot = claimSendSlot();
  const bool streamed = writeShared(stores_, slot, src, bytes, /*local=*/true);
  postSend();
  // My copy while the next rank reads the piece, from whichever of the two
  // is in this core's cache: the slot it just wrote (only this rank's later
  // sends rewrite it), or the source it just read when the stores streamed.
  if (dst != src) std::memcpy(dst, streamed ? src : slot, bytes);
}

void ShmTransport::recv(void* dst, size_t bytes) {
  std::memcpy(dst, awaitRecvSlot(), bytes);
  releaseRecv();
}

void ShmTransport::recvCopySend(void* dst, size_t bytes) {
  const char* in = awaitRecvSlot();
  // Forward first: the next rank's hop starts while we keep our copy.
  writeShared(stores_, claimSendSlot(), in, bytes, /*local=*/false);
  postSend();
  std::memcpy(dst, in, bytes);
  releaseRecv();
}

// The first hop goes as elements: as partials, a half type's would double
// the bytes of a 2-rank reduce-scatter.
void ShmTransport::sendPartial(const kernels::ReduceSpec& spec, const void* local,
                               size_t count) {
  send(local, count * elementSize(spec.dtype));
}

void ShmTransport::recvReduceSend(const kernels::ReduceSpec& spec, Hop hop,
                                  const void* local, size_t count) {
  const char* in = awaitRecvSlot();
  kernels::reducePartial(spec, claimSendSlot(), in, incoming(hop), local, count);
  postSend();
  releaseRecv();
}

void ShmTransport::recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop,
                                  const void* local, void* dst, size_t count) {
  kernels::reduceFinal(spec, dst, nullptr, awaitRecvSlot(), incoming(hop), local, count);
  releaseRecv();
}

void ShmTransport::recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop,
                                      const void* local, void* dst, size_t count) {
  const char* in = awaitRecvSlot();
  kernels::reduceFinal(spec, dst, claimSendSlot(), in, incoming(hop), local, count);
  postSend();
  releaseRecv();
}

void ShmTransport::copy(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) std::memcpy(dst, src, bytes);
}

void ShmTransport::stage(void* dst, const void* src, size_t bytes) {
  writeShared(stagingStores_, dst, src, bytes, /*local=*/true);
}

void ShmTransport::reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src,
                           int nsrc, size_t count) {
  kernels::reduceN(spec, dst, src, nsrc, count);
}

void* ShmTransport::stagingBuffer() {
  return segments_[rank_].staging + ((rounds_ + 1) % 2) * directBytes_;
}

void ShmTransport::exchange() {
  ++rounds_;
  segments_[rank_].header->staged.value.store(rounds_, std::memory_order_release);
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_) continue;
    const auto& staged = header(k).staged.value;
    waitFor(k, spinPhase_, [&] { return staged.load(std::memory_order_acquire) >= rounds_; });
  }
}

void ShmTransport::enterStaged(const CollectiveDesc& desc, Deadline deadline) {
  ++rounds_;
  enter(desc, deadline);
  // The peer's failed line is written only when it gives up: a cache hit.
  for (int k = 0; k < worldSize_; ++k) {
    if (k != rank_) failIfGaveUp(k, desc.seq);
  }
}

const void* ShmTransport::peerBuffer(int rank) const {
  return segments_[rank].staging + (rounds_ % 2) * directBytes_;
}

const void* ShmTransport::registeredTensor(int rank, const registered::Ref& ref, size_t bytes) {
  Segment& s = segments_[rank];
  return s.tensors.map(ref, bytes, s.pid, rank);
}

namespace {
std::atomic<uint64_t> processReadsCount{0};
std::atomic<uint64_t> processWritesCount{0};
std::atomic<int64_t> pauseBeforeCheckMs{0};
std::atomic<int64_t> pauseBeforeCopyMs{0};

void pauseFor(const std::atomic<int64_t>& ms) {
  const int64_t n = ms.load(std::memory_order_relaxed);
  if (n > 0) std::this_thread::sleep_for(std::chrono::milliseconds(n));
}
} // namespace

uint64_t ShmTransport::processReads() {
  return processReadsCount.load(std::memory_order_relaxed);
}

uint64_t ShmTransport::processWrites() {
  return processWritesCount.load(std::memory_order_relaxed);
}

void ShmTransport::pauseWrites(std::chrono::milliseconds beforeCheck,
                               std::chrono::milliseconds beforeCopy) {
  pauseBeforeCheckMs.store(beforeCheck.count(), std::memory_order_relaxed);
  pauseBeforeCopyMs.store(beforeCopy.count(), std::memory_order_relaxed);
}

namespace {
// Copies `bytes` between `local` here and `remote` in process `pid` through
// the kernel, in as many calls as it takes (a call may copy less): the
// bytes copied, and the errno of the call that failed (0 if none did, or
// one copied nothing).
std::pair<size_t, int> copyThroughKernel(int pid, bool write, char* local, char* remote,
                                         size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec here{local + done, bytes - done};
    iovec there{remote + done, bytes - done};
    const ssize_t got = write ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                              : process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (got <= 0) return {done, got < 0 ? errno : 0};
    done += static_cast<size_t>(got);
  }
  return {done, 0};
}
} // namespace

void ShmTransport::readProcess(int rank, void* dst, uint64_t address, size_t bytes) {
  // The kernel copies from the peer's page tables as they are during the
  // call: a peer that exited (its pid then names nothing, or, once reaped,
  // another process: hence the pidfd below) or unmapped the range fails it.
  const auto [done, err] = copyThroughKernel(segments_[rank].pid, /*write=*/false,
                                             static_cast<char*>(dst),
                                             reinterpret_cast<char*>(address), bytes);
  // A peer releases its tensor only after the collective's next meeting
  // (which this rank has not reached), or after it gave up or died: the
  // bytes read are its tensor's unless one of those happened first, and a
  // failed read is named by that first.
  checkCopied(rank, /*write=*/false, done, bytes, err);
  processReadsCount.fetch_add(1, std::memory_order_relaxed);
}

void ShmTransport::writeProcess(int rank, uint64_t address, const void* src, size_t bytes) {
  auto& writing = segments_[rank_].header->writing.value;
  // announce the write, then look whether the receiver still takes it
  // (protocol in shm.h: "Writes into a peer")
  writing.store(current_.seq, std::memory_order_seq_cst);
  pauseFor(pauseBeforeCheckMs);
  if (header(rank).refusesWrites.value.load(std::memory_order_seq_cst) != 0) {
    writing.store(0, std::memory_order_release);
    failIfGaveUp(rank, std::numeric_limits<uint64_t>::max());
    PYDDP_CHECK_COMM(false, "rank ", rank, " gave up while rank ", rank_,
                     " was to write its tensor in ", currentCall());
  }
  pauseFor(pauseBeforeCopyMs);
  const auto [done, err] = copyThroughKernel(
      segments_[rank].pid, /*write=*/true, const_cast<char*>(static_cast<const char*>(src)),
      reinterpret_cast<char*>(address), bytes);
  writing.store(0, std::memory_order_release);
  if (done > 0) processWritesCount.fetch_add(1, std::memory_order_relaxed);
  checkCopied(rank, /*write=*/true, done, bytes, err);
}

void ShmTransport::checkCopied(int rank, bool write, size_t done, size_t bytes, int err) const {
  const Segment& s = segments_[rank];
  // ESRCH: the process has no memory any more (its main thread exited,
  // though a pidfd may not say so until its last thread has).
  PYDDP_CHECK_COMM(err != ESRCH && peerStillIn(rank), "rank ", rank, " (pid ", s.pid,
                   ") exited while rank ", rank_, (write ? " wrote" : " read"),
                   " its tensor in ", currentCall());
  failIfGaveUp(rank, current_.seq);
  PYDDP_CHECK_COMM(done == bytes, "rank ", rank_, ": ", currentCall(), ": ",
                   (write ? "process_vm_writev" : "process_vm_readv"), " of ", bytes - done,
                   (write ? " bytes into rank " : " bytes of rank "), rank, "'s tensor (pid ",
                   s.pid, ") failed: ", err != 0 ? std::strerror(err) : "no progress");
}

bool ShmTransport::peerStillIn(int rank) const {
  pollfd p{segments_[rank].pidfd, POLLIN, 0};
  int ready;
  do {
    ready = poll(&p, 1, 0);
  } while (ready < 0 && errno == EINTR);
  // readable once the process has exited
  return ready <= 0 || (p.revents & POLLIN) == 0;
}

} // namespace shm
} // namespace pyddp
