// How a rank waits for a peer on memory both map (shm counters, channel
// flags): spin, then yield, then sleep, and every kCheckPeriod look at the
// slow things (is the peer alive, has the deadline passed).
//
// A collective between ranks that are all inside it takes microseconds, so
// a waiter first spins. A peer that is still computing (DDP's backward) or
// more ranks than cores (tests run 4 ranks on 2 cores) needs the CPU handed
// over: yield, and after that sleep. With more ranks than cores a waiter
// does not spin at all (spinPhaseFor): the peer it waits for is likely not
// running, and spinning keeps it off the core (Open MPI yields at once
// under --oversubscribe too). 4 ranks on 2 cores, all_reduce of 4 KiB:
// 60.9 us spinning first, 34.0 us yielding at once (3 ranks: 69.4 and
// 14.3 us; `python -m pyddp.bench --world-size 4`, benchmarks/README.md).
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "common/types.h"

namespace pyddp {

class Backoff {
 public:
  static constexpr auto kSpinPhase = std::chrono::microseconds(20);
  static constexpr auto kYieldPhase = std::chrono::milliseconds(2);
  static constexpr auto kSleepQuantum = std::chrono::microseconds(50);
  // Reading /proc/<pid>/stat of a peer costs microseconds: look every
  // 20 ms, which bounds how late a dead peer is noticed.
  static constexpr auto kCheckPeriod = std::chrono::milliseconds(20);

  // `spinPhase`: how long to spin before yielding (spinPhaseFor).
  explicit Backoff(Clock::duration spinPhase = kSpinPhase) : spinPhase_(spinPhase) {
    restart();
  }

  // The spin phase for `ranks` ranks on this host: none when they outnumber
  // the cores this process may run on.
  static Clock::duration spinPhaseFor(int ranks);

  // Something moved: wait as if from the start (spin first).
  void restart() {
    start_ = now_ = Clock::now();
    nextCheck_ = start_ + kCheckPeriod;
    spins_ = 0;
  }

  // Pauses once, as long as the wait so far calls for; returns true when
  // the slow checks are due.
  bool pause() {
    const auto waited = now_ - start_;
    if (waited < spinPhase_) {
      relax();
    } else if (waited < kYieldPhase) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleepQuantum);
    }
    // Reading the clock costs tens of cycles: do it every few spins.
    if (waited >= spinPhase_ || (++spins_ & 63) == 0) now_ = Clock::now();
    if (now_ < nextCheck_) return false;
    nextCheck_ = now_ + kCheckPeriod;
    return true;
  }

  Clock::time_point now() const { return now_; }
  // Whether the wait has gone past spinning (and may afford slower looks,
  // such as whether the caller was interrupted).
  bool pastSpinning() const { return now_ - start_ >= spinPhase_; }

 private:
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  const Clock::duration spinPhase_;
  Clock::time_point start_, now_, nextCheck_;
  uint32_t spins_ = 0;
};

inline Clock::duration Backoff::spinPhaseFor(int ranks) {
  cpu_set_t set;
  const int cores = sched_getaffinity(0, sizeof(set), &set) == 0
                        ? CPU_COUNT(&set)
                        : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return ranks <= cores ? kSpinPhase : Clock::duration::zero();
}

} // namespace pyddp
