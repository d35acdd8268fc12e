#include "transport/nccl.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <thread>

#include "common/check.h"
#include "common/cuda_device.h"
#include "kernels/cuda.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "pyddp needs NCCL >= 2.10 (ncclAvg)"
#endif

namespace pyddp {
namespace nccl {
namespace {

// How often the host polls a nonblocking NCCL call or a descriptor check's
// event. NCCL answers ncclInProgress only while it waits for peers (init,
// the first use of a connection), which takes milliseconds, and a full
// check ring is rare: 100 us adds nothing that matters.
constexpr auto kPollInterval = std::chrono::microseconds(100);

// Bytes reserved for the descriptor check's words at the start of the
// transport's device buffer: cudaMalloc's alignment, so the ring scratch
// after it stays aligned for vectorised kernels.
constexpr size_t kCheckBytes = 256;
static_assert(p2p::kDescWords * sizeof(uint64_t) <= kCheckBytes);

constexpr const char* kInitHint =
    " (every rank must create the group within its timeout; several ranks on one GPU need "
    "NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1; NCCL_DEBUG=WARN prints NCCL's reasons)";

// checkCuda, naming this rank; the message is built only on failure.
void cudaCheck(cudaError_t err, int rank, const char* what) {
  if (err != cudaSuccess) checkCuda(err, c10::str("rank ", rank, ": nccl: ", what).c_str());
}

std::string toHex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string fromHex(const std::string& text) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i + 1 < text.size(); i += 2) {
    const int hi = digit(text[i]), lo = digit(text[i + 1]);
    PYDDP_CHECK(hi >= 0 && lo >= 0, "malformed hex in an NCCL bootstrap blob");
    out += static_cast<char>(hi * 16 + lo);
  }
  return out;
}

// NCCL's text for the last error, as " (...)", or "".
std::string lastError(ncclComm_t comm) {
  const char* text = ncclGetLastError(comm);
  return (text && *text) ? c10::str(" (", text, ")") : "";
}

} // namespace

std::array<int, 3> version() {
  int code = 0;
  const ncclResult_t r = ncclGetVersion(&code);
  PYDDP_CHECK(r == ncclSuccess, "ncclGetVersion failed: ", ncclGetErrorString(r));
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return {code / 10000, code % 10000 / 100, code % 100};
}

std::string versionString() {
  const auto v = version();
  return c10::str(v[0], ".", v[1], ".", v[2]);
}

ncclDataType_t dataType(DataType t) {
  switch (t) {
    case DataType::Float32: return ncclFloat32;
    case DataType::Float64: return ncclFloat64;
    case DataType::Float16: return ncclFloat16;
    case DataType::BFloat16: return ncclBfloat16;
    case DataType::Int8: return ncclInt8;
    case DataType::UInt8: return ncclUint8;
    case DataType::Int32: return ncclInt32;
    case DataType::Int64: return ncclInt64;
  }
  PYDDP_CHECK(false, "no NCCL type for dtype ", static_cast<int>(t));
  return ncclUint8;
}

ncclRedOp_t redOp(RedOp op) {
  switch (op) {
    case RedOp::Sum: return ncclSum;
    case RedOp::Avg: return ncclAvg;
    case RedOp::Product: return ncclProd;
    case RedOp::Min: return ncclMin;
    case RedOp::Max: return ncclMax;
  }
  PYDDP_CHECK(false, "no NCCL operator for op ", static_cast<int>(op));
  return ncclSum;
}

std::string newUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  PYDDP_CHECK_COMM(r == ncclSuccess, "ncclGetUniqueId failed: ", ncclGetErrorString(r),
                   lastError(nullptr));
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

// --- Communicator -------------------------------------------------------------

