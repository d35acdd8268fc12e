// The cost of an operation that a rank times on its own clock, as the floor
// of its recent samples (nanoseconds per byte).
//
// A copy's time has a floor (what it costs) and noise above it (a copy
// preempted for a time slice, 1000 times its usual time; the cache taken by
// other work on the same core): a lower sample sets the estimate, a higher
// one raises it by at most `maxRise`, so noise barely moves it and a real
// rise is followed within a few samples. With a moving average instead,
// noise counted most against what was sampled most (transport/slot_stores.h
// says by how much).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace pyddp {

class FloorEstimate {
 public:
  explicit FloorEstimate(double maxRise) : maxRise_(maxRise) {}

  // A sample: `bytes` took `nanoseconds`. Samples that are not times (NaN,
  // negative, of no bytes) are ignored.
  void observe(size_t bytes, double nanoseconds) {
    if (bytes == 0 || !std::isfinite(nanoseconds) || nanoseconds < 0) return;
    const double sample = nanoseconds / static_cast<double>(bytes);
    // 0 is "not measured yet": a sample of 0 ns (a coarse clock) counts as
    // the smallest positive time.
    const double positive = sample > 0 ? sample : 1e-9;
    nsPerByte_ = nsPerByte_ == 0 ? positive : std::min(positive, maxRise_ * nsPerByte_);
  }

  bool measured() const { return nsPerByte_ != 0; }
  // ns per byte; 0 until the first sample.
  double nsPerByte() const { return nsPerByte_; }

 private:
  double maxRise_;
  double nsPerByte_ = 0;
};

} // namespace pyddp
