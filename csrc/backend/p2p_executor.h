// P2pExecutor: runs an engine's point-to-point operations (send, recv) over
// its transport's MessageLink, beside its collectives: they are not
// numbered and do not wait for the collectives queued before them, as in
// ProcessGroupGloo. Every operation returns a Work at once. A progress
// thread moves messages while operations are pending (so an isend moves
// while its caller computes or waits in a collective); a thread that waits
// for a Work moves them itself, so a blocking send or recv costs no thread
// hand-off.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu_work.h"
#include "transport/transport.h"

namespace pyddp {

class P2pExecutor {
 public:
  // `link` stays alive until shutdown() returned.
  P2pExecutor(int rank, MessageLink& link);
  ~P2pExecutor();
  P2pExecutor(const P2pExecutor&) = delete;
  P2pExecutor& operator=(const P2pExecutor&) = delete;

  // `tensor` (contiguous) is sent to / received from `peer`; `keep` holds
  // tensors the operation reads or writes; `finish` runs once it succeeded
  // (copying a received message into a non-contiguous tensor). A receive's
  // `peer` may be MessageLink::kAnySource; its Work's sourceRank() is the
  // rank it took its message from.
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int peer, int64_t tag,
                                      std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& output, const at::Tensor& buffer,
                                      int peer, int64_t tag, std::chrono::milliseconds timeout,
                                      std::function<void()> finish);
  // Fails what is pending (the link tells the peers) and stops the thread.
  void shutdown(const std::string& why);

 private:
  struct Pending {
    uint64_t id;
    c10::intrusive_ptr<CpuWork> work;
    std::vector<at::Tensor> keep;
    std::function<void()> finish;
  };
  // What Works and the thread share; Works may outlive the executor.
  struct Core {
    std::mutex mu;
    std::condition_variable cv;
    MessageLink* link;  // mu; null once shut down
    std::vector<Pending> pending;  // mu
    bool stop = false;             // mu
  };

  c10::intrusive_ptr<c10d::Work> post(CollectiveKind kind, const std::string& what,
                                      uint64_t id, std::vector<at::Tensor> outputs,
                                      std::vector<at::Tensor> keep,
                                      std::function<void()> finish);
  // One step: moves messages and settles the Works whose operations
  // finished (their futures complete outside the lock, so callbacks may
  // wait for other operations). Returns whether anything moved.
  static bool drive(const std::shared_ptr<Core>& core);
  static void loop(std::shared_ptr<Core> core);

  const int rank_;
  std::shared_ptr<Core> core_;
  std::thread thread_;
};

} // namespace pyddp
