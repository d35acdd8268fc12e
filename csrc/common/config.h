// The one place where PYDDP_* environment settings are read. Every setting
// is listed in the README; Python reads them through pyddp._C.settings().
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "common/types.h"

namespace pyddp {

// The values an integer setting may take: [min, max], multiples of `step`.
// Checked on the value as written (an environment variable's text, a
// field's value), before it is narrowed to its field's type.
struct IntRange {
  long long min;
  long long max;
  long long step = 1;
};
// Slots hold whole elements of every dtype and start on cache lines.
constexpr IntRange kSlotBytesRange{64, 1LL << 30, 64};
// The fused ring verbs hold one received piece while claiming a send slot.
constexpr IntRange kNumSlotsRange{2, 1024};
constexpr IntRange kStagingRange{0, 1LL << 30};  // direct_max_bytes, two_shot_max_bytes

// RingOptions of one process group. Defaults come from the environment; Python
// may override fields (pyddp.RingOptions) before creating the group. All
// ranks must use the same geometry (slotBytes, numSlots, directMaxBytes):
// connecting checks it.
struct RingOptions {
  // Bytes per ring slot: a block moves through the ring in pieces of at most
  // this size, so copying a piece overlaps with reducing the previous one.
  size_t slotBytes;
  // Slots per ring link. The fused ring verbs hold one received piece while
  // claiming a send slot, so fewer than 2 slots deadlock the ring.
  int numSlots;
  // All-reduces up to this many bytes use the direct (one-shot) algorithm;
  // it is also the size of each rank's staging buffers, so a forced direct
  // all-reduce of more moves in chunks of this size. 0 disables direct.
  size_t directMaxBytes;
  // All-reduces larger than directMaxBytes and up to this many bytes use the
  // two-shot algorithm; 0 disables it under Auto.
  size_t twoShotMaxBytes;
  Algo algo;
  // Milliseconds every wait may take before it fails naming the missing rank.
  int64_t timeoutMs;
  // Bytes of point-to-point messages that arrived before their receive was
  // posted that a rank holds per sending peer; more wait in the sender's
  // channel (transport/shm_channel.h). Each rank's own: ranks may differ.
  size_t p2pBufferBytes;
  // How this rank writes the pieces it copies into its ring slots
  // (transport/slot_stores.h). Each rank's own: ranks may differ.
  SlotStores slotStores;
  // All-gathers, broadcasts, all-reduces and reduce-scatters of at least
  // cmaMinBytes per rank may read each peer's plain (unregistered) tensor
  // where it lies, through Linux cross-memory attach (process_vm_readv):
  // one copy, made by the kernel, instead of one into a ring slot and one
  // out (a broadcast's root writes part of each receiver's meanwhile; a
  // reduction reduces from the copy). `cma` says on which calls
  // (backend/cma_chooser.h). Every rank must use the same two values:
  // connecting checks it.
  CmaReads cma;
  size_t cmaMinBytes;

