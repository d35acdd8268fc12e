#include "backend/fused_engine.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "algorithms/collectives.h"
#include "algorithms/select.h"
#include "backend/bootstrap.h"
#include "backend/cpu_executor.h"
#include "backend/monitored_barrier.h"
#include "backend/p2p_executor.h"
#include "common/blob.h"
#include "common/check.h"
#include "common/interrupt.h"
#include "device/emulated_grid.h"
#include "transport/wait_policy.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/device_executor.h"
#include "common/cuda_device.h"
#include "device/fused_kernels.h"
#endif

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

// Threads of one channel's team (a thread block) on a GPU: enough 16-byte
// loads in flight per SM to reach memory bandwidth with a channel per SM.
// An initial value, not yet measured on pyddp's kernels.
constexpr int kThreadsPerChannel = 512;

// The digest of a descriptor (every field, the sequence number included),
// which the channels compare on the device.
uint64_t digestOf(const CollectiveDesc& d) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const uint64_t v : fieldValues(d)) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

// Whether the bytes of `a` and `b` are apart.
bool apart(const at::Tensor& a, const at::Tensor& b) {
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  return pa + a.nbytes() <= pb || pb + b.nbytes() <= pa;
}

// Block `block` of `t`'s bytes split into `blocks` equal ones.
const char* blockOf(const at::Tensor& t, int block, int blocks) {
  return static_cast<const char*>(t.data_ptr()) + t.nbytes() / blocks * block;
}

#ifdef PYDDP_WITH_CUDA
// A launch of the channel programs on host threads ("cuda_host"), which a
// host function of the engine's stream runs: it owns its arguments.
struct HostLaunch {
  device::FusedArgs args;
  DataType dtype;
  RedOp op;
};

void CUDART_CB runHostLaunch(void* launch) {
  const std::unique_ptr<HostLaunch> l(static_cast<HostLaunch*>(launch));
  try {
    device::runEmulated(l->args, l->dtype, l->op);
  } catch (...) {
    // Nothing may leave a host function. runEmulated gave up (no thread to
    // run a channel on), and its host reports the collective failed.
  }
}
#endif

std::function<void()> finishOf(Results& results) {
  if (results.finish) return std::move(results.finish);
  return [] {};
}

} // namespace

FusedEngine::FusedEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                         const GroupOptions& options, c10::Device device,
                         std::unique_ptr<FusedMemory> memory)
    : Engine(rank, size, device, memory->name(), store),
      options_(options),
      memory_(std::move(memory)),
      programsOnHost_(device.is_cuda() && memory_->onHost()) {
  options_.validate();
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  FusedMemory& mem = *memory_;
  EngineExecutor made = makeExecutor(rank, device, Ms(options_.timeoutMs));
  executor_ = std::move(made.owner);
  cpuExec_ = made.cpu;
  deviceExec_ = made.device;
  PYDDP_CHECK(executor_ != nullptr, "rank ", rank, ": the fused engine serves ", device,
              " tensors only in a CUDA build");
  bootstrap::connect(mem, *store, rank, size, Ms(options_.timeoutMs));
  lanes_ = std::make_unique<shm::MessageLanes>(rank, size, mem.control(), options_);
  const auto directory = std::make_shared<bootstrap::StoreDirectory>(store);
  link_ = lanes_->messages(directory, Lane::Collectives);
  p2p_ = std::make_unique<P2pExecutor>(rank, *lanes_->messages(directory, Lane::User));
  if (cpuExec_) {
    shm::MessageLanes& lanes = *lanes_;
    cpuExec_->start(CpuExecutor::Hooks{
        [] {},
        [&mem](const std::string& why) {
          mem.control().giveUp(why, /*onNext=*/false);
          mem.tellPeers();
        },
        [&mem, &lanes] {
          mem.control().abort();
          mem.abort();
          lanes.abort();
        },
        [&mem](const std::string& why) {
          mem.control().giveUp(why, /*onNext=*/true);
          mem.tellPeers();
        }});
    return;
  }
#ifdef PYDDP_WITH_CUDA
  deviceExec_->start(DeviceExecutor::Hooks{
      nullptr,
      // Errors the device recorded, and peers whose process exited.
      [this] {
        const int64_t word = memory_->error();
        if (word != 0) return describeError(word, CollectiveDesc{});
        const std::string dead = memory_->control().deadPeer();
        return dead.empty() ? dead : "rank " + std::to_string(rank_) + ": " + dead;
      },
      [&mem](const std::string& why) {
        mem.control().giveUp(why, /*onNext=*/false);
        mem.abort();
        mem.tellPeers();
      },
      [this] {
        const int64_t word = memory_->error();
        return word == 0 ? std::string() : describeError(word, CollectiveDesc{});
      }});
#endif
}

