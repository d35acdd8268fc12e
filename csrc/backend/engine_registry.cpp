#include "backend/engine_registry.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <string_view>

#include "backend/fused_engine.h"
#include "backend/layout.h"
#include "backend/transport_engine.h"
#include "common/check.h"
#include "transport/emulated_memory.h"
#include "transport/factory.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/nccl_engine.h"
#include "common/blob.h"
#include "common/cuda_device.h"
#include "transport/cuda_ipc.h"
#endif

namespace pyddp {
namespace {

enum class EngineKind { Ring, Nccl, Hierarchical, Fused };

// Channels of the emulated grid: a thread each per rank, on machines with
// few cores; more than one, so that channels run beside each other.
constexpr int kEmulatedChannels = 4;
// A GPU's: every channel a launch may use, and chunks of a size that keeps
// a channel's loads in flight (512 KiB: an initial value, not yet measured
// on pyddp's kernels). 64 MiB of buffer per rank.
constexpr device::Geometry kGpuGeometry{device::kMaxChannels, 512 * 1024};

struct Candidate {
  const char* backend;  // the user's name that selects it
  c10::DeviceType device;
  EngineKind engine;
  const char* transport;
};

// Candidates in order of preference. "auto" on the CPU: shared memory when
// every rank is on one host, else shm inside each host and gloo between
// hosts. "auto" on a CUDA device: GPU memory mapped between processes when
// every rank reaches every peer's memory (one host, peer access proven at
// connect) and no GPU that ranks share runs their kernels in turns (no MPS:
// kernelsTakeTurns); then the same programs on host threads over host
// memory, the CUDA tensors staged through it ("cuda_host", one host: no
// kernel waits for a peer); else NCCL. "emulated": the GPU's fused
// collectives run on the CPU (device/emulated_grid.h), for testing them
// without a GPU.
constexpr Candidate kCandidates[] = {
    {"shm", c10::kCPU, EngineKind::Ring, "shm"},
    {"emulated", c10::kCPU, EngineKind::Fused, "emulated"},
    {"auto", c10::kCPU, EngineKind::Ring, "shm"},
    {"auto", c10::kCPU, EngineKind::Hierarchical, "shm+gloo"},
    {"cuda_ipc", c10::kCUDA, EngineKind::Fused, "cuda_ipc"},
    {"cuda_ipc", c10::kCUDA, EngineKind::Fused, "cuda_host"},
    {"cuda_host", c10::kCUDA, EngineKind::Fused, "cuda_host"},
    {"nccl", c10::kCUDA, EngineKind::Nccl, "nccl"},
    {"nccl_ring", c10::kCUDA, EngineKind::Ring, "nccl"},
    {"auto", c10::kCUDA, EngineKind::Fused, "cuda_ipc"},
    {"auto", c10::kCUDA, EngineKind::Fused, "cuda_host"},
    {"auto", c10::kCUDA, EngineKind::Nccl, "nccl"},
};

bool waitsOnTheGpu(const Candidate& c) {
  return c.engine == EngineKind::Fused && c.device == c10::kCUDA &&
      std::string_view(c.transport) == "cuda_ipc";
}

// CUDA tensors whose fused programs run on host threads over shared
// memory: one host.
bool runsOnHost(const Candidate& c) {
  return c.engine == EngineKind::Fused && c.device == c10::kCUDA && !waitsOnTheGpu(c);
}

bool served(const Candidate& c) {
  // shm and torch's gloo
  if (c.engine == EngineKind::Hierarchical) return true;
  if (c.engine == EngineKind::Fused) {
#ifdef PYDDP_WITH_CUDA
    return true;
#else
    return c.device == c10::kCPU;  // the emulated grid
#endif
  }
  const auto names = transportNames();
  return std::find(names.begin(), names.end(), c.transport) != names.end();
}

std::string describe(const Candidate& c) {
  switch (c.engine) {
    case EngineKind::Nccl: return "NCCL's collectives";
    case EngineKind::Hierarchical: return "shm inside each host and gloo between hosts";
    case EngineKind::Fused: return std::string("pyddp's fused collectives over ") + c.transport;
    case EngineKind::Ring: break;
  }
  return std::string("pyddp's ring over ") + c.transport;
}

// Why a CPU candidate cannot serve ranks on `hosts`; "" when it can.
std::string whyNotHere(const Candidate& c, const HostMap& hosts, const CrossHostFactory& gloo) {
  if (c.engine == EngineKind::Hierarchical) {
    if (hosts.hosts() == 1) return "every rank runs on one host";
    if (!gloo) return "no engine between hosts was given";
    return "";
  }
  if (hosts.hosts() > 1) {
    return "the ranks span " + hosts.describe() + ", and shared memory serves one host";
  }
  return "";
}

c10::intrusive_ptr<Engine> make(const Candidate& c,
                                const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                int size, const GroupOptions& options, c10::Device device,
                                const HostMap& hosts, const CrossHostFactory& gloo) {
  if (c.engine == EngineKind::Ring) {
    return c10::make_intrusive<TransportEngine>(store, rank, size, options, device, c.transport);
  }
  if (c.engine == EngineKind::Hierarchical) {
    return c10::make_intrusive<HierarchicalEngine>(store, rank, size, options, hosts, gloo);
  }
  if (c.engine == EngineKind::Fused && (device.is_cpu() || !waitsOnTheGpu(c))) {
    // The emulated grid's geometry: a few channels, and chunks of the
    // options' slots, so that tests reach many rounds with small tensors.
    const device::Geometry geometry{kEmulatedChannels,
                                    roundUp(options.slotBytes, device::kLineBytes)};
    return c10::make_intrusive<FusedEngine>(
        store, rank, size, options, device,
        std::make_unique<EmulatedMemory>(rank, size, geometry, c.transport));
  }
#ifdef PYDDP_WITH_CUDA
  if (c.engine == EngineKind::Fused) {
    return c10::make_intrusive<FusedEngine>(
        store, rank, size, options, device,
        std::make_unique<CudaIpcMemory>(rank, size, kGpuGeometry, device.index()));
  }
#endif
#ifdef PYDDP_WITH_CUDA
  return c10::make_intrusive<NcclEngine>(store, rank, size,
                                         std::chrono::milliseconds(options.timeoutMs), device);
#else
  return nullptr;  // unreachable: a CPU-only build serves no NCCL candidate
#endif
}

#ifdef PYDDP_WITH_CUDA
// This process's GPU `device`: its UUID and whether MPS serves it there.
GpuPlace gpuPlaceOf(int device) {
  cudaDeviceProp prop{};
  checkCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int mps = 0;
  const bool said =
      cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) == cudaSuccess;
  cudaGetLastError();  // a driver that does not know the attribute
  return GpuPlace{"GPU-" + toHex(prop.uuid.bytes, sizeof(prop.uuid.bytes)),
                  said ? (mps != 0 ? 1 : 0) : -1};
}
#endif

} // namespace

