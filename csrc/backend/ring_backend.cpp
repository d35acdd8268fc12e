#include "backend/ring_backend.h"

#include <pthread.h>

#include <cstring>

#include "common/check.h"
#include "transport/shm.h"

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

// A bootstrap blob starts with one of these: the transport's blob follows,
// or why this rank could not set its transport up.
constexpr const char* kBlobOk = "+";
constexpr const char* kBlobFailed = "!";

// How often a device-mode shutdown looks whether the stream has drained.
constexpr auto kDrainPoll = std::chrono::microseconds(200);

// All-gathers one string per rank through the store. A rank that never
// publishes its key is named in the error.
std::vector<std::string> exchange(c10d::Store& store, const std::string& key,
                                  const std::string& mine, int rank, int size,
                                  Ms timeout) {
  store.set(key + "/" + std::to_string(rank),
            std::vector<uint8_t>(mine.begin(), mine.end()));
  const auto deadline = Clock::now() + timeout;
  std::vector<std::string> all(size);
  for (int peer = 0; peer < size; ++peer) {
    const std::string k = key + "/" + std::to_string(peer);
    const auto left = std::max(
        Ms(1), std::chrono::duration_cast<Ms>(deadline - Clock::now()));
    try {
      store.wait({k}, left);
    } catch (const std::exception& e) {
      PYDDP_CHECK_COMM(false, "rank ", peer, " did not join the process group within ",
                       timeout.count(), " ms (rank ", rank, " waited for store key '",
                       k, "'): ", messageOf(e));
    }
    const std::vector<uint8_t> v = store.get(k);
    all[peer].assign(v.begin(), v.end());
  }
  return all;
}

// A tensor to compute in: the tensor itself when contiguous, else a
// contiguous copy whose result copyBack() writes into the original.
at::Tensor dense(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}
void copyBack(const at::Tensor& original, const at::Tensor& computed) {
  if (!original.is_same(computed)) original.copy_(computed);
}

std::vector<at::Tensor> withInput(std::vector<at::Tensor> tensors, const at::Tensor& input) {
  tensors.push_back(input);
  return tensors;
}

CollectiveDesc makeDesc(CollectiveKind kind, size_t count, DataType dtype,
                        RedOp op = RedOp::Sum, int root = -1,
                        Algo algo = Algo::Ring) {
  CollectiveDesc d;
  d.kind = kind;
  d.count = count;
  d.dtype = dtype;
  d.op = op;
  d.root = root;
  d.algo = static_cast<int32_t>(algo);
  return d;
}

} // namespace


RingBackend::RingBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                         int size, const RingOptions& options, c10::Device device,
                         const std::string& transport)
    : c10d::Backend(rank, size),
      options_(options),
      device_(device),
      checks_(rank, size, device, "this group's transport") {
  options_.validate();
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  PYDDP_CHECK_VALUE(device.is_cpu() || (device.is_cuda() && device.has_index()), "rank ", rank,
                    ": RingBackend serves the CPU or one CUDA device (cuda:N), not ", device);
  const Ms timeout(options_.timeoutMs);
  // Wait for every rank before creating anything: a rank killed while
  // others are still missing leaves no shared memory behind.
  exchange(*store, "shm/hello", "", rank, size, timeout);
  // phase 1: publish what peers need to reach us (or why we cannot be
  // reached), learn theirs
  std::string blob;
  std::exception_ptr ownFailure;
  try {
    transport_ = makeTransport(transport);
    blob = kBlobOk + transport_->setup();
  } catch (const std::exception& e) {
    blob = kBlobFailed + messageOf(e);
    ownFailure = std::current_exception();
  }
  auto blobs = exchange(*store, "shm/blob", blob, rank, size, timeout);
  if (ownFailure) std::rethrow_exception(ownFailure);
  for (int peer = 0; peer < size; ++peer) {
    PYDDP_CHECK_COMM(blobs[peer].rfind(kBlobOk, 0) == 0, "rank ", rank, ": rank ", peer,
                     " could not set up its transport for ", device_, ": ",
                     blobs[peer].substr(std::strlen(kBlobFailed)));
    blobs[peer].erase(0, std::strlen(kBlobOk));
  }
  // phase 2: reach every peer, and tell every peer whether we could: a
  // refusal (another host, no peer access) fails every rank alike
  std::string refusal;
  std::exception_ptr ownRefusal;
  try {
    transport_->connect(blobs);
  } catch (const std::exception& e) {
    refusal = messageOf(e);
    ownRefusal = std::current_exception();
  }
  const auto refusals = exchange(*store, "shm/connected", refusal, rank, size, timeout);
  if (ownRefusal) std::rethrow_exception(ownRefusal);
  for (int peer = 0; peer < size; ++peer) {
    PYDDP_CHECK_COMM(refusals[peer].empty(), "rank ", rank, ": the ", transport_->name(),
                     " transport cannot connect: rank ", peer, " refused (",
                     refusals[peer], ")");
  }
  transport_->connected();
  if (device_.is_cuda()) {
    startMonitor();
    return;  // device collectives run on the caller's thread
  }
  worker_ = std::thread(workerLoop, exec_, this);
  exec_->workerId = worker_.get_id();
}

