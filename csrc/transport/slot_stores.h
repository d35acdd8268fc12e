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
// towards memory instead. Both ends of it, measured on the AMD EPYC VM with
// benchmarks/core_distance.cpp (8 slots of 64 KiB, both directions at once;
// benchmarks/studies/where-the-host-puts-the-two-vcpus.md):
//
//   round trip of a cache line   near 130-175 ns        far 500-1000 ns
//   writer's copy into a slot    cached 22-24 GB/s,     cached 3.7 GB/s,
//                                streaming 11-14 GB/s   streaming 17 GB/s
//   whole handoff, each way      cached 9.0-11.6 GB/s,  cached 2.3-2.9 GB/s,
//                                streaming 4.0-6.2 GB/s streaming 4.6-6.4 GB/s
//
// The writer's own copy time tells the two cases apart by a factor of 8,
// so each rank chooses for itself, from its own clock, with no word to its
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
  // Smaller slot writes are cached and not timed. Pieces this small come
  // from small messages or small slots, and the writer's ratio (below) does
  // not tell near cores from far ones for them: the first hop of a 2-rank
  // reduce_scatter of 8 KiB a rank read 3.6 on one rank and 8.2 on the
  // other between near cores, where streaming them made the call 1.15x
  // slower (outside loop, 2.1-2.3 us cached against 2.5).
  static constexpr size_t kMinChosenBytes = 16 * 1024;
  // The same for the staging buffers of the direct algorithms (LocalOps::
  // stage). A timed write's two clock reads (24 ns each on the AMD EPYC VM)
  // weigh on small writes: a cached write of 4 KiB between near cores
  // measured 270-420 ns with them, and the kinds' difference at that size
  // is larger than they are (kStagedStreamingAdvantage).
  static constexpr size_t kMinChosenStagedBytes = 4 * 1024;
  // The first chosen writes are cached and not timed: they touch the ring's
  // slots (or the staging buffers) for the first time (page faults, several
  // times a copy's time), which would count against whichever kind they
  // were timed for. 16: twice round the default ring of 8 slots
  // (common/config.h).
  static constexpr uint64_t kWarmupWrites = 16;
  // One write in 4 of the preferred kind timed: two clock reads per 64 KiB
  // piece cost 2% of a cached write between near cores; one in 4 costs 0.5%.
  static constexpr uint64_t kSampleEvery = 4;
  // One write in 64 with the other kind: a piece of the wrong kind costs
  // about twice the right one's time on near cores and four times on far
  // ones, so exploring costs 1.5-5% (one in 32 cost up to 10% on far cores,
  // 2-rank all_gather of 1 MiB). Cores moving apart are noticed within a
  // few samples of the preferred kind (about 20 writes); moving back, only
  // the explorations measure cached stores, and it takes about three of
  // them (about 200 writes: 1-2 ms of copying 64 KiB pieces).
  static constexpr uint64_t kExploreEvery = 64;
  // How much faster than cached stores streaming ones must be for the writer
  // to be worth their cost to the reader, who then reads the piece from
  // memory instead of from the writer's cache. In the table above the
  // writer's ratio (cached time / streaming time) is 0.5-0.6 on near cores,
  // where the whole handoff favours cached stores by about 2x, and 4.6 on
  // far ones, where it favours streaming stores by about 2x. The times of
  // pyddp's own ranks (2 ranks, the AMD EPYC VM) put it at 0.7-1.05 near
  // for all_gather of 1 MiB, 1.4-1.9 for 16 MiB, up to 1.6 under DDP's
  // backward (`python -m pyddp.bench ddp`), and at 3.5-6.0 far: 2.5 leaves
  // 1.3x on the near side and 1.4x on the far one.
  static constexpr double kStreamingAdvantage = 2.5;
  // The same for the staging buffers, written whole before a meeting:
  // their writes (4-8 KiB under the default direct_max_bytes) leave the two
  // cases closer for the writer. 4 KiB staged by all_reduce of 2 ranks:
  // 1.9-4.7 on near cores, where cached stores made all_reduce and
  // all_gather 1.4-1.6x faster (1.1-1.3 us against 1.6-2.1), and 7.5-10.5
  // on far ones, where streaming stores made all_reduce 1.6x faster (1.7 us
  // against 2.8-3.7;
  // benchmarks/studies/streaming-stores-for-staged-chunks.md).
  static constexpr double kStagedStreamingAdvantage = 6;
  // Each kind's estimate is the floor of its times (common/cost_estimate.h),
  // which a higher sample raises by at most this factor. With a moving
  // average, noise (DDP's backward on the same core) counted most against
  // the kind sampled most, the preferred one, and `python -m pyddp.bench
  // ddp` read 0.24-0.38x torch's overhead under auto against 0.14-0.23x
  // cached. A real rise (4-6x for cached stores when the cores move apart)
  // is followed within 4-5 samples.
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
