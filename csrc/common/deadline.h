// When a collective's waits give up, with the timeout that set it.
//
// The timeout travels with the time so that an error can name it ("did not
// arrive within the timeout of 30000 ms") without reading the clock again
// to recover it: a clock read (24 ns on the AMD EPYC VM of
// benchmarks/README.md) is a sixth of a barrier of one rank.
#pragma once

#include <chrono>

#include "common/types.h"

namespace pyddp {

struct Deadline {
  Clock::time_point at;
  std::chrono::milliseconds timeout{0};

  static Deadline after(std::chrono::milliseconds timeout) {
    return {Clock::now() + timeout, timeout};
  }

  // Engines and transports that need only the time take a Deadline as one.
  operator Clock::time_point() const { return at; }
};

} // namespace pyddp
