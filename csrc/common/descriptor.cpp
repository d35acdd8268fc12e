#include "common/descriptor.h"

#include <sstream>

namespace pyddp {
namespace {

// Word codecs per field type: how a field becomes an unsigned word, and
// how a word (maybe the maximum or minimum over ranks) reads in a message.
uint64_t toWord(uint64_t v) {
  return v;
}
uint64_t toWord(int32_t v) {
  return static_cast<uint64_t>(static_cast<int64_t>(v) + 1);
}
template <typename E, typename = std::enable_if_t<std::is_enum_v<E>>>
uint64_t toWord(E e) {
  return static_cast<uint32_t>(e);
}

template <typename T>
struct Tag {};

std::string fromWord(Tag<uint64_t>, uint64_t w) {
  return std::to_string(w);
}
std::string fromWord(Tag<int32_t>, uint64_t w) {
  return w == 0 ? "none" : std::to_string(w - 1);
}
// An enum's name where the word names one of its values, else the number.
template <typename E, typename = std::enable_if_t<std::is_enum_v<E>>>
std::string fromWord(Tag<E>, uint64_t w) {
  const std::string name =
      w <= static_cast<uint64_t>(INT32_MAX) ? toString(static_cast<E>(w)) : "unknown";
  return name == "unknown" ? std::to_string(w) : name;
}

constexpr const char* kFieldNames[kDescFields] = {
#define PYDDP_DESC_NAME(name, type, init, label) label,
    PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_NAME)
#undef PYDDP_DESC_NAME
};

enum FieldIndex {
#define PYDDP_DESC_INDEX(name, type, init, label) k_##name,
  PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_INDEX)
#undef PYDDP_DESC_INDEX
};

bool isReduction(CollectiveKind k) {
  return k == CollectiveKind::AllReduce || k == CollectiveKind::ReduceScatter ||
      k == CollectiveKind::Reduce;
}

} // namespace

DescValues fieldValues(const CollectiveDesc& d) {
  return {
#define PYDDP_DESC_VALUE(name, type, init, label) toWord(d.name),
      PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_VALUE)
#undef PYDDP_DESC_VALUE
  };
}

const char* fieldName(int i) {
  return i >= 0 && i < kDescFields ? kFieldNames[i] : "unknown";
}

std::string formatField(int i, uint64_t v) {
  // A hash reads as one.
  if (i == k_split) {
    std::ostringstream hex;
    hex << "0x" << std::hex << v;
    return hex.str();
  }
  if (i == k_window) return v == 0 ? "none" : "buffer " + std::to_string(v);
  switch (i) {
#define PYDDP_DESC_FORMAT(name, type, init, label) \
  case k_##name:                                   \
    return fromWord(Tag<type>{}, v);
    PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_FORMAT)
#undef PYDDP_DESC_FORMAT
  }
  return std::to_string(v);
}

// Field by field, not through fieldValues(): every collective on shm
// compares world_size descriptors.
bool operator==(const CollectiveDesc& a, const CollectiveDesc& b) {
#define PYDDP_DESC_EQUAL(name, type, init, label) &&a.name == b.name
  return true PYDDP_COLLECTIVE_DESC_FIELDS(PYDDP_DESC_EQUAL);
#undef PYDDP_DESC_EQUAL
}

std::string describe(const CollectiveDesc& d) {
  const DescValues v = fieldValues(d);
  std::ostringstream s;
  s << toString(d.kind) << "(";
  bool first = true;
  for (int i = 0; i < kDescFields; ++i) {
    // seq and kind are said around the call; op only matters to reductions.
    const bool shown = i != k_seq && i != k_kind && (i != k_op || isReduction(d.kind)) &&
        (i != k_root || d.root >= 0) && (i != k_split || d.split != 0) &&
        (i != k_window || d.window != 0);
    if (!shown) continue;
    s << (first ? "" : ", ") << kFieldNames[i] << "=" << formatField(i, v[i]);
    first = false;
  }
  s << ")";
  return s.str();
}

std::string mismatch(const CollectiveDesc& mine, int rank, const CollectiveDesc& theirs,
                     int peer) {
  if (mine == theirs) return "";
  return "collective #" + std::to_string(mine.seq) + " differs between ranks: rank " +
      std::to_string(rank) + " called " + describe(mine) + " but rank " + std::to_string(peer) +
      " called " + describe(theirs) +
      "; every rank must issue the same collectives in the same order";
}

DescMismatch::DescMismatch(const std::string& why, const CollectiveDesc& mine, int peer,
                           bool splitDiffers)
    : c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            "pyddp: " + why),
      mine_(mine),
      peer_(peer),
      splitDiffers_(splitDiffers) {}

void checkSame(const CollectiveDesc& mine, int rank, const CollectiveDesc& theirs, int peer) {
  const std::string why = mismatch(mine, rank, theirs, peer);
  if (!why.empty()) throw DescMismatch(why, mine, peer, mine.split != theirs.split);
}

DescWords encodeWords(const CollectiveDesc& d) {
  const DescValues v = fieldValues(d);
  DescWords w{};
  for (int i = 0; i < kDescFields; ++i) {
    w[2 * i] = v[i];
    w[2 * i + 1] = ~v[i];
  }
  return w;
}

std::string mismatch(const CollectiveDesc& mine, const DescWords& reducedMax, int rank) {
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

void checkSame(const CollectiveDesc& mine, const DescWords& reducedMax, int rank) {
  const std::string why = mismatch(mine, reducedMax, rank);
  if (why.empty()) return;
  const bool splitDiffers = reducedMax[2 * k_split] != ~reducedMax[2 * k_split + 1];
  throw DescMismatch(why, mine, -1, splitDiffers);
}

} // namespace pyddp
