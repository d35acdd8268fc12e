// Collective algorithms over the transport interface. Each one is a short
// list of transport verbs; which bytes move where comes from schedule.h.
// Buffers are raw host or device pointers: the engine owns the tensors.
#pragma once

#include <cstddef>
#include <vector>

#include "transport/transport.h"

namespace pyddp {
namespace algorithms {

// What every algorithm needs to know about the call.
struct Call {
  Transport& transport;
  CollectiveDesc desc;
  Clock::time_point deadline;
  int rank;
  int worldSize;
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
                   const std::vector<void*>& outBlocks, size_t blockCount);
// out = reduce over ranks of inBlocks[rank] (blockCount elements each).
void ringReduceScatter(const Call& c, const kernels::ReduceSpec& spec,
                       const std::vector<const void*>& inBlocks, void* out,
                       size_t blockCount);
// buf of rank `root` to buf of every rank, along the chain root, root+1, ...
void chainBroadcast(const Call& c, void* buf, size_t bytes, int root);
// Returns once every rank has entered.
void barrier(const Call& c);

} // namespace algorithms
} // namespace pyddp
