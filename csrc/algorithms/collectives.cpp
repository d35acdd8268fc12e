#include "algorithms/collectives.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "algorithms/schedule.h"
#include "common/check.h"

namespace pyddp {
namespace algorithms {
namespace {

using schedule::Range;

char* at(void* base, size_t elem, size_t elemSize) {
  return static_cast<char*>(base) + elem * elemSize;
}
const char* at(const void* base, size_t elem, size_t elemSize) {
  return static_cast<const char*>(base) + elem * elemSize;
}

// The tag of a collective's messages: below every tag a user can give (a
// C int), and one per collective, so no message of one collective is
// taken by another.
int64_t collectiveTag(const CollectiveDesc& desc) {
  return std::numeric_limits<int64_t>::min() + static_cast<int64_t>(desc.seq);
}

// Elements per piece: a slot must hold a piece as partial results, which
// are wider than elements for half types.
size_t reducePieceElems(RingLink& link, DataType dtype) {
  return link.pieceBytes() / kernels::partialSize(dtype);
}

// Every rank entered the same collective (Transport::enter), unless it did
// before this algorithm started.
void arrive(const Call& c) {
  if (!c.arrived) c.transport.enter(c.desc, c.deadline);
}

// The rounds of a direct collective, and its arrival. A tensor that fits
// one round arrives with it (PeerMemory::enterStaged): one meeting instead
// of two, which is most of a small collective's time. A longer one, or an
// empty one, arrives before its first round.
class StagedRounds {
 public:
  StagedRounds(const Call& c, PeerMemory& mem, size_t count, size_t chunkElems)
      : c_(c), mem_(mem), arrivePending_(!c.arrived && count > 0 && count <= chunkElems) {
    if (!arrivePending_) arrive(c);
  }
  // Publishes this rank's staged round; returns once every rank has.
  void exchange() {
    if (!arrivePending_) return mem_.exchange();
    arrivePending_ = false;
    mem_.enterStaged(c_.desc, c_.deadline);
  }

