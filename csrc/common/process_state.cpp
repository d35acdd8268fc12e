#include "common/process_state.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace pyddp {
namespace process {
namespace {

std::atomic<uint64_t> generation{0};

void countFork() {
  generation.fetch_add(1, std::memory_order_relaxed);
}

// The thread that runs the exit hook, once it began.
std::atomic<bool> exiting{false};
std::atomic<std::thread::id> exitThread{};
thread_local bool ownThread = false;

} // namespace

uint64_t forkGeneration() {
  return generation.load(std::memory_order_relaxed);
}

void onFork(void (*prepare)(), void (*parent)(), void (*child)()) {
  // The generation counts before any registry's child handler runs.
  static std::once_flag counted;
  std::call_once(counted, [] { pthread_atfork(nullptr, nullptr, countFork); });
  pthread_atfork(prepare, parent, child);
}

void beginExit() {
  exitThread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  exiting.store(true, std::memory_order_release);
}

void parkIfExiting() {
  if (!exiting.load(std::memory_order_acquire) || ownThread ||
      exitThread.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    return;
  }
  while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

void markOwnThread() {
  ownThread = true;
}

} // namespace process
} // namespace pyddp