FusedEngine::~FusedEngine() {
  shutDown(Teardown::Destroyed);
#ifdef PYDDP_WITH_CUDA
  if (deviceExec_) {
    // Launches still on the stream (after an abort, or a retire that gave
    // up) end at their next look at the abort word; the peers' registered
    // buffers and the host staging they read go after them.
    memory_->abort();
    QuietDeviceGuard scope(device_.index());
    cudaStreamSynchronize(deviceExec_->stream());
    for (char* buffer : hostStaging_) cudaFreeHost(buffer);
  }
#endif
}

const Executor& FusedEngine::executor() const {
  return *executor_;
}

void FusedEngine::shutDown(Teardown how) {
  if (shutDown_.exchange(true)) return;
  if (p2p_) p2p_->shutdown(teardownReason(rank_, memory_->control().deadPeer(), how));
#ifdef PYDDP_WITH_CUDA
  if (deviceExec_ && how == Teardown::Destroyed) {
    // Peers read this rank's device memory: collectives already queued
    // complete (as a destroy after dist.all_reduce(t) expects), then every
    // rank meets every other before the memory is freed. On failure the
    // abort that follows ends what is left. An abort ends them at once
    // (the executor fails the group first); the memory stays mapped until
    // the engine is destroyed.
    deviceExec_->retire([this](const CollectiveDesc& desc, Deadline deadline) {
      const device::FusedArgs a =
          argsFor(desc, device::Protocol::Barrier, nullptr, nullptr, 0, deadline.timeout);
      memory_->control().publish(desc);
      advance(a, 1);
      try {
        enqueue(a, desc, at::Tensor(), at::Tensor());
        cudaStreamSynchronize(deviceExec_->stream());
      } catch (const std::exception&) {
        // A launch that fails leaves the abort path to end what is left.
      }
    });
  }
#endif
  executor_->shutdown(how);
  memory_->control().abort();
  // Nothing drives the messages any more: what they left in /dev/shm goes
  // now, not when the group is collected.
  if (lanes_) lanes_->close();
}

Ms FusedEngine::timeoutOf(const CallOptions& call) const {
  return call.timeout.count() > 0 ? call.timeout : Ms(options_.timeoutMs);
}

int FusedEngine::channelsFor(size_t bytes) const {
  const size_t chunk = memory_->geometry().chunkBytes;
  const size_t wanted = (bytes + chunk - 1) / chunk;
  const size_t most = static_cast<size_t>(memory_->geometry().channels);
  return static_cast<int>(wanted < 1 ? 1 : (wanted > most ? most : wanted));
}

namespace {

// `f()`'s error message as part of another pyddp error; "" if it returned.
template <typename F>
std::string failureOf(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return bare(messageOf(e));
  }
  return "";
}

} // namespace

