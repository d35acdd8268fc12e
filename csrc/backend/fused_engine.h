// FusedEngine: the fused collectives, one launch per collective: every
// rank's device runs a channel program (device/programs.h) that stages,
// meets its peers and moves the bytes itself, over buffers every rank maps
// (transport/fused_memory.h). On a GPU, a launch is a kernel on the
// engine's internal stream (backend/device_executor.h), enqueued by the
// caller's thread; the host never waits for the peers, and reads the
// device's error word when the collective's done event fires. On the
// emulated grid (device/emulated_grid.h: the CPU test suite's), a launch
// is one CPU thread per channel, run by the CPU executor, whose thread
// watches the peers' processes meanwhile as the GPU's monitor does. Where
// ranks' kernels take turns on a shared GPU (no MPS), the registry takes
// the emulated grid's memory for CUDA tensors ("cuda_host"): a launch
// copies them to host staging on the engine's stream and runs the programs
// on host threads from a host function there, so no kernel waits for a
// peer.
//
// The engine keeps, per channel, the counts of barriers crossed and rounds
// staged that every launch starts from (layout.h): the programs advance
// them deterministically from the collective's arguments, the same on
// every rank, so the host advances its copies as it launches.
//
// The collectives without a channel program of their own are the fused
// ones with scratch: reduce an all-reduce only the root keeps, gather an
// all-gather only the root keeps, scatter a broadcast of the root's whole
// list of which every rank keeps its block. Point-to-point messages,
// monitored_barrier and all-to-all move over the same messages as the shm
// transport's (transport/shm_channel.h's MessageLanes, over this memory's
// control plane; P2pExecutor), with its semantics: FIFO per pair and tag,
// receives from any source, unexpected messages held aside up to
// p2p_buffer_bytes. CUDA tensors are staged through host memory: copied
// to the host on the caller's current stream before they are sent (for
// all-to-all, on the engine's stream, behind the caller's), and to the
// device once received; correct and simple, but bound by the copies and
// the host's messages, not by the GPU's links.
//
// Registered buffers (NCCL's window registration, vLLM's registered
// buffers): registerBuffer() is a collective in which every rank names a
// tensor of the same size; each maps every peer's (FusedMemory::
// mapRegion) and keeps it until deregisterBuffer() or the group's end. An
// all-reduce, all-gather, reduce-scatter or broadcast whose tensor that
// peers read lies in one on every rank (the same registration: the
// descriptor's window, which ranks compare; anywhere in it) launches with
// every rank's buffer and reads the peers' tensors where they lie
// (programs.h: registered launches); the one-shot all-reduce's sizes keep
// staging (one barrier where in place takes three).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/engine.h"
#include "common/config.h"
#include "device/programs.h"
#include "transport/fused_memory.h"
#include "transport/shm_channel.h"

namespace pyddp {

class CpuExecutor;
class DeviceExecutor;
class P2pExecutor;

class FusedEngine final : public Engine {
 public:
  // Connects `memory` on every rank (bounded by options.timeoutMs); a
  // refusal by any rank fails every rank alike. `device`: the CPU for the
  // emulated grid, or the CUDA device whose memory `memory` is.
  FusedEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              const GroupOptions& options, c10::Device device,
              std::unique_ptr<FusedMemory> memory);
  ~FusedEngine() override;

  const std::string getBackendName() const override { return "pyddp"; }

  // How many channels a collective of `bytes` per rank uses: one per
  // kBytesPerChannel, at most the geometry's (every rank alike).
  int channelsFor(size_t bytes) const;

