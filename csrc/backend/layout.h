// Layout: where a group's ranks run, and so which engines serve which part
// of the group. Hosts are found at group creation: every rank publishes its
// host identity (common/host.h: hostname and boot id, or PYDDP_HOSTID)
// through the store, and every rank groups the same ranks alike.
//
//   one host                 flat: one engine over every rank (shm)
//   one rank on every host   cross-host: torch's gloo over every rank
//   several hosts, several   hierarchical: shm inside each host, gloo
//   ranks on some            between hosts (backend/hierarchical_engine.h)
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace pyddp {

struct HostMap {
  // Hosts are numbered by their lowest rank; ranks on a host ascend.
  std::vector<int> hostOf;                // rank -> host
  std::vector<std::vector<int>> ranksOn;  // host -> its ranks
  std::vector<std::string> names;         // host -> its identity

  int hosts() const { return static_cast<int>(ranksOn.size()); }
  // This rank's index among the ranks of its host.
  int localRank(int rank) const;
  // Every host has the same number of ranks.
  bool even() const;
  // "2 hosts: ranks 0,1 on a/..., ranks 2,3 on b/..."
  std::string describe() const;
};

// All-gathers every rank's host identity through `store` (under "hosts/").
HostMap exchangeHosts(c10d::Store& store, int rank, int size,
                      std::chrono::milliseconds timeout);

// Where a rank's CUDA tensors live: its GPU (the device's UUID, unique
// across hosts) and whether NVIDIA's MPS serves the process there (1, 0;
// -1 where the driver does not say, taken as not served).
struct GpuPlace {
  std::string uuid;
  int mps = -1;
};

// Why kernels of ranks that share a GPU do not run at the same time there:
// "" when no GPU serves two ranks, or MPS serves every rank on each that
// does. Without MPS the kernels of different processes take turns on a GPU
// (time slices), so a kernel that waits for a peer's kernel spins until
// the GPU switches processes.
std::string kernelsTakeTurns(const std::vector<GpuPlace>& places);

// All-gathers every rank's GpuPlace (`mine`) through `store` (under "gpus/").
std::vector<GpuPlace> exchangeGpus(c10d::Store& store, int rank, int size,
                                   const GpuPlace& mine, std::chrono::milliseconds timeout);

} // namespace pyddp