// Registration protocol, under the group's store (bootstrap::gatherOutcomes,
// bounded by the group's timeout), registration n alike on every rank:
//   registered/<n>/region  each rank's byte count and its exportRegion()
//                          blob, or why it could not register its tensor;
//   registered/<n>/mapped  once it mapped every peer's, or why not.
// A rank acts on a step only once every rank's outcome of it is in, so all
// keep the registration or all fail, naming the same rank.
void FusedEngine::registerBuffer(const at::Tensor& tensor) {
  refuseIfUnusable("register_buffer");
  Registration reg;
  std::string region;
  // A rank whose tensor is refused says so to its peers, so that every
  // rank fails alike and counts the registration.
  const std::string exportFailure = failureOf([&] {
    PYDDP_CHECK_VALUE(registersBuffers(), "the ", transport_, " transport stages ", device_,
                      " tensors through host memory and reads no registered buffer in place");
    PYDDP_CHECK_VALUE(tensor.defined() && tensor.device() == device_ && tensor.is_contiguous() &&
                          tensor.nbytes() > 0,
                      "register_buffer takes a contiguous, non-empty tensor on ", device_,
                      ", got ",
                      tensor.defined() ? tensor.toString() + " of " +
                              std::to_string(tensor.nbytes()) + " bytes on " +
                              tensor.device().str() + (tensor.is_contiguous() ? "" : ", strided")
                                       : std::string("None"));
    reg.tensor = tensor;
    reg.data = static_cast<const char*>(tensor.data_ptr());
    reg.bytes = tensor.nbytes();
    const std::lock_guard<std::mutex> lock(registrationsMutex_);
    for (const Registration& other : registrations_) {
      PYDDP_CHECK_VALUE(reg.data + reg.bytes <= other.data || other.data + other.bytes <= reg.data,
                        "the tensor overlaps registered buffer ", other.number,
                        "; deregister that first");
    }
    region = memory_->exportRegion(reg.data, reg.bytes);
  });
  {
    const std::lock_guard<std::mutex> lock(registrationsMutex_);
    reg.number = ++registrationsMade_;
  }
  const Ms timeout(options_.timeoutMs);
  const std::string key = "registered/" + std::to_string(reg.number);
  const std::vector<std::string> regions = bootstrap::gatherOutcomes(
      groupStore(), key + "/region",
      BlobWriter().put("bytes", reg.bytes).putBytes("region", region).str(), exportFailure,
      rank_, size_, timeout, "register its tensor");
  std::vector<BlobReader> blobs;
  for (int r = 0; r < size_; ++r) {
    blobs.emplace_back(regions[r], "rank " + std::to_string(r) + "'s registered tensor");
    PYDDP_CHECK_VALUE(blobs[r].get<size_t>("bytes") == reg.bytes, "register_buffer: rank ",
                      rank_, " registered ", reg.bytes, " bytes, rank ", r, " ",
                      blobs[r].get<size_t>("bytes"), "; every rank registers as many");
  }
  const std::string mapFailure = failureOf([&] {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        reg.peer[r] = reg.data;
        continue;
      }
      FusedMemory::PeerRegion mapped = memory_->mapRegion(r, blobs[r].bytes("region"), reg.bytes);
      reg.peer[r] = mapped.data;
      reg.maps.push_back(std::move(mapped.keep));
    }
  });
  bootstrap::gatherOutcomes(groupStore(), key + "/mapped", "", mapFailure, rank_, size_, timeout,
                            "map a peer's tensor");
  const std::lock_guard<std::mutex> lock(registrationsMutex_);
  registrations_.push_back(std::move(reg));
}

void FusedEngine::deregisterBuffer(const at::Tensor& tensor) {
  refuseIfUnusable("deregister_buffer");
  const auto matches = [&](const Registration& reg) {
    return tensor.defined() && reg.data == tensor.data_ptr() && reg.bytes == tensor.nbytes();
  };
  {
    const std::lock_guard<std::mutex> lock(registrationsMutex_);
    PYDDP_CHECK_VALUE(std::any_of(registrations_.begin(), registrations_.end(), matches), "rank ",
                      rank_, ": deregister_buffer: the tensor is not registered with this group "
                      "(pass the tensor register_buffer took)");
  }
  // Once this rank's barrier is done, every rank ran every collective
  // before it: no launch reads the buffer any more, here or at a peer.
  barrierAll(CallOptions{})->wait();
  const std::lock_guard<std::mutex> lock(registrationsMutex_);
  registrations_.erase(std::remove_if(registrations_.begin(), registrations_.end(), matches),
                       registrations_.end());
}

