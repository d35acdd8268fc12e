#include "algorithms/select.h"

namespace pyddp {
namespace algorithms {
namespace {

// The all-reduce's algorithm for `bytes`, staged. Transports without mapped
// peer memory (NCCL) run every size on the ring.
Algo allReduceAlgo(size_t bytes, const Capabilities& caps, const GroupOptions& o) {
  if (!caps.peerMemory) return Algo::Ring;
  if (o.algo != Algo::Auto) return o.algo;
  if (o.directMaxBytes > 0 && bytes <= o.directMaxBytes) return Algo::Direct;
  if (bytes <= o.twoShotMaxBytes) return Algo::TwoShot;
  return Algo::Ring;
}

// The all-gather's and reduce-scatter's for `bytes` staged per rank: Ring
// and Direct as set; otherwise Direct up to directMaxBytes (one round, one
// meeting) and Ring above (which overlaps its copies, piece by piece).
Algo gatherAlgo(size_t bytes, const Capabilities& caps, const GroupOptions& o) {
  if (!caps.peerMemory) return Algo::Ring;
  if (o.algo == Algo::Ring || o.algo == Algo::Direct) return o.algo;
  return o.directMaxBytes > 0 && bytes <= o.directMaxBytes ? Algo::Direct : Algo::Ring;
}

// The fused all-reduce's program for `bytes` per rank: Direct (one-shot)
// as set or up to kFusedOneShotMaxBytes, else TwoShot (the fused engine has
// no ring: Ring set takes two-shot, which moves as little per rank).
Algo fusedAllReduceAlgo(size_t bytes, const GroupOptions& o) {
  if (o.algo == Algo::Direct) return Algo::Direct;
  if (o.algo == Algo::Auto && bytes <= kFusedOneShotMaxBytes) return Algo::Direct;
  return Algo::TwoShot;
}

// A fused engine's plan: the all-reduce's program (also the reduce's, an
// all-reduce only the root keeps); the other collectives have one program
// and keep the descriptor's algo. No messages. A collective that reads in
// place, on a tensor in a registered buffer (desc.window, alike on every
// rank), reads the peers' where they lie, but the one-shot all-reduce,
// which meets its peers once where in place meets them three times.
Plan fusedPlan(Plan p, const CollectiveDesc& desc, const GroupOptions& options) {
  if (p.kind == CollectiveKind::AllReduce || p.kind == CollectiveKind::Reduce) {
    p.algo = fusedAllReduceAlgo(p.bytes, options);
  }
  p.staged = p.algo;
  if (desc.window != 0 && readsInPlace(p.kind) &&
      !(p.kind == CollectiveKind::AllReduce && p.algo == Algo::Direct)) {
    p.algo = Algo::Registered;
    p.reads.mapped = true;
  }
  return p;
}

} // namespace

bool readsRegistered(CollectiveKind kind, size_t bytes) {
  switch (kind) {
    case CollectiveKind::ReduceScatter:
      return bytes >= kRegisteredReduceScatterMinBytes;
    case CollectiveKind::AllReduce:
      return bytes >= kRegisteredAllReduceMinBytes && bytes <= kRegisteredMaxBytes;
    default:
      return bytes >= kRegisteredMinBytes && bytes <= kRegisteredMaxBytes;
  }
}

Plan select(const CollectiveDesc& desc, const Capabilities& caps, const GroupOptions& options) {
  Plan p;
  p.kind = desc.kind;
  p.bytes = desc.count * elementSize(desc.dtype);
  p.algo = desc.algo;
  if (caps.fused) return fusedPlan(p, desc, options);
  switch (desc.kind) {
    case CollectiveKind::AllReduce:
      p.algo = allReduceAlgo(p.bytes, caps, options);
      break;
    case CollectiveKind::AllGather:
      p.algo = gatherAlgo(p.bytes, caps, options);
      break;
    case CollectiveKind::ReduceScatter:
      // staged: a rank's whole input
      p.algo = gatherAlgo(caps.worldSize * p.bytes, caps, options);
      break;
    case CollectiveKind::Broadcast:
      p.algo = Algo::Ring;
      break;
    case CollectiveKind::Reduce:
      // the all-reduce's direct algorithm for small sizes; else the ring's
      p.algo = allReduceAlgo(p.bytes, caps, options) == Algo::Direct ? Algo::Direct : Algo::Ring;
      p.messages = caps.messages;
      break;
    case CollectiveKind::Gather:
      p.messages = caps.messages;
      p.algo = p.messages ? Algo::Direct : Algo::Ring;
      break;
    case CollectiveKind::Scatter:
      p.messages = caps.messages;
      if (p.messages) p.algo = Algo::Direct;
      break;
    case CollectiveKind::AllToAll:
      p.messages = true;
      p.algo = Algo::Direct;
      break;
    default:
      break;
  }
  p.staged = p.algo;
  if (!readsInPlace(desc.kind)) return p;
  // Options and refusals are alike on every rank, and so are these.
  p.reads.mapped = caps.readsRegistered && readsRegistered(desc.kind, p.bytes);
  p.reads.throughKernel =
      caps.readsThroughKernel && options.cma != CmaReads::Never && p.bytes >= options.cmaMinBytes;
  if (p.reads.mapped || p.reads.throughKernel) p.algo = Algo::Registered;
  p.votes = p.reads.throughKernel && caps.rank == kernelVoter(desc.root, caps.worldSize);
  return p;
}

Plan vote(Plan plan, const KernelChoice& chooser) {
  if (!plan.votes) return plan;
  const KernelPick pick = chooser.peek(plan.kind, plan.bytes);
  plan.reads.kernelVote = pick.kernel;
  plan.timed = pick.timed;
  return plan;
}

} // namespace algorithms
} // namespace pyddp
