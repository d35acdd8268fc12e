// Ring schedules as pure functions: which block moves at which step, how a
// buffer splits into blocks and a block into pieces. The ring algorithms
// (collectives.cpp, backend/transport_engine.cpp) use them on the host; the
// fused collectives' channel programs (device/programs.h) split their parts
// with balancedBlock on the GPU too, so the functions are __host__
// __device__. Unit tested through pyddp._C._testing.
//
// Vocabulary (as in Gloo):
//   block  the share of a buffer that belongs to one rank: for all-reduce a
//          balanced 1/n split of the tensor (the first count % n blocks are
//          one element longer); for all-gather and reduce-scatter the
//          rank-sized blocks of the gathered / scattered tensor;
//   step   one hop of the ring: at transfer step s (0 <= s < n-1) every rank
//          sends one block to rank+1 and receives one from rank-1;
//   piece  the part of a block that fits one slot; blocks move piece by
//          piece so the next hop starts before the block has fully arrived;
//   slot   a fixed-size staging buffer of the sending rank; consecutive
//          pieces rotate through the link's slots.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/reduce.h"  // PYDDP_HD

namespace pyddp {
namespace schedule {

struct Range {
  size_t begin;
  size_t count;
};

PYDDP_HD inline int mod(int a, int n) {
  const int r = a % n;
  return r < 0 ? r + n : r;
}

// Block b of a `count`-element buffer split as evenly as possible in n.
PYDDP_HD inline Range balancedBlock(size_t count, int n, int b) {
  const size_t base = count / n;
  const size_t extra = count % n;
  const size_t ub = static_cast<size_t>(b);
  const size_t begin = ub * base + (ub < extra ? ub : extra);
  return Range{begin, base + (ub < extra ? 1 : 0)};
}

// Block sent by `rank` at transfer step `step`. `shift` picks the block each
// rank starts from: a ring that starts with block rank+shift ends, after
// n-1 reduction hops, with the fully reduced block rank+shift+1 on rank.
//   all-reduce reduce phase: shift 0  (rank ends owning block rank+1)
//   all-reduce gather phase: shift 1  (rank starts from block rank+1)
//   reduce-scatter:          shift -1 (rank ends owning block rank)
//   all-gather:              shift 0  (rank starts from its own block)
PYDDP_HD inline int sendBlock(int rank, int step, int n, int shift) {
  return mod(rank + shift - step, n);
}

// What `rank` receives at `step` is by definition what rank-1 sends.
PYDDP_HD inline int recvBlock(int rank, int step, int n, int shift) {
  return sendBlock(mod(rank - 1, n), step, n, shift);
}

// Piece p of a block of `count` elements, pieces of at most pieceElems.
PYDDP_HD inline Range piece(size_t count, size_t pieceElems, size_t p) {
  const size_t begin = p * pieceElems;
  if (begin >= count) return Range{count, 0};
  const size_t left = count - begin;
  return Range{begin, left < pieceElems ? left : pieceElems};
}

PYDDP_HD inline size_t numPieces(size_t count, size_t pieceElems) {
  return (count + pieceElems - 1) / pieceElems;
}

// Position of `rank` in the broadcast chain root -> root+1 -> ... -> root-1.
PYDDP_HD inline int chainPosition(int rank, int root, int n) {
  return mod(rank - root, n);
}

// A broadcast read through the kernel (collectives.h, registeredBroadcast)
// splits each receiver's buffer in two: the head it reads from the root's,
// the tail of rootWrittenBytes() the root writes into it meanwhile. The
// root writes n-1 tails while each receiver reads one head, so a tail of
// 1/n of the buffer keeps both busy for the same time. It is rounded down to
// a multiple of kPageBytes: a tail of less than a page is not worth the
// root's system call. 0: the receivers read it all.
constexpr size_t kPageBytes = 4096;
PYDDP_HD inline size_t rootWrittenBytes(size_t bytes, int n) {
  return n < 2 ? 0 : bytes / static_cast<size_t>(n) / kPageBytes * kPageBytes;
}

// A reduction read through the kernel (collectives.h, registeredAllReduce)
// copies a piece of each peer's block at a time into scratch before it
// reduces it: all the pieces small enough to be still in the cache (L2)
// when the reduction reads them, each large enough that its system call is
// worth it (benchmarks/studies/reductions-through-the-kernel.md).
constexpr size_t kKernelScratchBytes = 512 * 1024;
// The piece of each peer's block on `worldSize` ranks: kKernelScratchBytes
// shared among the peers, in whole pages (so whole elements of any type),
// a page at the least.
PYDDP_HD inline size_t kernelPieceBytes(int worldSize) {
  const size_t peers = worldSize > 1 ? static_cast<size_t>(worldSize - 1) : 1;
  const size_t piece = kKernelScratchBytes / peers / kPageBytes * kPageBytes;
  return piece > kPageBytes ? piece : kPageBytes;
}
// The scratch such a reduction needs: a piece per peer.
PYDDP_HD inline size_t kernelScratchBytes(int worldSize) {
  return worldSize > 1 ? static_cast<size_t>(worldSize - 1) * kernelPieceBytes(worldSize) : 0;
}

} // namespace schedule
} // namespace pyddp
