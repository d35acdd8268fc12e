// Shared-memory transport: CPU tensors between processes on one host.
//
// It is three parts, each with its own protocol, over one POSIX
// shared-memory segment per rank, which every peer maps read-only (a
// segment is written only by the rank that created it):
//
//   [ ControlHeader | DataHeader | ring slots: numSlots x slotBytes |
//     staging: 2 x directBytes ]
//
// (directBytes: GroupOptions::stagingBytes(), rounded up to a cache line.)
//
// - the control plane (shm_control.h): the segment's lifecycle, arrival
//   and the descriptor check, liveness and giving up;
// - the data plane here: the ring link (slot_fifo.h: this rank -> rank+1)
//   and the direct rounds' staging buffers;
// - process memory (process_memory.h): peers' registered tensors mapped,
//   and peers' plain tensors copied through the kernel;
// and the point-to-point channels (shm_channel.h), segments of their own.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/config.h"
#include "common/descriptor.h"
#include "transport/process_memory.h"
#include "transport/registered.h"
#include "transport/shm_channel.h"
#include "transport/shm_control.h"
#include "transport/slot_fifo.h"
#include "transport/slot_stores.h"
#include "transport/transport.h"

namespace pyddp {
namespace shm {

constexpr uint64_t kDataMagic = 0x7079646470736d64ull;  // "pyddpsmd"
// The data header's layout and the protocols below: builds that read them
// differently do not connect (8: split from the control header).
constexpr uint32_t kDataLayoutVersion = 8;

// Synchronisation protocol of the data plane (counters start at 0 and only
// increase):
//
// Direct rounds (PeerMemory). Rounds are numbered over the life of the
//   group. In round R a rank writes staging buffer R % 2, stores staged = R
//   (release) and waits until every peer's staged >= R (acquire); then it
//   reads every rank's buffer R % 2. Invariant: a rank writes buffer R % 2
//   only after seeing every peer at round R-1, and a peer reads round R-2's
//   buffers before it publishes R-1, so no buffer is overwritten while read.
//   A collective's first round may be published with its arrival instead
//   (enterStaged): the rank stages buffer R % 2 before it publishes the
//   descriptor, so a peer's published >= seq also says it staged round R,
//   and staged is not stored (the next exchange() stores R+1, which says
//   both). A peer may give up after it published; a waiter reads its failed
//   (acquire) once the descriptors agree and fails if failed is in 1..seq,
//   so a rank that comes late does not take the data of a collective its
//   peers gave up on, while a peer that finished #seq and left is no reason
//   to fail it.
//
// Ring link (this rank -> rank+1): a slot FIFO (slot_fifo.h) of this rank's
//   slots, posted by this rank and consumed by rank+1. Fused verbs hold one
//   received slot while claiming a send slot; numSlots >= 2 keeps the ring
//   free of that circular wait.
struct alignas(kCacheLine) DataHeader {
  // Written once before the segment is published, read-only afterwards.
  uint64_t magic;
  uint32_t layoutVersion;
  int32_t numSlots;
  uint64_t slotBytes;
  uint64_t directBytes;
  Counter staged;    // direct rounds this rank has staged
  Counter posted;    // ring pieces this rank has written to its slots
  Counter consumed;  // ring pieces this rank has read from its left peer
  ProcessWords process;
};
// The exact layout, pinned, as ControlHeader's.
static_assert(std::is_standard_layout_v<DataHeader>);
static_assert(offsetof(DataHeader, magic) == 0 && offsetof(DataHeader, layoutVersion) == 8 &&
              offsetof(DataHeader, numSlots) == 12 && offsetof(DataHeader, slotBytes) == 16 &&
              offsetof(DataHeader, directBytes) == 24 && offsetof(DataHeader, staged) == 64 &&
              offsetof(DataHeader, posted) == 128 && offsetof(DataHeader, consumed) == 192 &&
              offsetof(DataHeader, process) == 256 && sizeof(DataHeader) == 448);

class ShmTransport final : public Transport,
                          public RingLink,
                          public LocalOps,
                          public PeerMemory {
 public:
  ShmTransport(int rank, int worldSize, const GroupOptions& options);
  ~ShmTransport() override;
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Transport
  const char* name() const override { return "shm"; }
  std::string reserve() override { return control_.reserve(); }
  std::string setup() override;
  void reclaim(const std::string& reservation) override { ControlPlane::reclaim(reservation); }
  std::string whyNotConnect(int peer, const std::string& blob) const override;
  void connect(const std::vector<std::string>& blobs) override;
  void connected() override;
  void enter(const CollectiveDesc& desc, Deadline deadline) override;
  RingLink& ring() override { return *this; }
  LocalOps& local() override { return *this; }
  PeerMemory* peerMemory() override { return this; }
  void abandon(const std::string& why) override;
  void leave(const std::string& why) override;
  // Also fails the pending point-to-point operations (messages()), with
  // the reason this rank gave up if it did.
  void abort() override;
  std::string deadPeer() const override { return control_.deadPeer(); }
  // Point-to-point channels between pairs of ranks (shm_channel.h), one set
  // per lane.
  MessageLink* messages(std::shared_ptr<Directory> directory, Lane lane) override {
    return lanes_.messages(std::move(directory), lane);
  }

  // RingLink
  size_t pieceBytes() const override { return slotBytes_; }
  void send(const void* src, size_t bytes) override;
  void sendCopy(const void* src, void* dst, size_t bytes) override;
  void recv(void* dst, size_t bytes) override;
  void recvCopySend(void* dst, size_t bytes) override;
  void sendPartial(const kernels::ReduceSpec& spec, const void* local,
                   size_t count) override;
  void recvReduceSend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      size_t count) override;
  void recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      void* dst, size_t count) override;
  void recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                          void* dst, size_t count) override;

  // LocalOps, on the CPU
  void copy(void* dst, const void* src, size_t bytes) override;
  // With the stores stagingStores_ picks.
  void stage(void* dst, const void* src, size_t bytes) override;
  void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
               size_t count) override;

  // PeerMemory
  size_t capacityBytes() const override { return directBytes_; }
  void* stagingBuffer() override;
  void exchange() override;
  void enterStaged(const CollectiveDesc& desc, Deadline deadline) override;
  const void* peerBuffer(int rank) const override;
  std::string whyNotMapRegistered() const override { return memory_.whyNotMapRegistered(); }
  const void* registeredTensor(int rank, const registered::Ref& ref, size_t bytes) override {
    return memory_.registeredTensor(rank, ref, bytes);
  }
  std::string whyNotReadProcesses() const override { return memory_.whyNotReadProcesses(); }
  void readProcess(int rank, void* dst, uint64_t address, size_t bytes) override {
    memory_.readProcess(rank, dst, address, bytes);
  }
  void writeProcess(int rank, uint64_t address, const void* src, size_t bytes) override {
    memory_.writeProcess(rank, address, src, bytes);
  }
  void awaitRingTaken() override;

 private:
  // Where rank `rank`'s data plane lies in its segment.
  const DataHeader& data(int rank) const {
    return *reinterpret_cast<const DataHeader*>(control_.peerData(rank));
  }
  DataHeader& ownData() const { return *reinterpret_cast<DataHeader*>(control_.ownData()); }
  const char* slots(int rank) const { return control_.peerData(rank) + sizeof(DataHeader); }
  const char* staging(int rank) const {
    return slots(rank) + static_cast<size_t>(numSlots_) * slotBytes_;
  }
  size_t dataBytes() const;
  // The ring halves of the verbs: the next send slot, once free; the next
  // received piece, once posted.
  char* claimSendSlot();
  const char* awaitRecvSlot();
  // Copies what a peer reads next (a piece into a claimed slot, a staged
  // chunk) with the stores `stores` picks; `local`: src is this rank's own
  // memory, not a peer's slot. Returns whether the stores were streaming
  // (dst is then not in this core's cache).
  bool writeShared(SlotStoreChooser& stores, void* dst, const void* src, size_t bytes,
                   bool local);
  void giveUp(const std::string& why, bool onNext);

  const int rank_;
  const int worldSize_;
  const size_t slotBytes_;
  const int numSlots_;
  const size_t directBytes_;
  const CmaReads cma_;
  const size_t cmaMinBytes_;
  // How long a wait for a ring slot spins before it yields
  // (Backoff::pieceSpinPhaseFor): none with more ranks than cores.
  const Clock::duration pieceSpinPhase_;

  ControlPlane control_;
  ProcessMemory memory_;
  SlotSender ring_;       // to rank + 1
  SlotReceiver fromLeft_;  // from rank - 1
  // Each lane made by its first messages(), which the engine calls before
  // any other thread sees this transport (abort() reads them from any
  // thread). Destroyed before control_, which their teardown asks about
  // peers.
  MessageLanes lanes_;

  // For the ring's slots, and for the staging buffers: each kind's
  // estimate is per byte, and the smaller staged writes need a higher ratio.
  SlotStoreChooser stores_;
  SlotStoreChooser stagingStores_;
  uint64_t rounds_ = 0;  // direct rounds staged (staged says those of exchange())
};

} // namespace shm
} // namespace pyddp