device::FusedArgs FusedEngine::argsFor(const CollectiveDesc& desc, device::Protocol protocol,
                                       const void* input, void* output, size_t count,
                                       Ms timeout) {
  device::FusedArgs a{};
  a.protocol = protocol;
  a.rank = rank_;
  a.size = size_;
  a.channels = channelsFor(count * elementSize(desc.dtype) *
                           (protocol == device::Protocol::ReduceScatter ? size_ : 1));
  a.root = desc.root;
  a.average = desc.op == RedOp::Avg;
  a.seq = desc.seq;
  a.digest = digestOf(desc);
  a.count = count;
  a.input = input;
  a.output = output;
  for (int r = 0; r < size_; ++r) a.base[r] = memory_->base(r);
  a.geometry = memory_->geometry();
  for (int c = 0; c < device::kMaxChannels; ++c) {
    a.crossed[c] = crossed_[c];
    a.rounds[c] = rounds_[c];
  }
  a.error = memory_->errorWord();
  a.abort = memory_->abortWord();
  a.timeoutNs = static_cast<uint64_t>(timeout.count()) * 1000000ull;
  return a;
}

void FusedEngine::advance(const device::FusedArgs& a, size_t elementBytes) {
  const int channels = a.protocol == device::Protocol::Barrier ? 1 : a.channels;
  for (int c = 0; c < channels; ++c) {
    const device::ChannelPlan plan = device::planChannel(a, c, elementBytes);
    crossed_[c] += plan.barriers;
    rounds_[c] += plan.rounds;
  }
}

std::string FusedEngine::describeError(int64_t word, const CollectiveDesc& desc) const {
  const int peer = device::errorRank(word);
  const std::string call = desc.seq == 0
      ? std::string("a collective")
      : std::string(toString(desc.kind)) + " #" + std::to_string(desc.seq);
  const shm::ControlPlane& control = memory_->control();
  switch (device::errorCode(word)) {
    case device::kTimeout:
      return c10::str("pyddp: rank ", rank_, ": ", call, " timed out after ",
                      options_.timeoutMs, " ms waiting for rank ", peer);
    case device::kPeerFailed: {
      // Its host writes why as it reports the failure: give it a moment.
      std::string why = control.peerFailure(peer);
      for (int i = 0; i < 50 && why.empty(); ++i) {
        std::this_thread::sleep_for(Ms(2));
        why = control.peerFailure(peer);
      }
      return c10::str("pyddp: rank ", peer, " gave up while rank ", rank_, " waited for it in ",
                      call, why.empty() ? "" : ": " + why);
    }
    case device::kMismatch: {
      const std::string differs = desc.seq == 0 ? "" : control.differs(desc, peer);
      return "pyddp: " + (differs.empty() ? c10::str("rank ", peer, " called another collective "
                                                     "than rank ", rank_, "'s ", call,
                                                     "; every rank must issue the same "
                                                     "collectives in the same order")
                                          : differs);
    }
    case device::kAborted:
      if (!abortedBecause_.empty()) return abortedBecause_;
      return c10::str("pyddp: rank ", rank_, ": the process group was destroyed while ", call,
                      " waited for rank ", peer);
    case device::kOk:
      break;
  }
  return c10::str("pyddp: rank ", rank_, ": ", call, " failed (device error ", word, ")");
}

