// The memory the fused collectives share between the ranks of one host,
// and the words between a rank's device and its host. Plain types that
// nvcc and g++ both compile.
//
// Each rank owns one buffer (cudaMalloc'd and exported by IPC handle on a
// GPU, a shared-memory segment in the emulated grid) that every peer maps:
//
//   [ FusedHeader | staging: channels x 2 x chunkBytes |
//     results: channels x 2 x chunkBytes ]
//
// Ownership: every byte of a rank's buffer is written by that rank only
// (its kernels, or its host before the first collective), except probe[k],
// which only rank k writes (the access check at connect). Peers only read.
//
// Vocabulary (programs.h):
//   channel  a part of every collective's buffer, moved by one team of
//            threads (a thread block; a CPU thread in the emulated grid);
//   chunk    what one channel stages per round: at most chunkBytes;
//   round    one use of a channel's staging: stage a chunk, meet the peers,
//            read theirs; rounds alternate between the two halves;
//   barrier  a channel meeting its peers' same channel: each arrives by
//            storing its count of barriers crossed, and waits for theirs.
//
// Protocol (all counters only increase, from 0, over the group's life, so
// nothing is reset between collectives):
//   Barrier. To cross its k-th barrier (k = 1, 2, ...) channel c of a rank
//     stores arrive[c] = k (release, after its team's writes), then waits
//     until every peer's arrive[c] >= k (acquire), then its team reads.
//   Agreement. Before the first barrier of collective #seq, channel c stores
//     the collective's digest in digest[c].slot[seq % kDigestRing] (and the
//     offset of its registered tensor beside it); after that barrier it
//     compares each peer's (and reads where the peer's tensor lies). A rank is at most one collective
//     ahead of a peer on any channel (a launch ends before the next starts,
//     and its barriers need the peer's arrivals), so the ring never
//     overwrites a digest a peer still reads.
//   Rounds. The r-th round of channel c (counted over the group's life)
//     uses half r % 2 of the channel's staging and results. A rank writes
//     half h in round r only after its first barrier of round r, which
//     needs every peer's arrival there, which each stores only after it
//     finished reading round r - 1; the reads of round r - 2, in half h too,
//     are done before that. So no half is overwritten while a peer reads it.
//   Failure. A channel that gives up (a timeout, a peer that gave up, a
//     mismatch, this rank's abort) records the first cause in the error
//     word, stores failed = 1, and returns; every later launch of the rank
//     returns at once while the error word is set, so its stream drains
//     instead of hanging, and the host reports the error on the collective.
#pragma once

#include <cstddef>
#include <cstdint>

#include "device/primitives.h"

namespace pyddp {
namespace device {

// Kernels take one buffer pointer per rank by value.
constexpr int kMaxRanks = 16;
// Channels of one launch at most: each is a thread block, and two ranks
// sharing a GPU under MPS must have every block of both resident at once
// (a spinning block must never wait for a peer's block that has no SM):
// 2 x 32 blocks of one per SM leave most of an H100/H200's 132 SMs free.
constexpr int kMaxChannels = 32;
constexpr int kDigestRing = 4;

// A flag per 128-byte line: flags of different writers never share a line,
// and a GPU's 128-byte lines hold one flag each.
constexpr size_t kLineBytes = 128;
struct alignas(kLineBytes) Flag {
  uint64_t value;
};
static_assert(sizeof(Flag) == kLineBytes);

// What collective #seq is, for the peers: its digest, and for a
// registered launch the byte offset of this rank's tensor in the
// registered buffer (each rank's may differ), in slot seq % kDigestRing.
struct alignas(kLineBytes) DigestSlots {
  uint64_t slot[kDigestRing];
  uint64_t offset[kDigestRing];
};
static_assert(sizeof(DigestSlots) == kLineBytes);

constexpr uint64_t kFusedMagic = 0x7079646466757365ull;  // "pyddfuse"
constexpr uint32_t kFusedLayoutVersion = 2;

struct alignas(kLineBytes) FusedHeader {
  Flag arrive[kMaxChannels];         // barriers channel c crossed
  DigestSlots digest[kMaxChannels];  // collectives channel c is in
  Flag failed;                       // nonzero: this rank gave up
  // Written once at setup; peers read them at connect to check that they
  // map a buffer of this layout, and this very buffer (the token is also
  // in the bootstrap blob).
  uint64_t magic;
  uint32_t layoutVersion;
  uint32_t channels;
  uint64_t chunkBytes;
  uint64_t token;
  // probe[k]: written by rank k at connect and read back, proving that
  // rank k can write here.
  uint64_t probe[kMaxRanks];
};
static_assert(offsetof(FusedHeader, arrive) == 0 &&
              offsetof(FusedHeader, digest) == kMaxChannels * kLineBytes &&
              offsetof(FusedHeader, failed) == 2 * kMaxChannels * kLineBytes &&
              offsetof(FusedHeader, magic) == (2 * kMaxChannels + 1) * kLineBytes &&
              offsetof(FusedHeader, probe) == (2 * kMaxChannels + 1) * kLineBytes + 32 &&
              sizeof(FusedHeader) == (2 * kMaxChannels + 3) * kLineBytes);

// Where the regions of a rank's buffer lie: the same on every rank, which
// connect checks.
struct Geometry {
  int channels;       // the most a launch uses
  size_t chunkBytes;  // per channel and half; a multiple of kLineBytes

  PYDDP_DEV size_t regionBytes() const {
    return static_cast<size_t>(channels) * 2 * chunkBytes;
  }
  PYDDP_DEV size_t bytes() const { return sizeof(FusedHeader) + 2 * regionBytes(); }
  PYDDP_DEV size_t stagingOffset(int c, uint64_t round) const {
    return sizeof(FusedHeader) + (static_cast<size_t>(c) * 2 + round % 2) * chunkBytes;
  }
  PYDDP_DEV size_t resultsOffset(int c, uint64_t round) const {
    return stagingOffset(c, round) + regionBytes();
  }
};

// The error word (code << 32 | rank to blame) a rank's device writes for
// its host.
enum ErrorCode : int64_t {
  kOk = 0,
  kTimeout = 1,     // the rank did not arrive within the timeout
  kPeerFailed = 2,  // the rank gave up first
  kAborted = 3,     // this rank's host aborted (teardown, a dead peer)
  kMismatch = 4,    // the rank called another collective
};

PYDDP_DEV inline int64_t encodeError(ErrorCode code, int32_t rank) {
  return (static_cast<int64_t>(code) << 32) | static_cast<uint32_t>(rank);
}
PYDDP_DEV inline ErrorCode errorCode(int64_t word) {
  return static_cast<ErrorCode>(word >> 32);
}
PYDDP_DEV inline int32_t errorRank(int64_t word) {
  return static_cast<int32_t>(word & 0xffffffff);
}

// One look at a wait on peer `peer`: kOk when its flag reached the target
// (stop waiting), -1 to keep waiting, else the error word to record. A
// reached flag wins over a failure seen at the same time (the data is
// there); this rank's abort wins over everything else.
PYDDP_DEV inline int64_t waitVerdict(uint64_t flag, uint64_t target, uint64_t peerFailed,
                                     int64_t abortWord, uint64_t elapsedNs, uint64_t timeoutNs,
                                     int32_t peer) {
  if (abortWord != 0) return encodeError(kAborted, peer);
  if (flag >= target) return kOk;
  if (peerFailed != 0) return encodeError(kPeerFailed, peer);
  if (elapsedNs > timeoutNs) return encodeError(kTimeout, peer);
  return -1;
}

} // namespace device
} // namespace pyddp
