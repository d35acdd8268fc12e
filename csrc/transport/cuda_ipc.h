// The fused collectives' memory on GPUs of one host (fused_memory.h): each
// rank cudaMallocs one buffer (device/layout.h), exports it by IPC handle
// and maps every peer's; its device's words (the first error, the host's
// abort) are host-mapped memory. Access to every peer is proven at connect
// by a read of its header and a write of this rank's probe slot, read back
// (cudaDeviceCanAccessPeer is not trusted). Host-side bootstrap and
// liveness are the shm control plane's (shm_control.h), alone.
//
// A registered tensor (FusedEngine::registerBuffer) is exported as its
// caching-allocator allocation's IPC handle and its offset there; a peer
// opens each handle once per process (CUDA refuses a second open of one
// handle, and two registered tensors may share an allocation) and closes
// it when the last registration in it ends.
//
// Setup, connect and teardown run on a stream of this object's own and
// synchronise that stream, never the device: a device-wide synchronisation
// would also wait on other groups' pending collectives.
//
// Only compiled in CUDA builds (PYDDP_WITH_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "transport/fused_memory.h"

namespace pyddp {

class CudaIpcMemory final : public FusedMemory {
 public:
  CudaIpcMemory(int rank, int worldSize, const device::Geometry& geometry, int device);
  // Waits for this object's stream, unmaps the peers and frees the buffer:
  // the engine has drained its collectives and met its peers first.
  ~CudaIpcMemory() override;
  CudaIpcMemory(const CudaIpcMemory&) = delete;
  CudaIpcMemory& operator=(const CudaIpcMemory&) = delete;

  const char* name() const override { return "cuda_ipc"; }
  bool onHost() const override { return false; }
  std::string reserve() override { return control_.reserve(); }
  std::string setup() override;
  void reclaim(const std::string& reservation) override {
    shm::ControlPlane::reclaim(reservation);
  }
  std::string whyNotConnect(int peer, const std::string& blob) const override;
  void connect(const std::vector<std::string>& blobs) override;
  void connected() override { control_.connected(); }

  char* base(int rank) const override { return bases_[rank]; }
  int64_t* errorWord() const override { return deviceWords_ + kErrorWord; }
  const int64_t* abortWord() const override { return deviceWords_ + kAbortWord; }
  int64_t error() const override;
  void abort() override;
  // Raises this rank's failed flag from a stream that does not queue behind
  // its own (maybe waiting) kernels.
  void tellPeers() override;
  std::string exportRegion(const void* data, size_t bytes) const override;
  PeerRegion mapRegion(int peer, const std::string& blob, size_t bytes) const override;

 private:
  // The host-mapped words, each on its own 64-byte line: the error word,
  // the abort word and a constant 1 (the source of the failed flag that
  // tellPeers() copies to the device).
  static constexpr size_t kWordStride = 64 / sizeof(int64_t);
  static constexpr size_t kErrorWord = 0, kAbortWord = kWordStride, kOneWord = 2 * kWordStride;
  static constexpr size_t kWordsBytes = 3 * 64;

  device::FusedHeader* header(int rank) const {
    return reinterpret_cast<device::FusedHeader*>(bases_[rank]);
  }

  const int rank_;
  const int worldSize_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  uint64_t token_ = 0;
  std::vector<char*> bases_;  // by rank: own cudaMalloc, then mapped peers
  int64_t* hostWords_ = nullptr;    // cudaHostAlloc'd, mapped
  int64_t* deviceWords_ = nullptr;  // the same, as the device addresses them
};

} // namespace pyddp