void FusedEngine::runOnGrid(const device::FusedArgs& a, const CollectiveDesc& desc) {
  abortedBecause_.clear();
  std::atomic<bool> done{false};
  std::string unstarted;  // why a channel could not start, read after the join
  std::thread runner([&] {
    try {
      device::runEmulated(a, desc.dtype, desc.op);
    } catch (const std::exception& e) {
      unstarted = e.what();
    }
    done.store(true, std::memory_order_release);
  });
  // As the GPU's monitor: a dead peer or the caller's interrupt ends the
  // device's waits through the abort word.
  Backoff backoff;
  while (!done.load(std::memory_order_acquire)) {
    if (!backoff.pause() || !abortedBecause_.empty()) continue;
    const std::string dead = memory_->control().deadPeer();
    if (!dead.empty()) {
      abortedBecause_ = c10::str("pyddp: ", dead, "; rank ", rank_, " was waiting for it in ",
                                 toString(desc.kind), " #", desc.seq);
    } else if (interruptRequested()) {
      abortedBecause_ = c10::str("pyddp: rank ", rank_, ": interrupted while ",
                                 toString(desc.kind), " #", desc.seq, " was running");
    }
    if (!abortedBecause_.empty()) memory_->abort();
  }
  runner.join();
  PYDDP_CHECK_COMM(unstarted.empty(), "rank ", rank_, ": ", toString(desc.kind), " #", desc.seq,
                   ": a channel thread of the emulated grid could not start: ", unstarted);
  const int64_t word = memory_->error();
  // describeError's messages start with pyddp's prefix
  if (word != 0) C10_THROW_ERROR(DistBackendError, describeError(word, desc));
}

WorkPtr FusedEngine::launch(const Planned& planned, const at::Tensor& input,
                            const at::Tensor& output, size_t count, Results& results,
                            const CallOptions& call, std::function<void()> before,
                            std::vector<at::Tensor> uses) {
  const CollectiveDesc& desc = planned.desc;
  const size_t elementBytes = elementSize(desc.dtype);
  const Ms timeout = timeoutOf(call);
  const auto transfer = [this, protocol = planned.protocol, peer = planned.peer,
                         offset = planned.offset, input, output, count, elementBytes, timeout,
                         before = std::move(before)](const CollectiveDesc& d, Deadline) {
    if (before) before();
    device::FusedArgs a = argsFor(d, protocol, input.defined() ? input.data_ptr() : nullptr,
                                  output.defined() ? output.data_ptr() : nullptr, count, timeout);
    std::copy(peer.begin(), peer.end(), a.peer);
    a.offset = offset;
    if (device::registered(a)) registeredLaunches_.fetch_add(1, std::memory_order_relaxed);
    memory_->control().publish(d);
    // The programs advance the counts whether or not they finish: a launch
    // that gave up leaves the group failed.
    advance(a, elementBytes);
    if (cpuExec_) {
      runOnGrid(a, d);
      return;
    }
#ifdef PYDDP_WITH_CUDA
    enqueue(a, d, input, output);
#endif
  };
  for (const at::Tensor& t : {input, output}) {
    if (t.defined()) uses.push_back(t);
  }
  return executor_->submit(Collective{desc, results.tensors.vec(), std::move(uses), transfer,
                                      finishOf(results), desc.kind == CollectiveKind::Barrier,
                                      call.timeout},
                           call);
}

