// monitoredBarrier over point-to-point messages: c10d's barrier that names
// the ranks that did not arrive (torch's ProcessGroup.monitored_barrier),
// with ProcessGroupGloo's protocol and messages, so code that reads gloo's
// errors reads pyddp's.
//
// Protocol, for one call (every rank of the group calls it in the same
// order, as any collective; a rank that skipped one, as the faulty rank of
// a failed barrier did, is a call behind the others from then on):
//   arrive   every rank r != 0 sends rank 0 one token;
//   judge    rank 0 takes the tokens in rank order, all bounded by one
//            deadline (start + timeout): the first rank whose token did not
//            come (every such rank, with waitAllRanks) fails the barrier;
//   answer   rank 0 sends every other rank the verdict: kPassed, or the
//            first rank that failed.
// Only rank 0 applies the caller's timeout: the other ranks wait for the
// verdict within the group's timeout, so that rank 0, not a rank that
// merely waited, names the faulty rank. Unlike gloo, a failed barrier
// still answers, so the ranks that arrived fail at once naming the faulty
// rank instead of at their own timeout.
//
// Tags: call k uses tags kTagBase + 2k (arrive) and kTagBase + 2k + 1
// (answer). They lie below INT32_MIN, out of reach of user tags (32-bit,
// ArgChecks::tag), and differ per call, so a token that arrives after rank
// 0 gave up on it is set aside as an unexpected message instead of being
// taken by a later call.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>

namespace pyddp {

class P2pExecutor;

namespace monitored {

constexpr int64_t kTagBase = std::numeric_limits<int64_t>::min();
static_assert(kTagBase < std::numeric_limits<int32_t>::min());

// The verdict rank 0 sends when every rank arrived in time.
constexpr int64_t kPassed = -1;

// Tag of call `call`'s arrive (answer = false) or answer message.
constexpr int64_t tag(uint64_t call, bool answer) {
  return kTagBase + static_cast<int64_t>(2 * call) + (answer ? 1 : 0);
}

// Runs call number `call` of this rank's monitored barriers; returns once
// the barrier passed, throws c10::DistBackendError naming the faulty rank(s)
// otherwise. `timeout` bounds rank 0's wait for the other ranks,
// `groupTimeout` the other ranks' wait for rank 0.
void barrier(P2pExecutor& p2p, int rank, int size, uint64_t call,
             std::chrono::milliseconds timeout, std::chrono::milliseconds groupTimeout,
             bool waitAllRanks);

} // namespace monitored
} // namespace pyddp
