// Whether an all-gather, broadcast, all-reduce or reduce-scatter reads
// peers' plain tensors through the kernel (cross-memory attach: one
// process_vm_readv copy from the owner's memory) or through the ring's
// slots (two copies, pipelined over both ranks' cores), chosen by what
// each has just cost.
//
// Neither wins everywhere, and on a virtual machine which one wins changes
// while a job runs: the kernel copy's speed does not depend on where the
// host runs the ranks' vCPUs, while the slots' cached handoffs are several
// times faster between near cores than between far ones
// (transport/slot_stores.h), so at the same size the kernel copy won every
// round of one batch and lost most of the next
// (benchmarks/studies/single-copy-through-the-kernel.md). So the choice
// follows an estimate of nanoseconds per byte of each path, per collective
// kind and power-of-two size, the median of its recent times
// (common/cost_estimate.h); it takes the kernel once that is clearly
// cheaper, keeps it while it is cheaper at all, takes the slots otherwise
// and, for a short run of calls now and then, the other path, to notice a
// change.
//
// The ranks must take the same path, so one rank chooses and times (rank 0,
// or a broadcast's last rank of the chain: algorithms::kernelVoter); its
// pick travels in the word it stages at the collective's arrival
// (algorithms::TensorWhere), which every rank reads. The engine's plans
// read the pick through algorithms::KernelChoice and report how it went
// through algorithms::PathFeedback (algorithms/select.h).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>

#include "algorithms/select.h"
#include "common/check.h"
#include "common/cost_estimate.h"
#include "common/types.h"

namespace pyddp {

class CmaChooser final : public algorithms::KernelChoice, public algorithms::PathFeedback {
 public:
  // Four calls in a row of every 128 take the path not preferred, so a
  // change that makes that path the cheaper one is noticed within 128 calls
  // of a size; where the worse path cost up to 2x the better one, exploring
  // costs about 3-5%. The first call after a switch pays for the other
  // path's cold state (caches, the slots' pipeline), and an estimate from a
  // lone call kept the wrong path, so that call is not timed and the warm
  // ones set the estimate
  // (benchmarks/studies/single-copy-through-the-kernel.md).
  //
  // Before that, exploring runs start at calls 16, 32 and 64 (kFirstExplore
  // and its doublings): the first runs of a size measure each path on the
  // first calls of a job, which may still be paying for work that later
  // calls do not, and a pick made from them held until call 128
  // (benchmarks/studies/what-the-kernel-chooser-samples.md). So a pick made
  // from the first runs is looked at again after 7 calls; the extra looks
  // cost the other path's time on 12 of the first 128.
  static constexpr uint64_t kExploreEvery = 128;
  static constexpr uint64_t kExploreRun = 4;
  static constexpr uint64_t kFirstExplore = 16;
  // The first runs, one per path, end before the first exploring one, and
  // the doublings of kFirstExplore reach kExploreEvery.
  static_assert(kFirstExplore > 2 * kExploreRun && kFirstExplore < kExploreEvery);
  static_assert(std::has_single_bit(kFirstExplore) && std::has_single_bit(kExploreEvery));

  // Whether an exploring run starts at the `call`-th call of a size
  // (counted from 1).
  static constexpr bool exploresFrom(uint64_t call) {
    return call % kExploreEvery == 0 ||
        (call >= kFirstExplore && call < kExploreEvery && std::has_single_bit(call));
  }
  // Each path's estimate is the median of its last kWindow samples (a
  // sample counts as it is: the window, not a cap on rises, keeps one slow
  // call from moving it). Where the two paths are close, the latest sample
  // of each ranked them wrong often, and the floor of the window followed
  // lucky low samples
  // (benchmarks/studies/what-the-kernel-chooser-samples.md). With 3, the
  // three timed calls of one exploring run set the estimate of the path it
  // explores (a change that makes it the cheaper one is still noticed at
  // the next run, and two warm calls outvote a cold one), one lucky call
  // does not, and a rise of the preferred path is followed within 2 calls.
  static constexpr int kWindow = 3;
  // The kernel is taken once its estimate is more than this much below the
  // slots', and kept while it is below at all: each estimate follows its
  // path's noise, so with one threshold, at 1.0 or at 1.2, the choice
  // flipped back and forth between two paths close to it. Where the kernel
  // won, it won by at least this much
  // (benchmarks/studies/single-copy-through-the-kernel.md).
  static constexpr double kKernelAdvantage = 1.2;

  explicit CmaChooser(CmaReads mode) : mode_(mode) {}

