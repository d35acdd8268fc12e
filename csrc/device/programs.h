// The fused collectives as channel programs: what one channel of one rank
// does for a whole collective, written once for the GPU (a channel is a
// thread block of a single launch: fused_kernels.cu) and the emulated grid
// (a channel is a CPU thread: emulated_grid.h), against primitives.h. The
// buffers and the barrier protocol are layout.h's.
//
// A collective's elements split into `channels` contiguous parts, one per
// channel (in 16-byte granules, so every part starts aligned). A channel
// moves its part in rounds of at most a chunk per rank:
//
//   one-shot all-reduce  stage the chunk; barrier; reduce every rank's
//                        staged chunk, in rank order, into the output.
//   two-shot all-reduce  stage the chunk; barrier; rank r reduces block r of
//                        every rank's chunk, in rank order, into its
//                        results; barrier; copy every rank's reduced block
//                        into the output.
//   all-gather           stage the chunk of this rank's input; barrier; copy
//                        every rank's staged chunk into its block of the
//                        output.
//   reduce-scatter       stage the chunk's piece of every block of the input;
//                        barrier; reduce block `rank` of every rank's
//                        staged pieces, in rank order, into the output.
//   broadcast            the root stages the chunk; barrier; the others copy
//                        the root's staged chunk.
//   barrier              one barrier on channel 0.
//
// A registered launch (FusedArgs::peer set: every rank's tensor lies in a
// buffer that every rank mapped when it was registered, each at the offset
// its rank publishes at the first barrier) stages nothing and has no
// rounds: a channel reads its peers' parts where they lie and writes its
// own rank's tensor only, between barriers that every channel of the
// launch crosses:
//
//   all-reduce (two-shot) barrier; rank r reduces block r of every rank's
//                         part, in rank order, in place into its own;
//                         barrier; copy every other rank's reduced block
//                         from its tensor; barrier.
//   all-gather            barrier; copy every rank's part of its input into
//                         its block of the output; barrier.
//   reduce-scatter        barrier; reduce block `rank` of every rank's
//                         input, in rank order, into the output; barrier.
//   broadcast             barrier; the others copy the root's part; barrier.
//
// The first barrier says every rank's tensor holds its input (its stream
// reached the launch). A rank writes only what no peer reads before the
// next barrier: its own block of the all-reduce in the first phase (peers
// read theirs), the other blocks in the second (peers read each block
// from the rank that reduced it), an output that does not overlap what
// peers read of its input (the engine refuses the registered path for one
// that does). The last barrier: no rank returns, letting its caller write
// its tensor, while a peer still reads it.
//
// Reductions run in rank order on every rank, so every rank ends with the
// same bits; half types accumulate in fp32 (kernels/reduce.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "algorithms/schedule.h"
#include "device/layout.h"
#include "kernels/elementwise.h"
#include "kernels/reduce.h"

