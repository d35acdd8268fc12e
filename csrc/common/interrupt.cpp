#include "common/interrupt.h"

namespace pyddp {
namespace {

// The innermost scope of this thread: set and reset by InterruptScope only,
// so it is empty whenever no call into pyddp is on this thread's stack.
thread_local InterruptScope* innermost = nullptr;

} // namespace

InterruptScope::InterruptScope(std::function<bool()> check, std::function<void()> waiting)
    : check_(std::move(check)), waiting_(std::move(waiting)), outer_(innermost) {
  innermost = this;
}

void InterruptScope::startWaiting() {
  if (!waiting_) return;
  const std::function<void()> waiting = std::move(waiting_);
  waiting_ = nullptr;
  waiting();
}

InterruptScope::~InterruptScope() {
  innermost = outer_;
}

bool interruptRequested() {
  InterruptScope* scope = innermost;
  if (scope == nullptr || scope->fired_) return scope != nullptr;
  const auto now = Clock::now();
  if (!scope->asked_) {
    scope->startWaiting();
    scope->asked_ = true;
    scope->nextCheck_ = now + InterruptScope::kPeriod;
    return false;
  }
  if (now < scope->nextCheck_) return false;
  scope->nextCheck_ = now + InterruptScope::kPeriod;
  scope->fired_ = scope->check_();
  return scope->fired_;
}

void aboutToBlock() {
  if (innermost != nullptr) innermost->startWaiting();
}

bool interruptible() {
  return innermost != nullptr;
}

} // namespace pyddp
