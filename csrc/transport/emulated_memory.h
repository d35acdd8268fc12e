// The fused collectives' memory for the emulated grid (device/
// emulated_grid.h): each rank's buffer is the data of its control plane's
// shared-memory segment (shm_control.h), which every peer maps read-only,
// as a GPU's peers map its exported buffer; the device's words are this
// process's memory. So the channel programs run between real processes
// over memory shared as on a GPU, and the CPU test suite exercises their
// barriers, digests, rounds and failures.
//
// The same memory serves CUDA tensors whose GPU runs no kernel that waits
// for a peer ("cuda_host": backend/fused_engine.h stages them through host
// memory and runs the programs on host threads).
//
// Registered tensors are CPU tensors in registered memory (pyddp.empty:
// transport/registered.h), which peers map read-only as the shm transport
// does, as a GPU's peers open a registered tensor's IPC handle.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/fused_memory.h"

namespace pyddp {

class EmulatedMemory final : public FusedMemory {
 public:
  // `name`: the transport's, for users and messages.
  EmulatedMemory(int rank, int worldSize, const device::Geometry& geometry,
                 const char* name = "emulated");

  const char* name() const override { return name_; }
  bool onHost() const override { return true; }
  std::string reserve() override { return control_.reserve(); }
  std::string setup() override;
  void reclaim(const std::string& reservation) override {
    shm::ControlPlane::reclaim(reservation);
  }
  std::string whyNotConnect(int peer, const std::string& blob) const override;
  void connect(const std::vector<std::string>& blobs) override;
  void connected() override { control_.connected(); }

  char* base(int rank) const override;
  int64_t* errorWord() const override { return &words_->error; }
  const int64_t* abortWord() const override { return &words_->abort; }
  int64_t error() const override;
  void abort() override;
  void tellPeers() override;
  std::string exportRegion(const void* data, size_t bytes) const override;
  PeerRegion mapRegion(int peer, const std::string& blob, size_t bytes) const override;

 private:
  // The device's words, apart from the buffer (host memory on a GPU too).
  struct Words {
    int64_t error = 0;
    int64_t abort = 0;
  };

  const int rank_;
  const int worldSize_;
  const char* const name_;
  std::unique_ptr<Words> words_;
};

} // namespace pyddp
