// Registered memory: CPU tensors that the peers of this host read where
// they lie, with no copy into a staging buffer (NCCL's user-buffer
// registration, for shared memory).
//
// Each allocation is its own memfd (no name in /dev/shm, so nothing is
// left behind by a rank that dies), mode 0600, mapped read-write by the
// process that made it, which owns it: only the owner writes it, and it is
// freed (unmapped, fd closed) when its tensor is. A peer reaches it through
// /proc/<owner pid>/fd/<fd> (the same user and pid namespace, which the
// shm transport checks), maps it read-only and keeps the mapping for later
// collectives on the same tensor (PeerMaps). The memory lives until the
// owner and every peer that mapped it have let go.
//
// A Ref is what a rank tells its peers about one tensor: which allocation
// (the owner's pid, its fd there, the memfd's inode, a serial number the
// owner never reuses) and where in it the tensor starts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <string>
#include <type_traits>

namespace pyddp {
namespace registered {

// Staged in a peer-readable buffer and read by peers of another build:
// the layout is pinned.
struct alignas(8) Ref {
  uint64_t serial;  // 0: the tensor is not in registered memory
  uint64_t inode;
  uint64_t mapBytes;  // the allocation's length
  uint64_t offset;    // the tensor's first byte in the allocation
  int32_t pid;
  int32_t fd;
};
static_assert(std::is_trivially_copyable_v<Ref> && std::is_standard_layout_v<Ref>);
static_assert(offsetof(Ref, serial) == 0 && offsetof(Ref, inode) == 8 &&
              offsetof(Ref, mapBytes) == 16 && offsetof(Ref, offset) == 24 &&
              offsetof(Ref, pid) == 32 && offsetof(Ref, fd) == 36 && sizeof(Ref) == 40);

// `bytes` (rounded up to whole pages; at least one) of registered memory,
// zero-filled. Thread-safe.
void* allocate(size_t bytes);
// Frees what allocate() returned. Thread-safe.
void release(void* data);
// Where [data, data + bytes) lies, if wholly inside one allocation of this
// process; a Ref with serial 0 if not. Thread-safe.
Ref locate(const void* data, size_t bytes);

// "" if this process can map what `ref` names (rank `peer`'s memory, pid
// `pid`), else why not: what PeerMaps::map would throw. Maps and unmaps it.
std::string whyNotMappable(const Ref& ref, int pid, int peer);

// One peer's allocations mapped into this process, most recently used
// first, at most kMapsPerPeer: a peer's tensor freed long ago is unmapped
// once newer ones push it out, or with the PeerMaps. A collective maps at
// most one tensor of each peer, so it never pushes out one it still reads.
class PeerMaps {
 public:
  // 64: more buckets than a DDP model usually has (each bucket is one
  // tensor), so a training loop maps each once; a peer's freed memory is
  // held by at most this many mappings.
  static constexpr size_t kMapsPerPeer = 64;

  PeerMaps() = default;
  ~PeerMaps();
  PeerMaps(PeerMaps&&) = default;
  PeerMaps& operator=(PeerMaps&&) = delete;
  PeerMaps(const PeerMaps&) = delete;
  PeerMaps& operator=(const PeerMaps&) = delete;

  // The first byte of the tensor `ref` names, `bytes` long, which rank
  // `peer` (process `pid`) owns, mapped read-only. Throws (RuntimeError) if
  // `ref` is not that much of that process's registered memory of this
  // user, or cannot be opened.
  const void* map(const Ref& ref, size_t bytes, int pid, int peer);

  // Allocations mapped by every PeerMaps of this process so far: tests
  // see through it which path a collective took.
  static uint64_t mapsMade();

 private:
  struct Mapping {
    uint64_t serial;
    uint64_t inode;
    void* base;
    size_t bytes;
  };
  std::list<Mapping> maps_;
};

} // namespace registered
} // namespace pyddp