Communicator::Communicator(const std::string& uniqueId, int rank, int size,
                           c10::DeviceIndex device, Clock::time_point deadline)
    : rank_(rank), device_(device) {
  PYDDP_CHECK(uniqueId.size() == NCCL_UNIQUE_ID_BYTES, "rank ", rank,
              ": malformed NCCL unique id of ", uniqueId.size(), " bytes");
  ncclUniqueId id;
  std::memcpy(id.internal, uniqueId.data(), NCCL_UNIQUE_ID_BYTES);
  // NCCL binds the communicator to the current device.
  c10::cuda::CUDAGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::unique_lock<std::mutex> lock(mu_);
  const ncclResult_t r = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
  try {
    settle(lock, r,
           c10::str("ncclCommInitRankConfig (rank ", rank, " of ", size, " on cuda:",
                    static_cast<int>(device), ")").c_str(),
           deadline, kInitHint);
  } catch (...) {
    abortLocked();
    throw;
  }
}

Communicator::~Communicator() {
  abort();
}

void Communicator::settle(std::unique_lock<std::mutex>& lock, ncclResult_t result,
                          const char* what, Clock::time_point deadline, const char* hint) {
  while (result == ncclInProgress) {
    PYDDP_CHECK_COMM(Clock::now() < deadline, "rank ", rank_, ": ", what,
                     " did not finish within the group's timeout", hint);
    lock.unlock();
    std::this_thread::sleep_for(kPollInterval);
    lock.lock();
    PYDDP_CHECK_COMM(comm_ != nullptr, "rank ", rank_, ": ", what,
                     " was interrupted: the NCCL communicator was aborted");
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
    result = query != ncclSuccess ? query : state;
  }
  PYDDP_CHECK_COMM(result == ncclSuccess, "rank ", rank_, ": ", what, " failed: ",
                   ncclGetErrorString(result), lastError(comm_), hint);
}

void Communicator::run(const char* what, const std::function<ncclResult_t(ncclComm_t)>& calls,
                       Clock::time_point deadline) {
  c10::cuda::CUDAGuard guard(device_);
  std::unique_lock<std::mutex> lock(mu_);
  PYDDP_CHECK_COMM(comm_ != nullptr, "rank ", rank_, ": ", what,
                   " on an NCCL communicator that was aborted or destroyed");
  settle(lock, calls(comm_), what, deadline, "");
}

std::string Communicator::asyncError() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) return "";
  ncclResult_t state = ncclSuccess;
  const ncclResult_t query = ncclCommGetAsyncError(comm_, &state);
  const ncclResult_t r = query != ncclSuccess ? query : state;
  if (r == ncclSuccess || r == ncclInProgress) return "";
  return c10::str("rank ", rank_, ": NCCL reported an error in a running collective: ",
                  ncclGetErrorString(r), lastError(comm_));
}

bool Communicator::destroy(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!comm_) return false;
  try {
    c10::cuda::CUDAGuard guard(device_);
    settle(lock, ncclCommFinalize(comm_), "ncclCommFinalize", deadline, "");
    // Once finalized, destroying is local and does not block.
    if (comm_) ncclCommDestroy(comm_);
    comm_ = nullptr;
    return true;
  } catch (const std::exception&) {
    abortLocked();
    return false;
  }
}

void Communicator::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  abortLocked();
}

void Communicator::abortLocked() {
  if (!comm_) return;
  ncclCommAbort(comm_);  // the communicator is gone whatever this returns
  comm_ = nullptr;
}

// --- NcclTransport ------------------------------------------------------------

NcclTransport::NcclTransport(int rank, int worldSize, c10::DeviceIndex device,
                             cudaStream_t stream, size_t pieceBytes,
                             std::chrono::milliseconds timeout)
    : rank_(rank),
      worldSize_(worldSize),
      device_(device),
      stream_(stream),
      pieceBytes_(pieceBytes),
      timeout_(timeout) {
  PYDDP_CHECK_VALUE(pieceBytes > 0, "the NCCL transport needs pieces of at least one byte");
}

NcclTransport::~NcclTransport() {
  // Nothing of ours then waits for a peer on the device.
  if (comm_) comm_->abort();
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
      cudaSetDevice(device_) == cudaSuccess;
  // Copies and kernels that use the buffers may still be queued.
  if (deviceBuffer_ || checkSlots_) cudaStreamSynchronize(stream_);
  for (cudaEvent_t e : checkEvents_) {
    if (e) cudaEventDestroy(e);
  }
  if (deviceBuffer_) cudaFree(deviceBuffer_);
  if (checkSlots_) cudaFreeHost(checkSlots_);
  if (switched) cudaSetDevice(previous);
}

