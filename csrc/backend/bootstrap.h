// Bootstrap: how the ranks of a group meet through torch's store and
// connect a transport.
//
// Sequence (keys under the group's store prefix, one per rank):
//   hello/<rank>      every rank is there before anything is created, so a
//                     rank killed while others are still missing leaves no
//                     shared memory behind;
//   blob/<rank>       phase 1: the transport's setup() blob, or why this
//                     rank could not set its transport up;
//   connected/<rank>  phase 2: "" once connect(blobs) succeeded, else why
//                     not (another host, no peer access);
// then connected() releases what bootstrap needed (shm unlinks its
// segment names). Every rank publishes its outcome before it acts on it, so
// a refusal fails every rank alike, naming the rank that refused.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace pyddp {
namespace bootstrap {

// All-gathers one string per rank through the store under `key`/<rank>.
// A rank that never publishes its key within `timeout` is named in the
// error.
std::vector<std::string> allGather(c10d::Store& store, const std::string& key,
                                   const std::string& mine, int rank, int size,
                                   std::chrono::milliseconds timeout);

// Sets up and connects `transport` on every rank (the sequence above).
void connect(Transport& transport, c10d::Store& store, int rank, int size,
             std::chrono::milliseconds timeout);

// The group's store as a transport's Directory, for connections made after
// bootstrap (point-to-point channels).
class StoreDirectory final : public Directory {
 public:
  explicit StoreDirectory(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void publish(const std::string& key, const std::string& value) override;
  std::optional<std::string> lookup(const std::string& key) override;

 private:
  const c10::intrusive_ptr<c10d::Store> store_;
};

} // namespace bootstrap
} // namespace pyddp