void RingBackend::retireDevice() {
#ifdef PYDDP_WITH_CUDA
  std::lock_guard<std::mutex> lock(deviceMu_);
  if (!brokenBy_.empty() || !monitor_->failure().empty()) return;  // the abort path ends it
  // A clean end: collectives already queued complete (as a destroy after
  // dist.all_reduce(t) expects), then every rank meets every other, so no
  // peer still reads this rank's buffer when it is freed. Bounded by the
  // timeout; on failure the abort that follows ends what is left.
  const auto deadline = Clock::now() + Ms(options_.timeoutMs);
  if (!drainDevice(deadline) || !ipc_) return;  // NCCL owns its buffers
  CollectiveDesc retire = makeDesc(CollectiveKind::Barrier, 0, DataType::UInt8);
  retire.seq = nextSeq_++;  // every rank ran the same collectives: the same number
  try {
    transport_->enter(retire, deadline);
  } catch (const std::exception&) {
    // A peer that never comes (it failed, or was destroyed without its
    // collectives) is the abort path's to handle.
  }
#endif
}

std::unique_ptr<Transport> RingBackend::makeTransport(const std::string& name) {
  const std::string chosen = name.empty() ? (device_.is_cpu() ? "shm" : "cuda_ipc") : name;
  if (device_.is_cpu()) {
    PYDDP_CHECK_VALUE(chosen == "shm", "rank ", rank_, ": CPU tensors travel over shm, not ",
                      chosen);
    return std::make_unique<shm::ShmTransport>(rank_, size_, options_);
  }
#ifdef PYDDP_WITH_CUDA
  PYDDP_CHECK_VALUE(chosen == "cuda_ipc" || chosen == "nccl", "rank ", rank_, ": ", device_,
                    " tensors travel over cuda_ipc or nccl, not ", chosen);
  stream_ = std::make_unique<gpu::CollectiveStream>(device_);
  if (chosen == "nccl") {
    return std::make_unique<nccl::NcclTransport>(rank_, size_, device_.index(),
                                                 stream_->stream().stream(), options_.slotBytes,
                                                 Ms(options_.timeoutMs));
  }
  auto ipc = std::make_unique<ipc::CudaIpcTransport>(rank_, size_, options_, device_.index(),
                                                     stream_->stream().stream());
  ipc_ = ipc.get();
  return ipc;
#else
  PYDDP_CHECK_TYPE(false, "rank ", rank_, ": pyddp was built without CUDA, so it has no "
                   "transport for ", device_, " tensors (rebuild against a CUDA build of torch "
                   "with nvcc installed)");
  return nullptr;
#endif
}

bool RingBackend::drainDevice(Clock::time_point deadline) const {
#ifdef PYDDP_WITH_CUDA
  QuietDeviceGuard guard(device_.index());
  while (cudaStreamQuery(stream_->stream().stream()) == cudaErrorNotReady) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kDrainPoll);
  }
#endif
  return true;
}

void RingBackend::startMonitor() {
#ifdef PYDDP_WITH_CUDA
  monitor_ = std::make_unique<gpu::WorkMonitor>(
      // cuda_ipc reports device waits that gave up and dead peers; NCCL's
      // hangs end at the deadline.
      rank_, device_.index(), [this] { return ipc_ ? ipc_->asyncError() : std::string(); },
      // Waits of kernels still queued end at once instead of at their timeout.
      [this](const std::string&) { transport_->abort(); });
#endif
}

