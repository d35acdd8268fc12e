#include "backend/p2p_executor.h"

#include <pthread.h>

#include "backend/torch_types.h"
#include "common/check.h"
#include "common/process_state.h"
#include "transport/wait_policy.h"

namespace pyddp {
namespace {

std::exception_ptr commError(const std::string& why) {
  return std::make_exception_ptr(c10::DistBackendError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "pyddp: " + why));
}

Clock::time_point deadlineAfter(std::chrono::milliseconds timeout) {
  return Clock::now() + timeout;
}

} // namespace

P2pExecutor::P2pExecutor(int rank, MessageLink& link)
    : rank_(rank), core_(std::make_shared<Core>()) {
  core_->link = &link;
  thread_ = std::thread(loop, core_);
}

P2pExecutor::~P2pExecutor() {
  shutdown(teardownReason(rank_, ""));
}

void P2pExecutor::shutdown(const std::string& why) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (core_->stop) return;
    core_->stop = true;
    if (core_->link) core_->link->abort(why);
    core_->link = nullptr;
    failed.swap(core_->pending);
  }
  core_->cv.notify_all();
  for (auto& p : failed) p.work->fail(commError(why));
  if (thread_.joinable()) thread_.join();
}

bool P2pExecutor::drive(const std::shared_ptr<Core>& core) {
  std::vector<Pending> done;
  std::vector<std::string> why;
  std::vector<int> sources;
  bool moved = false;
  {
    std::lock_guard<std::mutex> lock(core->mu);
    if (!core->link) return false;
    moved = core->link->progress();
    for (size_t i = 0; i < core->pending.size();) {
      std::string error;
      const auto state = core->link->poll(core->pending[i].id, &error);
      if (state == MessageLink::State::Pending) {
        ++i;
        continue;
      }
      sources.push_back(core->link->sourceOf(core->pending[i].id));
      core->link->release(core->pending[i].id);
      why.push_back(state == MessageLink::State::Failed ? error : "");
      done.push_back(std::move(core->pending[i]));
      core->pending.erase(core->pending.begin() + static_cast<std::ptrdiff_t>(i));
      moved = true;
    }
    // A waiter's drive may have left the link busy with nothing pending:
    // the thread takes over.
    if (core->pending.empty() && core->link->busy()) core->cv.notify_all();
  }
  for (size_t i = 0; i < done.size(); ++i) {
    if (!why[i].empty()) {
      done[i].work->fail(commError(why[i]));
      continue;
    }
    done[i].work->setSourceRank(sources[i]);
    try {
      if (done[i].finish) done[i].finish();
    } catch (const std::exception&) {
      done[i].work->fail(std::current_exception());
      continue;
    }
    done[i].work->complete();
  }
  return moved;
}

void P2pExecutor::loop(std::shared_ptr<Core> core) {
  pthread_setname_np(pthread_self(), "pyddp-p2p");
  process::markOwnThread();
  Backoff backoff;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(core->mu);
      const auto busy = [&] {
        return !core->pending.empty() || (core->link && core->link->busy());
      };
      const bool idle = !busy();
      core->cv.wait(lock, [&] { return core->stop || busy(); });
      if (core->stop) return;
      if (idle) backoff.restart();
    }
    if (drive(core)) {
      backoff.restart();
    } else {
      backoff.pause();
    }
  }
}

c10::intrusive_ptr<c10d::Work> P2pExecutor::post(CollectiveKind kind, const std::string& what,
                                                 uint64_t id, std::vector<at::Tensor> outputs,
                                                 std::vector<at::Tensor> keep,
                                                 std::function<void()> finish) {
  std::weak_ptr<Core> weak = core_;
  auto work = c10::make_intrusive<CpuWork>(
      rank_, kind, std::move(outputs), std::thread::id(),
      [weak] {
        const auto core = weak.lock();
        return core ? drive(core) : false;
      },
      what,
      // An interrupted waiter gives up on this operation only; the next
      // drive() settles its Work.
      [weak, id](const std::string& why) {
        const auto core = weak.lock();
        if (!core) return;
        std::lock_guard<std::mutex> lock(core->mu);
        if (core->link) core->link->cancel(id, why);
      });
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->pending.push_back(Pending{id, work, std::move(keep), std::move(finish)});
  }
  core_->cv.notify_all();
  return work;
}

c10::intrusive_ptr<c10d::Work> P2pExecutor::send(const at::Tensor& tensor, int peer, int64_t tag,
                                                 std::chrono::milliseconds timeout) {
  const auto dtype = dataTypeOf(tensor.scalar_type());
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    PYDDP_CHECK(core_->link != nullptr, "rank ", rank_, ": send on a process group that was "
                "destroyed");
    id = core_->link->postSend(peer, tag, *dtype, tensor.data_ptr(), tensor.nbytes(),
                               deadlineAfter(timeout));
  }
  return post(CollectiveKind::Send, c10::str("send to rank ", peer, " (tag ", tag, ")"), id, {},
              {tensor}, nullptr);
}

c10::intrusive_ptr<c10d::Work> P2pExecutor::recv(const at::Tensor& output,
                                                 const at::Tensor& buffer, int peer, int64_t tag,
                                                 std::chrono::milliseconds timeout,
                                                 std::function<void()> finish) {
  const auto dtype = dataTypeOf(buffer.scalar_type());
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    PYDDP_CHECK(core_->link != nullptr, "rank ", rank_, ": recv on a process group that was "
                "destroyed");
    id = core_->link->postRecv(peer, tag, *dtype, buffer.data_ptr(), buffer.nbytes(),
                               deadlineAfter(timeout));
  }
  const std::string from =
      peer == MessageLink::kAnySource ? "any rank" : c10::str("rank ", peer);
  return post(CollectiveKind::Recv, c10::str("recv from ", from, " (tag ", tag, ")"), id,
              {output}, {output, buffer}, std::move(finish));
}

} // namespace pyddp