std::string NcclTransport::setup() {
  std::string blob = "nccl " + versionString() + "\n";
  if (rank_ == 0) blob += toHex(newUniqueId());
  return blob;
}

std::string NcclTransport::whyNotConnect(int peer, const std::string& blob) const {
  const size_t nl = blob.find('\n');
  if (blob.rfind("nccl ", 0) != 0 || nl == std::string::npos) {
    return c10::str("rank ", peer, " sent a malformed NCCL bootstrap blob");
  }
  const std::string theirs = blob.substr(5, nl - 5);
  if (theirs != versionString()) {
    return c10::str("rank ", peer, " uses NCCL ", theirs, " and rank ", rank_, " NCCL ",
                    versionString());
  }
  return "";
}

void NcclTransport::connect(const std::vector<std::string>& blobs) {
  PYDDP_CHECK(static_cast<int>(blobs.size()) == worldSize_, "expected ", worldSize_,
              " bootstrap blobs, got ", blobs.size());
  for (int peer = 0; peer < worldSize_; ++peer) {
    const std::string why = whyNotConnect(peer, blobs[peer]);
    PYDDP_CHECK(why.empty(), "rank ", rank_, ": the NCCL transport cannot connect: ", why);
  }
  const int devices = c10::cuda::device_count();
  PYDDP_CHECK_COMM(device_ >= 0 && device_ < devices, "rank ", rank_,
                   ": the NCCL transport needs CUDA device ", static_cast<int>(device_),
                   ", but ", devices, " CUDA devices are visible");
  const std::string& first = blobs[0];
  comm_ = std::make_unique<Communicator>(fromHex(first.substr(first.find('\n') + 1)), rank_,
                                         worldSize_, device_, Clock::now() + timeout_);
  c10::cuda::CUDAGuard guard(device_);
  const size_t scratch = roundUp(pieceBytes_, kCheckBytes);
  cudaCheck(cudaMalloc(&deviceBuffer_, kCheckBytes + 2 * scratch), rank_,
            "cudaMalloc of the NCCL transport's scratch");
  cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&checkSlots_),
                          kChecksInFlight * p2p::kDescWords * sizeof(uint64_t),
                          cudaHostAllocDefault),
            rank_, "cudaHostAlloc of the descriptor check's slots");
  for (cudaEvent_t& e : checkEvents_) {
    cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), rank_, "cudaEventCreate");
  }
  char* base = static_cast<char*>(deviceBuffer_);
  // The conversion to the private base is accessible here only.
  ring_ = std::make_unique<p2p::P2pRing>(static_cast<p2p::P2pOps&>(*this), pieceBytes_,
                                         base + kCheckBytes, base + kCheckBytes + scratch);
}

Communicator& NcclTransport::comm() {
  PYDDP_CHECK(comm_ != nullptr, "rank ", rank_, ": the NCCL transport is not connected");
  return *comm_;
}

RingLink& NcclTransport::ring() {
  PYDDP_CHECK(ring_ != nullptr, "rank ", rank_, ": the NCCL transport is not connected");
  return *ring_;
}

void NcclTransport::flush() {
  if (ring_) ring_->flush();
}

void NcclTransport::abandon(const std::string&) {
  if (comm_) comm_->abort();
}

void NcclTransport::abort() {
  if (comm_) comm_->abort();
}

void NcclTransport::readCheck(uint64_t i) {
  const int slot = static_cast<int>(i % kChecksInFlight);
  p2p::DescWords reduced;
  std::memcpy(reduced.data(), checkSlots_ + slot * p2p::kDescWords, sizeof reduced);
  const std::string why = p2p::descMismatch(checkDescs_[slot], reduced, rank_);
  PYDDP_CHECK_COMM(why.empty(), why);
}

void NcclTransport::checkDescriptors() {
  while (checksRead_ < checksIssued_) {
    const int slot = static_cast<int>(checksRead_ % kChecksInFlight);
    const cudaError_t state = cudaEventQuery(checkEvents_[slot]);
    if (state == cudaErrorNotReady) return;
    cudaCheck(state, rank_, "cudaEventQuery of a descriptor check");
    readCheck(checksRead_++);
  }
}

