// Whether an all-gather or broadcast reads peers' plain tensors through
// the kernel (cross-memory attach: one process_vm_readv copy from the
// owner's memory) or through the ring's slots (two copies, pipelined over
// both ranks' cores), chosen by what each has just cost.
//
// Neither wins everywhere, and on a virtual machine which one wins changes
// while a job runs: the kernel copy moves 6-7.5 GB/s wherever the host runs
// the ranks' vCPUs, the slots' cached handoffs 9-12 GB/s between near cores
// and 2.3-2.9 GB/s between far ones (transport/slot_stores.h), so at 256
// KiB to 4 MiB per rank the kernel copy won every round of one batch and
// lost most of the next (benchmarks/README.md, "Single copy through the
// kernel"). So the choice follows an estimate of nanoseconds per byte of
// each path, per collective kind and power-of-two size, the floor of its
// recent times (common/floor_estimate.h); it takes the kernel where that is
// clearly cheaper, the slots otherwise and, one call in kExploreEvery, the
// other path, to notice a change.
//
// The ranks must take the same path, so one rank chooses and times (rank 0,
// or a broadcast's last rank of the chain: algorithms::kernelVoter); its
// pick travels in the word it stages at the collective's arrival
// (algorithms::TensorWhere), which every rank reads.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "common/floor_estimate.h"
#include "common/types.h"

namespace pyddp {

class CmaChooser {
 public:
  // One call in 32 takes the path not preferred: the worse path cost up to
  // 2x the better one in the measurements above, so exploring costs at most
  // about 3%, and a change that makes that path the cheaper one is noticed
  // within 32 calls of a size.
  static constexpr uint64_t kExploreEvery = 32;
  // A higher sample raises an estimate by at most this factor: as the slot
  // stores' (transport/slot_stores.h), whose noise is the same kind.
  static constexpr double kMaxRise = 1.5;
  // The kernel is taken while its estimate is more than this much below
  // the slots'. The estimate of the path not taken is a floor from its last
  // samples, the other one's follows its noise up, so between two paths
  // within a few percent the choice flipped back and forth: all_gather of
  // 256 KiB per rank on 2 near cores took the kernel in 19-38 of each 64
  // calls, for 1.08-1.19x the slots' time. Where the kernel won, it did by
  // 1.2-1.7x (far cores, 1 and 4 MiB).
  static constexpr double kKernelAdvantage = 1.2;

  explicit CmaChooser(CmaReads mode) : mode_(mode) {}

  // Whether the next collective of `kind` (AllGather or Broadcast) on
  // `bytes` per rank reads through the kernel, and whether its time is
  // wanted (observe()).
  struct Pick {
    bool kernel;
    bool timed;
  };
  Pick next(CollectiveKind kind, size_t bytes) {
    if (mode_ != CmaReads::Auto) return {mode_ == CmaReads::Always, false};
    Size& s = size(kind, bytes);
    ++s.calls;
    // Each path is measured once before either is preferred.
    if (!s.cost[kKernel].measured()) return {true, true};
    if (!s.cost[kSlots].measured()) return {false, true};
    const bool preferred = prefersKernel(s);
    return {s.calls % kExploreEvery == 0 ? !preferred : preferred, true};
  }

  // The collective next() picked took `nanoseconds` from the end of its
  // arrival meeting.
  void observe(CollectiveKind kind, size_t bytes, bool kernel, double nanoseconds) {
    size(kind, bytes).cost[kernel ? kKernel : kSlots].observe(bytes, nanoseconds);
  }

  // Whether a call that is not exploring would read through the kernel.
  bool prefersKernel(CollectiveKind kind, size_t bytes) {
    if (mode_ != CmaReads::Auto) return mode_ == CmaReads::Always;
    return prefersKernel(size(kind, bytes));
  }

 private:
  static constexpr int kSlots = 0;
  static constexpr int kKernel = 1;
  static constexpr int kSizes = 64;  // powers of two of a size_t

  struct Size {
    FloorEstimate cost[2] = {FloorEstimate(kMaxRise), FloorEstimate(kMaxRise)};
    uint64_t calls = 0;
  };

  static bool prefersKernel(const Size& s) {
    return s.cost[kKernel].measured() &&
        (!s.cost[kSlots].measured() ||
         s.cost[kKernel].nsPerByte() * kKernelAdvantage < s.cost[kSlots].nsPerByte());
  }

  // The estimates of `kind` at the power of two that `bytes` falls in.
  Size& size(CollectiveKind kind, size_t bytes) {
    const int log2 = bytes == 0 ? 0 : static_cast<int>(std::bit_width(bytes)) - 1;
    return sizes_[kind == CollectiveKind::Broadcast ? 1 : 0][log2];
  }

  const CmaReads mode_;
  Size sizes_[2][kSizes];
};

} // namespace pyddp
