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

std::string randomName() {
  std::random_device rd;
  std::ostringstream name;
  name << "/pyddp-" << std::hex;
  for (int i = 0; i < 4; ++i) name << rd();
  return name.str();
}

} // namespace

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

Segment Segment::create(size_t bytes, const std::string& who) {
  Segment s;
  int fd = -1;
  // A collision of 128 random bits means another creator; pick again.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    s.name_ = randomName();
    fd = shm_open(s.name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    PYDDP_CHECK(fd >= 0 || errno == EEXIST, who, ": shm_open(", s.name_, ") failed: ",
                std::strerror(errno));
  }
  PYDDP_CHECK(fd >= 0, who, ": could not create a unique shm segment");
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
                      const std::string& who) {
  PYDDP_CHECK(name.rfind("/pyddp-", 0) == 0 && name.find('/', 1) == std::string::npos, who,
              ": '", name, "' is not a pyddp segment name");
  const int fd = shm_open(name.c_str(), writable ? O_RDWR : O_RDONLY, 0);
  PYDDP_CHECK(fd >= 0, who, ": cannot open shm segment ", name, ": ", std::strerror(errno),
              " (do the ranks share /dev/shm?)");
  struct stat st {};
  const bool statted = fstat(fd, &st) == 0;
  const int statErrno = errno;
  if (!statted || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 0777) != 0600 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    PYDDP_CHECK(statted, who, ": fstat of shm segment ", name, " failed: ",
                std::strerror(statErrno));
    PYDDP_CHECK(false, who, ": shm segment ", name, " is not what its creator announced (",
                st.st_size, " bytes, owner uid ", st.st_uid, ", mode ", std::oct,
                (st.st_mode & 0777), std::dec, "; expected ", bytes, " bytes, uid ", geteuid(),
                ", mode 600): refusing to map it");
  }
  void* base = mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                    fd, 0);
  const int mapErrno = errno;
  close(fd);
  PYDDP_CHECK(base != MAP_FAILED, who, ": mmap of shm segment ", name, " failed: ",
              std::strerror(mapErrno));
  Segment s;
  s.base_ = base;
  s.bytes_ = bytes;
  s.name_ = name;
  return s;
}

void Segment::remove(const std::string& name) {
  shm_unlink(name.c_str());
}

void Segment::unlink() {
  if (!linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

} // namespace shm
} // namespace pyddp
