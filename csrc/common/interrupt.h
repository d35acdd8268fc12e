// How a thread blocked inside pyddp notices that its caller wants out
// (Ctrl-C), without the core knowing who the caller is. The layer that
// knows (pyddp's bindings: Python's signal handlers) installs a check on the
// calling thread for the duration of one call (InterruptScope); every long
// wait (shm waits once they stop spinning, Work.wait, bootstrap's store
// waits) asks interruptRequested() and gives up when it says so. A thread
// without a scope (the CPU worker, a thread torch calls from) is never
// interrupted.
//
// The scope also tells the caller when the call starts to wait (its
// `waiting` hook, run once): at the first interruptRequested(), or at
// aboutToBlock() before a wait that asks late (a Work's). The bindings keep
// the GIL through a small call that only spins, and let Python's other
// threads run from there.
#pragma once

#include <chrono>
#include <functional>

#include "common/types.h"

namespace pyddp {

class InterruptScope {
 public:
  // How often `check` runs at most: it may be slow (Python's takes the GIL).
  static constexpr auto kPeriod = std::chrono::milliseconds(5);

  // Installs `check` (true: the caller wants out) on this thread until
  // destroyed; scopes nest. The first kPeriod starts at the first
  // interruptRequested(), not here: a call that never waits (most small
  // collectives) reads no clock for its scope.
  // `waiting`, if not empty, runs at most once, on this thread, when the
  // call starts to wait.
  explicit InterruptScope(std::function<bool()> check, std::function<void()> waiting = {});
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  friend bool interruptRequested();
  friend bool interruptible();
  friend void aboutToBlock();

  void startWaiting();

  std::function<bool()> check_;
  std::function<void()> waiting_;  // empty once it ran
  InterruptScope* outer_;
  Clock::time_point nextCheck_;  // valid once asked_
  bool asked_ = false;
  bool fired_ = false;  // once true, stays true: the signal was consumed
};

// Whether this thread's caller wants out: runs the innermost scope's check
// at most every InterruptScope::kPeriod (false in between, and always
// without a scope).
bool interruptRequested();
// This thread is about to block on something that another thread of the
// process settles: runs the innermost scope's `waiting` hook if it has not
// run (nothing without a scope).
void aboutToBlock();
// Whether this thread has a scope (waits that would otherwise block without
// looking can then wake up every kPeriod to ask).
bool interruptible();

} // namespace pyddp
