#include "transport/registered.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "common/check.h"
#include "transport/shm_segment.h"

namespace pyddp {
namespace registered {
namespace {

struct Allocation {
  size_t bytes;
  int fd;
  uint64_t inode;
  uint64_t serial;
};

// Every allocation of this process, by its first byte.
struct Registry {
  std::mutex mutex;
  std::map<uintptr_t, Allocation> byBase;
  uint64_t lastSerial = 0;
};

Registry& registry() {
  // Never destroyed: tensors freed while the process exits still find it.
  static Registry* r = new Registry();
  return *r;
}

std::atomic<uint64_t> mapsMadeCount{0};

constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;

size_t wholePages(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return std::max<size_t>(page, (bytes + page - 1) / page * page);
}

std::string errnoText() {
  return std::strerror(errno);
}

} // namespace

void* allocate(size_t bytes) {
  const size_t length = wholePages(bytes);
  const int fd = memfd_create("pyddp-registered", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  PYDDP_CHECK(fd >= 0, "registered memory: memfd_create: ", errnoText());
  struct stat st;
  // 0600, as every segment a peer maps (shm::segmentProblem); ftruncate,
  // not posix_fallocate: memfd pages come from the page cache, not /dev/shm.
  // Sealed at that size, so no process can shrink it under a peer's
  // mapping (which would fault at the first read past the end).
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(length)) != 0 ||
      fcntl(fd, F_ADD_SEALS, kSizeSeals | F_SEAL_SEAL) != 0 || fstat(fd, &st) != 0) {
    const std::string why = errnoText();
    close(fd);
    PYDDP_CHECK(false, "registered memory: cannot make ", length, " bytes: ", why);
  }
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const std::string why = errnoText();
    close(fd);
    PYDDP_CHECK(false, "registered memory: mmap of ", length, " bytes: ", why);
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.byBase[reinterpret_cast<uintptr_t>(base)] =
      Allocation{length, fd, static_cast<uint64_t>(st.st_ino), ++r.lastSerial};
  return base;
}

void release(void* data) {
  Registry& r = registry();
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.byBase.find(reinterpret_cast<uintptr_t>(data));
    if (it == r.byBase.end()) return;
    a = it->second;
    r.byBase.erase(it);
  }
  munmap(data, a.bytes);
  close(a.fd);
}

Ref locate(const void* data, size_t bytes) {
  const auto p = reinterpret_cast<uintptr_t>(data);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.byBase.upper_bound(p);
  if (it == r.byBase.begin()) return Ref{};
  --it;
  const Allocation& a = it->second;
  const uintptr_t offset = p - it->first;
  if (offset >= a.bytes || bytes > a.bytes - offset) return Ref{};
  return Ref{a.serial, a.inode, a.bytes, offset, static_cast<int32_t>(getpid()), a.fd};
}

PeerMaps::~PeerMaps() {
  for (const Mapping& m : maps_) munmap(m.base, m.bytes);
}

namespace {

// What `ref` names, mapped read-only, once it proves to be that much of
// process `pid`'s registered memory of this user; MAP_FAILED and `problem`
// set if it does not, or cannot be opened.
void* mapChecked(const Ref& ref, int pid, int peer, std::string& problem) {
  if (ref.pid != pid || ref.fd < 0 || ref.serial == 0) {
    problem = "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") named fd " +
        std::to_string(ref.fd) + " of pid " + std::to_string(ref.pid) +
        ": not its own registered memory";
    return MAP_FAILED;
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(ref.fd);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    problem = "cannot open rank " + std::to_string(peer) + "'s registered memory (" + path +
        "): " + errnoText() + "; it must be readable by the processes of this group (the "
        "same user and pid namespace, and a process that may be traced: dumpable)";
    return MAP_FAILED;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    problem = "fstat: " + errnoText();
  } else if (static_cast<uint64_t>(st.st_ino) != ref.inode) {
    problem = "it is not the allocation rank " + std::to_string(peer) + " named";
  } else if (const int seals = fcntl(fd, F_GET_SEALS);
             seals < 0 || (seals & kSizeSeals) != kSizeSeals) {
    problem = "its size is not sealed";
  } else {
    problem = shm::segmentProblem(st.st_uid, st.st_mode, st.st_size, ref.mapBytes, geteuid());
  }
  void* base = problem.empty()
      ? mmap(nullptr, ref.mapBytes, PROT_READ, MAP_SHARED, fd, 0)
      : MAP_FAILED;
  if (problem.empty() && base == MAP_FAILED) problem = "mmap: " + errnoText();
  close(fd);
  if (!problem.empty()) {
    problem = "will not map rank " + std::to_string(peer) + "'s registered memory (" + path +
        "): " + problem;
  }
  return base;
}

} // namespace

std::string whyNotMappable(const Ref& ref, int pid, int peer) {
  std::string problem;
  void* base = mapChecked(ref, pid, peer, problem);
  if (base != MAP_FAILED) munmap(base, ref.mapBytes);
  return problem;
}

const void* PeerMaps::map(const Ref& ref, size_t bytes, int pid, int peer) {
  const auto at = [&](const Mapping& m) {
    return static_cast<const char*>(m.base) + ref.offset;
  };
  PYDDP_CHECK(ref.pid == pid && ref.fd >= 0 && ref.offset <= ref.mapBytes &&
                  bytes <= ref.mapBytes - ref.offset,
              "rank ", peer, " (pid ", pid, ") named ", bytes, " bytes at offset ", ref.offset,
              " of ", ref.mapBytes, " bytes of pid ", ref.pid, "'s registered memory (fd ",
              ref.fd, "): not its own, or not that long");
  for (auto it = maps_.begin(); it != maps_.end(); ++it) {
    if (it->serial != ref.serial || it->inode != ref.inode || it->bytes != ref.mapBytes) continue;
    maps_.splice(maps_.begin(), maps_, it);  // most recently used first
    return at(maps_.front());
  }
  std::string problem;
  void* base = mapChecked(ref, pid, peer, problem);
  PYDDP_CHECK(base != MAP_FAILED, problem);
  if (maps_.size() == kMapsPerPeer) {
    munmap(maps_.back().base, maps_.back().bytes);
    maps_.pop_back();
  }
  maps_.push_front(Mapping{ref.serial, ref.inode, base, ref.mapBytes});
  mapsMadeCount.fetch_add(1, std::memory_order_relaxed);
  return at(maps_.front());
}

uint64_t PeerMaps::mapsMade() {
  return mapsMadeCount.load(std::memory_order_relaxed);
}

} // namespace registered
} // namespace pyddp
