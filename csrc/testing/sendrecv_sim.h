// An in-process stand-in for NCCL's point-to-point groups, for CPU tests of
// SendRecvRing (transport/sendrecv_ring.h) and the descriptor check by
// words (common/descriptor.h) under the real algorithms
// (algorithms/collectives.h): the ranks are threads of one process, and a
// send completes only once its receiver has posted the matching receive
// (the strictest behaviour NCCL allows), so a pairing that could deadlock
// on a GPU deadlocks here too, and is reported when `timeout` passes.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "common/descriptor.h"
#include "kernels/cpu.h"

namespace pyddp {
namespace sendrecv {

// One collective on every simulated rank. Rank r runs descs[r] (ranks may
// disagree, to test the check) with op specs[r], reading inputs[r] and
// writing outputs[r] (host buffers shaped as the engine shapes them:
// all_gather's output and reduce_scatter's input hold world-size blocks of
// descs[r].count elements; broadcast runs in place on outputs[r]).
// Each rank runs its collective `repeats` times in a row on the same
// transport (sequence numbers descs[r].seq, +1, ...), to catch state
// carried between collectives. flushAfter=false leaves out
// SendRecvRing::flush() (an engine that forgets it).
// Returns each rank's error message ("" when it succeeded); a rank that
// fails makes the others' waits fail at once.
std::vector<std::string> simulateRing(const std::vector<CollectiveDesc>& descs,
                  const std::vector<kernels::ReduceSpec>& specs,
                  const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                  size_t pieceBytes, int repeats, bool flushAfter,
                  std::chrono::milliseconds timeout);

} // namespace sendrecv
} // namespace pyddp
