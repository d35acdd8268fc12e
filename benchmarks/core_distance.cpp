// How far apart two CPUs of this (x86-64) machine are, as shared memory sees it.
//
// Two threads, pinned to CPUs A and B (0 and 1 unless given):
//   - round trip: one cache line bounced between them (the latency a flag
//     of the shm transport pays each way, twice per round trip);
//   - handoff: both threads at once send 256 MiB to each other through a
//     ring of 8 slots of 64 KiB (the 2-rank shm ring's defaults,
//     common/config.h), each writing a slot of its own and copying the
//     peer's out, with cached stores and with streaming (non-temporal)
//     stores into the slot; and how fast the writer's copies into its
//     slots alone went (what transport/slot_stores.h measures).
// On a virtual machine the host decides where the two vCPUs run, and may
// move them while a job runs: run this before and after a benchmark to know
// which case it measured
// (benchmarks/studies/where-the-host-puts-the-two-vcpus.md).
//
//   g++ -O2 -pthread benchmarks/core_distance.cpp -o /tmp/core_distance
//   /tmp/core_distance [A B]
#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kLine = 64;
constexpr int kSlots = 8;
constexpr size_t kSlotBytes = 64 * 1024;
constexpr size_t kBlockSlots = 16;  // source and destination: 1 MiB each, reused
constexpr size_t kHandoffBytes = size_t{256} << 20;
constexpr long kRoundTrips = 200000;

struct alignas(kLine) Flag {
  std::atomic<long> value{0};
};
static_assert(sizeof(Flag) == kLine);

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
    std::fprintf(stderr, "cannot pin a thread to CPU %d\n", cpu);
    std::abort();
  }
}

double roundTripNs(int a, int b) {
  Flag ping, pong;
  std::thread other([&] {
    pin(b);
    for (long i = 1; i <= kRoundTrips; ++i) {
      while (ping.value.load(std::memory_order_acquire) != i) {
      }
      pong.value.store(i, std::memory_order_release);
    }
  });
  pin(a);
  const auto start = Clock::now();
  for (long i = 1; i <= kRoundTrips; ++i) {
    ping.value.store(i, std::memory_order_release);
    while (pong.value.load(std::memory_order_acquire) != i) {
    }
  }
  const auto end = Clock::now();
  other.join();
  return std::chrono::duration<double, std::nano>(end - start).count() / kRoundTrips;
}

// SSE2's 16-byte streaming stores, as kernels::streamingCopy (the slots are
// 64-byte aligned and 64 KiB long here: no head or tail).
void streamCopy(char* dst, const char* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), v);
  }
  _mm_sfence();  // the streaming stores are visible before the slot is posted
}

// One thread's side of the ring: its slots (written by it, read by the
// peer), its posted and consumed counters, and its own source and
// destination blocks.
struct Side {
  char* slots;
  char* src;
  char* dst;
  Flag posted;    // pieces written to own slots
  Flag consumed;  // pieces read from the peer's slots
  double writeNs = 0;  // time spent copying into own slots
};

// Piece k goes to slot k % kSlots once the peer has consumed piece
// k - kSlots; both directions advance in one loop, as the ring's fused verbs
// do.
void runSide(Side& me, Side& peer, long pieces, bool streaming) {
  long sent = 0, received = 0;
  while (sent < pieces || received < pieces) {
    if (sent < pieces && peer.consumed.value.load(std::memory_order_acquire) >= sent + 1 - kSlots) {
      char* slot = me.slots + (sent % kSlots) * kSlotBytes;
      const char* from = me.src + (sent % kBlockSlots) * kSlotBytes;
      const auto start = Clock::now();
      if (streaming) {
        streamCopy(slot, from, kSlotBytes);
      } else {
        std::memcpy(slot, from, kSlotBytes);
      }
      me.writeNs += std::chrono::duration<double, std::nano>(Clock::now() - start).count();
      me.posted.value.store(++sent, std::memory_order_release);
    }
    if (received < pieces && peer.posted.value.load(std::memory_order_acquire) >= received + 1) {
      std::memcpy(me.dst + (received % kBlockSlots) * kSlotBytes,
                  peer.slots + (received % kSlots) * kSlotBytes, kSlotBytes);
      me.consumed.value.store(++received, std::memory_order_release);
    }
  }
}

char* buffer(size_t bytes) {
  char* p = static_cast<char*>(std::aligned_alloc(4096, bytes));
  if (p == nullptr) std::abort();
  std::memset(p, 1, bytes);
  return p;
}

struct Handoff {
  double gbs;         // each way, the whole handoff
  double writerGbs;   // thread A's copies into its slots alone
};

Handoff handoff(int a, int b, bool streaming) {
  Side sides[2];
  for (Side& s : sides) {
    s.slots = buffer(kSlots * kSlotBytes);
    s.src = buffer(kBlockSlots * kSlotBytes);
    s.dst = buffer(kBlockSlots * kSlotBytes);
  }
  const long pieces = kHandoffBytes / kSlotBytes;
  const auto start = Clock::now();
  std::thread other([&] {
    pin(b);
    runSide(sides[1], sides[0], pieces, streaming);
  });
  pin(a);
  runSide(sides[0], sides[1], pieces, streaming);
  other.join();
  const auto end = Clock::now();
  const double writeNs = sides[0].writeNs;
  for (Side& s : sides) {
    std::free(s.slots);
    std::free(s.src);
    std::free(s.dst);
  }
  return {kHandoffBytes / std::chrono::duration<double, std::nano>(end - start).count(),
          kHandoffBytes / writeNs};
}

} // namespace

int main(int argc, char** argv) {
  const int a = argc > 2 ? std::atoi(argv[1]) : 0;
  const int b = argc > 2 ? std::atoi(argv[2]) : 1;
  const double roundTrip = roundTripNs(a, b);
  const Handoff cached = handoff(a, b, false);
  const Handoff streaming = handoff(a, b, true);
  std::printf("CPUs %d and %d: round trip %.0f ns, 64 KiB slot handoff (GB/s each way) "
              "cached %.2f, streaming %.2f; writer's copies (GB/s) cached %.2f, "
              "streaming %.2f\n",
              a, b, roundTrip, cached.gbs, streaming.gbs, cached.writerGbs, streaming.writerGbs);
  return 0;
}
