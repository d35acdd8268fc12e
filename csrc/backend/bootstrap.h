// Bootstrap: how the ranks of a group meet through torch's store and
// connect a transport.
//
// Sequence (keys under the group's store prefix, one per rank):
//   hello/<rank>      every rank is there before anything is created, and
//                     says who it is (host, pid) and what its transport will
//                     create (Transport::reserve(): shm's segment name);
//   blob/<rank>       phase 1: the transport's setup() blob, or why this
//                     rank could not set its transport up;
//   connected/<rank>  phase 2: "" once connect(blobs) succeeded, else why
//                     not (another host, no peer access, a forged blob);
//                     once every rank's is there, nobody opens a peer's
//                     segment again, and every rank reclaims every peer's
//                     reservation (so a rank killed before it removed its
//                     own leaves nothing behind);
//   done/<rank>       this rank has read everything it needed, success or
//                     failure: no rank leaves bootstrap before every live
//                     rank it heard from got here, so the rank that hosts
//                     the store (a TCPStore's rank 0) cannot take it away
//                     from a peer that is still reading why it failed;
// then connected() releases what bootstrap needed (shm unlinks its own
// segment name). Every rank publishes its outcome before it acts on it, so
// a refusal fails every rank alike, naming the rank that refused.
//
// Every store wait polls: it names every rank still missing at the timeout,
// fails as soon as a rank it heard from has exited (naming it), and gives up
// when the caller is interrupted (common/interrupt.h). When bootstrap fails,
// every rank reclaims the reservations of the ranks that died.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace pyddp {
namespace bootstrap {

// All-gathers one string per rank through the store under `key`/<rank>.
// Ranks that do not publish their key within `timeout` are named in the
// error; an interrupt ends the wait.
std::vector<std::string> allGather(c10d::Store& store, const std::string& key,
                                   const std::string& mine, int rank, int size,
                                   std::chrono::milliseconds timeout);

// One step that every rank of a group takes alike after it is made (a
// buffer's registration): all-gathers each rank's outcome under `key`/<rank>,
// what it publishes (`ok`) or why it could not (`failed`, not empty), and
// returns every rank's ok. Throws DistBackendError on every rank alike,
// naming the first rank in rank order that could not `step`, or a rank that
// did not `step` within `timeout`; an interrupt ends the wait.
std::vector<std::string> gatherOutcomes(c10d::Store& store, const std::string& key,
                                        const std::string& ok, const std::string& failed,
                                        int rank, int size, std::chrono::milliseconds timeout,
                                        const std::string& step);

// Agrees on a group before it is made (new_group): each rank of `ranks`
// (numbered in a group they all belong to; `rank` is this one) publishes
// `request`, what it asked for (the members and the size of the group they
// come from), under hello/<rank> with its pid, and reads every other's,
// watching their processes as bootstrap does. Throws DistBackendError
// naming each distinct request and the ranks that made it unless all are
// equal, when a rank does not come within `timeout` (naming it and `call`),
// or when one it heard from exits. Keys under done/ as bootstrap's.
void agree(c10d::Store& store, int rank, const std::vector<int>& ranks,
           const std::string& request, const std::string& call,
           std::chrono::milliseconds timeout);

// Sets up and connects `transport` on every rank (the sequence above).
void connect(Connectable& transport, c10d::Store& store, int rank, int size,
             std::chrono::milliseconds timeout);

// The group's store as a transport's Directory, for connections made after
// bootstrap (point-to-point channels).
class StoreDirectory final : public Directory {
 public:
  explicit StoreDirectory(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void publish(const std::string& key, const std::string& value) override;
  std::optional<std::string> lookup(const std::string& key) override;

 private:
  // `f` on the store, unless its connection failed before: then it throws
  // at once. A store's connection fails for good when the rank that hosts
  // it exits, and torch logs every failed call with a stack trace; a
  // teardown that reclaims what dead peers left asks once per pair of ranks.
  template <typename F>
  auto ask(const std::string& key, F&& f);

  const c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<bool> failed_{false};
};

} // namespace bootstrap
} // namespace pyddp
