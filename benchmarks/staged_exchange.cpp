// What a small staged exchange costs between two CPUs of this (x86-64 with
// AVX-512BW) machine, with no Python and no pyddp around it.
//
// Two threads, pinned to CPUs A and B (0 and 1 unless given), each round
// exchange 4 KiB and sum the two, as a 2-rank all_reduce of 4 KiB does
// (algorithms/collectives.cpp, directAllReduce), by these protocols:
//   flag           the shm transport's direct rounds (transport/shm.h): copy
//                  into staging buffer R % 2, store a flag = R (release),
//                  wait for the peer's flag, sum from the peer's buffer;
//   flag+prefetch  the same, prefetching all the peer's lines once its flag
//                  is seen;
//   flag+prefetchw the same, asking for the lines of the staging buffer it
//                  writes next (R + 1) once the peer's flag is seen: the
//                  peer is then done with them;
//   4 buffers      the flag's protocol with staging buffer R % 4;
//   1 buffer       one staging buffer, written once the peer stored a
//                  second flag (done = R - 1) after its sum of round R - 1;
//   lines          flags in the data's lines (NCCL's LL protocol on cache
//                  lines): each 64-byte line of buffer R % 2 carries 56
//                  bytes, then R in its last 8 (stored after them, release);
//                  the reader waits for each line's R and unpacks its 56
//                  bytes into a contiguous buffer, then sums;
//   lines, last    the same, waiting for the last line's R first.
// benchmarks/studies/a-waits-first-clock-reading.md and
// benchmarks/studies/which-lines-a-staged-exchange-writes.md have its
// numbers on the AMD EPYC VM. On a
// virtual machine, run benchmarks/core_distance.cpp before and after to
// know how far apart the two vCPUs were.
//
//   g++ -O2 -march=native -pthread benchmarks/staged_exchange.cpp -o /tmp/staged_exchange
//   /tmp/staged_exchange [A B]
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kLine = 64;
constexpr size_t kBytes = 4096;
constexpr size_t kFloats = kBytes / sizeof(float);
constexpr size_t kLineData = kLine - sizeof(uint64_t);
constexpr size_t kLines = (kBytes + kLineData - 1) / kLineData;
constexpr long kRounds = 300000;
constexpr int kRepeats = 4;

struct alignas(kLine) Flag {
  std::atomic<uint64_t> round{0};
};
struct alignas(kLine) Line {
  char data[kLineData];
  std::atomic<uint64_t> round;
};
static_assert(sizeof(Line) == kLine);

// What one thread writes and its peer reads. Owner: the thread of that index.
struct alignas(kLine) Shared {
  char staging[4][kBytes];
  Flag staged;
  Flag done;  // 1 buffer: the last round whose sum read the peer's buffer
  Line lines[2][kLines];
};
Shared shared[2];

enum class Protocol {
  Flag,
  FlagPrefetch,
  FlagPrefetchWrite,
  FourBuffers,
  OneBuffer,
  Lines,
  LinesLastFirst
};
constexpr const char* kNames[] = {"flag",     "flag+prefetch", "flag+prefetchw", "4 buffers",
                                  "1 buffer", "lines",         "lines, last"};

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

void sum(float* out, const float* a, const float* b) {
  for (size_t i = 0; i < kFloats; ++i) out[i] = a[i] + b[i];
}

// Nanoseconds a round, for thread `me` on `cpu`.
double run(Protocol protocol, int me, int cpu) {
  pin(cpu);
  Shared& mine = shared[me];
  const Shared& theirs = shared[1 - me];
  alignas(kLine) float in[kFloats], out[kFloats];
  alignas(kLine) char unpacked[kLines * kLineData + kLine];
  for (size_t i = 0; i < kFloats; ++i) in[i] = static_cast<float>(me + i);
  const char* src = reinterpret_cast<const char*>(in);
  const auto start = Clock::now();
  for (uint64_t r = 1; r <= kRounds; ++r) {
    const int buf = static_cast<int>(protocol == Protocol::FourBuffers ? r % 4
                                     : protocol == Protocol::OneBuffer ? 0
                                                                       : r % 2);
    if (protocol != Protocol::Lines && protocol != Protocol::LinesLastFirst) {
      if (protocol == Protocol::OneBuffer) {
        while (theirs.done.round.load(std::memory_order_acquire) + 1 < r) _mm_pause();
      }
      std::memcpy(mine.staging[buf], src, kBytes);
      mine.staged.round.store(r, std::memory_order_release);
      while (theirs.staged.round.load(std::memory_order_acquire) < r) _mm_pause();
      if (protocol == Protocol::FlagPrefetch) {
        for (size_t b = 0; b < kBytes; b += kLine) _mm_prefetch(theirs.staging[buf] + b, _MM_HINT_T0);
      }
      if (protocol == Protocol::FlagPrefetchWrite) {
        for (size_t b = 0; b < kBytes; b += kLine) _mm_prefetch(mine.staging[1 - buf] + b, _MM_HINT_ET0);
      }
      sum(out, in, reinterpret_cast<const float*>(theirs.staging[buf]));
      if (protocol == Protocol::OneBuffer) mine.done.round.store(r, std::memory_order_release);
    } else {
      for (size_t l = 0; l < kLines; ++l) {
        const size_t n = std::min(kLineData, kBytes - l * kLineData);
        const __m512i v = _mm512_maskz_loadu_epi8((uint64_t{1} << n) - 1, src + l * kLineData);
        _mm512_mask_storeu_epi8(mine.lines[buf][l].data, (uint64_t{1} << kLineData) - 1, v);
        mine.lines[buf][l].round.store(r, std::memory_order_release);
      }
      const Line* peer = theirs.lines[buf];
      if (protocol == Protocol::LinesLastFirst) {
        while (peer[kLines - 1].round.load(std::memory_order_acquire) != r) _mm_pause();
      }
      for (size_t l = 0; l < kLines; ++l) {
        while (peer[l].round.load(std::memory_order_acquire) != r) _mm_pause();
        // 64 bytes into the unpacked buffer; the next line's 56 overwrite the last 8
        _mm512_storeu_si512(unpacked + l * kLineData, _mm512_load_si512(&peer[l]));
      }
      sum(out, in, reinterpret_cast<const float*>(unpacked));
    }
    asm volatile("" : : "r"(out) : "memory");  // the sum is used
  }
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kRounds;
}

} // namespace

int main(int argc, char** argv) {
  const int a = argc > 2 ? std::atoi(argv[1]) : 0;
  const int b = argc > 2 ? std::atoi(argv[2]) : 1;
  std::printf("2 threads on CPUs %d and %d, %zu bytes a round, ns a round (thread on %d)\n",
              a, b, kBytes, a);
  for (int repeat = 0; repeat < kRepeats; ++repeat) {
    for (int p = 0; p < static_cast<int>(std::size(kNames)); ++p) {
      const auto protocol = static_cast<Protocol>(p);
      std::memset(static_cast<void*>(shared), 0, sizeof shared);
      std::thread other([&] { run(protocol, 1, b); });
      const double ns = run(protocol, 0, a);
      other.join();
      std::printf("  %s %.0f", kNames[p], ns);
    }
    std::printf("\n");
  }
}
