#include "backend/ring_backend.h"

#include <pthread.h>

#include <cstring>

#include "common/check.h"
#include "transport/shm.h"

namespace pyddp {
namespace {

using Ms = std::chrono::milliseconds;

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
                       k, "'): ", e.what());
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

std::optional<DataType> dataTypeOf(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::Float32;
    case at::kDouble: return DataType::Float64;
    case at::kHalf: return DataType::Float16;
    case at::kBFloat16: return DataType::BFloat16;
    case at::kChar: return DataType::Int8;
    case at::kByte: return DataType::UInt8;
    case at::kInt: return DataType::Int32;
    case at::kLong: return DataType::Int64;
    default: return std::nullopt;
  }
}

RingBackend::RingBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                         int size, const RingOptions& options)
    : c10d::Backend(rank, size), options_(options) {
  options_.validate();
  PYDDP_CHECK_VALUE(size >= 1 && rank >= 0 && rank < size, "rank ", rank,
                    " is not in [0, world_size=", size, ")");
  const Ms timeout(options_.timeoutMs);
  transport_ = std::make_unique<shm::ShmTransport>(rank, size, options_);
  // phase 1: publish what peers need to reach us, learn theirs
  const auto blobs = exchange(*store, "shm/blob", transport_->setup(), rank, size, timeout);
  // phase 2: map every peer, then wait until every peer has mapped us
  transport_->connect(blobs);
  exchange(*store, "shm/connected", "", rank, size, timeout);
  transport_->connected();
  worker_ = std::thread([this] { workerLoop(); });
}

RingBackend::~RingBackend() {
  shutdown();
}

void RingBackend::shutdown() {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_all();
  for (Job& job : dropped) {
    job.work->fail(std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
        c10::str("pyddp: rank ", rank_, ": the process group was destroyed before ",
                 toString(job.desc.kind), " #", job.desc.seq, " ran"))));
  }
  if (worker_.joinable()) worker_.join();
}

void RingBackend::workerLoop() {
  pthread_setname_np(pthread_self(), "pyddp-worker");
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !busy_); });
    if (stop_) return;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    run(job);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

c10::intrusive_ptr<c10d::Work> RingBackend::submit(
    CollectiveDesc desc, c10d::OpType type, std::vector<at::Tensor> outputs,
    Body body, bool asyncOp) {
  auto work = c10::make_intrusive<RingWork>(rank_, type, std::move(outputs));
  Job job{desc, std::move(body), work};
  std::unique_lock<std::mutex> lock(mu_);
  PYDDP_CHECK(!stop_, "rank ", rank_, ": ", toString(desc.kind),
              " on a process group that was destroyed");
  job.desc.seq = nextSeq_++;
  if (!asyncOp && queue_.empty() && !busy_) {
    // Nothing is ahead of this call: run it here, keeping call order.
    busy_ = true;
    lock.unlock();
    run(job);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
    return work;
  }
  queue_.push_back(std::move(job));
  cv_.notify_all();
  return work;
}

void RingBackend::run(Job& job) {
  try {
    PYDDP_CHECK_COMM(brokenBy_.empty(), "rank ", rank_, ": ", toString(job.desc.kind),
                     " #", job.desc.seq, " refused: an earlier collective failed and "
                     "left the process group unusable (", brokenBy_,
                     "); destroy it and create a new one");
    const algorithms::Call call{*transport_, job.desc,
                                Clock::now() + Ms(options_.timeoutMs), rank_, size_};
    job.body(call);
    job.work->complete();
  } catch (const std::exception& e) {
    if (brokenBy_.empty()) brokenBy_ = e.what();
    job.work->fail(std::current_exception());
  }
}

