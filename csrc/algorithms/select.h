// Which algorithm a collective of TransportEngine or FusedEngine takes, and
// how it copies its peers' data: the whole policy as pure functions of the call, what the
// transport offers and the group's options, so that it can be read and
// tested as a table (tests/unit/test_select.py). The engines run the plan
// (backend/transport_engine.cpp, backend/fused_engine.cpp).
//
// Two moments decide. When the call is made, select() fixes the algorithm:
// it goes on the descriptor, which every rank compares at the arrival, so
// it may depend only on what is alike on every rank (the call, the
// options, refusals agreed at connect). When the collective runs, after
// every collective before it, the rank that votes on the kernel copy asks
// its chooser (vote()), whose estimates follow the times of the
// collectives before (backend/cma_chooser.h); the vote travels to the
// peers in the word staged at the arrival (algorithms::TensorWhere).
#pragma once

#include <cstddef>
#include <optional>

#include "algorithms/collectives.h"
#include "common/config.h"
#include "common/descriptor.h"

namespace pyddp {
namespace algorithms {

// What the engine's transport offers, found once it has connected, alike
// on every rank.
struct Capabilities {
  int rank = 0;
  int worldSize = 1;
  // It maps peers' staging buffers: the direct and two-shot algorithms.
  bool peerMemory = false;
  // It moves messages between pairs of ranks (MessageLink): reduce, gather
  // and scatter send to or from the root alone.
  bool messages = false;
  // Every rank maps every peer's registered tensors (TransportEngine::
  // registeredRefusal() is empty).
  bool readsRegistered = false;
  // Every rank reads every peer's plain tensors through the kernel
  // (TransportEngine::processRefusal() is empty).
  bool readsThroughKernel = false;
  // Every collective is one launch of a channel program (FusedEngine,
  // device/programs.h): the all-reduce one-shot (Direct) or two-shot
  // (TwoShot), every other collective its one program; Registered, reading
  // the peers' tensors where they lie, on a registered buffer
  // (CollectiveDesc::window).
  bool fused = false;
};

// How one collective runs on this rank.
struct Plan {
  CollectiveKind kind = CollectiveKind::Barrier;
  // Bytes per rank (an all-reduce's tensor, a reduce-scatter's output
  // block): what the windows below and the chooser go by.
  size_t bytes = 0;
  // The descriptor's algorithm: Registered where the collective may read
  // its peers' tensors where they lie (registeredAllReduce and its kin).
  Algo algo = Algo::Ring;
  // What runs where it does not read them in place (a tensor not
  // registered, a vote against the kernel): Ring, Direct or TwoShot.
  // For the collectives that never read in place, algo.
  Algo staged = Algo::Ring;
  // Reduce, gather and scatter: one message to or from the root per rank;
  // otherwise the ring's all-reduce and all-gather into scratch, and the
  // broadcast chain.
  bool messages = false;
  // The copy path of a Registered plan: peers' registered tensors mapped
  // (reads.mapped, inside the window readsRegistered() takes), plain ones
  // read through the kernel (reads.throughKernel, from cmaMinBytes on) if
  // the voter votes so (reads.kernelVote, set by vote()).
  InPlaceReads reads;
  // This rank votes on the kernel copy (kernelVoter()): vote() asks its
  // chooser, and the chooser hears how it went (PathFeedback).
  bool votes = false;
  // Set by vote(): the chooser wants the collective's time.
  bool timed = false;
};

// The chooser's pick for the next collective of `kind` (one that may read
// through the kernel) on `bytes` per rank, read without changing it: the
// view select's vote() consults.
struct KernelPick {
  bool kernel = false;
  bool timed = false;
};
class KernelChoice {
 public:
  virtual KernelPick peek(CollectiveKind kind, size_t bytes) const = 0;

 protected:
  ~KernelChoice() = default;
};

// What the engine tells a chooser after it ran a plan that asked it
// (Plan::votes): the call counts whatever happened; `nanoseconds` is the
// time it was asked for, from the end of the arrival meeting to the end
// of the collective on every rank, or nullopt where it was not asked for
// or the collective did not take the path voted for.
class PathFeedback {
 public:
  virtual void record(const Plan& plan, std::optional<double> nanoseconds) = 0;

 protected:
  ~PathFeedback() = default;
};

// The bytes per rank from which, and up to which, reading registered
// tensors in place measured faster than staging them
// (benchmarks/studies/registered-memory.md, "The window's edges").
constexpr size_t kRegisteredMinBytes = 64 * 1024;
constexpr size_t kRegisteredAllReduceMinBytes = 512 * 1024;
constexpr size_t kRegisteredMaxBytes = 8 * 1024 * 1024;
constexpr size_t kRegisteredReduceScatterMinBytes = 4 * 1024;

// Fused all-reduces of at most this many bytes per rank take the one-shot
// program (every rank reduces the whole tensor: one barrier per round),
// larger ones two-shot (each reduces its block: two barriers, a 1/n share
// of the reduction). An initial value from vLLM's and TensorRT-LLM's
// choices for a few GPUs, not yet measured on pyddp's kernels.
constexpr size_t kFusedOneShotMaxBytes = 256 * 1024;

// The collectives that have an algorithm reading peers' tensors in place,
// mapped or through the kernel.
constexpr bool readsInPlace(CollectiveKind kind) {
  return kind == CollectiveKind::AllGather || kind == CollectiveKind::Broadcast ||
      kind == CollectiveKind::AllReduce || kind == CollectiveKind::ReduceScatter;
}
// Whether a collective of `kind` (readsInPlace) on `bytes` per rank maps
// registered tensors where they lie when all it reads are.
bool readsRegistered(CollectiveKind kind, size_t bytes);

// The plan of `desc` (as the front end made it: its algo is what a
// collective without a choice keeps), before the vote.
Plan select(const CollectiveDesc& desc, const Capabilities& caps, const GroupOptions& options);

// `plan` with its vote, where it votes: the chooser's pick, read when the
// collective runs.
Plan vote(Plan plan, const KernelChoice& chooser);

} // namespace algorithms
} // namespace pyddp