RingBackend::~RingBackend() {
  shutdown();
}

void RingBackend::shutdown() {
  // The first caller does the work; a concurrent or later one returns (a
  // callback on the worker must not wait for a caller joining the worker).
  if (shutDown_.exchange(true)) return;
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(exec_->mu);
    exec_->stop = true;
    dropped.swap(exec_->queue);
  }
  exec_->cv.notify_all();
#ifdef PYDDP_WITH_CUDA
  if (monitor_) {
    retireDevice();
    monitor_->stop(c10::str("rank ", rank_, ": the process group was destroyed"));
  }
#endif
  if (transport_) transport_->abort();
  for (Job& job : dropped) {
    job.work->fail(std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        c10::str("pyddp: rank ", rank_, ": the process group was destroyed before this ",
                 toString(job.desc.kind), " ran"))));
  }
  if (!worker_.joinable()) return;
  if (std::this_thread::get_id() == worker_.get_id()) {
    // Destroyed from a future callback: the worker leaves its loop once the
    // callback returns, touching only the shared Executor.
    worker_.detach();
  } else {
    worker_.join();
  }
}

namespace {
// Marks the executor busy for one job, whatever the job throws. Only a
// queued job waits for `busy` to clear: waking the idle worker after every
// inline call would cost two context switches per small collective.
template <typename Executor>
class BusyScope {
 public:
  BusyScope(std::unique_lock<std::mutex>& lock, Executor& exec) : lock_(lock), exec_(exec) {
    exec_.busy = true;
    lock_.unlock();
  }
  ~BusyScope() {
    lock_.lock();
    exec_.busy = false;
    if (!exec_.queue.empty()) exec_.cv.notify_all();
  }

 private:
  std::unique_lock<std::mutex>& lock_;
  Executor& exec_;
};
} // namespace

void RingBackend::workerLoop(std::shared_ptr<Executor> exec, RingBackend* backend) {
  pthread_setname_np(pthread_self(), "pyddp-worker");
  std::unique_lock<std::mutex> lock(exec->mu);
  while (true) {
    exec->cv.wait(lock, [&] { return exec->stop || (!exec->queue.empty() && !exec->busy); });
    if (exec->stop) return;
    Job job = std::move(exec->queue.front());
    exec->queue.pop_front();
    BusyScope busy(lock, *exec);
    backend->run(job);  // `backend` may be gone once this returns
  }
}

c10::intrusive_ptr<c10d::Work> RingBackend::submit(CollectiveDesc desc,
                                                   std::vector<at::Tensor> outputs,
                                                   std::vector<at::Tensor> uses,
                                                   Transfer transfer, Finish finish,
                                                   bool asyncOp) {
  if (device_.is_cuda()) {
    return submitToDevice(desc, std::move(outputs), uses, transfer, finish, asyncOp);
  }
  std::unique_lock<std::mutex> lock(exec_->mu);
  PYDDP_CHECK(!exec_->stop, "rank ", rank_, ": ", toString(desc.kind),
              " on a process group that was destroyed");
  auto work = c10::make_intrusive<RingWork>(rank_, desc.kind, std::move(outputs),
                                            exec_->workerId);
  Job job{desc, std::move(transfer), std::move(finish), work};
  if (!asyncOp && std::this_thread::get_id() == exec_->workerId) {
    // A future callback (on the worker, inside the job that just finished
    // its transfer) waits for this call: queueing it would deadlock.
    lock.unlock();
    run(job);
    return work;
  }
  if (!asyncOp && exec_->queue.empty() && !exec_->busy) {
    // Nothing is ahead of this call: run it here, keeping call order.
    BusyScope busy(lock, *exec_);
    run(job);
    return work;
  }
  exec_->queue.push_back(std::move(job));
  exec_->cv.notify_all();
  return work;
}

