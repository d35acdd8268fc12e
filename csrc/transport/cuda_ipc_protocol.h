// The cuda_ipc transport's cross-process layout and flag protocol, in
// plain types that nvcc and g++ both compile: the device kernels spin on
// these structures, the host lays them out, and the CPU tests run the wait
// decision (waitVerdict) exactly as the kernels do.
//
// Each rank cudaMallocs one buffer (the base of an allocation, so its IPC
// handle maps it at offset 0) and every peer maps it with
// cudaIpcOpenMemHandle:
//
//   [ IpcHeader | ring slots: numSlots x slotBytes | staging: 2 x stagingBytes ]
//
// Ownership: every field of a rank's buffer is written by that rank only
// (its kernels, or its host through its own stream), except probe[k], which
// only rank k writes (the peer-access check at connect). Peers only read.
// A header starts with a magic number and a layout version, so that a peer
// of another layout is refused at connect instead of misread.
//
// Protocol (the shm transport's, moved onto the GPU; flags start at 0 and
// only increase, never reset, so no flag is ever read in a stale epoch):
//
// Ring link (this rank -> rank+1), pieces numbered over the group's life.
//   Send piece k: wait until the receiver's consumed >= k + 1 - numSlots,
//   write slot k % numSlots, then signal posted = k + 1. Receive piece k:
//   wait until the sender's posted >= k + 1, read the sender's slot, then
//   signal consumed = k + 1. The data kernel runs between the wait and the
//   signal kernels on one stream, so it starts after the wait returns and
//   the signal is written only after all its reads and writes completed.
// Direct rounds: in round R a rank writes its staging buffer R % 2, signals
//   staged = R and waits until every peer's staged >= R before reading their
//   buffers R % 2 (the shm invariants hold unchanged).
// Signals: __threadfence_system() then a volatile store, so a peer that
//   sees the flag also sees the data written before it. Waits: volatile
//   loads until satisfied, then __threadfence_system() before the data
//   kernel reads.
// Failure: every wait has a timeout (globaltimer), and gives up early when
//   the peer it waits on has set its failed flag or this rank's host set the
//   abort word. A wait that gives up records why in this rank's error word
//   (host-mapped memory, read by the host), sets this rank's failed flag so
//   waits on it end too, and every later wait and signal of this rank is a
//   no-op: the stream drains instead of hanging, and the host reports the
//   error on the collective.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define PYDDP_IPC_HD __host__ __device__
#else
#define PYDDP_IPC_HD
#endif

namespace pyddp {
namespace ipc {

// A flag per 128-byte line: flags of different writers never share a line,
// and a GPU's 128-byte cache lines hold one flag each.
constexpr int kFlagAlign = 128;
// Ranks a group may have on cuda_ipc: kernels take one pointer per peer by
// value, and kernels::cuda::reduceN takes at most 16 sources.
constexpr int kMaxRanks = 16;

struct alignas(kFlagAlign) Flag {
  uint64_t value;
};
static_assert(sizeof(Flag) == kFlagAlign);

constexpr uint64_t kIpcMagic = 0x7079646470697063ull;  // "pyddpipc"
constexpr uint32_t kIpcLayoutVersion = 1;

struct alignas(kFlagAlign) IpcHeader {
  Flag posted;    // ring pieces this rank wrote into its slots
  Flag consumed;  // ring pieces this rank read from its left peer's slots
  Flag staged;    // direct rounds this rank staged
  Flag failed;    // nonzero: this rank gave up
  // Written once at setup; peers read them at connect to check that they
  // map a buffer of this layout, and this very buffer (the token is also
  // in the bootstrap blob).
  uint64_t magic;
  uint32_t layoutVersion;
  uint32_t reserved;
  uint64_t token;
  // probe[k]: written by rank k at connect and read back, proving that rank
  // k can write here.
  uint64_t probe[kMaxRanks];
};
// The exact layout, pinned: a peer built from other sources must agree on
// every offset (magic and layoutVersion say whether it does).
static_assert(offsetof(IpcHeader, posted) == 0 && offsetof(IpcHeader, consumed) == 128 &&
              offsetof(IpcHeader, staged) == 256 && offsetof(IpcHeader, failed) == 384 &&
              offsetof(IpcHeader, magic) == 512 && offsetof(IpcHeader, layoutVersion) == 520 &&
              offsetof(IpcHeader, token) == 528 && offsetof(IpcHeader, probe) == 536 &&
              sizeof(IpcHeader) == 768);

// What a wait kernel does: up to kMaxRanks conditions "flag >= target",
// each naming the rank that writes the flag and that rank's failed flag.
struct WaitList {
  const volatile uint64_t* flag[kMaxRanks];
  const volatile uint64_t* peerFailed[kMaxRanks];
  uint64_t target[kMaxRanks];
  int32_t peer[kMaxRanks];
  int32_t n;
};

// What a signal kernel does: up to two stores "flag = value" into this
// rank's own header.
struct SignalList {
  volatile uint64_t* flag[2];
  uint64_t value[2];
  int32_t n;
};

// Error word codes (host-mapped int64: code << 32 | rank to blame).
enum ErrorCode : int64_t {
  kOk = 0,
  kTimeout = 1,     // the rank did not signal within the timeout
  kPeerFailed = 2,  // the rank gave up first
  kAborted = 3,     // this rank's host aborted (group teardown)
};

PYDDP_IPC_HD inline int64_t encodeError(ErrorCode code, int32_t rank) {
  return (static_cast<int64_t>(code) << 32) | static_cast<uint32_t>(rank);
}
PYDDP_IPC_HD inline ErrorCode errorCode(int64_t word) {
  return static_cast<ErrorCode>(word >> 32);
}
PYDDP_IPC_HD inline int32_t errorRank(int64_t word) {
  return static_cast<int32_t>(word & 0xffffffff);
}

// One look at condition i of a wait: kOk when satisfied (stop waiting on
// it), -1 to keep waiting, else the error word to record. Order matters: a
// satisfied flag wins over a failure seen at the same time (the data is
// there), and this rank's abort wins over everything else.
PYDDP_IPC_HD inline int64_t waitVerdict(uint64_t flag, uint64_t target, uint64_t peerFailed,
                                        int64_t abortWord, uint64_t elapsedNs,
                                        uint64_t timeoutNs, int32_t peer) {
  if (abortWord != 0) return encodeError(kAborted, peer);
  if (flag >= target) return kOk;
  if (peerFailed != 0) return encodeError(kPeerFailed, peer);
  if (elapsedNs > timeoutNs) return encodeError(kTimeout, peer);
  return -1;
}

} // namespace ipc
} // namespace pyddp