  // Whether the next collective of `kind` (algorithms::readsInPlace) on
  // `bytes` per rank reads through the kernel, and whether its time is
  // wanted.
  algorithms::KernelPick peek(CollectiveKind kind, size_t bytes) const override {
    if (mode_ != CmaReads::Auto) return {mode_ == CmaReads::Always, false};
    const Size& s = size(kind, bytes);
    const bool kernel = path(s, s.calls + 1);
    // The first call of a size, or after a switch, pays for the path's cold
    // state: a sample of neither path's cost.
    return {kernel, s.calls > 0 && kernel == s.lastKernel};
  }

  // The collective of `plan` that peek() picked for ran: it counts, and
  // its time, if given, is a sample of the path it took.
  void record(const algorithms::Plan& plan, std::optional<double> nanoseconds) override {
    if (mode_ == CmaReads::Auto) {
      Size& s = size(plan.kind, plan.bytes);
      ++s.calls;
      if (exploresFrom(s.calls)) {
        s.exploreKernel = !s.kernel;
        s.exploreEnd = s.calls + kExploreRun;
      }
      s.lastKernel = plan.reads.kernelVote;
    }
    if (nanoseconds) observe(plan.kind, plan.bytes, plan.reads.kernelVote, *nanoseconds);
  }

  // A collective of `kind` on `bytes` per rank took `nanoseconds` from the
  // end of its arrival meeting, through the kernel or not.
  void observe(CollectiveKind kind, size_t bytes, bool kernel, double nanoseconds) {
    Size& s = size(kind, bytes);
    s.cost[kernel ? kKernel : kSlots].observe(bytes, nanoseconds);
    s.kernel = prefersKernel(s);
  }

  // Whether a call that is not exploring would read through the kernel.
  bool prefersKernel(CollectiveKind kind, size_t bytes) const {
    if (mode_ != CmaReads::Auto) return mode_ == CmaReads::Always;
    return size(kind, bytes).kernel;
  }

 private:
  static constexpr int kSlots = 0;
  static constexpr int kKernel = 1;
  static constexpr int kSizes = 64;  // powers of two of a size_t
  static constexpr double kNoCap = std::numeric_limits<double>::infinity();

  struct Size {
    CostEstimate cost[2] = {CostEstimate(kNoCap, kWindow), CostEstimate(kNoCap, kWindow)};
    uint64_t calls = 0;
    bool kernel = false;  // the path preferred: the slots until both are measured
    bool exploreKernel = false;  // the path the latest exploring run takes
    uint64_t exploreEnd = 0;     // the first call after it
    bool lastKernel = false;  // the path of the call before
  };

  // The path of the `call`-th call of a size (counted from 1), the one
  // after the calls `s` counted.
  static bool path(const Size& s, uint64_t call) {
    // Each path is measured over a run before either is preferred.
    if (call <= kExploreRun) return true;
    if (call <= 2 * kExploreRun) return false;
    // A run explores from each call exploresFrom() names, on the path not
    // preferred at its start, even if the run makes it the preferred one
    // (record() keeps the run).
    if (exploresFrom(call)) return !s.kernel;
    return call < s.exploreEnd ? s.exploreKernel : s.kernel;
  }

  // The path preferred after the latest sample, from the one preferred before.
  static bool prefersKernel(const Size& s) {
    if (!s.cost[kKernel].measured() || !s.cost[kSlots].measured()) return false;
    const double kernel = s.cost[kKernel].nsPerByte(), slots = s.cost[kSlots].nsPerByte();
    return kernel * (s.kernel ? 1.0 : kKernelAdvantage) < slots;
  }

  static constexpr int kKinds = 4;
  static constexpr int kindIndex(CollectiveKind kind) {
    switch (kind) {
      case CollectiveKind::AllGather:
        return 0;
      case CollectiveKind::Broadcast:
        return 1;
      case CollectiveKind::AllReduce:
        return 2;
      case CollectiveKind::ReduceScatter:
        return 3;
      default:
        return -1;
    }
  }

  // The estimates of `kind` at the power of two that `bytes` falls in.
  const Size& size(CollectiveKind kind, size_t bytes) const {
    const int log2 = bytes == 0 ? 0 : static_cast<int>(std::bit_width(bytes)) - 1;
    const int k = kindIndex(kind);
    PYDDP_CHECK(k >= 0, toString(kind), " does not read through the kernel");
    return sizes_[k][log2];
  }
  Size& size(CollectiveKind kind, size_t bytes) {
    return const_cast<Size&>(std::as_const(*this).size(kind, bytes));
  }

  const CmaReads mode_;
  Size sizes_[kKinds][kSizes];
};

} // namespace pyddp
