#include "common/host.h"

#include <unistd.h>

#include <fstream>
#include <iterator>

#include "common/config.h"

namespace pyddp {
namespace {

std::string readFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

} // namespace

std::string hostId() {
  const std::string forced = hostIdOverride();
  if (!forced.empty()) return forced;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return std::string(host) + "/" + readFirstLine("/proc/sys/kernel/random/boot_id");
}

std::string pidNamespace() {
  char link[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, n) : "unknown";
}

bool processAlive(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // "pid (comm) S ...": the state follows the last ')' (comm may hold ')').
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return true;
  const char state = text[close + 2];
  return state != 'Z' && state != 'X';
}

} // namespace pyddp
