// The collective descriptor: what every rank must agree on for one
// collective. Each rank publishes its descriptor on entry and every rank
// compares, so that mismatched calls fail on every rank instead of hanging
// or producing garbage.
//
// One table defines the fields (PYDDP_COLLECTIVE_DESC_FIELDS). It drives
// the struct, which is also the wire format in shared-memory segments,
// equality, describe() and the word encoding that transports without
// shared memory (NCCL) all-reduce; a new field is added there once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <c10/util/Exception.h>

#include "common/types.h"

namespace pyddp {

// X(name, type, initial value, name in messages), in wire order.
#define PYDDP_COLLECTIVE_DESC_FIELDS(X)                        \
  X(seq, uint64_t, 0, "sequence number")                       \
  X(count, uint64_t, 0, "count")                               \
  X(kind, CollectiveKind, CollectiveKind::Barrier, "kind")     \
  X(dtype, DataType, DataType::Float32, "dtype")               \
  X(op, RedOp, RedOp::Sum, "op")                               \
  X(root, int32_t, -1, "src")                                  \
  X(algo, Algo, Algo::Ring, "algo")                            \
  X(split, uint64_t, 0, "split")                              \
  X(window, uint64_t, 0, "registered")

struct CollectiveDesc {
#define PYDDP_DESC_MEMBER(name, type, init, label) type name = init;
  PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_MEMBER)
#undef PYDDP_DESC_MEMBER
  // seq: 1, 2, ... in call order, identical on all ranks. count: elements
  // per rank-sized block (see the collective). root: broadcast and scatter
  // source, reduce and gather destination; -1 for the others. algo: which
  // algorithm runs it, which ranks must pick alike. split: how a coalesced
  // call splits its buffer into the user's tensors (their shapes, hashed
  // into at most kMaxSplit); 0 for one tensor. window: the buffer
  // registered with the fused engine (1, 2, ... in registration order,
  // alike on every rank) that the tensor peers read lies in; 0 for none.
};
// The struct is the shared-memory wire format: pin its layout.
static_assert(std::is_trivially_copyable_v<CollectiveDesc>);
static_assert(std::is_standard_layout_v<CollectiveDesc>);
static_assert(offsetof(CollectiveDesc, seq) == 0 && offsetof(CollectiveDesc, count) == 8 &&
              offsetof(CollectiveDesc, kind) == 16 && offsetof(CollectiveDesc, dtype) == 20 &&
              offsetof(CollectiveDesc, op) == 24 && offsetof(CollectiveDesc, root) == 28 &&
              offsetof(CollectiveDesc, algo) == 32 && offsetof(CollectiveDesc, split) == 40 &&
              offsetof(CollectiveDesc, window) == 48 && sizeof(CollectiveDesc) == 56);

// Every field's word stays below 2^63, so that each word of encodeWords()
// (below) has the same top bit on every rank, and a MAX of them as int64
// (torch's gloo, across hosts) orders them as uint64 does.
constexpr uint64_t kMaxSplit = (uint64_t{1} << 63) - 1;

#define PYDDP_DESC_COUNT(name, type, init, label) +1
constexpr int kDescFields = 0 PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_COUNT);
#undef PYDDP_DESC_COUNT

// The fields as unsigned words in table order: enums by value, root + 1
// (so "none", -1, reads as 0, below every rank).
using DescValues = std::array<uint64_t, kDescFields>;
DescValues fieldValues(const CollectiveDesc& d);
// The name of field i in messages ("count", "src", ...).
const char* fieldName(int i);
// Word v of field i as a user reads it: an enum's name, a rank or "none".
std::string formatField(int i, uint64_t v);

bool operator==(const CollectiveDesc& a, const CollectiveDesc& b);

// "all_reduce(count=4, dtype=float32, op=SUM, algo=direct)": the call as
// the user made it (op for reductions, src when there is one).
std::string describe(const CollectiveDesc& d);

// The error when rank `rank` called `mine` and rank `peer` called `theirs`.
std::string mismatch(const CollectiveDesc& mine, int rank, const CollectiveDesc& theirs,
                     int peer);

// The error of a collective that ranks called differently: a
// DistBackendError that says who differed, so that an engine can say more
// (CollectiveDesc::split stands for shapes it knows). `peer` is the rank
// whose descriptor this rank compared with, or -1 when only the range of
// each field across every rank is known (the agreement below).
class DescMismatch : public c10::DistBackendError {
 public:
  DescMismatch(const std::string& why, const CollectiveDesc& mine, int peer, bool splitDiffers);
  const CollectiveDesc& mine() const { return mine_; }
  int peer() const { return peer_; }
  // Whether the ranks split a coalesced call differently.
  bool splitDiffers() const { return splitDiffers_; }

 private:
  CollectiveDesc mine_;
  int peer_;
  bool splitDiffers_;
};

// Throws DescMismatch unless rank `rank`'s `mine` equals rank `peer`'s
// `theirs`.
void checkSame(const CollectiveDesc& mine, int rank, const CollectiveDesc& theirs, int peer);

// Agreement without shared memory. Each field x is encoded as the pair
// (x, ~x); after an element-wise MAX all-reduce of every rank's words, a
// field's pair holds its maximum and its complemented minimum over the
// ranks, so every rank learns whether all ranks agree and, if not, the
// range of each field that differs.
constexpr int kDescWords = 2 * kDescFields;
using DescWords = std::array<uint64_t, kDescWords>;
DescWords encodeWords(const CollectiveDesc& d);
// "" when every rank called `mine`, given the MAX all-reduce of every
// rank's encodeWords(); else the error, naming this rank's call and the
// range of every field that differs.
std::string mismatch(const CollectiveDesc& mine, const DescWords& reducedMax, int rank);
// Throws DescMismatch (peer -1) unless mismatch(mine, reducedMax, rank) is "".
void checkSame(const CollectiveDesc& mine, const DescWords& reducedMax, int rank);

} // namespace pyddp