DataType RingBackend::checkTensor(const at::Tensor& t, const char* call,
                                  const char* what) const {
  PYDDP_CHECK_TYPE(t.defined(), "rank ", rank_, ": ", call, ": ", what,
                   " is an undefined tensor");
  PYDDP_CHECK_TYPE(t.device().is_cpu(), "rank ", rank_, ": ", call, ": ", what,
                   " is on ", t.device(), "; the shm backend takes CPU tensors only");
  PYDDP_CHECK_TYPE(t.layout() == at::kStrided, "rank ", rank_, ": ", call, ": ", what,
                   " has layout ", t.layout(), "; only dense (strided) tensors are supported");
  const auto dtype = dataTypeOf(t.scalar_type());
  PYDDP_CHECK_TYPE(dtype.has_value(), "rank ", rank_, ": ", call, ": ", what, " has dtype ",
                   t.scalar_type(), "; supported: float32, float64, float16, "
                   "bfloat16, int8, uint8, int32, int64");
  return *dtype;
}

void RingBackend::checkOp(RedOp op, DataType dtype, const char* call) const {
  PYDDP_CHECK_TYPE(op != RedOp::Avg || isFloating(dtype), "rank ", rank_, ": ", call,
                   ": ReduceOp.AVG needs a floating-point tensor, got ",
                   toString(dtype), "; use SUM and divide");
}

kernels::ReduceSpec RingBackend::spec(DataType dtype, RedOp op) const {
  return kernels::ReduceSpec{dtype, op, size_};
}

