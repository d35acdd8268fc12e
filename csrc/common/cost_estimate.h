// The cost of an operation that a rank times on its own clock, from its
// recent samples (nanoseconds per byte).
//
// A copy's time has a floor (what it costs) and noise, mostly above it (a
// copy preempted for a time slice, 1000 times its usual time; the cache
// taken by other work on the same core). The estimate is the median of the
// last `window` samples, each counted as at most `maxRise` times the
// estimate before it. With a window of one, a lower sample sets the
// estimate and a higher one raises it by at most `maxRise`: the floor of
// the recent samples, which follows a real rise within a few of them. A
// wider window also keeps a lucky low sample from setting the estimate,
// where two paths' costs are close enough for it to rank them wrong. With a
// moving average instead, noise counted most against what was sampled most
// (transport/slot_stores.h says by how much).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>

#include "common/check.h"

namespace pyddp {

class CostEstimate {
 public:
  static constexpr int kMaxWindow = 16;

  // `maxRise` may be infinite: a sample then counts as it is.
  explicit CostEstimate(double maxRise, int window = 1) : maxRise_(maxRise), window_(window) {
    PYDDP_CHECK(maxRise >= 1 && window >= 1 && window <= kMaxWindow,
                "CostEstimate: maxRise at least 1 and a window of 1 to ", kMaxWindow,
                " samples, got ", maxRise, " and ", window);
  }

  // A sample: `bytes` took `nanoseconds`. Samples that are not times (NaN,
  // negative, of no bytes) are ignored.
  void observe(size_t bytes, double nanoseconds) {
    if (bytes == 0 || !std::isfinite(nanoseconds) || nanoseconds < 0) return;
    const double sample = nanoseconds / static_cast<double>(bytes);
    // 0 is "not measured yet": a sample of 0 ns (a coarse clock) counts as
    // the smallest positive time.
    const double positive = sample > 0 ? sample : 1e-9;
    samples_[next_] = measured() ? std::min(positive, maxRise_ * nsPerByte_) : positive;
    next_ = (next_ + 1) % window_;
    held_ = std::min(held_ + 1, window_);
    // the median, the lower of the middle two of an even count
    std::array<double, kMaxWindow> sorted = samples_;
    const int middle = (held_ - 1) / 2;
    std::nth_element(sorted.begin(), sorted.begin() + middle, sorted.begin() + held_);
    nsPerByte_ = sorted[middle];
  }

  bool measured() const { return nsPerByte_ != 0; }
  // ns per byte; 0 until the first sample.
  double nsPerByte() const { return nsPerByte_; }

 private:
  double maxRise_;
  int window_;
  // The last held_ samples (at most window_), as counted; the next goes at next_.
  std::array<double, kMaxWindow> samples_{};
  int next_ = 0;
  int held_ = 0;
  double nsPerByte_ = 0;
};

} // namespace pyddp
