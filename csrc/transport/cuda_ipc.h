// CUDA IPC transport: CUDA tensors between processes on one host, several
// ranks per GPU included. Each rank exports one device buffer (ring slots,
// staging buffers and flags: layout and protocol in cuda_ipc_protocol.h) and
// maps every peer's; data moves by kernels that read peers' memory, and
// every verb is enqueued on the stream given at construction, so the host
// never waits for the GPU.
//
// Host-side agreement (enter(): same collective on every rank, descriptor
// check, dead-peer and deadline detection, failure propagation between
// ranks) is the shm transport's control plane (shm_control.h), alone: one
// mechanism for both.
//
// Only compiled in CUDA builds (PYDDP_WITH_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "transport/cuda_ipc_kernels.h"
#include "transport/shm_control.h"
#include "transport/transport.h"

namespace pyddp {
namespace ipc {

class CudaIpcTransport final : public Transport,
                               public RingLink,
                               public LocalOps,
                               public PeerMemory {
 public:
  // `stream` (on `device`) runs every verb; the caller owns it and keeps it
  // alive longer than the transport.
  CudaIpcTransport(int rank, int worldSize, const RingOptions& options, int device,
                   cudaStream_t stream);
  ~CudaIpcTransport() override;
  CudaIpcTransport(const CudaIpcTransport&) = delete;
  CudaIpcTransport& operator=(const CudaIpcTransport&) = delete;

  // Transport
  const char* name() const override { return "cuda_ipc"; }
  // The control segment's name: the only thing that outlives a dead rank.
  std::string reserve() override { return control_.reserve(); }
  std::string setup() override;
  void reclaim(const std::string& reservation) override {
    shm::ControlPlane::reclaim(reservation);
  }
  std::string whyNotConnect(int peer, const std::string& blob) const override;
  // Maps every peer's buffer and proves access by writing and reading it
  // back (cudaDeviceCanAccessPeer is not trusted); throws why not.
  void connect(const std::vector<std::string>& blobs) override;
  void connected() override;
  // Also fails when an earlier collective's device wait gave up.
  void enter(const CollectiveDesc& desc, Deadline deadline) override;
  RingLink& ring() override { return *this; }
  LocalOps& local() override { return *this; }
  PeerMemory* peerMemory() override { return this; }
  void abandon(const std::string& why) override;
  void abort() override;

  // RingLink
  size_t pieceBytes() const override { return slotBytes_; }
  void send(const void* src, size_t bytes) override;
  void sendCopy(const void* src, void* dst, size_t bytes) override;
  void recv(void* dst, size_t bytes) override;
  void recvCopySend(void* dst, size_t bytes) override;
  // Every hop carries partials (sendPartial converts), so a receive reads
  // partials whatever its Hop.
  void sendPartial(const kernels::ReduceSpec& spec, const void* local,
                   size_t count) override;
  void recvReduceSend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      size_t count) override;
  void recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                      void* dst, size_t count) override;
  void recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop, const void* local,
                          void* dst, size_t count) override;

  // LocalOps, on the stream
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
               size_t count) override;

  // PeerMemory
  size_t capacityBytes() const override { return stagingBytes_; }
  void* stagingBuffer() override;
  void exchange() override;
  // Two meetings: the host arrives, while the staging is the stream's and
  // may not have run yet.
  void enterStaged(const CollectiveDesc& desc, Deadline deadline) override;
  const void* peerBuffer(int rank) const override;

  // The first failure of a device wait, as a message; "" while none. The
  // probe owns what it reads, so a collective's Work may keep it after the
  // transport is gone; reading it after the collective's done event fired
  // sees every failure of that collective or before it.
  std::function<std::string()> deviceErrorProbe() const override;
  // deviceError, or a peer whose process exited: what the engine's
  // monitor polls while collectives are pending.
  std::string asyncError() const override;
  std::string deadPeer() const override { return control_.deadPeer(); }

 private:
  char* slots(int rank) const { return bases_[rank] + sizeof(IpcHeader); }
  char* staging(int rank) const {
    return slots(rank) + static_cast<size_t>(numSlots_) * slotBytes_;
  }
  IpcHeader* header(int rank) const { return reinterpret_cast<IpcHeader*>(bases_[rank]); }

  // Sets this rank's failed flag, so that peers' device waits on it end.
  void raiseFailedFlag();
  // The waits and signals around one verb's data kernel.
  void waitFor(const WaitList& waits);
  void signal(const SignalList& signals);
  // Wait conditions: my send slot for piece k is free; piece k has arrived.
  void addSendSlotFree(WaitList& w, uint64_t piece) const;
  void addRecvArrived(WaitList& w, uint64_t piece) const;
  // Slot addresses of a piece.
  char* sendSlot(uint64_t piece) const;
  const char* recvSlot(uint64_t piece) const;

  const int rank_;
  const int worldSize_;
  const int device_;
  const size_t slotBytes_;
  const int numSlots_;
  const size_t stagingBytes_;
  const uint64_t timeoutNs_;
  cudaStream_t stream_;
  // Sets a peer-visible failed flag without queueing behind stream_.
  cudaStream_t sideStream_ = nullptr;
  shm::ControlPlane control_;

  uint64_t token_ = 0;
  std::vector<char*> bases_;  // by rank: own cudaMalloc, then mapped peers
  // Host-mapped words (see SharedWords) and a pinned 1 for sideStream_;
  // shared with the probes handed to Works.
  std::shared_ptr<int64_t> hostWords_;
  SharedWords words_{};

  uint64_t sent_ = 0;      // mirrors our posted flag
  uint64_t received_ = 0;  // mirrors our consumed flag
  uint64_t rounds_ = 0;    // mirrors our staged flag
};

} // namespace ipc
} // namespace pyddp
