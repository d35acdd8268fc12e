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

// GroupOptions of one process group. Defaults come from the environment; Python
// may override fields (pyddp.GroupOptions) before creating the group. All
// ranks must use the same geometry (slotBytes, numSlots, directMaxBytes):
// connecting checks it.
struct GroupOptions {
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

  static GroupOptions fromEnv();
  void validate() const;  // throws ValueError naming the offending setting
  // Bytes of each staging buffer of the direct algorithms: a larger message
  // moves through them in rounds.
  size_t stagingBytes() const;
};

// The ring's geometry by default: the smallest of the sizes and counts that
// measured fastest (benchmarks/studies/the-ring-slots-size-and-number.md).
constexpr size_t kDefaultSlotBytes = 64 * 1024;
constexpr int kDefaultNumSlots = 8;
// Where direct and ring all-reduce crossed on 2 ranks; more ranks favour
// direct (benchmarks/studies/direct-or-ring-for-a-small-all-reduce.md).
constexpr size_t kDefaultDirectMaxBytes = 8 * 1024;
constexpr size_t kDefaultTwoShotMaxBytes = 0;
// GroupOptions::cmaMinBytes by default: below it the kernel copy lost to the
// ring's slots or tied (benchmarks/studies/the-kernel-from-64-kib.md).
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
