// RingBackend: pyddp's process group for CPU tensors, a c10d::Backend so it
// can also serve torch.distributed. It owns one transport (shm) and one
// worker thread that runs queued collectives in call order, as
// ProcessGroupGloo does; a synchronous call with nothing queued runs on the
// caller's thread instead, saving two thread hand-offs per small message.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "algorithms/collectives.h"
#include "backend/work.h"
#include "common/config.h"

namespace pyddp {

// pyddp's element type for a torch dtype; nullopt when unsupported.
std::optional<DataType> dataTypeOf(at::ScalarType t);

class RingBackend final : public c10d::Backend {
 public:
  // Blocks until every rank has connected (bounded by options.timeoutMs).
  RingBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
              const RingOptions& options);
  ~RingBackend() override;

  const std::string getBackendName() const override { return "pyddp"; }
  const RingOptions& options() const { return options_; }

  // One collective each; returns at once when asyncOp, else when done.
  c10::intrusive_ptr<c10d::Work> allReduce(const at::Tensor& tensor, RedOp op,
                                           bool asyncOp);
  c10::intrusive_ptr<c10d::Work> allGatherSingle(const at::Tensor& output,
                                                 const at::Tensor& input,
                                                 bool asyncOp);
  c10::intrusive_ptr<c10d::Work> allGatherList(const std::vector<at::Tensor>& outputs,
                                               const at::Tensor& input,
                                               bool asyncOp);
  c10::intrusive_ptr<c10d::Work> broadcastFrom(const at::Tensor& tensor, int src,
                                               bool asyncOp);
  c10::intrusive_ptr<c10d::Work> reduceScatterSingle(const at::Tensor& output,
                                                     const at::Tensor& input,
                                                     RedOp op, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> barrierAll(bool asyncOp);

  // Stops the worker; queued collectives fail, a running one finishes or
  // times out. Idempotent; the destructor calls it.
  void shutdown();

 private:
  using Body = std::function<void(const algorithms::Call&)>;
  struct Job {
    CollectiveDesc desc;
    Body body;
    c10::intrusive_ptr<RingWork> work;
  };

  c10::intrusive_ptr<c10d::Work> submit(CollectiveDesc desc, c10d::OpType type,
                                        std::vector<at::Tensor> outputs, Body body,
                                        bool asyncOp);
  void run(Job& job);
  void workerLoop();

  // Argument checks shared by every call; messages name rank and call.
  DataType checkTensor(const at::Tensor& t, const char* call, const char* what) const;
  void checkOp(RedOp op, DataType dtype, const char* call) const;
  kernels::ReduceSpec spec(DataType dtype, RedOp op) const;

  const RingOptions options_;
  std::unique_ptr<Transport> transport_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;    // guarded by mu_
  bool busy_ = false;        // a job is running (worker or caller); mu_
  bool stop_ = false;        // mu_
  uint64_t nextSeq_ = 1;     // mu_; assigned in call order
  // Set by the running job only (busy_ serialises jobs): the failure that
  // left the transport's counters out of step with the peers.
  std::string brokenBy_;
  std::thread worker_;
};

} // namespace pyddp