#ifdef PYDDP_WITH_CUDA
void FusedEngine::enqueue(const device::FusedArgs& a, const CollectiveDesc& d,
                          const at::Tensor& input, const at::Tensor& output) {
  if (!programsOnHost_) {
    device::launchFused(a, d.dtype, d.op, kThreadsPerChannel, deviceExec_->stream(), rank_);
    return;
  }
  // Stream order: the tensors' bytes into host staging, the programs on host
  // threads (a host function, which holds the stream until they end), the
  // result back. Launches run one after another on the stream, so each
  // reuses the staging that the one before it let go.
  const cudaStream_t stream = deviceExec_->stream();
  const bool inPlace = input.defined() && output.defined() && input.data_ptr() == output.data_ptr();
  const size_t inBytes = input.defined() ? roundUp(input.nbytes(), device::kLineBytes) : 0;
  const size_t outBytes = output.defined() && !inPlace ? output.nbytes() : 0;
  char* staging = hostStaging(inBytes + outBytes);
  auto launch = std::make_unique<HostLaunch>(HostLaunch{a, d.dtype, d.op});
  if (input.defined()) {
    checkCuda(cudaMemcpyAsync(staging, input.data_ptr(), input.nbytes(), cudaMemcpyDeviceToHost,
                              stream),
              "cuda_host: staging a collective's input");
    launch->args.input = staging;
  }
  char* result = inPlace ? staging : staging + inBytes;
  if (output.defined()) launch->args.output = result;
  checkCuda(cudaLaunchHostFunc(stream, runHostLaunch, launch.get()),
            "cuda_host: enqueuing the channel programs");
  launch.release();  // the host function's now
  if (output.defined()) {
    checkCuda(cudaMemcpyAsync(output.data_ptr(), result, output.nbytes(), cudaMemcpyHostToDevice,
                              stream),
              "cuda_host: copying a collective's result back");
  }
}

char* FusedEngine::hostStaging(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (!hostStaging_.empty() && hostStagingBytes_ >= bytes) return hostStaging_.back();
  // Launches queued before this one may still use the smaller buffers: they
  // stay until the engine is destroyed (each at most half the next).
  const size_t grown = std::max(bytes, 2 * hostStagingBytes_);
  void* fresh = nullptr;
  checkCuda(cudaHostAlloc(&fresh, grown, cudaHostAllocDefault),
            "cuda_host: cudaHostAlloc of the staging buffer");
  hostStaging_.push_back(static_cast<char*>(fresh));
  hostStagingBytes_ = grown;
  return hostStaging_.back();
}
#endif

FusedEngine::Planned FusedEngine::plan(const CollectiveDesc& desc, device::Protocol protocol,
                                       const at::Tensor& read, bool writable) const {
  Planned p{desc, protocol, {}, 0};
  if (read.defined() && writable) {
    const std::lock_guard<std::mutex> lock(registrationsMutex_);
    const auto* data = static_cast<const char*>(read.data_ptr());
    for (const Registration& reg : registrations_) {
      if (data < reg.data || data + read.nbytes() > reg.data + reg.bytes) continue;
      p.desc.window = reg.number;
      p.peer = reg.peer;
      p.offset = static_cast<uint64_t>(data - reg.data);
      break;
    }
  }
  algorithms::Capabilities caps;
  caps.rank = rank_;
  caps.worldSize = size_;
  caps.fused = true;
  p.desc.algo = algorithms::select(p.desc, caps, options_).algo;
  if (p.desc.algo != Algo::Registered) {
    p.desc.window = 0;
    p.peer = {};
    p.offset = 0;
  }
  if (desc.kind == CollectiveKind::AllReduce || desc.kind == CollectiveKind::Reduce) {
    p.protocol = p.desc.algo == Algo::Direct ? device::Protocol::OneShotAllReduce
                                             : device::Protocol::TwoShotAllReduce;
  }
  return p;
}

WorkPtr FusedEngine::runAllReduce(const CollectiveDesc& desc, const at::Tensor& buf,
                                  Results results, const CallOptions& call) {
  return launch(plan(desc, device::Protocol::TwoShotAllReduce, buf, true), buf, buf, desc.count,
                results, call);
}

