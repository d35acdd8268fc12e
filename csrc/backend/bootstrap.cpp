#include "backend/bootstrap.h"

#include <unistd.h>

#include <exception>
#include <optional>
#include <sstream>
#include <thread>

#include "common/blob.h"
#include "common/check.h"
#include "common/host.h"
#include "common/interrupt.h"

namespace pyddp {
namespace bootstrap {
namespace {

using Ms = std::chrono::milliseconds;

// Store waits poll: peers usually publish within microseconds of each other,
// so the first pauses are short; then they grow to kMaxPause, which bounds
// how late a key is seen. Between pauses the wait looks at its deadline,
// at interrupts, and every kLivenessPeriod at the processes of the ranks it
// has heard from (/proc/<pid>/stat of each).
constexpr auto kFirstPause = std::chrono::microseconds(50);
constexpr auto kMaxPause = std::chrono::milliseconds(10);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(20);
// A store that fails (its host, a TCPStore's rank 0, exited) may do so a
// moment before that rank's process is seen to have exited.
constexpr auto kDeathGrace = std::chrono::milliseconds(200);

// A rank's outcome of one phase: "ok" and what it publishes, or "failed"
// and why (as bytes: either may span lines).
std::string outcome(const std::string& ok, const std::string& failed) {
  BlobWriter w;
  return failed.empty() ? w.putBytes("ok", ok).str() : w.putBytes("failed", failed).str();
}

std::string rankList(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

// One bootstrap's meeting through the store: all-gathers one value per rank
// under a key, watching the processes of the ranks it has heard from (their
// hello), so that a rank that dies is named at once instead of at the
// timeout.
class Meeting {
 public:
  Meeting(c10d::Store& store, int rank, int size, Ms timeout)
      : store_(store), rank_(rank), size_(size), timeout_(timeout), peers_(size) {}

  // Every rank's value of key/<rank>. `missing` completes "rank 2 did not
  // ..." in errors. Throws DistBackendError when a rank does not publish
  // within the timeout, a rank it heard from exits, or the caller is
  // interrupted.
  std::vector<std::string> allGather(const std::string& key, const std::string& mine,
                                     const std::string& missing);

  // Phase 0: who every rank is (its pid, for liveness) and what its
  // transport will create (`reservation`), before anything exists.
  void hello(const std::string& reservation);
  // Lets every peer's reservation go (transport.reclaim()): all, or those
  // of peers whose process has exited.
  void reclaim(Transport& transport, bool deadOnly) const;
  // Publishes done/<rank> and waits (bounded, errors ignored) until every
  // live rank it heard from has too: every rank has then read every value it
  // needed, so the rank that hosts the store may exit.
  void finish() noexcept;

 private:
  struct Peer {
    bool joined = false;     // its hello was read
    bool watched = false;    // same host and pid namespace: its pid means something here
    int pid = 0;
    std::string reservation;
  };

  std::string keyOf(const std::string& key, int rank) const {
    return key + "/" + std::to_string(rank);
  }
  // The first rank heard from whose process has exited; -1 while none.
  int deadPeer() const;
  // Reads every key/<peer> that is there into `values`; returns how many are missing.
  int readPresent(const std::string& key, std::vector<std::optional<std::string>>& values);
  // A store call failed: a dead peer explains it better than the store's error.
  [[noreturn]] void storeFailed(const std::exception& e, const std::string& key);
  void learn(int peer, const std::string& hello);

  c10d::Store& store_;
  const int rank_;
  const int size_;
  const Ms timeout_;
  std::vector<Peer> peers_;
};

int Meeting::deadPeer() const {
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && peers_[peer].watched && !processAlive(peers_[peer].pid)) return peer;
  }
  return -1;
}

void Meeting::storeFailed(const std::exception& e, const std::string& key) {
  const auto giveUp = Clock::now() + kDeathGrace;
  int dead = deadPeer();
  while (dead < 0 && Clock::now() < giveUp) {
    std::this_thread::sleep_for(kMaxPause);
    dead = deadPeer();
  }
  PYDDP_CHECK_COMM(dead < 0, "rank ", dead, " (pid ", peers_[dead].pid,
                   ") exited before the process group was connected, and the store failed "
                   "with it (rank ", rank_, " was reading '", key, "'): ", messageOf(e));
  PYDDP_CHECK_COMM(false, "rank ", rank_, ": the store failed while connecting the process "
                   "group (reading '", key, "'): ", messageOf(e));
}

int Meeting::readPresent(const std::string& key,
                         std::vector<std::optional<std::string>>& values) {
  int missing = 0;
  for (int peer = 0; peer < size_; ++peer) {
    if (values[peer]) continue;
    const std::string k = keyOf(key, peer);
    try {
      if (!store_.check({k})) {
        ++missing;
        continue;
      }
      const std::vector<uint8_t> v = store_.get(k);
      values[peer].emplace(v.begin(), v.end());
    } catch (const std::exception& e) {
      storeFailed(e, k);
    }
    if (key == "hello") learn(peer, *values[peer]);
  }
  return missing;
}

std::vector<std::string> Meeting::allGather(const std::string& key, const std::string& mine,
                                            const std::string& missing) {
  try {
    store_.set(keyOf(key, rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
  } catch (const std::exception& e) {
    storeFailed(e, keyOf(key, rank_));
  }
  const auto start = Clock::now();
  const auto deadline = start + timeout_;
  auto nextLook = start + kLivenessPeriod;
  auto pause = std::chrono::duration_cast<Clock::duration>(kFirstPause);
  std::vector<std::optional<std::string>> values(size_);
  while (readPresent(key, values) > 0) {
    std::vector<int> absent;
    for (int peer = 0; peer < size_; ++peer) {
      if (!values[peer]) absent.push_back(peer);
    }
    PYDDP_CHECK_COMM(!interruptRequested(), "rank ", rank_, ": interrupted while waiting for ",
                     rankList(absent), " to ", missing);
    const auto now = Clock::now();
    if (now >= nextLook) {
      const int dead = deadPeer();
      PYDDP_CHECK_COMM(dead < 0, "rank ", dead, " (pid ", peers_[dead].pid,
                       ") exited before the process group was connected (rank ", rank_,
                       " was waiting for ", rankList(absent), " to ", missing, ")");
      nextLook = now + kLivenessPeriod;
    }
    PYDDP_CHECK_COMM(now < deadline, rankList(absent), " did not ", missing, " within ",
                     timeout_.count(), " ms (rank ", rank_, " waited for store key '",
                     keyOf(key, absent.front()), "')");
    std::this_thread::sleep_for(pause);
    pause = std::min<Clock::duration>(2 * pause, kMaxPause);
  }
  std::vector<std::string> all(size_);
  for (int peer = 0; peer < size_; ++peer) all[peer] = std::move(*values[peer]);
  return all;
}

void Meeting::learn(int peer, const std::string& hello) {
  const BlobReader r(hello, "rank " + std::to_string(peer) + "'s hello");
  Peer& p = peers_[peer];
  p.joined = true;
  p.pid = r.get<int>("pid");
  p.watched = peer != rank_ && r.str("host") == hostId() &&
              r.str("pid_namespace") == pidNamespace();
  p.reservation = r.bytes("reservation");
}

void Meeting::hello(const std::string& reservation) {
  const std::string mine = BlobWriter()
                               .put("host", hostId())
                               .put("pid_namespace", pidNamespace())
                               .put("pid", static_cast<int>(getpid()))
                               .putBytes("reservation", reservation)
                               .str();
  allGather("hello", mine, "join the process group");
}

void Meeting::reclaim(Transport& transport, bool deadOnly) const {
  for (int peer = 0; peer < size_; ++peer) {
    const Peer& p = peers_[peer];
    if (peer == rank_ || !p.joined || p.reservation.empty()) continue;
    if (!deadOnly || (p.watched && !processAlive(p.pid))) transport.reclaim(p.reservation);
  }
}

void Meeting::finish() noexcept {
  try {
    store_.set(keyOf("done", rank_), std::vector<uint8_t>());
    const auto deadline = Clock::now() + timeout_;
    auto pause = std::chrono::duration_cast<Clock::duration>(kFirstPause);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_ || !peers_[peer].joined) continue;
      const std::string k = keyOf("done", peer);
      while (!store_.check({k})) {
        if (interruptRequested() || Clock::now() >= deadline) return;
        if (peers_[peer].watched && !processAlive(peers_[peer].pid)) break;
        std::this_thread::sleep_for(pause);
        pause = std::min<Clock::duration>(2 * pause, kMaxPause);
      }
    }
  } catch (const std::exception&) {
    // The store went with the rank that hosted it, after every rank that
    // needed it had read what it needed.
  }
}

} // namespace

std::vector<std::string> allGather(c10d::Store& store, const std::string& key,
                                   const std::string& mine, int rank, int size, Ms timeout) {
  // Every caller runs it while the group is being made (the host map, NCCL's
  // id): a rank that never publishes has not joined.
  return Meeting(store, rank, size, timeout).allGather(key, mine, "join the process group");
}

void connect(Transport& transport, c10d::Store& store, int rank, int size, Ms timeout) {
  Meeting meeting(store, rank, size, timeout);
  try {
    meeting.hello(transport.reserve());
    // phase 1: publish what peers need to reach us (or why we cannot be
    // reached), learn theirs
    std::string blob, why;
    std::exception_ptr ownFailure;
    try {
      blob = transport.setup();
    } catch (const std::exception& e) {
      why = messageOf(e);
      ownFailure = std::current_exception();
    }
    const auto published =
        meeting.allGather("blob", outcome(blob, why), "publish its transport's blob");
    if (ownFailure) std::rethrow_exception(ownFailure);
    std::vector<std::string> blobs(size);
    for (int peer = 0; peer < size; ++peer) {
      const BlobReader r(published[peer], "rank " + std::to_string(peer) + "'s bootstrap blob");
      PYDDP_CHECK_COMM(r.has("ok"), "rank ", rank, ": rank ", peer,
                       " could not set up its transport: ", r.bytes("failed"));
      blobs[peer] = r.bytes("ok");
    }
    // phase 2: reach every peer, and tell every peer whether we could
    std::exception_ptr ownRefusal;
    try {
      transport.connect(blobs);
    } catch (const std::exception& e) {
      why = messageOf(e);
      ownRefusal = std::current_exception();
    }
    const auto refusals =
        meeting.allGather("connected", outcome("", why), "finish connecting");
    // Every rank has finished connect(): nobody opens what a peer made
    // again, so each rank removes every name, and a rank killed before it
    // removed its own leaves nothing behind.
    meeting.reclaim(transport, /*deadOnly=*/false);
    if (ownRefusal) std::rethrow_exception(ownRefusal);
    for (int peer = 0; peer < size; ++peer) {
      const BlobReader r(refusals[peer], "rank " + std::to_string(peer) + "'s connect outcome");
      PYDDP_CHECK_COMM(r.has("ok"), "rank ", rank, ": the ", transport.name(),
                       " transport cannot connect: rank ", peer, " refused (", r.bytes("failed"),
                       ")");
    }
    transport.connected();
  } catch (const std::exception&) {
    // A rank that died cannot remove what it made; its peers can.
    meeting.reclaim(transport, /*deadOnly=*/true);
    meeting.finish();
    throw;
  }
  meeting.finish();
}

void StoreDirectory::publish(const std::string& key, const std::string& value) {
  store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::optional<std::string> StoreDirectory::lookup(const std::string& key) {
  if (!store_->check({key})) return std::nullopt;
  const std::vector<uint8_t> v = store_->get(key);
  return std::string(v.begin(), v.end());
}

} // namespace bootstrap
} // namespace pyddp
