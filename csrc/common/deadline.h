// When a collective's waits give up, with the timeout that set it.
//
// The timeout travels with the time so that an error can name it ("did not
// arrive within the timeout of 30000 ms") without reading the clock again
// to recover it: a clock read (24 ns on the AMD EPYC VM of
// benchmarks/studies/the-barriers-path.md) is a sixth of a barrier of one
// rank.
//
// For the same reason after() reads the coarse clock: Clock's own
// (steady_clock is CLOCK_MONOTONIC) as of its last tick, in 6 ns there.
// Adding a tick (4 ms there) keeps the deadline from coming early; it comes
// at most a tick late, which a timeout of milliseconds to minutes allows.
#pragma once

#include <time.h>

#include <chrono>
#include <type_traits>

#include "common/types.h"

namespace pyddp {

static_assert(std::is_same_v<Clock, std::chrono::steady_clock>,
              "Deadline::after reads steady_clock's clock, CLOCK_MONOTONIC, coarsely");

struct Deadline {
  Clock::time_point at;
  std::chrono::milliseconds timeout{0};

  static Deadline after(std::chrono::milliseconds timeout) {
    return {coarseNow() + coarseTick() + timeout, timeout};
  }

  // Engines and transports that need only the time take a Deadline as one.
  operator Clock::time_point() const { return at; }

 private:
  static Clock::time_point coarseNow() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return Clock::time_point(std::chrono::duration_cast<Clock::duration>(
        std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
  }
  static Clock::duration coarseTick() {
    static const Clock::duration tick = [] {
      timespec res{};
      clock_getres(CLOCK_MONOTONIC_COARSE, &res);
      return std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(res.tv_sec) +
                                                         std::chrono::nanoseconds(res.tv_nsec));
    }();
    return tick;
  }
};

} // namespace pyddp
