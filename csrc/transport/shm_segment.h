// One POSIX shared-memory segment mapped into this process: created here
// (0600, an unguessable name), or a peer's opened by name and checked.
// Ownership of what is inside is the caller's to state; this class owns
// the mapping (unmapped on destruction) and, for a created segment, the
// name until unlink(). The names and checks every pyddp segment shares
// (the shm transport's and the channels') are here too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyddp {
namespace shm {

// A fresh unguessable segment name: "/pyddp-" and 128 random bits in hex.
// Callers publish it before creating the segment (a reservation), so that
// a peer can remove it if the creator dies before it could.
std::string newSegmentName();
// Whether `name` is one newSegmentName() makes: all a store value may make
// a rank open or unlink.
bool isSegmentName(const std::string& name);
// Why a peer's segment, as fstat() describes it (owner uid, st_mode, size),
// is not one this rank may map: pyddp's segments are regular files of the
// user running the ranks (`me`) with mode 0600 and the size their geometry
// implies (`expected`). "" when it is one.
std::string segmentProblem(uint32_t owner, uint32_t mode, int64_t size, size_t expected,
                           uint32_t me);

class Segment {
 public:
  Segment() = default;
  ~Segment();
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // A new segment of `bytes` named `name` (from newSegmentName()),
  // zero-filled and mapped read-write; `who` names the creator in errors
  // ("rank 0"). Its name stays in /dev/shm until unlink(). posix_fallocate,
  // not ftruncate: a /dev/shm too small fails here with ENOSPC instead of
  // with SIGBUS at the first touch.
  static Segment create(const std::string& name, size_t bytes, const std::string& who);
  // Maps the segment `name` that a peer created. Refuses anything but a
  // pyddp name, and a regular file of this user with mode 0600 and exactly
  // `bytes` bytes (segmentProblem()): a forged name or size in a store
  // value cannot point a rank at memory it must not read, or make it read
  // past a mapping's end. `who` names the opener, `owner` the segment
  // ("rank 0's", "rank 0's channel's") in errors.
  static Segment open(const std::string& name, size_t bytes, bool writable,
                      const std::string& who, const std::string& owner);

  // Removes the name of a segment this process created from /dev/shm
  // (idempotent). Mappings stay valid.
  void unlink();
  // Removes a peer's segment name (once every rank that needs it has mapped
  // it, or the peer died before it could): a name already gone is fine, and
  // anything but a pyddp name is left alone.
  static void remove(const std::string& name);

  void* base() const { return base_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  bool linked() const { return linked_; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool linked_ = false;
};

} // namespace shm
} // namespace pyddp
