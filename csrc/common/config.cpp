#include "common/config.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "common/check.h"

namespace pyddp {
namespace {

constexpr const char* kSlotBytesVar = "PYDDP_SLOT_BYTES";
constexpr const char* kNumSlotsVar = "PYDDP_NUM_SLOTS";
constexpr const char* kDirectMaxVar = "PYDDP_DIRECT_MAX_BYTES";
constexpr const char* kTwoShotMaxVar = "PYDDP_TWO_SHOT_MAX_BYTES";
constexpr const char* kAlgoVar = "PYDDP_ALGO";
constexpr const char* kDebugVar = "PYDDP_DEBUG";
constexpr const char* kHostIdVar = "PYDDP_HOSTID";
constexpr const char* kP2pBufferVar = "PYDDP_P2P_BUFFER_BYTES";
constexpr const char* kSlotStoresVar = "PYDDP_SLOT_STORES";
constexpr const char* kCmaVar = "PYDDP_CMA";
constexpr const char* kCmaMinVar = "PYDDP_CMA_MIN_BYTES";
constexpr const char* kAllVars[] = {kSlotBytesVar, kNumSlotsVar,  kDirectMaxVar,
                                    kTwoShotMaxVar, kAlgoVar,      kDebugVar,
                                    kHostIdVar,     kP2pBufferVar, kSlotStoresVar,
                                    kCmaVar,        kCmaMinVar};

std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

long long parseInt(const char* name, const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  PYDDP_CHECK_VALUE(
      used == text.size() && used > 0, name, "='", text,
      "' is not an integer");
  return v;
}

// The value `text` names among `choices` (name, value), as variable `var`;
// ValueError listing the names if none.
template <typename T, size_t N>
T parseChoice(const char* var, const std::string& text,
              const std::pair<const char*, T> (&choices)[N]) {
  std::string names;
  for (const auto& [name, value] : choices) {
    if (text == name) return value;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  PYDDP_CHECK_VALUE(false, var, "='", text, "' is not one of ", names);
  return choices[0].second;
}

constexpr std::pair<const char*, Algo> kAlgos[] = {
    {"auto", Algo::Auto}, {"ring", Algo::Ring}, {"direct", Algo::Direct},
    {"two_shot", Algo::TwoShot}};
constexpr std::pair<const char*, SlotStores> kSlotStores[] = {
    {"auto", SlotStores::Auto}, {"cached", SlotStores::Cached},
    {"streaming", SlotStores::Streaming}};
constexpr std::pair<const char*, CmaReads> kCmaReads[] = {
    {"auto", CmaReads::Auto}, {"always", CmaReads::Always}, {"never", CmaReads::Never}};

} // namespace

RingOptions RingOptions::fromEnv() {
  RingOptions o;
  o.slotBytes = static_cast<size_t>(parseInt(
      kSlotBytesVar, envOr(kSlotBytesVar, std::to_string(kDefaultSlotBytes))));
  o.numSlots = static_cast<int>(parseInt(
      kNumSlotsVar, envOr(kNumSlotsVar, std::to_string(kDefaultNumSlots))));
  o.directMaxBytes = static_cast<size_t>(parseInt(
      kDirectMaxVar,
      envOr(kDirectMaxVar, std::to_string(kDefaultDirectMaxBytes))));
  o.twoShotMaxBytes = static_cast<size_t>(parseInt(
      kTwoShotMaxVar, envOr(kTwoShotMaxVar, std::to_string(kDefaultTwoShotMaxBytes))));
  o.algo = parseChoice(kAlgoVar, envOr(kAlgoVar, "auto"), kAlgos);
  o.timeoutMs = kDefaultTimeoutMs;
  const long long p2pBuffer = parseInt(
      kP2pBufferVar, envOr(kP2pBufferVar, std::to_string(kDefaultP2pBufferBytes)));
  PYDDP_CHECK_VALUE(p2pBuffer >= 0, kP2pBufferVar, "='", p2pBuffer, "' must not be negative");
  o.p2pBufferBytes = static_cast<size_t>(p2pBuffer);
  o.slotStores = parseChoice(kSlotStoresVar, envOr(kSlotStoresVar, "auto"), kSlotStores);
  const long long cmaMin =
      parseInt(kCmaMinVar, envOr(kCmaMinVar, std::to_string(kDefaultCmaMinBytes)));
  PYDDP_CHECK_VALUE(cmaMin >= 0, kCmaMinVar, "='", cmaMin, "' must not be negative");
  o.cmaMinBytes = static_cast<size_t>(cmaMin);
  o.cma = parseChoice(kCmaVar, envOr(kCmaVar, "auto"), kCmaReads);
  o.validate();
  return o;
}

void RingOptions::validate() const {
  // Slots hold whole elements of every dtype and start on cache lines.
  PYDDP_CHECK_VALUE(
      slotBytes >= 64 && slotBytes % 64 == 0 && slotBytes <= (1u << 30),
      "slot_bytes (", kSlotBytesVar, ") must be a multiple of 64 in [64, 1 GiB], got ",
      slotBytes);
  PYDDP_CHECK_VALUE(
      numSlots >= 2 && numSlots <= 1024, "num_slots (", kNumSlotsVar,
      ") must be in [2, 1024], got ", numSlots);
  PYDDP_CHECK_VALUE(
      directMaxBytes <= (1u << 30), "direct_max_bytes (", kDirectMaxVar,
      ") must be at most 1 GiB, got ", directMaxBytes);
  PYDDP_CHECK_VALUE(
      twoShotMaxBytes <= (1u << 30), "two_shot_max_bytes (", kTwoShotMaxVar,
      ") must be at most 1 GiB, got ", twoShotMaxBytes);
  PYDDP_CHECK_VALUE(algo != Algo::Direct || directMaxBytes > 0, "algo=direct (",
                    kAlgoVar, ") needs direct_max_bytes (", kDirectMaxVar, ") > 0");
  PYDDP_CHECK_VALUE(algo != Algo::TwoShot || stagingBytes() > 0, "algo=two_shot (",
                    kAlgoVar, ") needs direct_max_bytes (", kDirectMaxVar,
                    ") or two_shot_max_bytes (", kTwoShotMaxVar, ") > 0");
  PYDDP_CHECK_VALUE(timeoutMs > 0, "timeout must be positive, got ", timeoutMs, " ms");
}

size_t RingOptions::stagingBytes() const {
  return std::max(directMaxBytes, twoShotMaxBytes);
}

Algo RingOptions::allReduceAlgo(size_t bytes) const {
  if (algo != Algo::Auto) return algo;
  if (directMaxBytes > 0 && bytes <= directMaxBytes) return Algo::Direct;
  if (bytes <= twoShotMaxBytes) return Algo::TwoShot;
  return Algo::Ring;
}

Algo RingOptions::gatherAlgo(size_t bytes) const {
  if (algo == Algo::Ring || algo == Algo::Direct) return algo;
  return directMaxBytes > 0 && bytes <= directMaxBytes ? Algo::Direct : Algo::Ring;
}

std::string hostIdOverride() {
  return envOr(kHostIdVar, "");
}

std::map<std::string, std::string> settings() {
  std::map<std::string, std::string> out;
  for (const char* name : kAllVars) {
    out[name] = envOr(name, "");
  }
  return out;
}

bool readsRegistered(CollectiveKind kind, size_t bytes) {
  switch (kind) {
    case CollectiveKind::ReduceScatter:
      return bytes >= kRegisteredReduceScatterMinBytes;
    case CollectiveKind::AllReduce:
      return bytes >= kRegisteredAllReduceMinBytes && bytes <= kRegisteredMaxBytes;
    default:
      return bytes >= kRegisteredMinBytes && bytes <= kRegisteredMaxBytes;
  }
}

} // namespace pyddp
