#include "backend/bootstrap.h"

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

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

// Every rank's published value of `outcomes` (outcome()'s), or the error
// naming the first rank in rank order that could not `step`.
std::vector<std::string> okValues(const std::vector<std::string>& outcomes, int rank,
                                  const std::string& step) {
  std::vector<std::string> values;
  for (size_t peer = 0; peer < outcomes.size(); ++peer) {
    const BlobReader r(outcomes[peer], "rank " + std::to_string(peer) + "'s bootstrap blob");
    PYDDP_CHECK_COMM(r.has("ok"), "rank ", rank, ": rank ", peer, " could not ", step, ": ",
                     r.bytes("failed"));
    values.push_back(r.bytes("ok"));
  }
  return values;
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
// timeout. The ranks that meet are `ranks` (this one is `rank`, one of
// them), and key/<r> is rank r's value.
class Meeting {
 public:
  Meeting(c10d::Store& store, int rank, std::vector<int> ranks, Ms timeout)
      : store_(store), rank_(rank), ranks_(std::move(ranks)), timeout_(timeout),
        peers_(ranks_.size()) {}

  // Every rank's value of key/<rank>, in the order of `ranks`. `missing`
  // completes "rank 2 did not ..." in errors. Throws DistBackendError when a
  // rank does not publish within the timeout, a rank it heard from exits, or
  // the caller is interrupted.
  std::vector<std::string> allGather(const std::string& key, const std::string& mine,
                                     const std::string& missing);

  // Phase 0: who every rank is (its pid, for liveness) and what its
  // transport will create (`reservation`), before anything exists; `extra`
  // fields ride along. Returns every rank's hello.
  std::vector<std::string> hello(const std::string& reservation, const std::string& missing,
                                 const std::vector<std::pair<std::string, std::string>>& extra =
                                     {});
  // Lets every peer's reservation go (transport.reclaim()): all, or those
  // of peers whose process has exited.
  void reclaim(Connectable& transport, bool deadOnly) const;
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
  // The first rank heard from whose process has exited (its index in
  // ranks_); -1 while none.
  int deadPeer() const;
  // Reads every key/<peer> that is there into `values`; returns how many are missing.
  int readPresent(const std::string& key, std::vector<std::optional<std::string>>& values,
                  bool hellos);
  std::vector<std::string> gather(const std::string& key, const std::string& mine,
                                  const std::string& missing, bool hellos);
  // A store call failed: a dead peer explains it better than the store's error.
  [[noreturn]] void storeFailed(const std::exception& e, const std::string& key);
  void learn(size_t peer, const std::string& hello);

  c10d::Store& store_;
  const int rank_;
  const std::vector<int> ranks_;
  const Ms timeout_;
  std::vector<Peer> peers_;
};

int Meeting::deadPeer() const {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i] != rank_ && peers_[i].watched && !processAlive(peers_[i].pid)) {
      return static_cast<int>(i);
    }
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
  PYDDP_CHECK_COMM(dead < 0, "rank ", ranks_[dead], " (pid ", peers_[dead].pid,
                   ") exited before the process group was connected, and the store failed "
                   "with it (rank ", rank_, " was reading '", key, "'): ", messageOf(e));
  PYDDP_CHECK_COMM(false, "rank ", rank_, ": the store failed while connecting the process "
                   "group (reading '", key, "'): ", messageOf(e));
}

int Meeting::readPresent(const std::string& key,
                         std::vector<std::optional<std::string>>& values, bool hellos) {
  int missing = 0;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (values[i]) continue;
    const std::string k = keyOf(key, ranks_[i]);
    try {
      if (!store_.check({k})) {
        ++missing;
        continue;
      }
      const std::vector<uint8_t> v = store_.get(k);
      values[i].emplace(v.begin(), v.end());
    } catch (const std::exception& e) {
      storeFailed(e, k);
    }
    if (hellos) learn(i, *values[i]);
  }
  return missing;
}

std::vector<std::string> Meeting::allGather(const std::string& key, const std::string& mine,
                                            const std::string& missing) {
  return gather(key, mine, missing, /*hellos=*/false);
}