c10::intrusive_ptr<c10d::Work> RingBackend::allReduce(const at::Tensor& tensor,
                                                      RedOp op, bool asyncOp) {
  const DataType dtype = checkTensor(tensor, "all_reduce", "tensor");
  checkOp(op, dtype, "all_reduce");
  const size_t count = tensor.numel();
  const size_t bytes = count * elementSize(dtype);
  const bool direct = options_.directMaxBytes > 0 &&
      (options_.algo == Algo::Direct ||
       (options_.algo == Algo::Auto && bytes <= options_.directMaxBytes));
  const auto s = spec(dtype, op);
  at::Tensor buf = dense(tensor);
  return submit(
      makeDesc(CollectiveKind::AllReduce, count, dtype, op, -1,
               direct ? Algo::Direct : Algo::Ring),
      c10d::OpType::ALLREDUCE, {tensor},
      [=, this](const algorithms::Call& c) {
        void* data = buf.data_ptr();
        if (direct) {
          algorithms::directAllReduce(c, *transport_->peerMemory(), s, data, data, count);
        } else {
          algorithms::ringAllReduce(c, s, data, data, count);
        }
        copyBack(tensor, buf);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::allGatherSingle(const at::Tensor& output,
                                                            const at::Tensor& input,
                                                            bool asyncOp) {
  const DataType dtype = checkTensor(input, "all_gather_single", "input");
  PYDDP_CHECK_TYPE(checkTensor(output, "all_gather_single", "output") == dtype,
                   "rank ", rank_, ": all_gather_single: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  const size_t count = input.numel();
  PYDDP_CHECK_VALUE(static_cast<size_t>(output.numel()) == count * size_, "rank ", rank_,
                    ": all_gather_single: output has ", output.numel(),
                    " elements, expected ", count * size_, " (world_size ", size_,
                    " x input's ", count, ")");
  const at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const size_t es = elementSize(dtype);
  return submit(
      makeDesc(CollectiveKind::AllGather, count, dtype), c10d::OpType::_ALLGATHER_BASE,
      {output},
      [=, this](const algorithms::Call& c) {
        std::vector<void*> blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<char*>(out.data_ptr()) + b * count * es;
        }
        algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
        copyBack(output, out);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::allGatherList(
    const std::vector<at::Tensor>& outputs, const at::Tensor& input, bool asyncOp) {
  const DataType dtype = checkTensor(input, "all_gather", "input");
  PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "rank ", rank_,
                    ": all_gather: tensor_list has ", outputs.size(),
                    " tensors, expected world_size = ", size_);
  const size_t count = input.numel();
  std::vector<at::Tensor> outs;
  for (const auto& o : outputs) {
    PYDDP_CHECK_TYPE(checkTensor(o, "all_gather", "tensor_list entry") == dtype,
                     "rank ", rank_, ": all_gather: tensor_list entry dtype ",
                     o.scalar_type(), " differs from input dtype ", input.scalar_type());
    PYDDP_CHECK_VALUE(static_cast<size_t>(o.numel()) == count, "rank ", rank_,
                      ": all_gather: tensor_list entry has ", o.numel(),
                      " elements, expected ", count, " (the input's)");
    outs.push_back(dense(o));
  }
  const at::Tensor in = dense(input);
  return submit(
      makeDesc(CollectiveKind::AllGather, count, dtype), c10d::OpType::ALLGATHER,
      outputs,
      [=, this](const algorithms::Call& c) {
        std::vector<void*> blocks(size_);
        for (int b = 0; b < size_; ++b) blocks[b] = outs[b].data_ptr();
        algorithms::ringAllGather(c, dtype, in.data_ptr(), blocks, count);
        for (int b = 0; b < size_; ++b) copyBack(outputs[b], outs[b]);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::broadcastFrom(const at::Tensor& tensor,
                                                          int src, bool asyncOp) {
  const DataType dtype = checkTensor(tensor, "broadcast", "tensor");
  PYDDP_CHECK_VALUE(src >= 0 && src < size_, "rank ", rank_, ": broadcast: src=", src,
                    " is not a rank of this group (world_size ", size_, ")");
  const size_t count = tensor.numel();
  at::Tensor buf = dense(tensor);
  return submit(
      makeDesc(CollectiveKind::Broadcast, count, dtype, RedOp::Sum, src),
      c10d::OpType::BROADCAST, {tensor},
      [=, this](const algorithms::Call& c) {
        algorithms::chainBroadcast(c, buf.data_ptr(), count * elementSize(dtype), src);
        copyBack(tensor, buf);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::reduceScatterSingle(
    const at::Tensor& output, const at::Tensor& input, RedOp op, bool asyncOp) {
  const DataType dtype = checkTensor(input, "reduce_scatter_single", "input");
  PYDDP_CHECK_TYPE(checkTensor(output, "reduce_scatter_single", "output") == dtype,
                   "rank ", rank_, ": reduce_scatter_single: output dtype ",
                   output.scalar_type(), " differs from input dtype ", input.scalar_type());
  checkOp(op, dtype, "reduce_scatter_single");
  const size_t count = output.numel();
  PYDDP_CHECK_VALUE(static_cast<size_t>(input.numel()) == count * size_, "rank ", rank_,
                    ": reduce_scatter_single: input has ", input.numel(),
                    " elements, expected ", count * size_, " (world_size ", size_,
                    " x output's ", count, ")");
  const at::Tensor in = dense(input);
  at::Tensor out = dense(output);
  const auto s = spec(dtype, op);
  const size_t es = elementSize(dtype);
  return submit(
      makeDesc(CollectiveKind::ReduceScatter, count, dtype, op),
      c10d::OpType::_REDUCE_SCATTER_BASE, {output},
      [=, this](const algorithms::Call& c) {
        std::vector<const void*> blocks(size_);
        for (int b = 0; b < size_; ++b) {
          blocks[b] = static_cast<const char*>(in.data_ptr()) + b * count * es;
        }
        algorithms::ringReduceScatter(c, s, blocks, out.data_ptr(), count);
        copyBack(output, out);
      },
      asyncOp);
}

c10::intrusive_ptr<c10d::Work> RingBackend::barrierAll(bool asyncOp) {
  return submit(makeDesc(CollectiveKind::Barrier, 0, DataType::UInt8),
                c10d::OpType::BARRIER, {},
                [](const algorithms::Call& c) { algorithms::barrier(c); }, asyncOp);
}

} // namespace pyddp
