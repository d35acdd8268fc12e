// Which stores a rank writes its ring slots with, and the staging buffers
// of the direct algorithms: cached or streaming (non-temporal), chosen by
// what each costs the writer here and now. A transport keeps one chooser
// for each: their writes differ in size, and with it the ratio that tells
// the cases apart (kStagedStreamingAdvantage).
//
// A slot is written by one core and read at once by another. When the two
// cores are near (one L3), a cached write is cheapest: the reader takes the
// lines from the writer's cache. When they are far apart (another socket or
// chiplet, as a virtual machine's host places vCPUs and moves them while a
// job runs), each cached write first takes back, across that distance, the
// lines the reader holds from the slot's last piece, and the reader then
// fetches them from the writer's cache; streaming stores send the lines
// towards memory instead: cached stores win between near cores, streaming
// ones between far cores, each by about 2x for the whole handoff, and the
// writer's own copy time tells the two cases apart by a factor of 8
// (benchmarks/studies/where-the-host-puts-the-two-vcpus.md). So each rank
// chooses for itself, from its own clock, with no word to its
// peers (the reader reads a slot the same way however it was written).
// Which case holds can change from one second to the next, so the choice
// is kept current: it follows an estimate of nanoseconds per byte for each
// kind (the floor of its recent times), times one write in kSampleEvery of
// the kind it prefers, and writes one in kExploreEvery with the other kind.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/cost_estimate.h"
#include "common/types.h"
#include "kernels/cpu.h"

namespace pyddp {

class SlotStoreChooser {
 public:
  // Smaller slot writes are cached and not timed: for pieces this small
  // (small messages, small slots) the writer's ratio (below) does not tell
  // near cores from far ones
  // (benchmarks/studies/streaming-stores-for-staged-chunks.md).
  static constexpr size_t kMinChosenBytes = 16 * 1024;
  // The same for the staging buffers of the direct algorithms (LocalOps::
  // stage): from here the kinds' difference outweighs a timed write's two
  // clock reads (benchmarks/studies/streaming-stores-for-staged-chunks.md).
  static constexpr size_t kMinChosenStagedBytes = 4 * 1024;
  // The first chosen writes are cached and not timed: they touch the ring's
  // slots (or the staging buffers) for the first time (page faults, several
  // times a copy's time), which would count against whichever kind they
  // were timed for. 16: twice round the default ring of 8 slots
  // (common/config.h).
  static constexpr uint64_t kWarmupWrites = 16;
  // One write in 4 of the preferred kind timed: the clock reads cost 0.5%
  // of the writes (benchmarks/studies/where-the-host-puts-the-two-vcpus.md,
  // "The chooser's constants").
  static constexpr uint64_t kSampleEvery = 4;
  // One write in 64 with the other kind: exploring costs 1.5-5%, and cores
  // that move back near are noticed within about 200 writes (the same
  // study).
  static constexpr uint64_t kExploreEvery = 64;
  // How much faster than cached stores streaming ones must be for the writer
  // to be worth their cost to the reader, who then reads the piece from
  // memory instead of from the writer's cache: the writer's ratio (cached
  // time / streaming time) that leaves a margin on both sides of where the
  // whole handoff's winner changes (the same study).
  static constexpr double kStreamingAdvantage = 2.5;
  // The same for the staging buffers, written whole before a meeting:
  // their writes (4-8 KiB under the default direct_max_bytes) leave the two
  // cases closer for the writer
  // (benchmarks/studies/streaming-stores-for-staged-chunks.md).
  static constexpr double kStagedStreamingAdvantage = 6;
  // Each kind's estimate is the floor of its times (common/cost_estimate.h),
  // which a higher sample raises by at most this factor: a moving average
  // counted noise (DDP's backward on the same core) against the kind
  // sampled most, and a real rise is still followed within a few samples
  // (benchmarks/studies/where-the-host-puts-the-two-vcpus.md).
  static constexpr double kMaxRise = 1.5;

  struct Pick {
    bool streaming;
    bool timed;  // report the time the write took to observe()
  };

  // The chooser for ring slots; for staging buffers, kMinChosenStagedBytes
  // and kStagedStreamingAdvantage.
  explicit SlotStoreChooser(SlotStores mode, size_t minChosenBytes = kMinChosenBytes,
                            double streamingAdvantage = kStreamingAdvantage)
      : mode_(kernels::kHasStreamingStores ? mode : SlotStores::Cached),
        minChosenBytes_(minChosenBytes),
        streamingAdvantage_(streamingAdvantage) {}

  // How to make the next slot write, of `bytes` from a source that is
  // `local` to the writer (its own tensor) or not: a forwarded piece's copy
  // also reads the previous rank's slot, across a distance of its own, so
  // its time says nothing certain about the slot's; it follows the choice
  // and is not timed.
  Pick next(size_t bytes, bool local) {
    if (mode_ != SlotStores::Auto) return {mode_ == SlotStores::Streaming, false};
    if (bytes < minChosenBytes_) return {false, false};
    if (!local) return {prefersStreaming(), false};
    if (++writes_ <= kWarmupWrites) return {false, false};
    // Each kind is measured once before either is preferred.
    if (!cost_[kCached].measured()) return {false, true};
    if (!cost_[kStreaming].measured()) return {true, true};
    const bool preferred = prefersStreaming();
    if (writes_ % kExploreEvery == 0) return {!preferred, true};
    return {preferred, writes_ % kSampleEvery == 0};
  }

  // A timed write of `bytes` took `nanoseconds`.
  void observe(bool streaming, size_t bytes, double nanoseconds) {
    cost_[streaming ? kStreaming : kCached].observe(bytes, nanoseconds);
  }

  // Whether a write that is not exploring would be streaming.
  bool prefersStreaming() const {
    if (mode_ != SlotStores::Auto) return mode_ == SlotStores::Streaming;
    return cost_[kStreaming].measured() &&
           cost_[kStreaming].nsPerByte() * streamingAdvantage_ < cost_[kCached].nsPerByte();
  }

  // The estimates, ns per byte (0: not measured yet).
  double cachedNsPerByte() const { return cost_[kCached].nsPerByte(); }
  double streamingNsPerByte() const { return cost_[kStreaming].nsPerByte(); }

 private:
  static constexpr int kCached = 0;
  static constexpr int kStreaming = 1;

  const SlotStores mode_;
  const size_t minChosenBytes_;
  const double streamingAdvantage_;
  uint64_t writes_ = 0;  // chosen writes of local pieces so far
  CostEstimate cost_[2] = {CostEstimate(kMaxRise), CostEstimate(kMaxRise)};
};

} // namespace pyddp
