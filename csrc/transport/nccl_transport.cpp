#include "transport/nccl_transport.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <thread>

#include "common/blob.h"
#include "common/check.h"
#include "common/cuda_device.h"
#include "kernels/cuda.h"

namespace pyddp {
namespace nccl {
namespace {

// How often the host polls a descriptor check's event when every check
// slot is in flight, which is rare: 100 us adds nothing that matters.
constexpr auto kPollInterval = std::chrono::microseconds(100);

// Bytes reserved for the descriptor check's words at the start of the
// transport's device buffer: cudaMalloc's alignment, so the ring scratch
// after it stays aligned for vectorised kernels.
constexpr size_t kCheckBytes = 256;
static_assert(kDescWords * sizeof(uint64_t) <= kCheckBytes);

// checkCuda, naming this rank; the message is built only on failure.
void cudaCheck(cudaError_t err, int rank, const char* what) {
  if (err != cudaSuccess) checkCuda(err, c10::str("rank ", rank, ": nccl: ", what).c_str());
}

} // namespace

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
  BlobWriter blob;
  blob.put("nccl_version", versionString());
  if (rank_ == 0) blob.putBytes("unique_id", newUniqueId());
  return blob.str();
}

std::string NcclTransport::whyNotConnect(int peer, const std::string& blob) const {
  const std::string theirs =
      BlobReader(blob, c10::str("rank ", peer, "'s NCCL bootstrap blob")).str("nccl_version");
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
  const std::string id =
      BlobReader(blobs[0], "rank 0's NCCL bootstrap blob").bytes("unique_id");
  comm_ = std::make_unique<Communicator>(id, rank_,
                                         worldSize_, device_, Clock::now() + timeout_);
  c10::cuda::CUDAGuard guard(device_);
  const size_t scratch = roundUp(pieceBytes_, kCheckBytes);
  cudaCheck(cudaMalloc(&deviceBuffer_, kCheckBytes + 2 * scratch), rank_,
            "cudaMalloc of the NCCL transport's scratch");
  cudaCheck(cudaHostAlloc(reinterpret_cast<void**>(&checkSlots_),
                          kChecksInFlight * kDescWords * sizeof(uint64_t),
                          cudaHostAllocDefault),
            rank_, "cudaHostAlloc of the descriptor check's slots");
  for (cudaEvent_t& e : checkEvents_) {
    cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), rank_, "cudaEventCreate");
  }
  char* base = static_cast<char*>(deviceBuffer_);
  // The conversion to the private base is accessible here only.
  ring_ = std::make_unique<sendrecv::SendRecvRing>(static_cast<sendrecv::SendRecvOps&>(*this),
                                                   pieceBytes_, base + kCheckBytes,
                                                   base + kCheckBytes + scratch);
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
  DescWords reduced;
  std::memcpy(reduced.data(), checkSlots_ + slot * kDescWords, sizeof reduced);
  checkSame(checkDescs_[slot], reduced, rank_);
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

void NcclTransport::enter(const CollectiveDesc& desc, Deadline deadline) {
  deadline_ = deadline.at;
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
      PYDDP_CHECK_COMM(Clock::now() < deadline.at, "rank ", rank_, ": ", toString(desc.kind),
                       " #", desc.seq, " timed out waiting for the GPU to reach collective #",
                       checkDescs_[checksRead_ % kChecksInFlight].seq);
      std::this_thread::sleep_for(kPollInterval);
    }
    cudaCheck(state, rank_, "cudaEventQuery of a descriptor check");
    checkDescriptors();
  }
  const int slot = static_cast<int>(checksIssued_ % kChecksInFlight);
  uint64_t* host = checkSlots_ + slot * kDescWords;
  const DescWords words = encodeWords(desc);
  std::memcpy(host, words.data(), sizeof words);
  checkDescs_[slot] = desc;
  auto* dev = static_cast<uint64_t*>(deviceBuffer_);
  cudaCheck(cudaMemcpyAsync(dev, host, sizeof words, cudaMemcpyHostToDevice, stream_), rank_,
            "copying a collective descriptor to the GPU");
  comm_->run("ncclAllReduce of the collective descriptor", [&](ncclComm_t comm) {
    return ncclAllReduce(dev, dev, kDescWords, ncclUint64, ncclMax, comm, stream_);
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