void RingBackend::run(Job& job) {
  job.desc.seq = nextSeq_++;
  job.work->started(job.desc.seq);
  try {
    PYDDP_CHECK_COMM(brokenBy_.empty(), "rank ", rank_, ": ", toString(job.desc.kind),
                     " #", job.desc.seq, " refused: an earlier collective failed and "
                     "left the process group unusable (", brokenBy_,
                     "); destroy it and create a new one");
    const algorithms::Call call{*transport_, job.desc,
                                Clock::now() + Ms(options_.timeoutMs), rank_, size_};
    try {
      job.transfer(call);
    } catch (const std::exception& e) {
      brokenBy_ = messageOf(e);
      transport_->abandon(brokenBy_);
      throw;
    }
    job.finish();
  } catch (const std::exception&) {
    job.work->fail(std::current_exception());
    return;
  }
  job.work->complete();
}

c10::intrusive_ptr<c10d::Work> RingBackend::submitToDevice(
    CollectiveDesc desc, std::vector<at::Tensor> outputs, const std::vector<at::Tensor>& uses,
    const Transfer& transfer, const Finish& finish, bool asyncOp) {
#ifdef PYDDP_WITH_CUDA
  std::lock_guard<std::mutex> lock(deviceMu_);
  PYDDP_CHECK(!shutDown_.load(), "rank ", rank_, ": ", toString(desc.kind),
              " on a process group that was destroyed");
  desc.seq = nextSeq_++;
  const std::string what = c10::str(toString(desc.kind), " #", desc.seq);
  const std::string failure = brokenBy_.empty() ? monitor_->failure() : brokenBy_;
  PYDDP_CHECK_COMM(failure.empty(), "rank ", rank_, ": ", what, " refused: an earlier "
                   "collective failed and left the process group unusable (", failure,
                   "); destroy it and create a new one");
  // Flag targets are fixed at enqueue: a replayed CUDA graph would wait on
  // stale ones.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  checkCuda(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device_.index()).stream(),
                                       &capturing),
                 "cudaStreamIsCapturing");
  PYDDP_CHECK_VALUE(capturing == cudaStreamCaptureStatusNone, "rank ", rank_, ": ", what,
                    ": pyddp's ", transport_->name(), " transport cannot be captured in a "
                    "CUDA graph");
  auto work = c10::make_intrusive<gpu::CudaWork>(
      rank_, desc.kind, what, device_, outputs,
      /*hostBlocking=*/desc.kind == CollectiveKind::Barrier,
      ipc_ ? ipc_->deviceErrorProbe() : nullptr);
  {
    // Enqueue behind the caller's stream; the transport's verbs run on the
    // internal stream, and so do the copies of finish().
    gpu::StreamScope scope(*stream_);
    for (const auto& t : outputs) scope.use(t);
    for (const auto& t : uses) scope.use(t);
    const algorithms::Call call{*transport_, desc, Clock::now() + Ms(options_.timeoutMs), rank_,
                                size_};
    try {
      transfer(call);
      transport_->flush();
      finish();
    } catch (const std::exception& e) {
      // Some verbs may be on the stream already: this rank is out of step.
      // Earlier collectives, correctly queued, finish first (bounded), so
      // that the abort below ends only this one's waits.
      brokenBy_ = messageOf(e);
      drainDevice(Clock::now() + Ms(options_.timeoutMs));
      transport_->abandon(brokenBy_);
      monitor_->fail(brokenBy_);
      throw;
    }
    work->enqueued(stream_->stream());
  }
  monitor_->watch(work, Ms(options_.timeoutMs));
  if (!asyncOp) work->synchronize();
  return work;
#else
  PYDDP_CHECK(false, "unreachable: a device RingBackend in a build without CUDA");
  return {};
#endif
}






kernels::ReduceSpec RingBackend::spec(DataType dtype, RedOp op) const {
  return kernels::ReduceSpec{dtype, op, size_};
}