  static RingOptions fromEnv();
  void validate() const;  // throws ValueError naming the offending setting
  // Bytes of each staging buffer of the direct algorithms: a larger message
  // moves through them in rounds.
  size_t stagingBytes() const;
  // The all-reduce algorithm for a message of `bytes` (never Auto).
  Algo allReduceAlgo(size_t bytes) const;
  // The all-gather and reduce-scatter algorithm for `bytes` staged per rank
  // (never Auto): Ring and Direct as set; otherwise Direct up to
  // directMaxBytes (one round, one meeting) and Ring above (which overlaps
  // its copies, piece by piece).
  Algo gatherAlgo(size_t bytes) const;
};

// Measured with `PYDDP_SLOT_BYTES=... PYDDP_NUM_SLOTS=... python -m pyddp.bench
// --backends pyddp -b 1M -e 64M` on the 2-core development machine, 2 ranks:
// 64 KiB to 256 KiB slots with 4 or 8 slots were within noise of each other
// (64 MiB all_reduce ~9 ms); 1 MiB slots were 5-10% slower. The smallest of
// the best keeps a rank's ring buffers (512 KiB) inside its L2 cache.
constexpr size_t kDefaultSlotBytes = 64 * 1024;
constexpr int kDefaultNumSlots = 8;
// Same machine, PYDDP_ALGO=direct vs ring, 2 ranks: level (2.5-3.7 us) up to
// 4 KiB, ring 10% faster at 16 KiB and 2x at 64 KiB (direct makes every rank
// reduce the whole tensor). More ranks favour direct: the ring's latency
// grows with its 2(n-1) hops. 8 KiB sits between.
constexpr size_t kDefaultDirectMaxBytes = 8 * 1024;
constexpr size_t kDefaultTwoShotMaxBytes = 0;
// Whether a collective of `kind` on `bytes` per rank reads registered
// tensors where they lie (algorithms/collectives.h) when all it reads are.
// Measured on the 2-core development machine, 2 ranks, float32, median of
// three interleaved pairs of loops against the same collective on plain
// tensors: all_gather (bytes per input) and broadcast gain 1.4-2.2x from 64
// KiB to 8 MiB; below 64 KiB the staged algorithms' single meeting wins.
// all_reduce (two-shot, in place) loses at 256 KiB (0.81-0.88x) and gains
// 1.08x at 512 KiB, 1.3-1.65x from 1 to 4 MiB. Above 8 MiB the pipelined
// ring, which keeps two cores copying, catches up (16 MiB: 1.05-1.2x) and
// wins at 32 and 64 MiB (all_reduce 0.76-0.80x, broadcast 0.81-0.97x).
// reduce_scatter (bytes per output block), where each rank reads only its
// block of each input and no pipelined ring does less, gains at every size
// from 2 KiB to 64 MiB (2 ranks: 1.3-1.5x at 2-4 KiB, 2-4.5x from 16 KiB
// to 1 MiB, 1.1-2.6x at 16 MiB, 2x at 64 MiB; 3 ranks: 1.02x at 4 KiB,
// 1.1-2x from 16 KiB to 16 MiB) and is even at 1 KiB.
constexpr size_t kRegisteredMinBytes = 64 * 1024;
constexpr size_t kRegisteredAllReduceMinBytes = 512 * 1024;
constexpr size_t kRegisteredMaxBytes = 8 * 1024 * 1024;
constexpr size_t kRegisteredReduceScatterMinBytes = 4 * 1024;
bool readsRegistered(CollectiveKind kind, size_t bytes);
// RingOptions::cmaMinBytes by default. `python benchmarks/side_by_side.py
// cma OP BYTES 4` on the 2-core AMD EPYC VM
// (benchmarks/studies/single-copy-through-the-kernel.md), 2 ranks,
// rounds alternating between the
// slots, the kernel copy and auto: from 256 KiB to 16 MiB auto was within
// 1.1x of the faster of the two in 113 of 144 rounds. Below, since a
// broadcast's root writes half of it: at 64 and 128 KiB per rank the
// kernel copy took 0.55-0.96x the slots' time in each round, for
// all_gather and broadcast, on near cores and far ones alike, and auto with
// this minimum 0.57-1.0x; at 16 and 32 KiB the kernel copy took
// 0.91-1.54x in the rounds after the first (all_gather and broadcast of 16
// KiB 1.4-1.5x, broadcast of 32 KiB 1.1-1.3x).
constexpr size_t kDefaultCmaMinBytes = 64 * 1024;
constexpr int64_t kDefaultTimeoutMs = 5 * 60 * 1000;
// Four 64 MiB messages, or any number of small ones, ahead of the receives
// that want them.
constexpr size_t kDefaultP2pBufferBytes = 256 * 1024 * 1024;

// Every PYDDP_* variable with its current value ("" when unset).
std::map<std::string, std::string> settings();

// PYDDP_HOSTID: the host identity this process claims instead of its own
// (common/host.h), as NCCL_HOSTID does for NCCL; "" when unset.
std::string hostIdOverride();

} // namespace pyddp
