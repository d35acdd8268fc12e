// FusedEngine: the fused collectives, one launch per collective: every
// rank's device runs a channel program (device/programs.h) that stages,
// meets its peers and moves the bytes itself, over buffers every rank maps
// (transport/fused_memory.h). On a GPU, a launch is a kernel on the
// engine's internal stream (backend/device_executor.h), enqueued by the
// caller's thread; the host never waits for the peers, and reads the
// device's error word when the collective's done event fires. On the
// emulated grid (device/emulated_grid.h: the CPU test suite's), a launch
// is one CPU thread per channel, run by the CPU executor, whose thread
// watches the peers' processes meanwhile as the GPU's monitor does.
//
// The engine keeps, per channel, the counts of barriers crossed and rounds
// staged that every launch starts from (layout.h): the programs advance
// them deterministically from the collective's arguments, the same on
// every rank, so the host advances its copies as it launches.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <atomic>
#include <memory>
#include <string>

#include "backend/engine.h"
#include "common/config.h"
#include "device/programs.h"
#include "transport/fused_memory.h"

namespace pyddp {

class CpuExecutor;
class DeviceExecutor;

class FusedEngine final : public Engine {
 public:
  // Connects `memory` on every rank (bounded by options.timeoutMs); a
  // refusal by any rank fails every rank alike. `device`: the CPU for the
  // emulated grid, or the CUDA device whose memory `memory` is.
  FusedEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              const RingOptions& options, c10::Device device,
              std::unique_ptr<FusedMemory> memory);
  ~FusedEngine() override;

  const std::string getBackendName() const override { return "pyddp"; }

  // How many channels a collective of `bytes` per rank uses: one per
  // kBytesPerChannel, at most the geometry's (every rank alike).
  int channelsFor(size_t bytes) const;

 protected:
  const Executor& executor() const override;
  WorkPtr runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf, Results results,
                       const CallOptions& call) override;
  WorkPtr runAllGather(const CollectiveDesc& desc, const at::Tensor& input,
                       const RankBlocks& output, Results results,
                       const CallOptions& call) override;
  WorkPtr runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf, Results results,
                       const CallOptions& call) override;
  WorkPtr runReduceScatter(const CollectiveDesc& desc, const at::Tensor& input,
                           const at::Tensor& output, Results results,
                           const CallOptions& call) override;
  WorkPtr runBarrier(const CollectiveDesc& desc, const CallOptions& call) override;
  void shutDown(Teardown how) override;

 private:
  // One launch: `input` and `output` (contiguous; `count` as FusedArgs
  // says) with `protocol`, the results finished as `results` says.
  WorkPtr launch(const CollectiveDesc& desc, device::Protocol protocol, const at::Tensor& input,
                 const at::Tensor& output, size_t count, Results& results,
                 const CallOptions& call);
  device::FusedArgs argsFor(const CollectiveDesc& desc, device::Protocol protocol,
                            const void* input, void* output, size_t count,
                            std::chrono::milliseconds timeout);
  // Advances the per-channel counts past launch `a`.
  void advance(const device::FusedArgs& a, size_t elementBytes);
  // Runs `a` on the emulated grid to its end, watching the peers'
  // processes and the caller's interrupts; throws the device's error.
  void runOnGrid(const device::FusedArgs& a, const CollectiveDesc& desc);
  // The device's error word as a message about collective `desc`.
  std::string describeError(int64_t word, const CollectiveDesc& desc) const;

  const RingOptions options_;
  std::unique_ptr<FusedMemory> memory_;
  std::unique_ptr<Executor> executor_;
  CpuExecutor* cpuExec_ = nullptr;
  DeviceExecutor* deviceExec_ = nullptr;
  // Per channel, before the next launch (the executor runs one at a time).
  std::array<uint64_t, device::kMaxChannels> crossed_{};
  std::array<uint64_t, device::kMaxChannels> rounds_{};
  // Why the emulated grid's host aborted a launch (a dead peer, an
  // interrupt); "" for teardown.
  std::string abortedBecause_;
  std::atomic<bool> shutDown_{false};
};

} // namespace pyddp