 private:
  const Call& c_;
  PeerMemory& mem_;
  bool arrivePending_;
};

// Every rank's share of a staged round, in rank order, for a reduction: the
// peers' from their staging buffers at byte `offset`, this rank's from
// `mine` (which a streamed staging copy left out of this core's cache, and
// which a reduce-scatter does not stage).
void sharesOf(ConstRankPtrs& src, const PeerMemory& mem, int rank, const void* mine,
              size_t offset) {
  for (int k = 0; k < static_cast<int>(src.size()); ++k) {
    src[k] = k == rank ? mine : static_cast<const char*>(mem.peerBuffer(k)) + offset;
  }
}

} // namespace

void ringAllReduce(const Call& c, const kernels::ReduceSpec& spec,
                   const void* in, void* out, size_t count) {
  RingLink& link = c.transport.ring();
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  const size_t pe = reducePieceElems(link, spec.dtype);
  // Piece p of block b: where it starts in the tensor and how long it is.
  auto slice = [&](int b, size_t p) {
    const Range blk = schedule::balancedBlock(count, n, b);
    const Range pc = schedule::piece(blk.count, pe, p);
    return Range{blk.begin + pc.begin, pc.count};
  };
  // every rank arrived with the same call
  arrive(c);
  if (n == 1) {
    c.transport.local().copy(out, in, count * es);  // AVG over one rank is x / 1 = x
    return;
  }
  const size_t pieces = schedule::numPieces(schedule::balancedBlock(count, n, 0).count, pe);
  for (size_t p = 0; p < pieces; ++p) {
    // reduce phase, step 0: send my own block
    Range s = slice(schedule::sendBlock(r, 0, n, 0), p);
    if (s.count) link.sendPartial(spec, at(in, s.begin, es), s.count);
    // steps 1..n-2: add my share to the partial sum and pass it on
    for (int step = 0; step < n - 2; ++step) {
      s = slice(schedule::recvBlock(r, step, n, 0), p);
      if (s.count) link.recvReduceSend(spec, hopOfStep(step), at(in, s.begin, es), s.count);
    }
    // last reduce step: the block is complete; keep it and start gathering
    s = slice(schedule::recvBlock(r, n - 2, n, 0), p);
    if (s.count) {
      link.recvReduceCopySend(spec, hopOfStep(n - 2), at(in, s.begin, es), at(out, s.begin, es),
                              s.count);
    }
    // gather phase: store each finished block and pass it on
    for (int step = 0; step < n - 2; ++step) {
      s = slice(schedule::recvBlock(r, step, n, 1), p);
      if (s.count) link.recvCopySend(at(out, s.begin, es), s.count * es);
    }
    // last gather step: the block that started on my right neighbour
    s = slice(schedule::recvBlock(r, n - 2, n, 1), p);
    if (s.count) link.recv(at(out, s.begin, es), s.count * es);
  }
}

void directAllReduce(const Call& c, PeerMemory& mem,
                     const kernels::ReduceSpec& spec, const void* in, void* out,
                     size_t count) {
  const size_t es = elementSize(spec.dtype);
  const size_t chunkElems = mem.capacityBytes() / es;
  PYDDP_CHECK(chunkElems > 0 || count == 0, "direct all_reduce needs staging memory");
  LocalOps& ops = c.transport.local();
  ConstRankPtrs src(c.worldSize);
  // every rank arrived with the same call (with its first round if it has one round)
  StagedRounds rounds(c, mem, count, chunkElems);
  // The tensor moves in chunks that fit the staging buffers, one round each.
  for (size_t begin = 0; begin < count; begin += chunkElems) {
    const size_t n = std::min(chunkElems, count - begin);
    // stage my share of the chunk where every rank can read it
    ops.stage(mem.stagingBuffer(), at(in, begin, es), n * es);
    // every rank staged it
    rounds.exchange();
    // reduce all shares in rank order: the same bits on every rank
    sharesOf(src, mem, c.rank, at(in, begin, es), 0);
    ops.reduceN(spec, at(out, begin, es), src.data(), c.worldSize, n);
  }
}

void twoShotAllReduce(const Call& c, PeerMemory& mem, const kernels::ReduceSpec& spec,
                      const void* in, void* out, size_t count) {
  LocalOps& ops = c.transport.local();
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  const size_t chunkElems = mem.capacityBytes() / es;
  PYDDP_CHECK(chunkElems > 0 || count == 0, "two-shot all_reduce needs staging memory");
  ConstRankPtrs src(n);
  // every rank arrived with the same call (with its first round if it has one chunk)
  StagedRounds rounds(c, mem, count, chunkElems);
  // Chunk: what fits a staging buffer, one pair of rounds each. Block b of a
  // chunk (balancedBlock) is reduced by rank b alone, then read by all.
  for (size_t begin = 0; begin < count; begin += chunkElems) {
    const size_t len = std::min(chunkElems, count - begin);
    const Range mine = schedule::balancedBlock(len, n, r);
    // round 1: stage my share of the chunk where every rank can read it
    ops.stage(mem.stagingBuffer(), at(in, begin, es), len * es);
    rounds.exchange();
    // reduce my block of every rank's share in rank order, into the buffer
    // of round 2 (the same bits on every rank)
    sharesOf(src, mem, r, at(in, begin + mine.begin, es), mine.begin * es);
    ops.reduceN(spec, at(mem.stagingBuffer(), mine.begin, es), src.data(), n, mine.count);
    // round 2: every block is reduced; each rank copies all of them out
    rounds.exchange();
    for (int b = 0; b < n; ++b) {
      const Range blk = schedule::balancedBlock(len, n, b);
      ops.copy(at(out, begin + blk.begin, es), at(mem.peerBuffer(b), blk.begin, es),
               blk.count * es);
    }
  }
}

void ringAllGather(const Call& c, DataType dtype, const void* in,
                   c10::ArrayRef<void*> outBlocks, size_t blockCount) {
  RingLink& link = c.transport.ring();
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(dtype);
  const size_t pe = link.pieceBytes() / es;
  // every rank arrived with the same call
  arrive(c);
  if (n == 1) {
    c.transport.local().copy(outBlocks[r], in, blockCount * es);
    return;
  }
  const size_t pieces = schedule::numPieces(blockCount, pe);
  for (size_t p = 0; p < pieces; ++p) {
    const Range pc = schedule::piece(blockCount, pe, p);
    const size_t bytes = pc.count * es;
    // step 0: send my block, and keep it (its piece read from memory once)
    link.sendCopy(at(in, pc.begin, es), at(outBlocks[r], pc.begin, es), bytes);
    // steps 1..n-2: keep and forward my left neighbour's block
    for (int step = 0; step < n - 2; ++step) {
      const int b = schedule::recvBlock(r, step, n, 0);
      link.recvCopySend(at(outBlocks[b], pc.begin, es), bytes);
    }
    // last step: the block of my right neighbour
    const int b = schedule::recvBlock(r, n - 2, n, 0);
    link.recv(at(outBlocks[b], pc.begin, es), bytes);
  }
}

void directAllGather(const Call& c, PeerMemory& mem, DataType dtype, const void* in,
                     c10::ArrayRef<void*> outBlocks, size_t blockCount) {
  const size_t es = elementSize(dtype);
  const size_t chunkElems = mem.capacityBytes() / es;
  PYDDP_CHECK(chunkElems > 0 || blockCount == 0, "direct all_gather needs staging memory");
  LocalOps& ops = c.transport.local();
  // every rank arrived with the same call (with its first round if it has one round)
  StagedRounds rounds(c, mem, blockCount, chunkElems);
  // Each block moves in chunks that fit the staging buffers, one round each.
  for (size_t begin = 0; begin < blockCount; begin += chunkElems) {
    const size_t n = std::min(chunkElems, blockCount - begin);
    // stage my block's chunk where every rank can read it
    ops.stage(mem.stagingBuffer(), at(in, begin, es), n * es);
    // every rank staged it
    rounds.exchange();
    // every rank's chunk into its block, mine from where I staged it: my
    // input may be a peer's block, which its chunk has just overwritten
    for (int k = 0; k < c.worldSize; ++k) {
      if (k != c.rank || outBlocks[k] != in) {
        ops.copy(at(outBlocks[k], begin, es), mem.peerBuffer(k), n * es);
      }
    }
  }
}

void ringReduceScatter(const Call& c, const kernels::ReduceSpec& spec,
                       c10::ArrayRef<const void*> inBlocks, void* out,
                       size_t blockCount) {
  RingLink& link = c.transport.ring();
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  const size_t pe = reducePieceElems(link, spec.dtype);
  // every rank arrived with the same call
  arrive(c);
  if (n == 1) {
    c.transport.local().copy(out, inBlocks[0], blockCount * es);
    return;
  }
  const size_t pieces = schedule::numPieces(blockCount, pe);
  for (size_t p = 0; p < pieces; ++p) {
    const Range pc = schedule::piece(blockCount, pe, p);
    // step 0: send the block that will end on my left neighbour
    link.sendPartial(spec, at(inBlocks[schedule::sendBlock(r, 0, n, -1)], pc.begin, es),
                     pc.count);
    // steps 1..n-2: add my share to the partial sum and pass it on
    for (int step = 0; step < n - 2; ++step) {
      const int b = schedule::recvBlock(r, step, n, -1);
      link.recvReduceSend(spec, hopOfStep(step), at(inBlocks[b], pc.begin, es), pc.count);
    }
    // last step: my own block, complete
    const int b = schedule::recvBlock(r, n - 2, n, -1);
    link.recvReduceCopy(spec, hopOfStep(n - 2), at(inBlocks[b], pc.begin, es),
                        at(out, pc.begin, es), pc.count);
  }
}

void directReduceScatter(const Call& c, PeerMemory& mem, const kernels::ReduceSpec& spec,
                         c10::ArrayRef<const void*> inBlocks, void* out,
                         size_t blockCount) {
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  // Chunk: the same stretch of every block, as long as n of them fit a
  // staging buffer; block b's stretch is staged at b * len (all but my own,
  // which only I read, from my input).
  const size_t chunkElems = mem.capacityBytes() / es / n;
  PYDDP_CHECK(chunkElems > 0 || blockCount == 0, "direct reduce_scatter needs staging memory");
  LocalOps& ops = c.transport.local();
  ConstRankPtrs src(n);
  // every rank arrived with the same call (with its first round if it has one round)
  StagedRounds rounds(c, mem, blockCount, chunkElems);
  for (size_t begin = 0; begin < blockCount; begin += chunkElems) {
    const size_t len = std::min(chunkElems, blockCount - begin);
    // stage this stretch of every other block where its rank can read it
    for (int b = 0; b < n; ++b) {
      if (b != r) {
        ops.stage(at(mem.stagingBuffer(), b * len, es), at(inBlocks[b], begin, es), len * es);
      }
    }
    // every rank staged it
    rounds.exchange();
    // reduce my block's stretch of every rank in rank order
    sharesOf(src, mem, r, at(inBlocks[r], begin, es), r * len * es);
    ops.reduceN(spec, at(out, begin, es), src.data(), n, len);
  }
}

void chainBroadcast(const Call& c, void* buf, size_t bytes, int root) {
  RingLink& link = c.transport.ring();
  const int pos = schedule::chainPosition(c.rank, root, c.worldSize);
  const int last = c.worldSize - 1;
  const size_t pb = link.pieceBytes();
  // every rank arrived with the same call
  arrive(c);
  if (c.worldSize == 1) return;
  for (size_t p = 0; p < schedule::numPieces(bytes, pb); ++p) {
    const Range pc = schedule::piece(bytes, pb, p);
    char* piece = static_cast<char*>(buf) + pc.begin;
    if (pos == 0) {
      link.send(piece, pc.count);          // the root starts the chain
    } else if (pos < last) {
      link.recvCopySend(piece, pc.count);  // middle ranks keep and forward
    } else {
      link.recv(piece, pc.count);          // the last rank only keeps
    }
  }
}

void barrier(const Call& c) {
  arrive(c);
}

int kernelVoter(int root, int worldSize) {
  return root < 0 ? 0 : schedule::mod(root - 1, worldSize);
}

RegisteredView arriveRegistered(const Call& c, PeerMemory& mem, const void* mine, size_t bytes,
                                int root, InPlaceReads reads) {
  PYDDP_CHECK(!c.arrived && mem.capacityBytes() >= sizeof(TensorWhere),
              "a registered collective arrives with its staging buffer");
  // stage where my tensor lies, and arrive with it
  const TensorWhere own{mine ? registered::locate(mine, bytes) : registered::Ref{},
                        reinterpret_cast<uintptr_t>(mine), reads.kernelVote ? 1u : 0u};
  std::memcpy(mem.stagingBuffer(), &own, sizeof own);
  mem.enterStaged(c.desc, c.deadline);
  // the voter's vote: whether plain tensors are read through the kernel
  TensorWhere voter;
  std::memcpy(&voter, mem.peerBuffer(kernelVoter(root, c.worldSize)), sizeof voter);
  const bool throughKernel = reads.throughKernel && voter.kernelVote == 1;
  // how each tensor read is reached: mapped, through the kernel, or not at all
  RegisteredView view{ConstRankPtrs(c.worldSize),
                      c10::SmallVector<bool, kInlineRanks>(c.worldSize),
                      c10::SmallVector<uint64_t, kInlineRanks>(c.worldSize)};
  c10::SmallVector<TensorWhere, kInlineRanks> where(c.worldSize);
  for (int k = 0; k < c.worldSize; ++k) {
    std::memcpy(&where[k], mem.peerBuffer(k), sizeof where[k]);
    view.addresses[k] = where[k].address;
    if (root >= 0 && k != root) continue;
    const bool mapped = reads.mapped && where[k].ref.serial != 0;
    if (!mapped && !(throughKernel && where[k].address != 0)) return {};
    view.remote[k] = !mapped && k != c.rank;
    view.throughKernel = view.throughKernel || !mapped;
  }
  // mapped here
  for (int k = 0; k < c.worldSize; ++k) {
    if (root >= 0 && k != root) continue;
    view.tensors[k] = k == c.rank                ? mine
        : view.remote[k] ? reinterpret_cast<const void*>(where[k].address)
                         : mem.registeredTensor(k, where[k].ref, bytes);
  }
  return view;
}

namespace {

// `bytes` of rank k's tensor from `offset` on into dst, as the view reaches it.
void readTensor(const Call& c, PeerMemory& mem, const RegisteredView& view, int k, void* dst,
                size_t offset, size_t bytes) {
  if (bytes == 0) return;
  const void* src = at(view.tensors[k], offset, 1);
  if (view.remote[k]) {
    mem.readProcess(k, dst, reinterpret_cast<uintptr_t>(src), bytes);
  } else {
    c.transport.local().copy(dst, src, bytes);
  }
}

// dst = reduce over ranks k, in rank order, of `count` elements of rank k's
// tensor from element `first` on (the same bits on every rank that reduces
// them). A mapped tensor is reduced where it lies; a remote one is first
// copied through the kernel, piece by piece, into its slot of `scratch`
// (peer k's: slot k, less one past my rank), so that a piece is still in
// the cache when it is reduced.
void reduceFromEvery(const Call& c, PeerMemory& mem, const RegisteredView& view,
                     const kernels::ReduceSpec& spec, size_t first, void* dst, size_t count,
                     void* scratch) {
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  const size_t pieceBytes = schedule::kernelPieceBytes(n);
  const size_t pieceElems = view.throughKernel ? pieceBytes / es : std::max<size_t>(count, 1);
  ConstRankPtrs src(n);
  for (size_t p = 0; p < schedule::numPieces(count, pieceElems); ++p) {
    const schedule::Range pc = schedule::piece(count, pieceElems, p);
    for (int k = 0; k < n; ++k) {
      src[k] = at(view.tensors[k], first + pc.begin, es);
      if (!view.remote[k]) continue;
      void* slot = at(scratch, (k < r ? k : k - 1) * pieceBytes, 1);
      mem.readProcess(k, slot, reinterpret_cast<uintptr_t>(src[k]), pc.count * es);
      src[k] = slot;
    }
    c.transport.local().reduceN(spec, at(dst, pc.begin, es), src.data(), n, pc.count);
  }
}

} // namespace

void registeredAllGather(const Call& c, PeerMemory& mem, const RegisteredView& in,
                         DataType dtype, c10::ArrayRef<void*> outBlocks, size_t blockCount) {
  const size_t bytes = blockCount * elementSize(dtype);
  // every block from where its rank's input lies (my own last: no peer waits for it)
  for (int k = 1; k <= c.worldSize; ++k) {
    const int b = schedule::mod(c.rank + k, c.worldSize);
    readTensor(c, mem, in, b, outBlocks[b], 0, bytes);
  }
  // no peer reads my input any more
  mem.exchange();
}

void registeredBroadcast(const Call& c, PeerMemory& mem, const RegisteredView& bufs, void* buf,
                         size_t bytes, int root) {
  // Through the kernel every buf splits at `head`: the receiver reads the
  // head from the root's buf, the root writes the tail into the receiver's.
  const size_t tail =
      bufs.throughKernel ? schedule::rootWrittenBytes(bytes, c.worldSize) : 0;
  const size_t head = bytes - tail;
  if (c.rank == root) {
    // the tail of my buf into every peer's, in turn
    for (int k = 1; k < c.worldSize && tail > 0; ++k) {
      const int to = schedule::mod(root + k, c.worldSize);
      PYDDP_CHECK(bufs.addresses[to] != 0, "rank ", to, " offered no buffer to broadcast into");
      mem.writeProcess(to, bufs.addresses[to] + head, at(buf, head, 1), tail);
    }
  } else {
    // the head of the root's buf to mine
    readTensor(c, mem, bufs, root, buf, 0, head);
  }
  // every buf is whole: no rank reads the root's buf or writes mine any more
  mem.exchange();
}

void registeredAllReduce(const Call& c, PeerMemory& mem, const RegisteredView& bufs,
                         const kernels::ReduceSpec& spec, void* buf, size_t count,
                         void* scratch) {
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  // Block b (balancedBlock) is reduced by rank b, in place in rank b's buf,
  // which no other rank reads until the next meeting; the other ranks read
  // only their own block of it until then.
  const Range mine = schedule::balancedBlock(count, n, r);
  // reduce my block of every rank's buf in rank order
  reduceFromEvery(c, mem, bufs, spec, mine.begin, at(buf, mine.begin, es), mine.count, scratch);
  // every block is reduced
  mem.exchange();
  // each block from the rank that reduced it (my own is in place)
  for (int k = 1; k < n; ++k) {
    const int b = schedule::mod(r + k, n);
    const Range blk = schedule::balancedBlock(count, n, b);
    readTensor(c, mem, bufs, b, at(buf, blk.begin, es), blk.begin * es, blk.count * es);
  }
  // no peer reads my buf any more
  mem.exchange();
}

void registeredReduceScatter(const Call& c, PeerMemory& mem, const RegisteredView& in,
                             const kernels::ReduceSpec& spec, void* out, size_t blockCount,
                             void* scratch) {
  // reduce my block of every rank's input in rank order
  reduceFromEvery(c, mem, in, spec, c.rank * blockCount, out, blockCount, scratch);
  // no peer reads my input any more
  mem.exchange();
}

void pairwiseAllToAll(const Call& c, MessageLink& link, DataType dtype, const void* in,
                      const std::vector<size_t>& sendCounts,
                      const std::vector<size_t>& sendOffsets, void* out,
                      const std::vector<size_t>& recvCounts,
                      const std::vector<size_t>& recvOffsets) {
  const size_t es = elementSize(dtype);
  // every rank arrived with the same call
  arrive(c);
  // my own block needs no message
  c.transport.local().copy(at(out, recvOffsets[c.rank], es), at(in, sendOffsets[c.rank], es),
                           recvCounts[c.rank] * es);
  exchangeAllToAll(link, c.desc, c.deadline, c.rank, c.worldSize, dtype, in, sendCounts,
                   sendOffsets, out, recvCounts, recvOffsets);
}

void exchangeAllToAll(MessageLink& link, const CollectiveDesc& desc, Deadline deadline,
                      int r, int n, DataType dtype, const void* in,
                      const std::vector<size_t>& sendCounts,
                      const std::vector<size_t>& sendOffsets, void* out,
                      const std::vector<size_t>& recvCounts,
                      const std::vector<size_t>& recvOffsets) {
  const size_t es = elementSize(dtype);
  const int64_t tag = collectiveTag(desc);
  // step s: send to rank + s, receive from rank - s, all at once
  std::vector<uint64_t> ops;
  for (int step = 1; step < n; ++step) {
    const int to = schedule::mod(r + step, n), from = schedule::mod(r - step, n);
    ops.push_back(link.postSend(to, tag, dtype, at(in, sendOffsets[to], es),
                                sendCounts[to] * es, deadline));
    ops.push_back(link.postRecv(from, tag, dtype, at(out, recvOffsets[from], es),
                                recvCounts[from] * es, deadline));
  }
  // every block moved
  link.wait(ops);
}

void directGather(const Call& c, MessageLink& link, DataType dtype, const void* in,
                  c10::ArrayRef<void*> outBlocks, size_t count, int root) {
  const size_t bytes = count * elementSize(dtype);
  const int64_t tag = collectiveTag(c.desc);
  // every rank arrived with the same call
  arrive(c);
  std::vector<uint64_t> ops;
  if (c.rank != root) {
    // send my block to the root
    ops.push_back(link.postSend(root, tag, dtype, in, bytes, c.deadline));
  } else {
    // the root keeps its own block and receives every other
    c.transport.local().copy(outBlocks[root], in, bytes);
    for (int k = 0; k < c.worldSize; ++k) {
      if (k != root) ops.push_back(link.postRecv(k, tag, dtype, outBlocks[k], bytes, c.deadline));
    }
  }
  link.wait(ops);
}

void directScatter(const Call& c, MessageLink& link, DataType dtype,
                   c10::ArrayRef<const void*> inBlocks, void* out, size_t count,
                   int root) {
  const size_t bytes = count * elementSize(dtype);
  const int64_t tag = collectiveTag(c.desc);
  // every rank arrived with the same call
  arrive(c);
  std::vector<uint64_t> ops;
  if (c.rank != root) {
    // receive my block from the root
    ops.push_back(link.postRecv(root, tag, dtype, out, bytes, c.deadline));
  } else {
    // the root keeps its block and sends every other
    c.transport.local().copy(out, inBlocks[root], bytes);
    for (int k = 0; k < c.worldSize; ++k) {
      if (k != root) ops.push_back(link.postSend(k, tag, dtype, inBlocks[k], bytes, c.deadline));
    }
  }
  link.wait(ops);
}

void ringReduce(const Call& c, MessageLink& link, const kernels::ReduceSpec& spec,
                const void* in, void* out, size_t count, int root) {
  RingLink& ring = c.transport.ring();
  const int n = c.worldSize, r = c.rank;
  const size_t es = elementSize(spec.dtype);
  const size_t pe = reducePieceElems(ring, spec.dtype);
  auto slice = [&](int b, size_t p) {
    const Range blk = schedule::balancedBlock(count, n, b);
    const Range pc = schedule::piece(blk.count, pe, p);
    return Range{blk.begin + pc.begin, pc.count};
  };
  // every rank arrived with the same call
  arrive(c);
  if (n == 1) {
    c.transport.local().copy(out, in, count * es);
    return;
  }
  // The reduce phase of ringAllReduce: rank r ends owning block r + 1.
  const int owned = schedule::recvBlock(r, n - 2, n, 0);
  const size_t pieces = schedule::numPieces(schedule::balancedBlock(count, n, 0).count, pe);
  for (size_t p = 0; p < pieces; ++p) {
    // step 0: send my own block
    Range s = slice(schedule::sendBlock(r, 0, n, 0), p);
    if (s.count) ring.sendPartial(spec, at(in, s.begin, es), s.count);
    // steps 1..n-2: add my share to the partial sum and pass it on
    for (int step = 0; step < n - 2; ++step) {
      s = slice(schedule::recvBlock(r, step, n, 0), p);
      if (s.count) ring.recvReduceSend(spec, hopOfStep(step), at(in, s.begin, es), s.count);
    }
    // last step: the block I own is complete
    s = slice(owned, p);
    if (s.count) {
      ring.recvReduceCopy(spec, hopOfStep(n - 2), at(in, s.begin, es), at(out, s.begin, es),
                          s.count);
    }
  }
  // every owned block to the root
  const int64_t tag = collectiveTag(c.desc);
  std::vector<uint64_t> ops;
  if (r != root) {
    const Range mine = schedule::balancedBlock(count, n, owned);
    ops.push_back(link.postSend(root, tag, spec.dtype, at(out, mine.begin, es), mine.count * es,
                                c.deadline));
  } else {
    for (int k = 0; k < n; ++k) {
      if (k == root) continue;
      const Range theirs = schedule::balancedBlock(count, n, schedule::recvBlock(k, n - 2, n, 0));
      ops.push_back(link.postRecv(k, tag, spec.dtype, at(out, theirs.begin, es),
                                  theirs.count * es, c.deadline));
    }
  }
  link.wait(ops);
}

void directReduce(const Call& c, PeerMemory& mem, const kernels::ReduceSpec& spec,
                  const void* in, void* out, size_t count, int root) {
  const size_t es = elementSize(spec.dtype);
  const size_t chunkElems = mem.capacityBytes() / es;
  PYDDP_CHECK(chunkElems > 0 || count == 0, "direct reduce needs staging memory");
  LocalOps& ops = c.transport.local();
  ConstRankPtrs src(c.worldSize);
  // every rank arrived with the same call (with its first round if it has one round)
  StagedRounds rounds(c, mem, count, chunkElems);
  for (size_t begin = 0; begin < count; begin += chunkElems) {
    const size_t n = std::min(chunkElems, count - begin);
    // stage my share of the chunk where the root can read it
    ops.stage(mem.stagingBuffer(), at(in, begin, es), n * es);
    // every rank staged it
    rounds.exchange();
    if (c.rank != root) continue;
    // the root reduces all shares in rank order
    sharesOf(src, mem, root, at(in, begin, es), 0);
    ops.reduceN(spec, at(out, begin, es), src.data(), c.worldSize, n);
  }
}

} // namespace algorithms
} // namespace pyddp
