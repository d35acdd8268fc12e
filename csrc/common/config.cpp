#include "common/config.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <utility>

#include "common/check.h"

namespace pyddp {
namespace {

// An integer variable: its name, the values it may take and its value when
// unset or empty.
struct IntSetting {
  const char* var;
  IntRange range;
  long long fallback;
};

constexpr long long kMaxBytes = std::numeric_limits<int64_t>::max();
constexpr IntSetting kSlotBytes{"PYDDP_SLOT_BYTES", kSlotBytesRange, kDefaultSlotBytes};
constexpr IntSetting kNumSlots{"PYDDP_NUM_SLOTS", kNumSlotsRange, kDefaultNumSlots};
constexpr IntSetting kDirectMax{"PYDDP_DIRECT_MAX_BYTES", kStagingRange, kDefaultDirectMaxBytes};
constexpr IntSetting kTwoShotMax{"PYDDP_TWO_SHOT_MAX_BYTES", kStagingRange,
                                 kDefaultTwoShotMaxBytes};
constexpr IntSetting kP2pBuffer{"PYDDP_P2P_BUFFER_BYTES", {0, kMaxBytes},
                                kDefaultP2pBufferBytes};
constexpr IntSetting kCmaMin{"PYDDP_CMA_MIN_BYTES", {0, kMaxBytes}, kDefaultCmaMinBytes};
constexpr IntSetting kIntSettings[] = {kSlotBytes, kNumSlots, kDirectMax,
                                       kTwoShotMax, kP2pBuffer, kCmaMin};

constexpr const char* kAlgoVar = "PYDDP_ALGO";
constexpr const char* kSlotStoresVar = "PYDDP_SLOT_STORES";
constexpr const char* kCmaVar = "PYDDP_CMA";
constexpr const char* kDebugVar = "PYDDP_DEBUG";    // read by pyddp/__init__.py
constexpr const char* kHostIdVar = "PYDDP_HOSTID";  // any text (common/host.h)
constexpr const char* kOtherVars[] = {kAlgoVar, kSlotStoresVar, kCmaVar, kDebugVar,
                                      kHostIdVar};

std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

// The integer `text` spells (blanks, an optional sign, decimal digits,
// blanks), or nullopt if it spells none. Its magnitude saturates at
// kSaturated, which is beyond every range, so that a value of any length
// is range-checked as written and never wraps into range.
std::optional<__int128> parseInteger(const std::string& text) {
  constexpr __int128 kSaturated = static_cast<__int128>(1) << 100;
  const auto blank = [](char c) { return c == ' ' || c == '\t'; };
  size_t i = 0, end = text.size();
  while (i < end && blank(text[i])) ++i;
  while (end > i && blank(text[end - 1])) --end;
  const bool negative = i < end && text[i] == '-';
  if (i < end && (text[i] == '-' || text[i] == '+')) ++i;
  if (i == end) return std::nullopt;
  __int128 v = 0;
  for (; i < end; ++i) {
    if (text[i] < '0' || text[i] > '9') return std::nullopt;
    v = std::min(v * 10 + (text[i] - '0'), kSaturated);
  }
  return negative ? -v : v;
}

std::string decimal(__int128 v) {
  if (v < 0) return "-" + decimal(-v);
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  } while (v > 0);
  return digits;
}

bool inRange(const IntRange& r, __int128 v) {
  return v >= r.min && v <= r.max && v % r.step == 0;
}

// "a multiple of 64 in [64, 1073741824]", "in [2, 1024]"
std::string rangeText(const IntRange& r) {
  const std::string bounds =
      "in [" + std::to_string(r.min) + ", " + std::to_string(r.max) + "]";
  return r.step == 1 ? bounds : "a multiple of " + std::to_string(r.step) + " " + bounds;
}

// The value of `s`, checked: ValueError quoting the text as written when
// it is out of range or not an integer.
long long envInt(const IntSetting& s) {
  const std::string text = envOr(s.var, std::to_string(s.fallback));
  const std::optional<__int128> v = parseInteger(text);
  PYDDP_CHECK_VALUE(v.has_value(), s.var, "='", text, "' is not an integer");
  PYDDP_CHECK_VALUE(inRange(s.range, *v), s.var, "='", text, "' must be ",
                    rangeText(s.range));
  return static_cast<long long>(*v);
}

// An option set through Python (already of its field's type) in the range
// of its variable: ValueError naming both.
void checkOption(const char* field, const IntSetting& s, __int128 value) {
  PYDDP_CHECK_VALUE(inRange(s.range, value), field, " (", s.var, ") must be ",
                    rangeText(s.range), ", got ", decimal(value));
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

GroupOptions GroupOptions::fromEnv() {
  GroupOptions o;
  o.slotBytes = static_cast<size_t>(envInt(kSlotBytes));
  o.numSlots = static_cast<int>(envInt(kNumSlots));
  o.directMaxBytes = static_cast<size_t>(envInt(kDirectMax));
  o.twoShotMaxBytes = static_cast<size_t>(envInt(kTwoShotMax));
  o.algo = parseChoice(kAlgoVar, envOr(kAlgoVar, "auto"), kAlgos);
  o.timeoutMs = kDefaultTimeoutMs;
  o.p2pBufferBytes = static_cast<size_t>(envInt(kP2pBuffer));
  o.slotStores = parseChoice(kSlotStoresVar, envOr(kSlotStoresVar, "auto"), kSlotStores);
  o.cmaMinBytes = static_cast<size_t>(envInt(kCmaMin));
  o.cma = parseChoice(kCmaVar, envOr(kCmaVar, "auto"), kCmaReads);
  o.validate();
  return o;
}

void GroupOptions::validate() const {
  checkOption("slot_bytes", kSlotBytes, slotBytes);
  checkOption("num_slots", kNumSlots, numSlots);
  checkOption("direct_max_bytes", kDirectMax, directMaxBytes);
  checkOption("two_shot_max_bytes", kTwoShotMax, twoShotMaxBytes);
  checkOption("p2p_buffer_bytes", kP2pBuffer, p2pBufferBytes);
  checkOption("cma_min_bytes", kCmaMin, cmaMinBytes);
  PYDDP_CHECK_VALUE(algo != Algo::Direct || directMaxBytes > 0, "algo=direct (",
                    kAlgoVar, ") needs direct_max_bytes (", kDirectMax.var, ") > 0");
  PYDDP_CHECK_VALUE(algo != Algo::TwoShot || stagingBytes() > 0, "algo=two_shot (",
                    kAlgoVar, ") needs direct_max_bytes (", kDirectMax.var,
                    ") or two_shot_max_bytes (", kTwoShotMax.var, ") > 0");
  PYDDP_CHECK_VALUE(timeoutMs > 0, "timeout must be positive, got ", timeoutMs, " ms");
}

size_t GroupOptions::stagingBytes() const {
  return std::max(directMaxBytes, twoShotMaxBytes);
}

std::string hostIdOverride() {
  return envOr(kHostIdVar, "");
}

std::map<std::string, std::string> settings() {
  std::map<std::string, std::string> out;
  for (const IntSetting& s : kIntSettings) out[s.var] = envOr(s.var, "");
  for (const char* name : kOtherVars) out[name] = envOr(name, "");
  return out;
}

} // namespace pyddp
