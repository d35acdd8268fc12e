// Sparse COO all-reduce (SUM), as gloo computes it: every rank's coalesced
// indices and values gathered, concatenated in rank order and coalesced, so
// every rank ends with the same coalesced tensor. The engines run it as two
// all-gathers:
//   1. headers: kHeaderWords int64 per rank (dtype, sparse and dense dims,
//      nnz, sizes), so that every rank knows every rank's block, and all of
//      them check alike that the tensors agree;
//   2. blocks: each rank's indices (int64) then values, as bytes, in blocks
//      the size of the largest rank's (rounded up to 8 bytes, so that every
//      block's values start aligned for their dtype).
// The engine runs the first before its entry point returns and queues the
// second at once, so the two are adjacent in every rank's order of calls.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/types.h"

namespace pyddp {
namespace sparse {

constexpr int64_t kMaxDims = 16;
constexpr int64_t kHeaderWords = 4 + kMaxDims;

// The blocks of the second all-gather, the same on every rank.
struct Blocks {
  int64_t bytes = 0;          // per rank
  std::vector<int64_t> nnz;   // by rank
  int64_t sparseDim = 0;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
};

// `tensor` (a sparse COO tensor on `device`, op SUM) coalesced; refuses
// anything else, naming `rank` and `call`.
at::Tensor coalescedInput(const at::Tensor& tensor, RedOp op, int rank, c10::Device device,
                          const char* call);
// This rank's header (kHeaderWords int64).
at::Tensor headerOf(const at::Tensor& coalesced);
// The blocks every rank's header (`headers`: world_size x kHeaderWords)
// implies; throws alike on every rank when a rank's tensor differs from
// rank 0's in dtype, dims or sizes.
Blocks plan(const at::Tensor& headers, int rank, int size, const char* call);
// This rank's block: indices, then values, then padding (`bytes` bytes).
at::Tensor pack(const at::Tensor& coalesced, int64_t bytes);
// The coalesced sum of every rank's block of `gathered`.
at::Tensor sum(const at::Tensor& gathered, const Blocks& blocks);

} // namespace sparse
} // namespace pyddp