c10::intrusive_ptr<c10d::Work> RingBackend::allReduce(const at::Tensor& tensor,
                                                      RedOp op, bool asyncOp) {
  return reduceTo(tensor, op, -1, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::reduceTo(const at::Tensor& tensor, RedOp op,
                                                     int root, bool asyncOp) {
  const char* call = root < 0 ? "all_reduce" : "reduce";
  const DataType dtype = checks_.tensor(tensor, call, "tensor");
  checks_.writable(tensor, call, "tensor");
  checks_.op(op, dtype, call);
  if (root >= 0) checks_.root(root, call, "dst");
  const size_t count = tensor.numel();
  const size_t bytes = count * elementSize(dtype);
  // Transports without mapped peer memory (NCCL) run every size on the ring.
  const Algo algo = transport_->peerMemory() ? options_.allReduceAlgo(bytes) : Algo::Ring;
  const auto s = spec(dtype, op);
  // A reduce is an all-reduce whose result only the root keeps: the other
  // ranks compute into a copy and leave their tensor as it was.
  const bool keep = root < 0 || root == rank_;
  at::Tensor buf = keep ? dense(tensor) : tensor.contiguous().clone();
  return submit(
      makeDesc(root < 0 ? CollectiveKind::AllReduce : CollectiveKind::Reduce, count, dtype,
               op, root, algo),
      {tensor}, {buf},
      [=, this](const algorithms::Call& c) {
        void* data = buf.data_ptr();
        switch (algo) {
          case Algo::Direct:
            algorithms::directAllReduce(c, *transport_->peerMemory(), s, data, data, count);
            break;
          case Algo::TwoShot:
            algorithms::twoShotAllReduce(c, *transport_->peerMemory(), s, data, data, count);
            break;
          default:
            algorithms::ringAllReduce(c, s, data, data, count);
        }
      },
      [=] {
        if (keep) copyBack(tensor, buf);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::allGatherSingle(const at::Tensor& output,
                                                            const at::Tensor& input,
                                                            bool asyncOp) {
  const DataType dtype = checks_.single("all_gather_single", output, input, /*outputIsWhole=*/true);
  const size_t count = input.numel();
  const at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const size_t es = elementSize(dtype);
  return submit(
      makeDesc(CollectiveKind::AllGather, count, dtype), {output}, {in, out},
      [=, this](const algorithms::Call& c) {
        std::vector<void*> blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<char*>(out.data_ptr()) + b * count * es;
        }
        algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
      },
      [=] { copyBack(output, out); }, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::allGatherList(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input, bool asyncOp) {
  return gatherTo(outputs, input, -1, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::gatherTo(const std::vector<at::Tensor>& outputs,
                                                     const at::Tensor& input, int root,
                                                     bool asyncOp) {
  const char* call = root < 0 ? "all_gather" : "gather";
  // The output list's name in torch.distributed's signature.
  const char* list = root < 0 ? "tensor_list" : "gather_list";
  const std::string entry = std::string(list) + " entry";
  const DataType dtype = checks_.tensor(input, call, "input");
  if (root >= 0) checks_.root(root, call, "dst");
  const size_t count = input.numel();
  // A gather is an all-gather whose blocks only the root keeps: the other
  // ranks pass no outputs and gather into scratch tensors.
  const bool keep = root < 0 || root == rank_;
  std::vector<at::Tensor> outs;
  if (keep) {
    PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "rank ", rank_, ": ", call,
                      ": ", list, " has ", outputs.size(),
                      " tensors, expected world_size = ", size_);
    for (const auto& o : outputs) {
      PYDDP_CHECK_TYPE(checks_.tensor(o, call, entry.c_str()) == dtype, "rank ", rank_, ": ", call,
                       ": ", list, " entry dtype ", o.scalar_type(),
                       " differs from input dtype ", input.scalar_type());
      PYDDP_CHECK_VALUE(static_cast<size_t>(o.numel()) == count, "rank ", rank_, ": ", call,
                        ": ", list, " entry has ", o.numel(), " elements, expected ", count,
                        " (the input's)");
      checks_.writable(o, call, entry.c_str());
      outs.push_back(dense(o));
    }
  } else {
    PYDDP_CHECK_VALUE(outputs.empty(), "rank ", rank_, ": gather: only the destination rank ",
                      root, " passes a gather_list");
    for (int b = 0; b < size_; ++b) outs.push_back(at::empty({input.numel()}, input.options()));
  }
  const at::Tensor in = dense(input);
  return submit(
      makeDesc(root < 0 ? CollectiveKind::AllGather : CollectiveKind::Gather, count, dtype,
               RedOp::Sum, root),
      outputs, withInput(outs, in),
      [=, this](const algorithms::Call& c) {
        std::vector<void*> blocks(size_);
        for (int b = 0; b < size_; ++b) blocks[b] = outs[b].data_ptr();
        algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
      },
      [=] {
        if (!keep) return;
        for (size_t b = 0; b < outputs.size(); ++b) copyBack(outputs[b], outs[b]);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::broadcastFrom(const at::Tensor& tensor,
                                                          int src, bool asyncOp) {
  const DataType dtype = checks_.tensor(tensor, "broadcast", "tensor");
  checks_.writable(tensor, "broadcast", "tensor");
  checks_.root(src, "broadcast", "src");
  const size_t count = tensor.numel();
  at::Tensor buf = dense(tensor);
  return submit(
      makeDesc(CollectiveKind::Broadcast, count, dtype, RedOp::Sum, src), {tensor}, {buf},
      [=](const algorithms::Call& c) {
        algorithms::chainBroadcast(c, buf.data_ptr(), count * elementSize(dtype), src);
      },
      [=] { copyBack(tensor, buf); }, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::reduceScatterSingle(
    const at::Tensor& output, const at::Tensor& input, RedOp op, bool asyncOp) {
  const DataType dtype =
      checks_.single("reduce_scatter_single", output, input, /*outputIsWhole=*/false);
  checks_.op(op, dtype, "reduce_scatter_single");
  const size_t count = output.numel();
  const at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const auto s = spec(dtype, op);
  const size_t es = elementSize(dtype);
  return submit(
      makeDesc(CollectiveKind::ReduceScatter, count, dtype, op), {output}, {in, out},
      [=, this](const algorithms::Call& c) {
        std::vector<const void*> blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<const char*>(in.data_ptr()) + b * count * es;
        }
        algorithms::ringReduceScatter(c, s, blocks, out.data_ptr(), count);
      },
      [=] { copyBack(output, out); }, asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::barrierAll(bool asyncOp) {
  return submit(makeDesc(CollectiveKind::Barrier, 0, DataType::UInt8), {}, {},
                [](const algorithms::Call& c) { algorithms::barrier(c); }, [] {}, asyncOp);
}

// --- torch.distributed entry points ----------------------------------------

const at::Tensor& RingBackend::single(const std::vector<at::Tensor>& tensors,
                                      const char* call, const char* what) const {
  PYDDP_CHECK_VALUE(tensors.size() == 1, "rank ", rank_, ": ", call, ": got ", tensors.size(),
                    " ", what, " tensors; the pyddp backend takes one tensor per process");
  return tensors[0];
}

RedOp RingBackend::redOp(const c10d::ReduceOp& op, const char* call) const {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return RedOp::Sum;
    case c10d::ReduceOp::AVG: return RedOp::Avg;
    case c10d::ReduceOp::PRODUCT: return RedOp::Product;
    case c10d::ReduceOp::MIN: return RedOp::Min;
    case c10d::ReduceOp::MAX: return RedOp::Max;
    default: {
      // c10d's RedOpType values in order.
      const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR",
                             "PREMUL_SUM"};
      const auto i = static_cast<size_t>(op.op_);
      PYDDP_CHECK_VALUE(false, "rank ", rank_, ": ", call, ": the pyddp backend does not "
                        "support ReduceOp.", i < std::size(names) ? names[i] : "?",
                        " (supported: SUM, AVG, PRODUCT, MIN, MAX)");
    }
  }
  return RedOp::Sum;  // unreachable: the check above throws
}

c10::intrusive_ptr<c10d::Work> RingBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::AllreduceOptions& opts) {
  return allReduce(single(tensors, "allreduce", "input"), redOp(opts.reduceOp, "allreduce"),
                   opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                      const c10d::BroadcastOptions& opts) {
  PYDDP_CHECK_VALUE(opts.rootTensor == 0, "rank ", rank_, ": broadcast: rootTensor ",
                    opts.rootTensor, " given; the pyddp backend takes one tensor per process");
  return broadcastFrom(single(tensors, "broadcast", "input"), static_cast<int>(opts.rootRank),
                       opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::reduce(std::vector<at::Tensor>& tensors,
                                                   const c10d::ReduceOptions& opts) {
  PYDDP_CHECK_VALUE(opts.rootTensor == 0, "rank ", rank_, ": reduce: rootTensor ",
                    opts.rootTensor, " given; the pyddp backend takes one tensor per process");
  return reduceTo(single(tensors, "reduce", "input"), redOp(opts.reduceOp, "reduce"),
                  static_cast<int>(opts.rootRank), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  PYDDP_CHECK_VALUE(outputs.size() == 1, "rank ", rank_, ": allgather: got ", outputs.size(),
                    " output lists; the pyddp backend takes one per process");
  return allGatherList(outputs[0], single(inputs, "allgather", "input"), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  return allGatherSingle(output, input, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  // torch passes one (possibly empty) output list per process.
  PYDDP_CHECK_VALUE(outputs.size() <= 1, "rank ", rank_, ": gather: got ", outputs.size(),
                    " output lists; the pyddp backend takes one per process");
  static const std::vector<at::Tensor> none;
  return gatherTo(outputs.empty() ? none : outputs[0], single(inputs, "gather", "input"),
                  static_cast<int>(opts.rootRank), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const at::Tensor& output = single(outputs, "scatter", "output");
  const int root = static_cast<int>(opts.rootRank);
  const DataType dtype = checks_.tensor(output, "scatter", "output");
  checks_.writable(output, "scatter", "output");
  checks_.root(root, "scatter", "src");
  const size_t count = output.numel();
  // The root's list travels as one world-sized tensor down the broadcast
  // chain and each rank keeps its block: (n-1) times the bytes a tree
  // scatter moves, through the one transport verb set every rank has.
  at::Tensor whole;
  if (rank_ == root) {
    PYDDP_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                      "rank ", rank_, ": scatter: the source passes one list of world_size = ",
                      size_, " tensors");
    std::vector<at::Tensor> flat;
    for (const auto& t : inputs[0]) {
      PYDDP_CHECK_TYPE(checks_.tensor(t, "scatter", "input") == dtype, "rank ", rank_,
                       ": scatter: input dtype ", t.scalar_type(), " differs from output dtype ",
                       output.scalar_type());
      PYDDP_CHECK_VALUE(static_cast<size_t>(t.numel()) == count, "rank ", rank_,
                        ": scatter: an input has ", t.numel(), " elements, expected ", count,
                        " (the output's)");
      flat.push_back(t.reshape({-1}));
    }
    whole = at::cat(flat);
  } else {
    PYDDP_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "rank ",
                      rank_, ": scatter: only the source rank ", root, " passes inputs");
    whole = at::empty({static_cast<int64_t>(count) * size_}, output.options());
  }
  const int64_t mine = static_cast<int64_t>(count) * rank_;
  return submit(
      makeDesc(CollectiveKind::Scatter, count, dtype, RedOp::Sum, root), {output}, {whole},
      [=](const algorithms::Call& c) {
        algorithms::chainBroadcast(c, whole.data_ptr(), whole.numel() * elementSize(dtype),
                                   root);
      },
      [=] { output.copy_(whole.narrow(0, mine, count).view(output.sizes())); }, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  PYDDP_CHECK_VALUE(inputs.size() == 1, "rank ", rank_, ": reduce_scatter: got ",
                    inputs.size(), " input lists; the pyddp backend takes one per process");
  const at::Tensor& output = single(outputs, "reduce_scatter", "output");
  PYDDP_CHECK_VALUE(static_cast<int>(inputs[0].size()) == size_, "rank ", rank_,
                    ": reduce_scatter: input list has ", inputs[0].size(),
                    " tensors, expected world_size = ", size_);
  const DataType dtype = checks_.tensor(output, "reduce_scatter", "output");
  std::vector<at::Tensor> flat;
  for (const auto& t : inputs[0]) {
    PYDDP_CHECK_TYPE(checks_.tensor(t, "reduce_scatter", "input") == dtype, "rank ", rank_,
                     ": reduce_scatter: input dtype ", t.scalar_type(),
                     " differs from output dtype ", output.scalar_type());
    PYDDP_CHECK_VALUE(t.numel() == output.numel(), "rank ", rank_,
                      ": reduce_scatter: an input has ", t.numel(),
                      " elements, expected ", output.numel(), " (the output's)");
    flat.push_back(t.reshape({-1}));
  }
  // The list becomes one world-sized tensor, read when the call is made (as
  // the single-tensor form reads its input).
  return reduceScatterSingle(output, at::cat(flat), redOp(opts.reduceOp, "reduce_scatter"),
                             opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return reduceScatterSingle(output, input, redOp(opts.reduceOp, "reduce_scatter_tensor"),
                             opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::barrier(const c10d::BarrierOptions& opts) {
  return barrierAll(opts.asyncOp);
}

} // namespace pyddp