WorkPtr FusedEngine::runReduce(const CollectiveDesc& desc, const at::Tensor& input,
                               const at::Tensor& output, Results results,
                               const CallOptions& call) {
  // Every rank all-reduces into `output`, the root's result and the other
  // ranks' scratch, which starts as a copy of the input.
  std::function<void()> before;
  if (!output.is_same(input)) before = [input, output] { output.copy_(input); };
  return launch(plan(desc, device::Protocol::TwoShotAllReduce, at::Tensor(), false), output,
                output, desc.count, results, call, std::move(before), {input});
}

WorkPtr FusedEngine::runAllGather(const CollectiveDesc& desc, const at::Tensor& input,
                                  const RankBlocks& output, Results results,
                                  const CallOptions& call) {
  if (output.whole.defined()) {
    // peers read this rank's input while it writes the output's other blocks
    const bool writable = apart(input, output.whole) ||
        input.data_ptr() == blockOf(output.whole, rank_, size_);
    return launch(plan(desc, device::Protocol::AllGather, input, writable), input, output.whole,
                  desc.count, results, call);
  }
  // The program writes one buffer; a list's blocks may lie anywhere.
  const int64_t count = static_cast<int64_t>(desc.count);
  const at::Tensor whole = at::empty({count * size_}, input.options());
  Results gathered{results.tensors,
                   [whole, blocks = output.list.vec(), count, finish = finishOf(results)] {
                     for (size_t r = 0; r < blocks.size(); ++r) {
                       blocks[r].view({-1}).copy_(
                           whole.narrow(0, static_cast<int64_t>(r) * count, count));
                     }
                     finish();
                   }};
  return launch(plan(desc, device::Protocol::AllGather, input, true), input, whole, desc.count,
                gathered, call);
}

WorkPtr FusedEngine::runGather(const CollectiveDesc& desc, const at::Tensor& input,
                               const RankBlocks& output, Results results,
                               const CallOptions& call) {
  // The root's list receives the blocks, the other ranks (which pass none)
  // gather into scratch.
  return runAllGather(desc, input, RankBlocks{{}, output.list, desc.count}, std::move(results),
                      call);
}

WorkPtr FusedEngine::runScatter(const CollectiveDesc& desc, const RankBlocks& input,
                                const at::Tensor& output, Results results,
                                const CallOptions& call) {
  const int64_t count = static_cast<int64_t>(desc.count);
  const at::Tensor whole = at::empty({count * size_}, output.options());
  // The root packs its list in the collective's turn, so that a collective
  // queued before it that writes the list is seen.
  std::function<void()> pack;
  std::vector<at::Tensor> blocks = input.list.vec();
  if (!blocks.empty()) {
    pack = [whole, blocks, count] {
      for (size_t r = 0; r < blocks.size(); ++r) {
        whole.narrow(0, static_cast<int64_t>(r) * count, count).copy_(blocks[r].view({-1}));
      }
    };
  }
  Results kept{results.tensors,
               [whole, output, mine = count * rank_, count, finish = finishOf(results)] {
                 output.view({-1}).copy_(whole.narrow(0, mine, count));
                 finish();
               }};
  return launch(plan(desc, device::Protocol::Broadcast, at::Tensor(), false), whole, whole,
                desc.count * size_, kept, call, std::move(pack), std::move(blocks));
}

WorkPtr FusedEngine::runBroadcast(const CollectiveDesc& desc, const at::Tensor& buf,
                                  Results results, const CallOptions& call) {
  return launch(plan(desc, device::Protocol::Broadcast, buf, true), buf, buf, desc.count,
                results, call);
}

WorkPtr FusedEngine::runReduceScatter(const CollectiveDesc& desc, const at::Tensor& input,
                                      const at::Tensor& output, Results results,
                                      const CallOptions& call) {
  // peers read this rank's input's other blocks while it writes the output
  const bool writable = apart(input, output) || output.data_ptr() == blockOf(input, rank_, size_);
  return launch(plan(desc, device::Protocol::ReduceScatter, input, writable), input, output,
                desc.count, results, call);
}

