#include "transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>
#include <utility>

#include "common/check.h"

namespace pyddp {
namespace shm {
namespace {

constexpr char kNamePrefix[] = "/pyddp-";

} // namespace

std::string newSegmentName() {
  std::random_device rd;
  std::ostringstream name;
  name << kNamePrefix << std::hex;
  for (int i = 0; i < 4; ++i) name << rd();
  return name.str();
}

bool isSegmentName(const std::string& name) {
  const size_t prefix = sizeof(kNamePrefix) - 1;
  return name.size() > prefix && name.compare(0, prefix, kNamePrefix) == 0 &&
         name.find_first_not_of("0123456789abcdef", prefix) == std::string::npos;
}

std::string segmentProblem(uint32_t owner, uint32_t mode, int64_t size, size_t expected,
                           uint32_t me) {
  std::ostringstream why;
  if (!S_ISREG(mode)) {
    why << "it is not a regular file";
  } else if (owner != me) {
    why << "it belongs to uid " << owner << ", not to this process's uid " << me;
  } else if ((mode & 07777) != 0600) {
    why << "its mode is 0" << std::oct << (mode & 07777) << ", not 0600";
  } else if (size < 0 || static_cast<uint64_t>(size) != expected) {
    why << "it has " << size << " bytes, and this geometry makes " << expected;
  }
  return why.str();
}

Segment::~Segment() {
  if (base_) munmap(base_, bytes_);
}

Segment::Segment(Segment&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      name_(std::move(other.name_)),
      linked_(std::exchange(other.linked_, false)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    if (base_) munmap(base_, bytes_);
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    name_ = std::move(other.name_);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

Segment Segment::create(const std::string& name, size_t bytes, const std::string& who) {
  Segment s;
  s.name_ = name;
  // The name was published as this process's: another one would not be
  // reclaimed if it died. 128 random bits that exist already mean someone
  // made them on purpose.
  const int fd = shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  const int openErrno = errno;
  PYDDP_CHECK(fd >= 0, who, ": shm_open(", s.name_, ") failed: ", std::strerror(openErrno),
              openErrno == EEXIST ? " (a random name that exists already: who made it?)" : "");
  s.linked_ = true;
  const int sizeErr = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = sizeErr == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                            : MAP_FAILED;
  const int mapErrno = errno;
  close(fd);
  if (sizeErr != 0 || base == MAP_FAILED) s.unlink();
  PYDDP_CHECK(sizeErr == 0, who, ": allocating a ", bytes, "-byte shm segment failed: ",
              std::strerror(sizeErr),
              " (is /dev/shm large enough? lower PYDDP_SLOT_BYTES or PYDDP_NUM_SLOTS)");
  PYDDP_CHECK(base != MAP_FAILED, who, ": mmap of a shm segment failed: ",
              std::strerror(mapErrno));
  s.base_ = base;
  s.bytes_ = bytes;
  return s;
}

Segment Segment::open(const std::string& name, size_t bytes, bool writable,
                      const std::string& who, const std::string& owner) {
  PYDDP_CHECK(isSegmentName(name), who, ": ", owner, " blob names '", name,
              "', not a pyddp segment (a corrupted or forged store value?)");
  const int fd = shm_open(name.c_str(), writable ? O_RDWR : O_RDONLY, 0);
  PYDDP_CHECK(fd >= 0, who, ": cannot open ", owner, " shm segment ", name, ": ",
              std::strerror(errno), " (do the ranks share /dev/shm?)");
  struct stat st {};
  const bool statted = fstat(fd, &st) == 0;
  const int statErrno = errno;
  const std::string problem =
      statted ? segmentProblem(st.st_uid, st.st_mode, st.st_size, bytes, geteuid()) : "";
  if (!statted || !problem.empty()) {
    close(fd);
    PYDDP_CHECK(statted, who, ": fstat of ", owner, " shm segment ", name, " failed: ",
                std::strerror(statErrno));
    PYDDP_CHECK(false, who, ": refusing ", owner, " shm segment ", name, ": ", problem,
                " (a corrupted or forged store value?)");
  }
  void* base = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                    fd, 0);
  const int mapErrno = errno;
  close(fd);
  PYDDP_CHECK(base != MAP_FAILED, who, ": mmap of ", owner, " shm segment ", name, " failed: ",
              std::strerror(mapErrno));
  Segment s;
  s.base_ = base;
  s.bytes_ = bytes;
  s.name_ = name;
  return s;
}

void Segment::remove(const std::string& name) {
  if (isSegmentName(name)) shm_unlink(name.c_str());
}

void Segment::unlink() {
  if (!linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

} // namespace shm
} // namespace pyddp
