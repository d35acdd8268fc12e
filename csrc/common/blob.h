// Bootstrap blobs: what a rank publishes through the store about its end of
// a connection (segment names, IPC handles, NCCL ids, geometry), read back
// by every peer. One format for all of them: lines "key=value" in the order
// written; values hold no newline, and bytes travel as lowercase hex. A
// blob may carry another blob as a value (as bytes).
#pragma once

#include <charconv>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/check.h"

namespace pyddp {

std::string toHex(const void* data, size_t bytes);
// Throws "pyddp: malformed <what>" unless text is hex of whole bytes.
std::string fromHex(std::string_view text, const std::string& what);

class BlobWriter {
 public:
  BlobWriter& put(std::string_view key, std::string_view value);
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
  BlobWriter& put(std::string_view key, T value) {
    return put(key, std::string_view(std::to_string(value)));
  }
  BlobWriter& putBytes(std::string_view key, const void* data, size_t bytes) {
    return put(key, std::string_view(toHex(data, bytes)));
  }
  BlobWriter& putBytes(std::string_view key, const std::string& bytes) {
    return putBytes(key, bytes.data(), bytes.size());
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

class BlobReader {
 public:
  // `what` names the blob in errors, e.g. "rank 1's shm bootstrap blob".
  BlobReader(const std::string& text, std::string what);

  bool has(std::string_view key) const;
  // Each throws "pyddp: malformed <what>: ..." when the key is missing or
  // its value does not parse.
  const std::string& str(std::string_view key) const;
  template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
  T get(std::string_view key) const {
    const std::string& v = str(key);
    T out{};
    const auto [end, err] = std::from_chars(v.data(), v.data() + v.size(), out);
    PYDDP_CHECK(err == std::errc() && end == v.data() + v.size(), "malformed ", what_, ": ",
                key, "='", v, "' is not a ", std::is_signed_v<T> ? "" : "non-negative ",
                sizeof(T) * 8, "-bit integer");
    return out;
  }
  std::string bytes(std::string_view key) const;
  // Exactly `size` bytes into out.
  void bytes(std::string_view key, void* out, size_t size) const;

 private:
  std::string what_;
  std::vector<std::pair<std::string, std::string>> fields_;
};

} // namespace pyddp