WorkPtr FusedEngine::runBarrier(const CollectiveDesc& desc, const CallOptions& call) {
  Results none;
  return launch(plan(desc, device::Protocol::Barrier, at::Tensor(), false), at::Tensor(),
                at::Tensor(), 0, none, call);
}

namespace {

// A tensor's bytes in host memory: itself on the CPU, else a copy made on
// the current stream, which the copy waits for.
at::Tensor onHost(const at::Tensor& t) {
  return t.is_cpu() ? t : t.to(at::kCPU);
}

// Host memory for what will be copied into `t`: itself on the CPU.
at::Tensor hostFor(const at::Tensor& t) {
  return t.is_cpu() ? t : at::empty(t.sizes(), t.options().device(at::kCPU));
}

} // namespace

WorkPtr FusedEngine::runAllToAll(const CollectiveDesc& desc, const at::Tensor& input,
                                 const at::Tensor& output, const ArgChecks::AllToAll& a,
                                 Results results, const CallOptions& call) {
  const auto transfer = [this, input, output, a](const CollectiveDesc& d, Deadline deadline) {
    // On a GPU this runs on the engine's stream, behind the caller's.
    const at::Tensor in = onHost(input);
    const at::Tensor out = hostFor(output);
    // Every rank arrived with the same call. The fused launches publish
    // their descriptors without waiting (ControlPlane::publish), but no rank
    // leaves an all-to-all before every peer has arrived at it (each waits
    // until a receive of every peer took its message), so no peer's
    // descriptor of this collective is overwritten while it is compared.
    memory_->control().enter(d, deadline);
    // my own block needs no message
    const auto own = [&](const at::Tensor& t, const ArgChecks::Blocks& b) {
      return t.narrow(0, static_cast<int64_t>(b.offsets[rank_]),
                      static_cast<int64_t>(b.counts[rank_]));
    };
    own(out, a.out).copy_(own(in, a.in));
    algorithms::exchangeAllToAll(*link_, d, deadline, rank_, size_, d.dtype, in.data_ptr(),
                                 a.in.counts, a.in.offsets, out.data_ptr(), a.out.counts,
                                 a.out.offsets);
    if (!out.is_same(output)) output.copy_(out);
  };
  return executor_->submit(Collective{desc, results.tensors.vec(), {input, output}, transfer,
                                      finishOf(results), false, call.timeout},
                           call);
}

WorkPtr FusedEngine::runSend(const at::Tensor& tensor, int dst, int64_t tag,
                             const CallOptions& call) {
  auto work = p2p_->send(onHost(tensor), dst, tag, timeoutOf(call));
  if (!call.asyncOp) work->wait();
  return work;
}

WorkPtr FusedEngine::runRecv(const at::Tensor& buf, int src, int64_t tag, Results results,
                             const CallOptions& call) {
  static_assert(kAnySource == MessageLink::kAnySource);
  std::function<void()> finish = finishOf(results);
  const at::Tensor host = hostFor(buf);
  if (!host.is_same(buf)) {
    // The message reaches the device on the stream that was current at the
    // call, which the copy waits for, from whichever thread finishes the
    // receive.
    const c10::Stream stream =
        c10::impl::VirtualGuardImpl(buf.device().type()).getStream(buf.device());
    finish = [buf, host, stream, finish = std::move(finish)] {
      const c10::StreamGuard guard(stream);
      buf.copy_(host);
      finish();
    };
  }
  auto work = p2p_->recv(results.tensors[0], host, src, tag, timeoutOf(call), std::move(finish));
  if (!call.asyncOp) work->wait();
  return work;
}

void FusedEngine::runMonitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const Ms groupTimeout(options_.timeoutMs);
  const Ms timeout = opts.timeout == c10d::kUnsetTimeout ? groupTimeout : opts.timeout;
  monitored::barrier(*p2p_, rank_, size_, monitoredBarriers_++, timeout, groupTimeout,
                     waitAllRanks);
}

} // namespace pyddp
