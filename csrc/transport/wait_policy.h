// How a rank waits for a peer on memory both map (shm counters, channel
// flags): spin, then yield, then sleep, and every kCheckPeriod look at the
// slow things (is the peer alive, has the deadline passed).
//
// A collective between ranks that are all inside it takes microseconds, so
// a waiter first spins. A peer that is still computing (DDP's backward) or
// more ranks than cores (tests run 4 ranks on 2 cores) needs the CPU handed
// over: yield, and after that sleep.
#pragma once

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

  Backoff() { restart(); }

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
    if (waited < kSpinPhase) {
      relax();
    } else if (waited < kYieldPhase) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleepQuantum);
    }
    // Reading the clock costs tens of cycles: do it every few spins.
    if (waited >= kSpinPhase || (++spins_ & 63) == 0) now_ = Clock::now();
    if (now_ < nextCheck_) return false;
    nextCheck_ = now_ + kCheckPeriod;
    return true;
  }

  Clock::time_point now() const { return now_; }

 private:
  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  Clock::time_point start_, now_, nextCheck_;
  uint32_t spins_ = 0;
};

} // namespace pyddp
