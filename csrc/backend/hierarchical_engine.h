// HierarchicalEngine: a CPU group whose ranks span hosts (backend/layout.h),
// composed of engines that exist: pyddp's shm engine inside each host and
// torch's gloo between hosts. pyddp writes no network transport.
//
// Layouts (chosen from the host map, the same on every rank):
//   Even      every host has K > 1 ranks. all_reduce = reduce-scatter of
//             the tensor (padded to K shards) inside each host, all-reduce
//             of each shard across hosts among the ranks holding it (one
//             gloo group per local rank, so every rank's link is busy at
//             once), all-gather of the shards inside each host. all_gather
//             and broadcast compose the same way.
//   Leaders   hosts have different numbers of ranks: reduce to each host's
//             leader (its lowest rank), all-reduce among the leaders, and
//             broadcast from the leader inside each host.
//   Gloo      one rank on every host: gloo alone.
// Every other operation (reduce, gather, scatter, all-to-all, point-to-
// point, reduce-scatter in the Leaders and Gloo layouts) goes to a gloo
// group of every rank, where composing does not pay.
//
// Agreement: before each collective, its descriptor's words are MAX-
// reduced inside the host (shm) and across hosts (gloo), so a mismatch
// anywhere fails every rank. Failure: a rank whose collective failed
// publishes why under the group's store; ranks waiting in gloo look at it
// while they wait, so a rank dead on another host is named within
// milliseconds of its host's peers noticing, and at worst at the timeout.
//
// Results are identical on every rank: each element is reduced once, in a
// fixed order for a given placement (inside a host in ring order, across
// hosts in gloo's), and every rank copies the same bits. They may differ
// in the last bits of floating-point sums from a one-host run's order.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "backend/engine.h"
#include "backend/layout.h"
#include "common/config.h"
#include "common/descriptor.h"

namespace pyddp {

class CpuExecutor;
class TransportEngine;

// Makes a gloo group of `size` ranks on `store` (torch's ProcessGroupGloo,
// which this extension cannot construct itself: gloo's headers do not ship
// with torch).
using CrossHostFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout)>;

class HierarchicalEngine final : public Engine {
 public:
  enum class Shape { Even, Leaders, Gloo };

  // Blocks until every group of the composition is connected.
  HierarchicalEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     const GroupOptions& options, const HostMap& hosts,
                     const CrossHostFactory& gloo);
  ~HierarchicalEngine() override;

  const std::string getBackendName() const override { return "pyddp"; }
  Shape shape() const { return shape_; }
  // "hierarchical (2 hosts x 2 ranks: ...)" for the log.
  std::string describeLayout() const;

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
  // gloo's own, on the group of every rank.
  void runMonitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  void shutDown(Teardown how) override;

 private:
  // One composed collective: `run` does its steps on the executor's thread,
  // then the executor finishes `results`.
  WorkPtr submit(const CollectiveDesc& desc, Results& results, std::vector<at::Tensor> uses,
                 std::function<void()> run, const CallOptions& call);
  // Every rank called the same collective (local, then across hosts).
  void agree(const CollectiveDesc& desc);
  // Waits for a gloo Work, failing at once when a rank published why it
  // gave up, and at `deadline` naming the ranks of `group`.
  void await(const WorkPtr& work, const char* what, const std::vector<int>& group);
  // The steps, on contiguous buffers; op is never AVG (the caller divides).
  void allReduceSteps(const at::Tensor& buf, RedOp op);
  void allGatherSteps(const at::Tensor& out, const at::Tensor& in);
  void broadcastSteps(const at::Tensor& buf, int src);
  // Flat-gloo collectives on the executor, for what does not compose.
  WorkPtr onFlat(const CollectiveDesc& desc, Results& results, std::vector<at::Tensor> uses,
                 std::function<WorkPtr(c10d::Backend&)> call, const CallOptions& options);
  [[noreturn]] void failed(const std::string& why);
  // Runs and waits for a collective of this host's shm engine; its errors
  // name the group's ranks (that engine numbers this host's ranks from 0).
  void local(const std::function<WorkPtr()>& start);
  std::string translate(const std::string& localMessage) const;

  const GroupOptions options_;
  const HostMap hosts_;
  const c10::intrusive_ptr<c10d::Store> store_;
  const int host_;
  const int local_;
  const int localSize_;
  Shape shape_;
  // The engines of the composition. localEngine_ spans this host's ranks;
  // cross_ the ranks with this local rank on every host (Even) or the host
  // leaders (Leaders, only on leaders); flat_ every rank.
  c10::intrusive_ptr<TransportEngine> localEngine_;
  c10::intrusive_ptr<c10d::Backend> cross_;
  std::vector<int> crossRanks_;  // cross_'s members, by their rank in it
  c10::intrusive_ptr<c10d::Backend> flat_;
  std::unique_ptr<CpuExecutor> executor_;
  Clock::time_point deadline_;  // of the collective running on the executor
  // Set by shutDown(): a wait in gloo gives up at once instead of at its
  // deadline (gloo's own wait cannot be interrupted).
  std::atomic<bool> stopping_{false};
};

} // namespace pyddp
