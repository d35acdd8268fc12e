#include "backend/monitored_barrier.h"

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "backend/p2p_executor.h"
#include "common/check.h"

namespace pyddp {
namespace monitored {
namespace {

using Ms = std::chrono::milliseconds;

at::Tensor token(int64_t value) { return at::full({1}, value, at::kLong); }

// Why a token's receive failed, as its error's cause: the receive itself
// (its reserved tag means nothing to a user) is what the barrier's message
// already says. A receive's message is "<who>: <receive> did not complete
// within its timeout: <cause>" or "<who>: <receive> cannot complete:
// <cause>" (ShmMessages::expire); any other message is quoted whole.
std::string causeOf(const std::exception& e) {
  const std::string what = messageOf(e);
  for (std::string_view marker : {"within its timeout: ", "cannot complete: "}) {
    const size_t at = what.find(marker);
    if (at != std::string::npos) return what.substr(at + marker.size());
  }
  return bare(what);
}

std::string joined(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// Rank r != 0: arrive, then wait for rank 0's verdict.
void arrive(P2pExecutor& p2p, int rank, uint64_t call, Ms groupTimeout) {
  const at::Tensor verdict = token(kPassed);
  const std::string reached = "Rank " + std::to_string(rank) +
      " successfully reached monitoredBarrier, but received errors while waiting for "
      "send/recv from rank 0";
  try {
    p2p.send(token(rank), 0, tag(call, false), groupTimeout)->wait();
    p2p.recv(verdict, verdict, 0, tag(call, true), groupTimeout, nullptr)->wait();
  } catch (const std::exception& e) {
    PYDDP_CHECK_COMM(false, reached, ": ", causeOf(e),
                     ". Please check rank 0 logs for faulty rank.");
  }
  const int64_t faulty = verdict.item<int64_t>();
  PYDDP_CHECK_COMM(faulty == kPassed, reached, ": rank 0 found that rank ", faulty,
                   " failed to pass monitoredBarrier. Please check rank 0 logs for faulty rank.");
}

} // namespace

void barrier(P2pExecutor& p2p, int rank, int size, uint64_t call, Ms timeout, Ms groupTimeout,
             bool waitAllRanks) {
  if (size == 1) return;
  if (rank != 0) return arrive(p2p, rank, call, groupTimeout);

  // judge: every token's receive is posted now, so all share one deadline
  const auto deadline = Clock::now() + timeout;
  std::vector<at::Tensor> tokens;
  std::vector<c10::intrusive_ptr<c10d::Work>> receives;
  for (int r = 1; r < size; ++r) {
    tokens.push_back(token(kPassed));
    receives.push_back(p2p.recv(tokens.back(), tokens.back(), r, tag(call, false), timeout,
                                nullptr));
  }
  std::vector<int> passed, failed;
  std::string error;  // the first failure's message
  for (int r = 1; r < size; ++r) {
    auto& received = receives[r - 1];
    const bool arrived = received->isCompleted() && !received->exception();
    if (!waitAllRanks && !arrived && Clock::now() >= deadline) {
      error = "Rank 0 timed out in monitoredBarrier after " + std::to_string(timeout.count()) +
          " ms. " + (passed.empty() ? "No ranks successfully processed in monitoredBarrier."
                                    : "Successfully processed ranks: " + joined(passed));
      failed.push_back(r);
      break;
    }
    try {
      received->wait();
      passed.push_back(r);
    } catch (const std::exception& e) {
      failed.push_back(r);
      if (error.empty()) {
        error = "Rank " + std::to_string(r) + " failed to pass monitoredBarrier in " +
            std::to_string(timeout.count()) + " ms: " + causeOf(e);
      }
      if (!waitAllRanks) break;
    }
  }
  if (failed.size() > 1) {
    error = "Ranks " + joined(failed) + " failed to pass monitoredBarrier in " +
        std::to_string(timeout.count()) + " ms";
  }

  // answer: every rank learns the verdict; on failure nothing waits for the
  // answers, which ranks that never arrive will not take
  const int64_t verdict = failed.empty() ? kPassed : failed.front();
  std::vector<c10::intrusive_ptr<c10d::Work>> answers;
  for (int r = 1; r < size; ++r) answers.push_back(p2p.send(token(verdict), r, tag(call, true),
                                                            groupTimeout));
  PYDDP_CHECK_COMM(failed.empty(), error);
  for (auto& answer : answers) answer->wait();
}

} // namespace monitored
} // namespace pyddp