std::vector<std::string> Meeting::gather(const std::string& key, const std::string& mine,
                                         const std::string& missing, bool hellos) {
  try {
    store_.set(keyOf(key, rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
  } catch (const std::exception& e) {
    storeFailed(e, keyOf(key, rank_));
  }
  const auto start = Clock::now();
  const auto deadline = start + timeout_;
  auto nextLook = start + kLivenessPeriod;
  auto pause = std::chrono::duration_cast<Clock::duration>(kFirstPause);
  std::vector<std::optional<std::string>> values(ranks_.size());
  while (readPresent(key, values, hellos) > 0) {
    std::vector<int> absent;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (!values[i]) absent.push_back(ranks_[i]);
    }
    PYDDP_CHECK_COMM(!interruptRequested(), "rank ", rank_, ": interrupted while waiting for ",
                     rankList(absent), " to ", missing);
    const auto now = Clock::now();
    if (now >= nextLook) {
      const int dead = deadPeer();
      PYDDP_CHECK_COMM(dead < 0, "rank ", ranks_[dead], " (pid ", peers_[dead].pid,
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
  std::vector<std::string> all(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) all[i] = std::move(*values[i]);
  return all;
}

void Meeting::learn(size_t peer, const std::string& hello) {
  const BlobReader r(hello, "rank " + std::to_string(ranks_[peer]) + "'s hello");
  Peer& p = peers_[peer];
  p.joined = true;
  p.pid = r.get<int>("pid");
  p.watched = ranks_[peer] != rank_ && r.str("host") == hostId() &&
              r.str("pid_namespace") == pidNamespace();
  p.reservation = r.bytes("reservation");
}

std::vector<std::string> Meeting::hello(
    const std::string& reservation, const std::string& missing,
    const std::vector<std::pair<std::string, std::string>>& extra) {
  BlobWriter w;
  w.put("host", hostId())
      .put("pid_namespace", pidNamespace())
      .put("pid", static_cast<int>(getpid()))
      .putBytes("reservation", reservation);
  for (const auto& [name, value] : extra) w.putBytes(name, value);
  return gather("hello", w.str(), missing, /*hellos=*/true);
}

void Meeting::reclaim(Connectable& transport, bool deadOnly) const {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const Peer& p = peers_[i];
    if (ranks_[i] == rank_ || !p.joined || p.reservation.empty()) continue;
    if (!deadOnly || (p.watched && !processAlive(p.pid))) transport.reclaim(p.reservation);
  }
}

void Meeting::finish() noexcept {
  try {
    store_.set(keyOf("done", rank_), std::vector<uint8_t>());
    const auto deadline = Clock::now() + timeout_;
    auto pause = std::chrono::duration_cast<Clock::duration>(kFirstPause);
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (ranks_[i] == rank_ || !peers_[i].joined) continue;
      const std::string k = keyOf("done", ranks_[i]);
      while (!store_.check({k})) {
        if (interruptRequested() || Clock::now() >= deadline) return;
        if (peers_[i].watched && !processAlive(peers_[i].pid)) break;
        std::this_thread::sleep_for(pause);
        pause = std::min<Clock::duration>(2 * pause, kMaxPause);
      }
    }
  } catch (const std::exception&) {
    // The store went with the rank that hosted it, after every rank that
    // needed it had read what it needed.
  }
}

std::vector<int> firstRanks(int size) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  return ranks;
}

} // namespace

std::vector<std::string> allGather(c10d::Store& store, const std::string& key,
                                   const std::string& mine, int rank, int size, Ms timeout) {
  // Every caller runs it while the group is being made (the host map, NCCL's
  // id): a rank that never publishes has not joined.
  return Meeting(store, rank, firstRanks(size), timeout)
      .allGather(key, mine, "join the process group");
}

std::vector<std::string> gatherOutcomes(c10d::Store& store, const std::string& key,
                                        const std::string& ok, const std::string& failed,
                                        int rank, int size, Ms timeout, const std::string& step) {
  const auto outcomes =
      Meeting(store, rank, firstRanks(size), timeout).allGather(key, outcome(ok, failed), step);
  return okValues(outcomes, rank, step);
}

void connect(Connectable& transport, c10d::Store& store, int rank, int size, Ms timeout) {
  Meeting meeting(store, rank, firstRanks(size), timeout);
  try {
    meeting.hello(transport.reserve(), "join the process group");
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
    const std::vector<std::string> blobs = okValues(published, rank, "set up its transport");
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

void agree(c10d::Store& store, int rank, const std::vector<int>& ranks,
           const std::string& request, const std::string& call, Ms timeout) {
  Meeting meeting(store, rank, ranks, timeout);
  std::vector<std::string> hellos;
  try {
    hellos = meeting.hello("", "call " + call, {{"request", request}});
  } catch (const std::exception&) {
    meeting.finish();
    throw;
  }
  meeting.finish();
  // Each distinct request with the ranks that made it, in rank order.
  std::vector<std::pair<std::string, std::vector<int>>> asked;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::string theirs =
        BlobReader(hellos[i], "rank " + std::to_string(ranks[i]) + "'s hello").bytes("request");
    auto it = std::find_if(asked.begin(), asked.end(),
                           [&](const auto& a) { return a.first == theirs; });
    if (it == asked.end()) {
      asked.emplace_back(theirs, std::vector<int>());
      it = asked.end() - 1;
    }
    it->second.push_back(ranks[i]);
  }
  if (asked.size() == 1) return;
  std::ostringstream out;
  for (size_t i = 0; i < asked.size(); ++i) {
    out << (i ? "; " : "") << rankList(asked[i].second) << " asked for " << asked[i].first;
  }
  PYDDP_CHECK_COMM(false, "rank ", rank, ": ", call, ": the ranks disagree on the group: ",
                   out.str(), " (every rank must make the same groups, in the same order)");
}

template <typename F>
auto StoreDirectory::ask(const std::string& key, F&& f) {
  PYDDP_CHECK_COMM(!failed_.load(std::memory_order_relaxed), "the store's connection failed "
                   "earlier; not asking it for '", key, "'");
  try {
    return f();
  } catch (const c10::DistNetworkError&) {
    // The connection failed: the store is gone (a refused key is not).
    failed_.store(true, std::memory_order_relaxed);
    throw;
  }
}

void StoreDirectory::publish(const std::string& key, const std::string& value) {
  ask(key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
}

std::optional<std::string> StoreDirectory::lookup(const std::string& key) {
  return ask(key, [&]() -> std::optional<std::string> {
    if (!store_->check({key})) return std::nullopt;
    const std::vector<uint8_t> v = store_->get(key);
    return std::string(v.begin(), v.end());
  });
}

} // namespace bootstrap
} // namespace pyddp
