#include "backend/device_executor.h"

#include <thread>

#include "common/check.h"
#include "common/cuda_device.h"

namespace pyddp {
namespace {

// How often retire() looks whether the stream has drained.
constexpr auto kDrainPoll = std::chrono::microseconds(200);

} // namespace

DeviceExecutor::DeviceExecutor(int rank, c10::Device device, std::chrono::milliseconds timeout)
    : rank_(rank), device_(device), timeout_(timeout), stream_(device) {}

DeviceExecutor::~DeviceExecutor() {
  shutdown(Teardown::Destroyed);
}

void DeviceExecutor::shutdown(Teardown how) {
  // An abort fails the group first, so that peers' kernels waiting on
  // this rank exit and the peers read the abort as the reason.
  if (how == Teardown::Aborted && monitor_ && !stopped_.load() && hooks_.onFailure) {
    hooks_.onFailure(c10::str("rank ", rank_, " aborted its process group"));
  }
  stop(c10::str("the process group was ", pastTense(how)));
}

void DeviceExecutor::start(Hooks hooks) {
  hooks_ = std::move(hooks);
  monitor_ = std::make_unique<gpu::WorkMonitor>(rank_, device_.index(), hooks_.poll,
                                                hooks_.onFailure);
}

bool DeviceExecutor::stop(const std::string& why) {
  if (stopped_.exchange(true) || !monitor_) return false;
  return monitor_->stop(c10::str("rank ", rank_, ": ", why));
}

bool DeviceExecutor::drain(Clock::time_point deadline) const {
  QuietDeviceGuard guard(device_.index());
  while (cudaStreamQuery(stream()) == cudaErrorNotReady) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kDrainPoll);
  }
  return true;
}

void DeviceExecutor::retire(
    const std::function<void(const CollectiveDesc& desc, Deadline deadline)>& meet) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!monitor_ || !monitor_->failure().empty()) return;  // the abort path ends it
  const Deadline deadline = Deadline::after(timeout_);
  if (!drain(deadline)) return;
  CollectiveDesc desc;  // a barrier
  desc.kind = CollectiveKind::Barrier;
  desc.dtype = DataType::UInt8;
  desc.seq = nextSeq_++;  // every rank ran the same collectives: the same number
  meet(desc, deadline);
}

c10::intrusive_ptr<c10d::Work> DeviceExecutor::submit(Collective c, const CallOptions& call) {
  c10::intrusive_ptr<gpu::CudaWork> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    PYDDP_CHECK(monitor_ != nullptr && !stopped_.load(), "rank ", rank_, ": ",
                toString(c.desc.kind), " on a process group that ",
                monitor_ ? "was destroyed" : "has not connected");
    c.desc.seq = nextSeq_++;
    ++issued_;
    const std::string what = c10::str(toString(c.desc.kind), " #", c.desc.seq);
    const std::string failure = monitor_->failure();
    PYDDP_CHECK_COMM(failure.empty(), "rank ", rank_, ": ", what, " refused: an earlier "
                     "collective failed and left the process group unusable (", failure,
                     "); destroy it and create a new one");
    Transport* transport = hooks_.transport;
    if (transport) {
      // Flag targets are fixed at enqueue: a replayed CUDA graph would wait
      // on stale ones.
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      checkCuda(cudaStreamIsCapturing(
                    c10::cuda::getCurrentCUDAStream(device_.index()).stream(), &capturing),
                "cudaStreamIsCapturing");
      PYDDP_CHECK_VALUE(capturing == cudaStreamCaptureStatusNone, "rank ", rank_, ": ", what,
                        ": pyddp's ", transport->name(), " transport cannot be captured in a "
                        "CUDA graph");
    }
    work = c10::make_intrusive<gpu::CudaWork>(rank_, c.desc.kind, what, device_, c.outputs,
                                              c.hostBlocking, hooks_.deviceCheck);
    {
      // Enqueue behind the caller's stream; the transfer and the copies of
      // finish() run on the internal stream.
      gpu::StreamScope scope(stream_);
      for (const auto& t : c.outputs) scope.use(t);
      for (const auto& t : c.uses) scope.use(t);
      try {
        c.transfer(c.desc, Deadline::after(c.timeout.count() > 0 ? c.timeout : timeout_));
        if (transport) transport->flush();
        c.finish();
      } catch (const std::exception& e) {
        // Some of its work may be on the stream already: this rank is out of
        // step with its peers, and its queued waits can end only once they
        // stop. So abandon first (peers see this rank's failed flag and give
        // up, and their failed flags end this rank's waits), then drain:
        // draining first would wait, until the timeout, for pieces that never
        // come. Earlier collectives still in flight may fail with it; the
        // group is unusable from here anyway.
        const std::string why = c10::str("rank ", rank_, ": ", what, " failed: ", messageOf(e));
        if (transport) {
          transport->abandon(why);
          drain(Clock::now() + timeout_);
        }
        monitor_->fail(why);
        throw;
      }
      work->enqueued(stream_.stream());
    }
    monitor_->watch(work, c.timeout.count() > 0 ? c.timeout : timeout_);
  }
  if (!call.asyncOp) work->wait();
  return work;
}

} // namespace pyddp
