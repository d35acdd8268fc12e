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

} // namespace pyddp