namespace pyddp {
namespace device {

enum class Protocol : int32_t {
  OneShotAllReduce = 0,
  TwoShotAllReduce = 1,
  AllGather = 2,
  ReduceScatter = 3,
  Broadcast = 4,
  Barrier = 5,
};

// What a launch does, by value (a kernel argument): the same on every rank
// but for rank, input and output.
struct FusedArgs {
  Protocol protocol;
  int32_t rank;
  int32_t size;
  int32_t channels;  // channels of this launch, at most geometry.channels
  int32_t root;      // broadcast's source
  int32_t average;   // AVG: divide the sum by size
  // The collective's sequence number and its descriptor's digest: ranks
  // that called different collectives fail instead of mixing them.
  uint64_t seq;
  uint64_t digest;
  // all-reduce, broadcast: the tensor's elements; all-gather: the input's;
  // reduce-scatter: the output's (the input has size times as many).
  uint64_t count;
  const void* input;
  void* output;
  char* base[kMaxRanks];  // every rank's buffer, this rank's own writable
  // Registered launches: every rank's registered buffer that the tensor
  // peers read lies in (the all-reduce's buffer; the input of the others),
  // as this rank addresses it; all null for a staged launch. `offset`:
  // where this rank's tensor starts in its own, published at the first
  // barrier (each rank's may differ).
  const char* peer[kMaxRanks];
  uint64_t offset;
  Geometry geometry;
  // Before this launch: barriers crossed and rounds staged, by channel
  // (layout.h; the host keeps the counts as the programs advance them).
  uint64_t crossed[kMaxChannels];
  uint64_t rounds[kMaxChannels];
  int64_t* error;        // first failure of this rank's device; 0 = none
  const int64_t* abort;  // set by the host to end every wait
  uint64_t timeoutNs;
};

// What channel c does in a collective: its part (elements [first, first +
// elements) of each rank-sized block), the elements per round and per
// rank, and how many rounds and barriers.
struct ChannelPlan {
  size_t first = 0;
  size_t elements = 0;
  size_t roundElements = 0;
  uint64_t rounds = 0;
  uint64_t barriers = 0;
};

PYDDP_DEV inline size_t granule(size_t elementBytes) {
  return elementBytes >= kernels::grid::kVecBytes ? 1 : kernels::grid::kVecBytes / elementBytes;
}

// Part p of `total` elements split as evenly as possible into `parts` in
// whole granules (the last part takes the rest).
PYDDP_DEV inline schedule::Range granulePart(size_t total, int parts, int p, size_t granuleElems) {
  const size_t granules = total / granuleElems;
  const schedule::Range g = schedule::balancedBlock(granules, parts, p);
  const size_t begin = g.begin * granuleElems;
  const size_t end = p == parts - 1 ? total : (g.begin + g.count) * granuleElems;
  return schedule::Range{begin, end - begin};
}

PYDDP_DEV inline bool registered(const FusedArgs& a) {
  return a.peer[0] != nullptr;
}

PYDDP_DEV inline ChannelPlan planChannel(const FusedArgs& a, int c, size_t elementBytes) {
  ChannelPlan p;
  if (a.protocol == Protocol::Barrier) {
    if (c == 0) {
      p.rounds = 1;
      p.barriers = 1;
    }
    return p;
  }
  const size_t g = granule(elementBytes);
  const schedule::Range part = granulePart(a.count, a.channels, c, g);
  p.first = part.begin;
  p.elements = part.count;
  const size_t chunk = a.geometry.chunkBytes / elementBytes;
  // A reduce-scatter stages a piece of each of the size blocks per round.
  const size_t perRound = a.protocol == Protocol::ReduceScatter
      ? chunk / static_cast<size_t>(a.size) / g * g
      : chunk / g * g;
  if (registered(a)) {
    // the whole part at once, on every channel of the launch alike
    p.roundElements = p.elements;
    p.barriers = a.protocol == Protocol::TwoShotAllReduce ? 3 : 2;
    return p;
  }
  p.roundElements = perRound > 0 ? perRound : g;
  p.rounds = (p.elements + p.roundElements - 1) / p.roundElements;
  // Every collective meets on channel 0 at least once, so ranks that called
  // different collectives always compare digests there.
  if (p.rounds == 0 && c == 0) p.rounds = 1;
  p.barriers = p.rounds * (a.protocol == Protocol::TwoShotAllReduce ? 2 : 1);
  return p;
}

PYDDP_DEV inline FusedHeader* headerOf(const FusedArgs& a, int rank) {
  return reinterpret_cast<FusedHeader*>(a.base[rank]);
}

// This rank gives up with `error` (the first cause is kept) and tells its
// peers through its failed flag.
PYDDP_DEV inline void giveUp(const FusedArgs& a, int64_t error) {
#if defined(__CUDA_ARCH__)
  atomicCAS(reinterpret_cast<unsigned long long*>(a.error), 0ull,
            static_cast<unsigned long long>(error));
#else
  int64_t none = 0;
  std::atomic_ref<int64_t>(*a.error).compare_exchange_strong(none, error,
                                                             std::memory_order_acq_rel);
#endif
  storeRelease(&headerOf(a, a.rank)->failed.value, 1);
}

// How many polls of a flag pass between looks at the clock, the abort
// word and the peer's failed flag: each is a load the flag's own poll does
// not need.
constexpr unsigned kPollsPerCheck = 64;

// Channel c arrives at its barrier number `k` and waits for every peer's;
// with `agree`, it first publishes the collective's digest and then
// compares each peer's. False, on every thread of the team, once this rank
// gave up (the error word says why).
PYDDP_DEV inline bool crossBarrier(const FusedArgs& a, int c, uint64_t k, bool agree,
                                   const Team& team, int* shared) {
  team.sync();  // the team's writes happen before the arrival
  if (team.leader()) {
    FusedHeader* own = headerOf(a, a.rank);
    const int slot = static_cast<int>(a.seq % kDigestRing);
    if (agree) {
      own->digest[c].slot[slot] = a.digest;
      own->digest[c].offset[slot] = a.offset;
    }
    storeRelease(&own->arrive[c].value, k);
    int64_t verdict = kOk;
    const uint64_t start = nowNs();
    for (int r = 0; r < a.size && verdict == kOk; ++r) {
      if (r == a.rank) continue;
      const FusedHeader* peer = headerOf(a, r);
      for (unsigned polls = 1;; ++polls) {
        const bool check = polls % kPollsPerCheck == 0;
        verdict = waitVerdict(loadAcquire(&peer->arrive[c].value), k,
                              check ? loadAcquire(&peer->failed.value) : 0,
                              check ? loadVolatile(a.abort) : 0,
                              check ? nowNs() - start : 0, a.timeoutNs, r);
        if (verdict != -1) break;
        pause();
      }
      if (verdict == kOk && agree &&
          static_cast<uint64_t>(loadVolatile(reinterpret_cast<const int64_t*>(
              &peer->digest[c].slot[slot]))) != a.digest) {
        verdict = encodeError(kMismatch, r);
      }
    }
    if (verdict != kOk) giveUp(a, verdict);
    *shared = verdict == kOk ? 1 : 0;
  }
  team.sync();
  return *shared != 0;
}

// dst = src, `bytes` of them, by the team, in the widest units the
// addresses allow.
PYDDP_DEV inline void teamCopy(const Team& team, void* dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  const kernels::grid::GridPos pos{0, 1, static_cast<uint32_t>(team.tid),
                                   static_cast<uint32_t>(team.size)};
  const uintptr_t common = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                           bytes;
  const auto go = [&](auto unit) {
    using U = decltype(unit);
    const kernels::grid::Copy<U> f{static_cast<U*>(dst), nullptr, static_cast<const U*>(src)};
    const size_t count = bytes / sizeof(U);
    kernels::grid::gridMap(pos, f, count, kernels::grid::alignedSplit(f, count));
  };
  if (common % 8 == 0) {
    go(uint64_t{});
  } else if (common % 4 == 0) {
    go(uint32_t{});
  } else if (common % 2 == 0) {
    go(uint16_t{});
  } else {
    go(uint8_t{});
  }
}

// dst = finish(src[0] op ... op src[n - 1]), `count` elements, by the team.
template <typename T, typename Op>
PYDDP_DEV inline void teamReduce(const Team& team, const FusedArgs& a, T* dst,
                                 const T* const* src, size_t count) {
  if (count == 0) return;
  using A = kernels::acc_t<T>;
  kernels::grid::ReduceN<T, Op> f{};
  f.dst = dst;
  for (int k = 0; k < a.size; ++k) f.src[k] = src[k];
  f.nsrc = a.size;
  f.fin = kernels::Finish<A>{a.average ? static_cast<A>(a.size) : A(0)};
  const kernels::grid::GridPos pos{0, 1, static_cast<uint32_t>(team.tid),
                                   static_cast<uint32_t>(team.size)};
  kernels::grid::gridMap(pos, f, count, kernels::grid::alignedSplit(f, count));
}

// Channel c's part of the registered launch `a` (planned as `plan`), its
// barriers counted from `k`.
template <typename T, typename Op>
PYDDP_DEV void runRegistered(const FusedArgs& a, int c, const ChannelPlan& plan, uint64_t k,
                             const Team& team, int* shared) {
  const int n = a.size;
  const size_t g = granule(sizeof(T));
  T* out = static_cast<T*>(a.output);
  // every rank's tensor holds its input, and each says where it lies
  if (!crossBarrier(a, c, ++k, true, team, shared)) return;
  const T* tensor[kMaxRanks];
  const int slot = static_cast<int>(a.seq % kDigestRing);
  for (int r = 0; r < n; ++r) {
    const uint64_t offset = r == a.rank
        ? a.offset
        : static_cast<uint64_t>(loadVolatile(
              reinterpret_cast<const int64_t*>(&headerOf(a, r)->digest[c].offset[slot])));
    tensor[r] = reinterpret_cast<const T*>(a.peer[r] + offset);
  }
  const auto peer = [&](int r) { return tensor[r]; };
  const T* src[kMaxRanks];
  switch (a.protocol) {
    case Protocol::TwoShotAllReduce: {
      // reduce this rank's block in place, then fetch the others' reduced
      const schedule::Range mine = granulePart(plan.elements, n, a.rank, g);
      for (int r = 0; r < n; ++r) src[r] = peer(r) + plan.first + mine.begin;
      teamReduce<T, Op>(team, a, out + plan.first + mine.begin, src, mine.count);
      if (!crossBarrier(a, c, ++k, false, team, shared)) return;
      for (int r = 0; r < n; ++r) {
        if (r == a.rank) continue;
        const schedule::Range block = granulePart(plan.elements, n, r, g);
        const size_t at = plan.first + block.begin;
        teamCopy(team, out + at, peer(r) + at, block.count * sizeof(T));
      }
      break;
    }
    case Protocol::AllGather:
      for (int r = 0; r < n; ++r) {
        teamCopy(team, out + r * a.count + plan.first, peer(r) + plan.first,
                 plan.elements * sizeof(T));
      }
      break;
    case Protocol::ReduceScatter:
      for (int r = 0; r < n; ++r) src[r] = peer(r) + a.rank * a.count + plan.first;
      teamReduce<T, Op>(team, a, out + plan.first, src, plan.elements);
      break;
    case Protocol::Broadcast:
      if (a.rank != a.root) {
        teamCopy(team, out + plan.first, peer(a.root) + plan.first, plan.elements * sizeof(T));
      }
      break;
    default:
      break;
  }
  // no peer reads this rank's tensor any more
  crossBarrier(a, c, ++k, false, team, shared);
}

// Channel c's whole part of the collective `a`, on element type T and
// operator Op. `shared` is one int the team shares (the barrier's verdict).
template <typename T, typename Op>
PYDDP_DEV void runChannel(const FusedArgs& a, int c, const Team& team, int* shared) {
  if (loadVolatile(a.error) != 0) return;  // an earlier launch gave up: drain
  const ChannelPlan plan = planChannel(a, c, sizeof(T));
  if (registered(a)) {
    runRegistered<T, Op>(a, c, plan, a.crossed[c], team, shared);
    return;
  }
  const int n = a.size;
  const Geometry& geo = a.geometry;
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  uint64_t k = a.crossed[c];
  const auto staging = [&](int r, uint64_t round) {
    return reinterpret_cast<T*>(a.base[r] + geo.stagingOffset(c, round));
  };
  const auto results = [&](int r, uint64_t round) {
    return reinterpret_cast<T*>(a.base[r] + geo.resultsOffset(c, round));
  };
  const T* src[kMaxRanks];
  for (uint64_t j = 0; j < plan.rounds; ++j) {
    const uint64_t round = a.rounds[c] + j;
    const size_t begin = j * plan.roundElements;
    const size_t len = begin + plan.roundElements < plan.elements ? plan.roundElements
                                                                 : plan.elements - begin;
    const size_t at = plan.first + begin;  // in a rank-sized block
    const bool agree = j == 0;
    switch (a.protocol) {
      case Protocol::OneShotAllReduce:
        teamCopy(team, staging(a.rank, round), in + at, len * sizeof(T));
        if (!crossBarrier(a, c, ++k, agree, team, shared)) return;
        for (int r = 0; r < n; ++r) src[r] = staging(r, round);
        teamReduce<T, Op>(team, a, out + at, src, len);
        break;
      case Protocol::TwoShotAllReduce: {
        teamCopy(team, staging(a.rank, round), in + at, len * sizeof(T));
        if (!crossBarrier(a, c, ++k, agree, team, shared)) return;
        const schedule::Range mine = granulePart(len, n, a.rank, granule(sizeof(T)));
        for (int r = 0; r < n; ++r) src[r] = staging(r, round) + mine.begin;
        teamReduce<T, Op>(team, a, results(a.rank, round), src, mine.count);
        if (!crossBarrier(a, c, ++k, false, team, shared)) return;
        for (int r = 0; r < n; ++r) {
          const schedule::Range block = granulePart(len, n, r, granule(sizeof(T)));
          teamCopy(team, out + at + block.begin, results(r, round), block.count * sizeof(T));
        }
        break;
      }
      case Protocol::AllGather:
        teamCopy(team, staging(a.rank, round), in + at, len * sizeof(T));
        if (!crossBarrier(a, c, ++k, agree, team, shared)) return;
        for (int r = 0; r < n; ++r) {
          teamCopy(team, out + r * a.count + at, staging(r, round), len * sizeof(T));
        }
        break;
      case Protocol::ReduceScatter:
        for (int b = 0; b < n; ++b) {
          teamCopy(team, staging(a.rank, round) + b * len, in + b * a.count + at,
                   len * sizeof(T));
        }
        if (!crossBarrier(a, c, ++k, agree, team, shared)) return;
        for (int r = 0; r < n; ++r) src[r] = staging(r, round) + a.rank * len;
        teamReduce<T, Op>(team, a, out + at, src, len);
        break;
      case Protocol::Broadcast:
        if (a.rank == a.root) teamCopy(team, staging(a.rank, round), in + at, len * sizeof(T));
        if (!crossBarrier(a, c, ++k, agree, team, shared)) return;
        if (a.rank != a.root) teamCopy(team, out + at, staging(a.root, round), len * sizeof(T));
        break;
      case Protocol::Barrier:
        if (!crossBarrier(a, c, ++k, agree, team, shared)) return;
        break;
    }
  }
}

} // namespace device
} // namespace pyddp
