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
// under --oversubscribe too; benchmarks/studies/3-and-4-ranks-on-2-cores.md).
//
// A wait for a ring slot spins for much less (kPieceSpinPhase): the peer is
// inside the same collective, moving a piece that takes microseconds, so a
// piece that is late means the peer is not running, and spinning takes the
// core from whatever this rank's other thread has to do (DDP's backward,
// while the worker all-reduces buckets). On an idle core a yield returns at
// once, so the cost of yielding early is a system call per look.
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
  // How long a wait for a ring slot spins: DDP's worker took the least CPU
  // time with it, and synchronous collectives did not slow
  // (benchmarks/studies/ddp.md, "A slot's spin").
  static constexpr auto kPieceSpinPhase = std::chrono::microseconds(2);
  static constexpr auto kYieldPhase = std::chrono::milliseconds(2);
  static constexpr auto kSleepQuantum = std::chrono::microseconds(50);
  // Reading /proc/<pid>/stat of a peer costs microseconds: look every
  // 20 ms, which bounds how late a dead peer is noticed.
  static constexpr auto kCheckPeriod = std::chrono::milliseconds(20);
  // Reading the clock costs about as much as a pause: a spinning wait reads
  // it once every this many pauses, and not before the first of them, about
  // 0.4 us, which is longer than most waits of a collective on a peer that
  // is inside it (benchmarks/studies/a-waits-first-clock-reading.md).
  static constexpr uint32_t kSpinsPerClockRead = 16;

  // `spinPhase`: how long to spin before yielding (spinPhaseFor).
  explicit Backoff(Clock::duration spinPhase = kSpinPhase) : spinPhase_(spinPhase) {
    restart();
  }

  // The spin phase for `ranks` ranks on this host: none when they outnumber
  // the cores this process may run on.
  static Clock::duration spinPhaseFor(int ranks);
  // The same for a wait on a peer that is inside the collective (a slot).
  static Clock::duration pieceSpinPhaseFor(int ranks) {
    return std::min<Clock::duration>(spinPhaseFor(ranks), kPieceSpinPhase);
  }

  // Something moved: wait as if from the start (spin first).
  void restart() {
    started_ = false;
    spins_ = 0;
  }

  // Pauses once, as long as the wait so far calls for; returns true when
  // the slow checks are due.
  bool pause() {
    if (!started_) {
      // The spin phase counts from the clock's first reading.
      if (spinPhase_ > Clock::duration::zero() && ++spins_ < kSpinsPerClockRead) {
        relax();
        return false;
      }
      started_ = true;
      start_ = now_ = Clock::now();
      nextCheck_ = start_ + kCheckPeriod;
    }
    const auto waited = now_ - start_;
    if (waited < spinPhase_) {
      relax();
    } else if (waited < kYieldPhase) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(kSleepQuantum);
    }
    if (waited >= spinPhase_ || ++spins_ % kSpinsPerClockRead == 0) now_ = Clock::now();
    if (now_ < nextCheck_) return false;
    nextCheck_ = now_ + kCheckPeriod;
    return true;
  }

  Clock::time_point now() const { return now_; }
  // Whether the wait has gone past spinning (and may afford slower looks,
  // such as whether the caller was interrupted).
  bool pastSpinning() const { return started_ && now_ - start_ >= spinPhase_; }

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
  bool started_ = false;  // the clock was read since restart()
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