void NcclTransport::enter(const CollectiveDesc& desc, Clock::time_point deadline) {
  deadline_ = deadline;
  PYDDP_CHECK(comm_ != nullptr && ring_ != nullptr, "rank ", rank_,
              ": the NCCL transport is not connected");
  PYDDP_CHECK(!ring_->sendPending(), "rank ", rank_, ": ", toString(desc.kind), " #", desc.seq,
              " started with a ring send of the previous collective still unposted: the "
              "backend must call NcclTransport::flush() after every transfer");
  checkDescriptors();
  if (checksIssued_ - checksRead_ == kChecksInFlight) {
    // Every slot is in flight: wait for the oldest check.
    const cudaEvent_t oldest = checkEvents_[checksRead_ % kChecksInFlight];
    cudaError_t state;
    while ((state = cudaEventQuery(oldest)) == cudaErrorNotReady) {
      PYDDP_CHECK_COMM(Clock::now() < deadline, "rank ", rank_, ": ", toString(desc.kind),
                       " #", desc.seq, " timed out waiting for the GPU to reach collective #",
                       checkDescs_[checksRead_ % kChecksInFlight].seq);
      std::this_thread::sleep_for(kPollInterval);
    }
    cudaCheck(state, rank_, "cudaEventQuery of a descriptor check");
    checkDescriptors();
  }
  const int slot = static_cast<int>(checksIssued_ % kChecksInFlight);
  uint64_t* host = checkSlots_ + slot * p2p::kDescWords;
  const p2p::DescWords words = p2p::encodeDesc(desc);
  std::memcpy(host, words.data(), sizeof words);
  checkDescs_[slot] = desc;
  auto* dev = static_cast<uint64_t*>(deviceBuffer_);
  cudaCheck(cudaMemcpyAsync(dev, host, sizeof words, cudaMemcpyHostToDevice, stream_), rank_,
            "copying a collective descriptor to the GPU");
  comm_->run("ncclAllReduce of the collective descriptor", [&](ncclComm_t comm) {
    return ncclAllReduce(dev, dev, p2p::kDescWords, ncclUint64, ncclMax, comm, stream_);
  }, deadline);
  cudaCheck(cudaMemcpyAsync(host, dev, sizeof words, cudaMemcpyDeviceToHost, stream_), rank_,
            "copying a descriptor check's result to the host");
  cudaCheck(cudaEventRecord(checkEvents_[slot], stream_), rank_, "cudaEventRecord");
  ++checksIssued_;
}

void NcclTransport::post(const void* send, size_t sendBytes, void* recv, size_t recvBytes) {
  const int right = (rank_ + 1) % worldSize_;
  const int left = (rank_ + worldSize_ - 1) % worldSize_;
  comm().run("ncclSend/ncclRecv", [&](ncclComm_t c) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    if (sendBytes) r = ncclSend(send, sendBytes, ncclUint8, right, c, stream_);
    if (r == ncclSuccess && recvBytes) r = ncclRecv(recv, recvBytes, ncclUint8, left, c, stream_);
    // Always close the group: an open one would swallow this thread's next NCCL calls.
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  }, deadline_);
}

void NcclTransport::copy(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) kernels::cuda::copy(dst, nullptr, src, bytes, stream_);
}

void NcclTransport::reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src,
                            int nsrc, size_t count) {
  kernels::cuda::reduceN(spec, dst, src, nsrc, count, stream_);
}

void NcclTransport::toPartial(const kernels::ReduceSpec& spec, void* dst, const void* src,
                              size_t count) {
  kernels::cuda::toPartial(spec, dst, src, count, stream_);
}

void NcclTransport::reducePartial(const kernels::ReduceSpec& spec, void* dst,
                                  const void* partial, const void* local, size_t count) {
  kernels::cuda::reducePartial(spec, dst, partial, local, count, stream_);
}

void NcclTransport::reduceFinal(const kernels::ReduceSpec& spec, void* dst,
                                const void* partial, const void* local, size_t count) {
  kernels::cuda::reduceFinal(spec, dst, nullptr, partial, local, count, stream_);
}

} // namespace nccl
} // namespace pyddp
