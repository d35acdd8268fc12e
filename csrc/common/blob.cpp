#include "common/blob.h"

#include <cstring>

namespace pyddp {

std::string toHex(const void* data, size_t bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out(2 * bytes, '0');
  for (size_t i = 0; i < bytes; ++i) {
    out[2 * i] = kDigits[p[i] >> 4];
    out[2 * i + 1] = kDigits[p[i] & 15];
  }
  return out;
}

std::string fromHex(std::string_view text, const std::string& what) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  PYDDP_CHECK(text.size() % 2 == 0, "malformed ", what, ": odd-length hex");
  std::string out(text.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    PYDDP_CHECK(hi >= 0 && lo >= 0, "malformed ", what, ": not hex");
    out[i] = static_cast<char>(hi * 16 + lo);
  }
  return out;
}

BlobWriter& BlobWriter::put(std::string_view key, std::string_view value) {
  PYDDP_CHECK(key.find_first_of("=\n") == std::string_view::npos &&
                  value.find('\n') == std::string_view::npos,
              "blob field '", key, "' holds a newline or its key an '='");
  text_.append(key).append("=").append(value).append("\n");
  return *this;
}

BlobReader::BlobReader(const std::string& text, std::string what) : what_(std::move(what)) {
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + at, end - at);
    const size_t eq = line.find('=');
    PYDDP_CHECK(eq != std::string_view::npos, "malformed ", what_, ": line '", line,
                "' is not key=value");
    fields_.emplace_back(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
    at = end + 1;
  }
}

bool BlobReader::has(std::string_view key) const {
  for (const auto& [k, v] : fields_) {
    if (k == key) return true;
  }
  return false;
}

const std::string& BlobReader::str(std::string_view key) const {
  for (const auto& [k, v] : fields_) {
    if (k == key) return v;
  }
  static const std::string kNone;
  PYDDP_CHECK(false, "malformed ", what_, ": no field '", key, "'");
  return kNone;  // unreachable: the check throws
}

std::string BlobReader::bytes(std::string_view key) const {
  return fromHex(str(key), what_);
}

void BlobReader::bytes(std::string_view key, void* out, size_t size) const {
  const std::string b = bytes(key);
  PYDDP_CHECK(b.size() == size, "malformed ", what_, ": ", key, " holds ", b.size(),
              " bytes, expected ", size);
  std::memcpy(out, b.data(), size);
}

} // namespace pyddp