  // Registers `tensor` (contiguous, not empty, on this engine's device,
  // overlapping no registered buffer) on every rank: a collective in which
  // every rank passes one of as many bytes, which the group holds until
  // deregisterBuffer() or its end. Bounded by the group's timeout; a rank
  // that cannot export its own or map a peer's fails every rank alike,
  // saying why.
  void registerBuffer(const at::Tensor& tensor);
  // Ends the registration of `tensor` (as registered) on every rank: a
  // collective that waits, through a barrier of the group, until no rank
  // reads it, then lets the peers' mappings and the tensor go.
  void deregisterBuffer(const at::Tensor& tensor);
  // Whether registerBuffer() serves this engine: its programs read device
  // memory where it lies (not "cuda_host", which stages CUDA tensors
  // through host memory).
  bool registersBuffers() const { return !programsOnHost_; }
  // Launches that read registered buffers in place so far, for tests.
  uint64_t registeredLaunches() const {
    return registeredLaunches_.load(std::memory_order_relaxed);
  }

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
  WorkPtr runReduce(const CollectiveDesc& desc, const at::Tensor& input,
                    const at::Tensor& output, Results results,
                    const CallOptions& call) override;
  WorkPtr runGather(const CollectiveDesc& desc, const at::Tensor& input,
                    const RankBlocks& output, Results results,
                    const CallOptions& call) override;
  WorkPtr runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                     const at::Tensor& output, Results results,
                     const CallOptions& call) override;
  WorkPtr runAllToAll(const CollectiveDesc& desc, const at::Tensor& input,
                      const at::Tensor& output, const ArgChecks::AllToAll& a, Results results,
                      const CallOptions& call) override;
  WorkPtr runSend(const at::Tensor& tensor, int dst, int64_t tag,
                  const CallOptions& call) override;
  WorkPtr runRecv(const at::Tensor& buf, int src, int64_t tag, Results results,
                  const CallOptions& call) override;
  void runMonitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  void shutDown(Teardown how) override;

 private:
  // A collective as it runs: its descriptor as every rank compares it (the
  // algorithm algorithms::select() planned and the registered buffer it
  // reads), its program, and for a registered launch every rank's buffer
  // and where this rank's tensor lies in its own (device::FusedArgs).
  struct Planned {
    CollectiveDesc desc;
    device::Protocol protocol;
    std::array<const char*, device::kMaxRanks> peer{};
    uint64_t offset = 0;
  };
  // The plan of `desc` with program `protocol` (an all-reduce's: one-shot
  // or two-shot as selected), reading `read` in place where it lies in a
  // registered buffer and `writable` (this rank may write its output while
  // peers read `read`).
  Planned plan(const CollectiveDesc& desc, device::Protocol protocol, const at::Tensor& read,
               bool writable) const;

  // One launch: `input` and `output` (contiguous; `count` elements as
  // FusedArgs says) with `protocol`, the results finished as `results`
  // says. `before` runs first, in the collective's turn (on a GPU, on the
  // engine's stream), on the tensors of `uses` besides input and output.
  WorkPtr launch(const Planned& planned, const at::Tensor& input, const at::Tensor& output,
                 size_t count, Results& results, const CallOptions& call,
                 std::function<void()> before = nullptr, std::vector<at::Tensor> uses = {});
  std::chrono::milliseconds timeoutOf(const CallOptions& call) const;
  device::FusedArgs argsFor(const CollectiveDesc& desc, device::Protocol protocol,
                            const void* input, void* output, size_t count,
                            std::chrono::milliseconds timeout);
#ifdef PYDDP_WITH_CUDA
  // Enqueues launch `a` (of collective `d`, on `input` and `output`, which
  // may be undefined) on the engine's stream: the kernel, or with the
  // programs on the host ("cuda_host") the copies through host staging
  // around a host function that runs them. The GPU never waits for a peer
  // there, so ranks whose kernels take turns on a GPU still meet at once.
  void enqueue(const device::FusedArgs& a, const CollectiveDesc& d, const at::Tensor& input,
               const at::Tensor& output);
  // Pinned host memory of at least `bytes` for the next host launch.
  char* hostStaging(size_t bytes);
#endif
  // Advances the per-channel counts past launch `a`.
  void advance(const device::FusedArgs& a, size_t elementBytes);
  // Runs `a` on the emulated grid to its end, watching the peers'
  // processes and the caller's interrupts; throws the device's error.
  void runOnGrid(const device::FusedArgs& a, const CollectiveDesc& desc);
  // The device's error word as a message about collective `desc`.
  std::string describeError(int64_t word, const CollectiveDesc& desc) const;

  const GroupOptions options_;
  std::unique_ptr<FusedMemory> memory_;
  // CUDA tensors whose programs run on host threads ("cuda_host").
  const bool programsOnHost_;
#ifdef PYDDP_WITH_CUDA
  // Pinned staging of host launches, the newest (largest) last; used by one
  // launch at a time, in stream order, and freed with the engine.
  std::vector<char*> hostStaging_;
  size_t hostStagingBytes_ = 0;
#endif
  // memory_'s control plane's messages: the collectives' lane (link_) and
  // the user's, which p2p_ drives. Made once memory_ is connected.
  std::unique_ptr<shm::MessageLanes> lanes_;
  MessageLink* link_ = nullptr;
  std::unique_ptr<P2pExecutor> p2p_;
  std::atomic<uint64_t> monitoredBarriers_{0};  // calls so far, for their tags
  std::unique_ptr<Executor> executor_;
  CpuExecutor* cpuExec_ = nullptr;
  DeviceExecutor* deviceExec_ = nullptr;
  // Per channel, before the next launch (the executor runs one at a time).
  std::array<uint64_t, device::kMaxChannels> crossed_{};
  std::array<uint64_t, device::kMaxChannels> rounds_{};
  // A registered buffer: this rank's tensor (held: peers map its memory)
  // and every rank's copy as this rank addresses it.
  struct Registration {
    uint64_t number = 0;  // 1, 2, ... in registration order, alike on every rank
    at::Tensor tensor;
    const char* data = nullptr;
    size_t bytes = 0;
    std::array<const char*, device::kMaxRanks> peer{};
    std::vector<std::shared_ptr<const void>> maps;  // the peers' mappings
  };
  // Guards registrations_ (callers' threads register and launch).
  mutable std::mutex registrationsMutex_;
  std::vector<Registration> registrations_;
  uint64_t registrationsMade_ = 0;
  std::atomic<uint64_t> registeredLaunches_{0};

  // Why the emulated grid's host aborted a launch (a dead peer, an
  // interrupt); "" for teardown.
  std::string abortedBecause_;
  std::atomic<bool> shutDown_{false};
};

} // namespace pyddp
