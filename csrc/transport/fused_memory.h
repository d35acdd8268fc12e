// The memory of the fused collectives (device/layout.h): this rank's
// buffer and every peer's, mapped; the two words between this rank's device
// and its host (the device's first error, the host's abort); and the
// control plane beside them (shm_control.h: bootstrap, liveness, the
// descriptors that say how ranks differed). The fused engine
// (backend/fused_engine.h) launches its channel programs over it.
//
// Two kinds: CUDA IPC (cuda_ipc.h: device memory exported by IPC handle,
// host-mapped words) and shared memory between processes for the emulated
// grid (emulated_memory.h: the CPU test suite's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "device/layout.h"
#include "transport/shm_control.h"
#include "transport/transport.h"

namespace pyddp {

class FusedMemory : public Connectable {
 public:
  const device::Geometry& geometry() const { return geometry_; }
  // The buffers are host memory, which host threads run the programs over
  // (the emulated grid); false: device memory, which kernels do.
  virtual bool onHost() const = 0;
  // Rank `rank`'s buffer as this rank's device addresses it (this rank's
  // own writable, its peers' read-only).
  virtual char* base(int rank) const = 0;
  // Where the device records its first error, and where the host tells it
  // to stop waiting, as the device addresses them.
  virtual int64_t* errorWord() const = 0;
  virtual const int64_t* abortWord() const = 0;
  // The device's first error (layout.h's encoding), as the host reads it;
  // 0 while none.
  virtual int64_t error() const = 0;
  // Every wait of this rank's device ends from now on (the abort word).
  // Safe from any thread.
  virtual void abort() = 0;
  // Peers' waits on this rank end from now on (its failed flag), but for
  // what this rank has done its part of. Safe from any thread.
  virtual void tellPeers() = 0;

  // A peer's registered tensor (FusedEngine::registerBuffer) as this
  // rank's device addresses it, mapped read-only while `keep` lives.
  struct PeerRegion {
    const char* data = nullptr;
    std::shared_ptr<const void> keep;
  };
  // What a peer needs to map [data, data + bytes) of this rank's memory
  // (mapRegion). Throws, saying why, if that memory cannot be shared.
  virtual std::string exportRegion(const void* data, size_t bytes) const = 0;
  // Rank `peer`'s memory that `blob` (its exportRegion()) names, `bytes`
  // long. Throws, naming the peer, if it cannot be mapped.
  virtual PeerRegion mapRegion(int peer, const std::string& blob, size_t bytes) const = 0;

  shm::ControlPlane& control() { return control_; }
  const shm::ControlPlane& control() const { return control_; }

 protected:
  FusedMemory(int rank, int worldSize, const device::Geometry& geometry, size_t controlData)
      : geometry_(geometry), control_(rank, worldSize, controlData) {}

  const device::Geometry geometry_;
  shm::ControlPlane control_;
};

} // namespace pyddp