std::vector<std::string> backendNames() {
  std::vector<std::string> names;
  for (const Candidate& c : kCandidates) {
    if (served(c) && std::find(names.begin(), names.end(), c.backend) == names.end()) {
      names.push_back(c.backend);
    }
  }
  return names;
}

std::vector<std::string> deviceTypesOf(const std::string& backend) {
  std::vector<std::string> types;
  for (const Candidate& c : kCandidates) {
    const std::string type = c10::DeviceTypeName(c.device, /*lower_case=*/true);
    if (c.backend == backend && served(c) &&
        std::find(types.begin(), types.end(), type) == types.end()) {
      types.push_back(type);
    }
  }
  return types;
}

EngineChoice makeEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        const GroupOptions& options, c10::Device device,
                        const std::string& backend, const CrossHostFactory& gloo) {
  // Checked before the first store wait, which would wait for a rank that never comes.
  options.validate();
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  const auto names = backendNames();
  PYDDP_CHECK_VALUE(std::find(names.begin(), names.end(), backend) != names.end(), "rank ",
                    rank, ": backend '", backend, "' is not available; this build has ",
                    c10::Join(", ", names));
#ifndef PYDDP_WITH_CUDA
  PYDDP_CHECK_TYPE(!device.is_cuda(), "rank ", rank, ": pyddp was built without CUDA, so it "
                   "has no transport for ", device, " tensors (rebuild against a CUDA build of "
                   "torch with nvcc installed)");
#endif
  std::vector<const Candidate*> candidates;
  for (const Candidate& c : kCandidates) {
    if (c.backend == backend && c.device == device.type() && served(c)) candidates.push_back(&c);
  }
  PYDDP_CHECK_TYPE(!candidates.empty(), "rank ", rank, ": backend '", backend, "' serves ",
                   c10::Join(" and ", deviceTypesOf(backend)), " tensors, not ", device.type());
  EngineChoice choice;
  const TransportArgs args{rank, size, options, device.is_cpu() ? -1 : device.index(), nullptr};
  // Where the ranks run decides among the CPU candidates, and whether the
  // fused programs may run on the host for CUDA tensors (shared memory).
  HostMap hosts;
  const bool onHostCandidate = std::any_of(candidates.begin(), candidates.end(),
                                           [](const Candidate* c) { return runsOnHost(*c); });
  if (device.is_cpu() || onHostCandidate) {
    hosts = exchangeHosts(*store, rank, size, std::chrono::milliseconds(options.timeoutMs));
  }
  if (device.is_cpu()) choice.layout = hosts.describe();
  // Whether kernels that wait for each other could run at once.
  std::string turns;
#ifdef PYDDP_WITH_CUDA
  if (std::any_of(candidates.begin(), candidates.end(),
                  [](const Candidate* c) { return waitsOnTheGpu(*c); })) {
    turns = kernelsTakeTurns(exchangeGpus(*store, rank, size, gpuPlaceOf(device.index()),
                                          std::chrono::milliseconds(options.timeoutMs)));
  }
#endif
  for (const Candidate* c : candidates) {
    const bool last = c == candidates.back();
    std::string why = device.is_cpu() || runsOnHost(*c) ? whyNotHere(*c, hosts, gloo) : "";
    if (why.empty() && waitsOnTheGpu(*c)) why = turns;
    if (why.empty() && c->engine != EngineKind::Hierarchical && c->engine != EngineKind::Fused) {
      why = whyNotTransport(c->transport, args);
    }
    if (why.empty() && c->engine == EngineKind::Fused && size > device::kMaxRanks) {
      why = std::string(c->transport) + " serves at most " + std::to_string(device::kMaxRanks) +
          " ranks, not " + std::to_string(size);
    }
    if (!why.empty()) {
      PYDDP_CHECK_VALUE(!last, "rank ", rank, ": backend '", backend, "': ", why,
                        backend == "shm" && hosts.hosts() > 1
                            ? ": use the backend 'auto', which runs shm inside each host and "
                              "gloo between hosts"
                            : "");
      choice.refusals.push_back(describe(*c) + ": " + why);
      continue;
    }
    const auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        std::string(c->engine == EngineKind::Nccl    ? "nccl"
                    : c->engine == EngineKind::Fused ? "fused"
                                                     : "ring") +
            "-" + c->transport,
        store);
    try {
      choice.engine = make(*c, prefixed, rank, size, options, device, hosts, gloo);
      trackEngine(choice.engine);
      if (c->engine == EngineKind::Hierarchical) {
        choice.layout = static_cast<HierarchicalEngine&>(*choice.engine).describeLayout();
      }
      return choice;
    } catch (const c10::DistBackendError& e) {
      // A refusal at connect, which bootstrap made every rank see alike.
      if (last) throw;
      choice.refusals.push_back(describe(*c) + ": " + messageOf(e));
    }
  }
  return choice;  // unreachable: the last candidate returned or threw
}

} // namespace pyddp
