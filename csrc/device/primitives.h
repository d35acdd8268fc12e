// The few primitives the fused collectives' channel programs (programs.h)
// are written against, for the two machines that run them: a GPU, where a
// channel is one thread block, and the emulated grid (emulated_grid.h),
// where a channel is one CPU thread of a real process and "device memory"
// is shared memory between processes.
//
//   team        the threads of one channel: their index, their count, and a
//               barrier among them (__syncthreads; nothing for one thread);
//   flags       64-bit words in peer-visible memory, read with acquire and
//               written with release at system scope (PTX ld.acquire.sys /
//               st.release.sys; std::atomic_ref on the CPU), each on its own
//               128-byte line;
//   clock       nanoseconds (the GPU's globaltimer; steady_clock);
//   pause       a short back-off between two looks at a flag.
//
// Memory ordering. A flag is stored by one thread of its team after a team
// barrier that follows the team's data writes: the barrier orders every
// thread's writes before that thread's release store, and release is
// cumulative, so a peer that acquires the flag sees all of them. A waiter
// acquires with one thread, then meets its team at a barrier before any
// thread reads the data the flag guards.
#pragma once

#include <cstdint>

#include <atomic>
#include <chrono>
#include <thread>

#if defined(__CUDACC__)
#define PYDDP_DEV __host__ __device__
#else
#define PYDDP_DEV
#endif

namespace pyddp {
namespace device {

// Threads of one channel.
struct Team {
  int tid;
  int size;

  PYDDP_DEV void sync() const {
#if defined(__CUDA_ARCH__)
    __syncthreads();
#endif
  }
  PYDDP_DEV bool leader() const { return tid == 0; }
};

PYDDP_DEV inline uint64_t loadAcquire(const uint64_t* flag) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
  return v;
#else
  // Peers' flags are mapped read-only: a load does not write.
  return std::atomic_ref<uint64_t>(const_cast<uint64_t&>(*flag)).load(std::memory_order_acquire);
#endif
}

PYDDP_DEV inline void storeRelease(uint64_t* flag, uint64_t value) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
#else
  std::atomic_ref<uint64_t>(*flag).store(value, std::memory_order_release);
#endif
}

// A word the host writes and the device polls (abort), or the device
// writes and the host reads (error): host-mapped memory on a GPU.
PYDDP_DEV inline int64_t loadVolatile(const int64_t* word) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const volatile int64_t*>(word);
#else
  return std::atomic_ref<int64_t>(const_cast<int64_t&>(*word)).load(std::memory_order_acquire);
#endif
}

PYDDP_DEV inline void storeVolatile(int64_t* word, int64_t value) {
#if defined(__CUDA_ARCH__)
  __threadfence_system();
  *static_cast<volatile int64_t*>(word) = value;
#else
  std::atomic_ref<int64_t>(*word).store(value, std::memory_order_release);
#endif
}

PYDDP_DEV inline uint64_t nowNs() {
#if defined(__CUDA_ARCH__)
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
#endif
}

// Between two looks at a flag that was not there yet: a peer's flag lives
// in another process's memory, and a tight loop of remote loads takes
// bandwidth from the data moves beside it. The GPU's value is a start, to
// be measured; the CPU yields, since the emulated grid runs more threads
// than cores.
constexpr unsigned kPauseNs = 64;

PYDDP_DEV inline void pause() {
#if defined(__CUDA_ARCH__)
  __nanosleep(kPauseNs);
#else
  std::this_thread::yield();
#endif
}

} // namespace device
} // namespace pyddp
