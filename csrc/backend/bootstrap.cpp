#include "backend/bootstrap.h"

#include <exception>

#include "common/blob.h"
#include "common/check.h"

namespace pyddp {
namespace bootstrap {
namespace {

using Ms = std::chrono::milliseconds;

// A rank's outcome of one phase: "ok" and what it publishes, or "failed"
// and why (as bytes: either may span lines).
std::string outcome(const std::string& ok, const std::string& failed) {
  BlobWriter w;
  return failed.empty() ? w.putBytes("ok", ok).str() : w.putBytes("failed", failed).str();
}

} // namespace

std::vector<std::string> allGather(c10d::Store& store, const std::string& key,
                                   const std::string& mine, int rank, int size, Ms timeout) {
  store.set(key + "/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  const auto deadline = Clock::now() + timeout;
  std::vector<std::string> all(size);
  for (int peer = 0; peer < size; ++peer) {
    const std::string k = key + "/" + std::to_string(peer);
    const auto left = std::max(Ms(1), std::chrono::duration_cast<Ms>(deadline - Clock::now()));
    try {
      store.wait({k}, left);
    } catch (const std::exception& e) {
      PYDDP_CHECK_COMM(false, "rank ", peer, " did not join the process group within ",
                       timeout.count(), " ms (rank ", rank, " waited for store key '", k,
                       "'): ", messageOf(e));
    }
    const std::vector<uint8_t> v = store.get(k);
    all[peer].assign(v.begin(), v.end());
  }
  return all;
}

void connect(Transport& transport, c10d::Store& store, int rank, int size, Ms timeout) {
  allGather(store, "hello", "", rank, size, timeout);
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
  const auto published = allGather(store, "blob", outcome(blob, why), rank, size, timeout);
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
  const auto refusals = allGather(store, "connected", outcome("", why), rank, size, timeout);
  if (ownRefusal) std::rethrow_exception(ownRefusal);
  for (int peer = 0; peer < size; ++peer) {
    const BlobReader r(refusals[peer], "rank " + std::to_string(peer) + "'s connect outcome");
    PYDDP_CHECK_COMM(r.has("ok"), "rank ", rank, ": the ", transport.name(),
                     " transport cannot connect: rank ", peer, " refused (", r.bytes("failed"),
                     ")");
  }
  transport.connected();
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
