#include "transport/p2p.h"

#include <climits>
#include <cstring>
#include <sstream>

#include "common/check.h"
#include "common/config.h"

namespace pyddp {
namespace p2p {

P2pRing::P2pRing(P2pOps& ops, size_t pieceBytes, void* recvScratch, void* sendScratch)
    : ops_(ops), pieceBytes_(pieceBytes), recvScratch_(recvScratch), sendScratch_(sendScratch) {}

void P2pRing::flush() {
  if (!sendPending()) return;
  const Pending p = pending_;
  pending_ = {};
  ops_.post(p.data, p.bytes, nullptr, 0);
}

void P2pRing::receive(void* dst, size_t bytes) {
  PYDDP_CHECK(bytes <= pieceBytes_, "ring piece of ", bytes, " bytes exceeds the ",
              pieceBytes_, "-byte pieces of this link");
  const Pending p = pending_;
  pending_ = {};
  if (p.bytes != 0 || bytes != 0) ops_.post(p.data, p.bytes, dst, bytes);
}

void P2pRing::defer(const void* data, size_t bytes) {
  PYDDP_CHECK(bytes <= pieceBytes_, "ring piece of ", bytes, " bytes exceeds the ",
              pieceBytes_, "-byte pieces of this link");
  flush();
  pending_ = {data, bytes};
}

void P2pRing::send(const void* src, size_t bytes) {
  defer(src, bytes);
}

void P2pRing::recv(void* dst, size_t bytes) {
  receive(dst, bytes);
}

void P2pRing::recvCopySend(void* dst, size_t bytes) {
  receive(dst, bytes);
  defer(dst, bytes);
}

void P2pRing::sendPartial(const kernels::ReduceSpec& spec, const void* local, size_t count) {
  flush();  // the pending send may be reading sendScratch_
  if (count) ops_.toPartial(spec, sendScratch_, local, count);
  defer(sendScratch_, count * kernels::partialSize(spec.dtype));
}

void P2pRing::recvReduceSend(const kernels::ReduceSpec& spec, const void* local,
                             size_t count) {
  const size_t bytes = count * kernels::partialSize(spec.dtype);
  receive(recvScratch_, bytes);
  if (count) ops_.reducePartial(spec, sendScratch_, recvScratch_, local, count);
  defer(sendScratch_, bytes);
}

void P2pRing::recvReduceCopy(const kernels::ReduceSpec& spec, const void* local, void* dst,
                             size_t count) {
  receive(recvScratch_, count * kernels::partialSize(spec.dtype));
  if (count) ops_.reduceFinal(spec, dst, recvScratch_, local, count);
}

void P2pRing::recvReduceCopySend(const kernels::ReduceSpec& spec, const void* local,
                                 void* dst, size_t count) {
  receive(recvScratch_, count * kernels::partialSize(spec.dtype));
  if (count) ops_.reduceFinal(spec, dst, recvScratch_, local, count);
  defer(dst, count * elementSize(spec.dtype));
}

// --- descriptor agreement -----------------------------------------------------

namespace {

constexpr const char* kFieldNames[kDescFields] = {
    "sequence number", "count", "kind", "dtype", "op", "src", "algo"};

std::array<uint64_t, kDescFields> fields(const CollectiveDesc& d) {
  // root is -1 for collectives without one: store root + 1, so that ranges
  // read naturally in unsigned order.
  return {d.seq,
          d.count,
          static_cast<uint64_t>(d.kind),
          static_cast<uint64_t>(d.dtype),
          static_cast<uint64_t>(d.op),
          static_cast<uint64_t>(static_cast<int64_t>(d.root) + 1),
          static_cast<uint64_t>(static_cast<uint32_t>(d.algo))};
}

// A field's value by name where it names one (every enum here is an
// enum class, so any int32 converts), else as a number.
std::string formatField(int field, uint64_t v) {
  const bool fits = v <= static_cast<uint64_t>(INT32_MAX);
  const int32_t e = static_cast<int32_t>(v);
  const char* name = "unknown";
  switch (field) {
    case 2:
      if (fits) name = toString(static_cast<CollectiveKind>(e));
      break;
    case 3:
      if (fits) name = toString(static_cast<DataType>(e));
      break;
    case 4:
      if (fits) name = toString(static_cast<RedOp>(e));
      break;
    case 5:
      return v == 0 ? "none" : std::to_string(v - 1);
    case 6:
      if (fits) name = toString(static_cast<Algo>(e));
      break;
    default:
      break;
  }
  return std::strcmp(name, "unknown") == 0 ? std::to_string(v) : name;
}

} // namespace

DescWords encodeDesc(const CollectiveDesc& desc) {
  const auto f = fields(desc);
  DescWords w{};
  for (int i = 0; i < kDescFields; ++i) {
    w[2 * i] = f[i];
    w[2 * i + 1] = ~f[i];
  }
  return w;
}

std::string describe(const CollectiveDesc& d) {
  std::ostringstream s;
  s << toString(d.kind) << "(count=" << d.count << ", dtype=" << toString(d.dtype);
  if (d.kind == CollectiveKind::AllReduce || d.kind == CollectiveKind::ReduceScatter) {
    s << ", op=" << toString(d.op);
  }
  if (d.root >= 0) s << ", src=" << d.root;
  s << ")";
  return s.str();
}

std::string descMismatch(const CollectiveDesc& mine, const DescWords& reducedMax, int rank) {
  std::ostringstream diff;
  bool any = false;
  for (int i = 0; i < kDescFields; ++i) {
    const uint64_t hi = reducedMax[2 * i];
    const uint64_t lo = ~reducedMax[2 * i + 1];
    if (hi == lo) continue;
    diff << (any ? ", " : "") << kFieldNames[i] << " from " << formatField(i, lo) << " to "
         << formatField(i, hi);
    any = true;
  }
  if (!any) return "";
  return "collective #" + std::to_string(mine.seq) + " differs between ranks: rank " +
      std::to_string(rank) + " called " + describe(mine) + ", but across the ranks " +
      diff.str() + "; every rank must issue the same collectives in the same order";
}

} // namespace p2p
} // namespace pyddp
