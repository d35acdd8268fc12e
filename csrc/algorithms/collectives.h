// Collective algorithms over the transport interface. Each one is a short
// list of transport verbs; which bytes move where comes from schedule.h.
// Buffers are raw host or device pointers: the engine owns the tensors.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "transport/transport.h"

namespace pyddp {
namespace algorithms {

// One pointer per rank (its block, its staged copy), held inline up to
// kInlineRanks ranks: a small collective on one host allocates nothing
// (8: the ranks of a host with 8 GPUs; more spill to the heap).
constexpr unsigned kInlineRanks = 8;
using RankPtrs = c10::SmallVector<void*, kInlineRanks>;
using ConstRankPtrs = c10::SmallVector<const void*, kInlineRanks>;

// What every algorithm needs to know about the call.
struct Call {
  Transport& transport;
  CollectiveDesc desc;
  Deadline deadline;
  int rank;
  int worldSize;
  // Every rank has entered the collective already (arriveRegistered): the
  // algorithm starts without its own arrival.
  bool arrived = false;
};

// out = reduce(in over ranks); out may equal in. count elements per rank.
void ringAllReduce(const Call& c, const kernels::ReduceSpec& spec,
                   const void* in, void* out, size_t count);
// Same result read from every rank's staged copy, in chunks of
// PeerMemory::capacityBytes(): the lowest latency for small messages.
void directAllReduce(const Call& c, PeerMemory& mem,
                     const kernels::ReduceSpec& spec, const void* in, void* out,
                     size_t count);
// Same result in two rounds per chunk: each rank reduces one block of the
// chunk from every rank's staged copy, then gathers the reduced blocks. Each
// rank reads about 2x the chunk instead of n x: for medium messages.
void twoShotAllReduce(const Call& c, PeerMemory& mem, const kernels::ReduceSpec& spec,
                      const void* in, void* out, size_t count);
// outBlocks[r] = in of rank r (blockCount elements each); outBlocks[rank]
// may equal in.
void ringAllGather(const Call& c, DataType dtype, const void* in,
                   c10::ArrayRef<void*> outBlocks, size_t blockCount);
// The same from every rank's staged block, in chunks of
// PeerMemory::capacityBytes(): one meeting for a block that fits one.
void directAllGather(const Call& c, PeerMemory& mem, DataType dtype, const void* in,
                     c10::ArrayRef<void*> outBlocks, size_t blockCount);
// out = reduce over ranks of inBlocks[rank] (blockCount elements each).
void ringReduceScatter(const Call& c, const kernels::ReduceSpec& spec,
                       c10::ArrayRef<const void*> inBlocks, void* out,
                       size_t blockCount);
// The same from every rank's staged blocks, reduced in rank order, in
// chunks of every block that fill PeerMemory::capacityBytes(): one meeting
// for blocks that fit one.
void directReduceScatter(const Call& c, PeerMemory& mem, const kernels::ReduceSpec& spec,
                         c10::ArrayRef<const void*> inBlocks, void* out,
                         size_t blockCount);
// buf of rank `root` to buf of every rank, along the chain root, root+1, ...
void chainBroadcast(const Call& c, void* buf, size_t bytes, int root);
// Returns once every rank has entered.
void barrier(const Call& c);

// Registered memory (transport/registered.h): peers read a tensor where it
// lies, so the copy into and out of a staging buffer or ring slot becomes
// one copy. It meets its peers more often than a staged one-round form
// (all-gather and broadcast once more: no rank leaves while a peer reads
// its tensor; all-reduce twice, its blocks are reduced before they are
// read), so it pays for larger messages only. The same algorithms read a
// peer's plain tensor through the kernel (PeerMemory::readProcess:
// cross-memory attach), where the group allows it; a reduction copies a
// peer's block that way into scratch, a piece at a time, and reduces from
// the copy.

// What a rank stages at the arrival of such a collective: where its
// tensor lies. Read by peers of another build: the layout is pinned.
struct alignas(8) TensorWhere {
  registered::Ref ref;  // serial 0: not in registered memory
  uint64_t address;     // its first byte in the owner's process; 0: not offered
  // kernelVoter()'s alone counts: 1 if the collective reads plain tensors
  // through the kernel, where it may (backend/cma_chooser.h).
  uint64_t kernelVote;
};
static_assert(std::is_trivially_copyable_v<TensorWhere> &&
              std::is_standard_layout_v<TensorWhere>);
static_assert(offsetof(TensorWhere, ref) == 0 && offsetof(TensorWhere, address) == 40 &&
              offsetof(TensorWhere, kernelVote) == 48 && sizeof(TensorWhere) == 56);

// The rank whose vote says whether a collective with root `root` (-1:
// none) reads through the kernel: the one whose own time spans the whole
// collective on either path. A broadcast's root would not do: on the ring
// it returns once its last piece is in a slot, before its peers copied it
// out; the last rank of the chain returns last. Otherwise rank 0.
int kernelVoter(int root, int worldSize);

// How a collective may reach its peers' tensors: `mapped`, a registered
// one mapped here; `throughKernel`, any offered one through
// PeerMemory::readProcess, if the voter votes for it (`kernelVote`, which
// counts on kernelVoter() alone). `mapped` and `throughKernel` are alike on
// every rank (the engine's agreed refusals and the ranks' equal options).
struct InPlaceReads {
  bool mapped = false;
  bool throughKernel = false;
  bool kernelVote = false;
};

// The tensors a registered collective reads, as this rank reaches them:
// its own where it is, a peer's mapped read-only or, where remote[k], an
// address in rank k's process. Empty when one of them cannot be reached:
// the collective takes another algorithm.
struct RegisteredView {
  ConstRankPtrs tensors;  // by rank; nullptr for a rank not read
  c10::SmallVector<bool, kInlineRanks> remote;
  // Where each rank's tensor lies in its own process (0: not offered).
  c10::SmallVector<uint64_t, kInlineRanks> addresses;
  // Some rank reads a tensor through the kernel (a broadcast's root reads
  // nothing, but its peers read its tensor so): alike on every rank.
  bool throughKernel = false;
  bool usable() const { return !tensors.empty(); }
};
// The arrival of a collective that may read its tensors in place: every
// rank stages where its tensor `mine` (`bytes` long; nullptr: not offered)
// lies and arrives with it (one meeting, as PeerMemory::enterStaged). The
// tensors read are every rank's (root -1) or the root's; the view reaches
// them as `reads` allows, or is empty. A caller that goes on with another
// algorithm passes it a copy of `c` with `arrived` set.
RegisteredView arriveRegistered(const Call& c, PeerMemory& mem, const void* mine, size_t bytes,
                                int root, InPlaceReads reads);
// ringAllGather's result, each peer's block read from its input in place.
void registeredAllGather(const Call& c, PeerMemory& mem, const RegisteredView& in,
                         DataType dtype, c10::ArrayRef<void*> outBlocks, size_t blockCount);
// buf of rank `root` to buf of every rank, read from the root's buf in
// place. Through the kernel, the root, idle otherwise, writes the tail of
// each peer's buf (schedule::rootWrittenBytes) while the peer reads the
// head: two copies at once where there was one.
void registeredBroadcast(const Call& c, PeerMemory& mem, const RegisteredView& bufs, void* buf,
                         size_t bytes, int root);
// buf = reduce(buf over ranks), in place, as twoShotAllReduce but on every
// rank's buf where it lies: rank b reduces block b of every buf into its
// own, then every rank copies each block from the rank that reduced it.
// `scratch` holds schedule::kernelScratchBytes(c.worldSize) where
// bufs.throughKernel.
void registeredAllReduce(const Call& c, PeerMemory& mem, const RegisteredView& bufs,
                         const kernels::ReduceSpec& spec, void* buf, size_t count,
                         void* scratch);
// ringReduceScatter's result, read from every rank's input where it lies
// (its `n` blocks of `blockCount` elements, one after the other): rank r
// reduces block r of every input, in rank order, into out. `scratch` as
// registeredAllReduce's.
void registeredReduceScatter(const Call& c, PeerMemory& mem, const RegisteredView& in,
                             const kernels::ReduceSpec& spec, void* out, size_t blockCount,
                             void* scratch);

// Algorithms over point-to-point messages (MessageLink). Each is one round
// of messages tagged for this collective alone, so they never meet a
// user's send or recv.

// Block k of `in` (sendCounts[k] elements at sendOffsets[k]) goes to rank
// k; block k of `out` (recvCounts[k] at recvOffsets[k]) comes from rank k;
// this rank's own block is copied. Messages are posted in the pairwise
// order (rank + step) % n, so the ranks do not all start on one peer; a
// block size that the sender and the receiver disagree on fails both.
void pairwiseAllToAll(const Call& c, MessageLink& link, DataType dtype, const void* in,
                      const std::vector<size_t>& sendCounts,
                      const std::vector<size_t>& sendOffsets, void* out,
                      const std::vector<size_t>& recvCounts,
                      const std::vector<size_t>& recvOffsets);
// pairwiseAllToAll's messages alone (every block but block `rank`), for
// an engine that has no Transport: it arrives at collective `desc` and
// copies this rank's own block itself (backend/fused_engine.h).
void exchangeAllToAll(MessageLink& link, const CollectiveDesc& desc, Deadline deadline,
                      int rank, int worldSize, DataType dtype, const void* in,
                      const std::vector<size_t>& sendCounts,
                      const std::vector<size_t>& sendOffsets, void* out,
                      const std::vector<size_t>& recvCounts,
                      const std::vector<size_t>& recvOffsets);
// outBlocks[k] of rank `root` = in of rank k (count elements each); only
// the root receives, every other rank sends once.
void directGather(const Call& c, MessageLink& link, DataType dtype, const void* in,
                  c10::ArrayRef<void*> outBlocks, size_t count, int root);
// out of rank k = inBlocks[k] of rank `root` (count elements each).
void directScatter(const Call& c, MessageLink& link, DataType dtype,
                   c10::ArrayRef<const void*> inBlocks, void* out, size_t count,
                   int root);
// out of rank `root` = reduce(in over ranks): the reduce phase of the ring
// (each rank ends with one reduced block), then every rank's block to the
// root. out of the other ranks is scratch. Moves half what an all-reduce
// moves into the ranks that are not the root.
void ringReduce(const Call& c, MessageLink& link, const kernels::ReduceSpec& spec,
                const void* in, void* out, size_t count, int root);
// The same from every rank's staged copy, reduced by the root alone: for
// small messages.
void directReduce(const Call& c, PeerMemory& mem, const kernels::ReduceSpec& spec,
                  const void* in, void* out, size_t count, int root);

} // namespace algorithms
} // namespace pyddp
