#include "transport/cuda_ipc.h"

#include <cstring>
#include <random>

#include "common/blob.h"
#include "common/check.h"
#include "common/cuda_device.h"
#include "kernels/cuda.h"

namespace pyddp {
namespace ipc {
namespace {

// hostWords_ holds three int64 words, each on its own 64-byte line: the
// error word, the abort word and a constant 1 (the source of the failed
// flag that abandon() copies to the device).
constexpr size_t kWordStride = 64 / sizeof(int64_t);
constexpr size_t kErrorWord = 0, kAbortWord = kWordStride, kOneWord = 2 * kWordStride;
constexpr size_t kWordsBytes = 3 * 64;

// checkCuda, naming this rank; the message is built only on failure.
void cudaCheck(cudaError_t err, int rank, const char* what) {
  if (err != cudaSuccess) checkCuda(err, c10::str("rank ", rank, ": cuda_ipc: ", what).c_str());
}

// What a rank publishes: its control segment (the control plane's blob),
// the IPC handle of its buffer, the buffer's token and its geometry.
struct IpcBlob {
  std::string control;
  cudaIpcMemHandle_t handle;
  uint64_t token = 0;
  size_t slotBytes = 0;
  int numSlots = 0;
  size_t stagingBytes = 0;
};

std::string encode(const IpcBlob& b) {
  return BlobWriter()
      .putBytes("control", b.control)
      .putBytes("handle", &b.handle, sizeof(b.handle))
      .put("token", b.token)
      .put("slot_bytes", b.slotBytes)
      .put("num_slots", b.numSlots)
      .put("staging_bytes", b.stagingBytes)
      .str();
}

IpcBlob decode(const std::string& text, int peer) {
  const BlobReader r(text, "rank " + std::to_string(peer) + "'s cuda_ipc bootstrap blob");
  IpcBlob b;
  b.control = r.bytes("control");
  r.bytes("handle", &b.handle, sizeof(b.handle));
  b.token = r.get<uint64_t>("token");
  b.slotBytes = r.get<size_t>("slot_bytes");
  b.numSlots = r.get<int>("num_slots");
  b.stagingBytes = r.get<size_t>("staging_bytes");
  return b;
}

std::string describeError(int64_t word, int rank, uint64_t timeoutNs) {
  if (word == 0) return "";
  const std::string me = "rank " + std::to_string(rank) + ": cuda_ipc: ";
  const std::string peer = "rank " + std::to_string(errorRank(word));
  switch (errorCode(word)) {
    case kTimeout:
      return me + peer + " did not signal within " + std::to_string(timeoutNs / 1000000) +
             " ms (a device-side wait timed out)";
    case kPeerFailed:
      return me + peer + " gave up on a collective, so this rank's waits on it ended";
    case kAborted:
      return me + "the process group was aborted";
    default:
      return me + "unknown device error " + std::to_string(word);
  }
}

// The device error recorded in `words` (see deviceErrorProbe); "" while none.
std::string readError(const std::shared_ptr<int64_t>& words, int rank, uint64_t timeoutNs) {
  const int64_t word = words ? static_cast<volatile int64_t*>(words.get())[kErrorWord] : 0;
  return describeError(word, rank, timeoutNs);
}

BlobReader controlBlob(const IpcBlob& b, int peer) {
  return BlobReader(b.control, "rank " + std::to_string(peer) + "'s shm bootstrap blob");
}

} // namespace

CudaIpcTransport::CudaIpcTransport(int rank, int worldSize, const RingOptions& options,
                                   int device, cudaStream_t stream)
    : rank_(rank),
      worldSize_(worldSize),
      device_(device),
      slotBytes_(options.slotBytes),
      numSlots_(options.numSlots),
      stagingBytes_(roundUp(options.stagingBytes(), kFlagAlign)),
      timeoutNs_(static_cast<uint64_t>(options.timeoutMs) * 1000000ull),
      stream_(stream),
      control_(rank, worldSize, /*dataBytes=*/0),
      bases_(worldSize, nullptr) {
  options.validate();
  PYDDP_CHECK_VALUE(worldSize <= kMaxRanks, "the cuda_ipc transport serves at most ",
                    kMaxRanks, " ranks, got world_size ", worldSize,
                    "; use the nccl or auto backend");
}

CudaIpcTransport::~CudaIpcTransport() {
  // End every wait still queued, then let the streams drain: kernels must
  // not touch buffers freed below. (The engine drains and meets its peers
  // first on a clean shutdown, so nothing is left to abort then.) Errors
  // are ignored: a destructor cannot report them.
  if (!bases_[rank_] && !hostWords_) return;  // setup() never ran
  if (hostWords_) static_cast<volatile int64_t*>(hostWords_.get())[kAbortWord] = 1;
  QuietDeviceGuard scope(device_);
  cudaStreamSynchronize(stream_);
  if (sideStream_) {
    cudaStreamSynchronize(sideStream_);
    cudaStreamDestroy(sideStream_);
  }
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer != rank_ && bases_[peer]) cudaIpcCloseMemHandle(bases_[peer]);
  }
  if (bases_[rank_]) cudaFree(bases_[rank_]);
}

std::string CudaIpcTransport::setup() {
  QuietDeviceGuard scope(device_);
  const size_t bytes =
      sizeof(IpcHeader) + static_cast<size_t>(numSlots_) * slotBytes_ + 2 * stagingBytes_;
  void* base = nullptr;
  cudaCheck(cudaMalloc(&base, bytes), rank_, "cudaMalloc of the IPC buffer");
  bases_[rank_] = static_cast<char*>(base);
  cudaCheck(cudaMemsetAsync(base, 0, bytes, stream_), rank_, "clearing the IPC buffer");
  std::random_device entropy;
  token_ = (static_cast<uint64_t>(entropy()) << 32) | entropy();
  IpcHeader init{};
  init.magic = kIpcMagic;
  init.layoutVersion = kIpcLayoutVersion;
  init.token = token_;
  cudaCheck(cudaMemcpyAsync(&header(rank_)->magic, &init.magic,
                            offsetof(IpcHeader, probe) - offsetof(IpcHeader, magic),
                            cudaMemcpyHostToDevice, stream_),
            rank_, "writing the IPC buffer's header");
  void* words = nullptr;
  cudaCheck(cudaHostAlloc(&words, kWordsBytes, cudaHostAllocMapped), rank_,
            "cudaHostAlloc of the error words");
  hostWords_ = std::shared_ptr<int64_t>(static_cast<int64_t*>(words),
                                        [](int64_t* w) { cudaFreeHost(w); });
  std::memset(words, 0, kWordsBytes);
  hostWords_.get()[kOneWord] = 1;
  void* devWords = nullptr;
  cudaCheck(cudaHostGetDevicePointer(&devWords, words, 0), rank_,
            "mapping the error words");
  words_.error = static_cast<int64_t*>(devWords) + kErrorWord;
  words_.abort = static_cast<int64_t*>(devWords) + kAbortWord;
  words_.ownFailed = &header(rank_)->failed.value;
  cudaCheck(cudaStreamCreateWithFlags(&sideStream_, cudaStreamNonBlocking), rank_,
            "creating the side stream");

  IpcBlob b;
  BlobWriter control;
  control_.setup(control);
  b.control = control.str();
  cudaCheck(cudaIpcGetMemHandle(&b.handle, base), rank_, "cudaIpcGetMemHandle");
  b.token = token_;
  b.slotBytes = slotBytes_;
  b.numSlots = numSlots_;
  b.stagingBytes = stagingBytes_;
  // Peers must see the cleared flags and the token. The stream's own
  // synchronisation, not the device's: that would also wait for other
  // groups' pending waits, which may need this rank to go on.
  cudaCheck(cudaStreamSynchronize(stream_), rank_, "finishing the IPC buffer's setup");
  return encode(b);
}

std::string CudaIpcTransport::whyNotConnect(int peer, const std::string& blob) const {
  const IpcBlob b = decode(blob, peer);
  std::string why = control_.whyNotConnect(peer, controlBlob(b, peer));
  if (!why.empty()) return why;
  if (b.slotBytes != slotBytes_ || b.numSlots != numSlots_ || b.stagingBytes != stagingBytes_) {
    return "rank " + std::to_string(peer) + " uses a different cuda_ipc geometry (set "
           "PYDDP_SLOT_BYTES, PYDDP_NUM_SLOTS, PYDDP_DIRECT_MAX_BYTES and "
           "PYDDP_TWO_SHOT_MAX_BYTES alike on all ranks)";
  }
  return "";
}

void CudaIpcTransport::connect(const std::vector<std::string>& blobs) {
  QuietDeviceGuard scope(device_);
  std::vector<BlobReader> controlBlobs;
  std::vector<IpcBlob> peers(worldSize_);
  for (int peer = 0; peer < worldSize_; ++peer) {
    peers[peer] = decode(blobs[peer], peer);
    controlBlobs.push_back(controlBlob(peers[peer], peer));
    if (peer == rank_) continue;
    const std::string why = whyNotConnect(peer, blobs[peer]);
    PYDDP_CHECK_COMM(why.empty(), "rank ", rank_, ": cuda_ipc cannot reach ", why);
  }
  control_.connect(controlBlobs);
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const IpcBlob& b = peers[peer];
    void* mapped = nullptr;
    cudaCheck(cudaIpcOpenMemHandle(&mapped, b.handle, cudaIpcMemLazyEnablePeerAccess), rank_,
              ("cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s buffer").c_str());
    bases_[peer] = static_cast<char*>(mapped);
    // Prove access instead of trusting cudaDeviceCanAccessPeer: read the
    // peer's header through the mapping, write our token into its probe
    // slot and read it back.
    // On the stream, never the device-wide synchronous copies (see setup()).
    IpcHeader theirs{};
    cudaCheck(cudaMemcpyAsync(&theirs.magic, &header(peer)->magic,
                              offsetof(IpcHeader, probe) - offsetof(IpcHeader, magic),
                              cudaMemcpyDeviceToHost, stream_),
              rank_, "reading a peer's IPC buffer");
    cudaCheck(cudaStreamSynchronize(stream_), rank_, "reading a peer's IPC buffer");
    PYDDP_CHECK_COMM(theirs.magic == kIpcMagic && theirs.layoutVersion == kIpcLayoutVersion,
                     "rank ", rank_, ": cuda_ipc: rank ", peer, "'s buffer has an unexpected "
                     "layout (magic ", theirs.magic, ", version ", theirs.layoutVersion,
                     "): different pyddp versions?");
    PYDDP_CHECK_COMM(theirs.token == b.token, "rank ", rank_, ": cuda_ipc: reading rank ", peer,
                     "'s buffer returned the wrong token: peer memory is not accessible");
    uint64_t seen = 0;
    cudaCheck(cudaMemcpyAsync(&header(peer)->probe[rank_], &token_, sizeof(token_),
                              cudaMemcpyHostToDevice, stream_),
              rank_, "writing a peer's IPC buffer");
    cudaCheck(cudaMemcpyAsync(&seen, &header(peer)->probe[rank_], sizeof(seen),
                              cudaMemcpyDeviceToHost, stream_),
              rank_, "reading back a peer's IPC buffer");
    cudaCheck(cudaStreamSynchronize(stream_), rank_, "reading back a peer's IPC buffer");
    PYDDP_CHECK_COMM(seen == token_, "rank ", rank_, ": cuda_ipc: a write to rank ", peer,
                     "'s buffer did not read back: peer memory is not writable");
  }
}

void CudaIpcTransport::connected() {
  control_.connected();
}

std::function<std::string()> CudaIpcTransport::deviceErrorProbe() const {
  return [words = hostWords_, rank = rank_, timeoutNs = timeoutNs_] {
    return readError(words, rank, timeoutNs);
  };
}

std::string CudaIpcTransport::asyncError() const {
  const std::string failed = readError(hostWords_, rank_, timeoutNs_);
  if (!failed.empty()) return failed;
  const std::string dead = control_.deadPeer();
  return dead.empty() ? "" : "rank " + std::to_string(rank_) + ": cuda_ipc: " + dead;
}

void CudaIpcTransport::enter(const CollectiveDesc& desc, Deadline deadline) {
  const std::string failed = readError(hostWords_, rank_, timeoutNs_);
  PYDDP_CHECK_COMM(failed.empty(), failed);
  control_.enter(desc, deadline);
}

void CudaIpcTransport::raiseFailedFlag() {
  // The side stream does not queue behind this rank's own (maybe waiting)
  // kernels.
  if (hostWords_ && sideStream_) {
    QuietDeviceGuard scope(device_);
    cudaMemcpyAsync(const_cast<uint64_t*>(words_.ownFailed), hostWords_.get() + kOneWord,
                    sizeof(uint64_t), cudaMemcpyHostToDevice, sideStream_);
  }
}

void CudaIpcTransport::abandon(const std::string& why) {
  control_.giveUp(why, /*onNext=*/false);
  raiseFailedFlag();
}

void CudaIpcTransport::abort() {
  control_.abort();
  if (hostWords_) static_cast<volatile int64_t*>(hostWords_.get())[kAbortWord] = 1;
  // The abort word ends this rank's waits; peers' waits on this rank end
  // only through its failed flag, which a wait kernel raises only if one is
  // running when the abort lands.
  raiseFailedFlag();
}

void CudaIpcTransport::waitFor(const WaitList& waits) {
  cudaCheck(launchWait(waits, words_, timeoutNs_, stream_), rank_, "launching a wait");
}

void CudaIpcTransport::signal(const SignalList& signals) {
  cudaCheck(launchSignal(signals, words_, stream_), rank_, "launching a signal");
}

void CudaIpcTransport::addSendSlotFree(WaitList& w, uint64_t piece) const {
  if (piece + 1 <= static_cast<uint64_t>(numSlots_)) return;  // a slot never used
  const int next = (rank_ + 1) % worldSize_;
  w.flag[w.n] = &header(next)->consumed.value;
  w.peerFailed[w.n] = &header(next)->failed.value;
  w.target[w.n] = piece + 1 - numSlots_;
  w.peer[w.n] = next;
  ++w.n;
}

void CudaIpcTransport::addRecvArrived(WaitList& w, uint64_t piece) const {
  const int prev = (rank_ + worldSize_ - 1) % worldSize_;
  w.flag[w.n] = &header(prev)->posted.value;
  w.peerFailed[w.n] = &header(prev)->failed.value;
  w.target[w.n] = piece + 1;
  w.peer[w.n] = prev;
  ++w.n;
}

char* CudaIpcTransport::sendSlot(uint64_t piece) const {
  return slots(rank_) + (piece % numSlots_) * slotBytes_;
}

const char* CudaIpcTransport::recvSlot(uint64_t piece) const {
  const int prev = (rank_ + worldSize_ - 1) % worldSize_;
  return slots(prev) + (piece % numSlots_) * slotBytes_;
}

// Each verb: one wait kernel (the slots it needs), one data kernel, one
// signal kernel (the flags it advances), in stream order.

void CudaIpcTransport::send(const void* src, size_t bytes) {
  const uint64_t k = sent_++;
  WaitList w{};
  addSendSlotFree(w, k);
  if (w.n) waitFor(w);
  kernels::cuda::copy(sendSlot(k), nullptr, src, bytes, stream_);
  signal({{&header(rank_)->posted.value}, {k + 1}, 1});
}

void CudaIpcTransport::sendCopy(const void* src, void* dst, size_t bytes) {
  const uint64_t k = sent_++;
  WaitList w{};
  addSendSlotFree(w, k);
  if (w.n) waitFor(w);
  kernels::cuda::copy(sendSlot(k), dst == src ? nullptr : dst, src, bytes, stream_);
  signal({{&header(rank_)->posted.value}, {k + 1}, 1});
}

void CudaIpcTransport::recv(void* dst, size_t bytes) {
  const uint64_t k = received_++;
  WaitList w{};
  addRecvArrived(w, k);
  waitFor(w);
  kernels::cuda::copy(dst, nullptr, recvSlot(k), bytes, stream_);
  signal({{&header(rank_)->consumed.value}, {k + 1}, 1});
}

void CudaIpcTransport::recvCopySend(void* dst, size_t bytes) {
  const uint64_t kr = received_++, ks = sent_++;
  WaitList w{};
  addRecvArrived(w, kr);
  addSendSlotFree(w, ks);
  waitFor(w);
  kernels::cuda::copy(dst, sendSlot(ks), recvSlot(kr), bytes, stream_);
  signal({{&header(rank_)->consumed.value, &header(rank_)->posted.value}, {kr + 1, ks + 1}, 2});
}

void CudaIpcTransport::sendPartial(const kernels::ReduceSpec& spec, const void* local,
                                   size_t count) {
  const uint64_t k = sent_++;
  WaitList w{};
  addSendSlotFree(w, k);
  if (w.n) waitFor(w);
  kernels::cuda::toPartial(spec, sendSlot(k), local, count, stream_);
  signal({{&header(rank_)->posted.value}, {k + 1}, 1});
}

void CudaIpcTransport::recvReduceSend(const kernels::ReduceSpec& spec, Hop, const void* local,
                                      size_t count) {
  const uint64_t kr = received_++, ks = sent_++;
  WaitList w{};
  addRecvArrived(w, kr);
  addSendSlotFree(w, ks);
  waitFor(w);
  kernels::cuda::reducePartial(spec, sendSlot(ks), recvSlot(kr), local, count, stream_);
  signal({{&header(rank_)->consumed.value, &header(rank_)->posted.value}, {kr + 1, ks + 1}, 2});
}

void CudaIpcTransport::recvReduceCopy(const kernels::ReduceSpec& spec, Hop, const void* local,
                                      void* dst, size_t count) {
  const uint64_t k = received_++;
  WaitList w{};
  addRecvArrived(w, k);
  waitFor(w);
  kernels::cuda::reduceFinal(spec, dst, nullptr, recvSlot(k), local, count, stream_);
  signal({{&header(rank_)->consumed.value}, {k + 1}, 1});
}

void CudaIpcTransport::recvReduceCopySend(const kernels::ReduceSpec& spec, Hop, const void* local,
                                          void* dst, size_t count) {
  const uint64_t kr = received_++, ks = sent_++;
  WaitList w{};
  addRecvArrived(w, kr);
  addSendSlotFree(w, ks);
  waitFor(w);
  kernels::cuda::reduceFinal(spec, dst, sendSlot(ks), recvSlot(kr), local, count, stream_);
  signal({{&header(rank_)->consumed.value, &header(rank_)->posted.value}, {kr + 1, ks + 1}, 2});
}

void CudaIpcTransport::copy(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) kernels::cuda::copy(dst, nullptr, src, bytes, stream_);
}

void CudaIpcTransport::reduceN(const kernels::ReduceSpec& spec, void* dst,
                               const void* const* src, int nsrc, size_t count) {
  kernels::cuda::reduceN(spec, dst, src, nsrc, count, stream_);
}

void* CudaIpcTransport::stagingBuffer() {
  return staging(rank_) + ((rounds_ + 1) % 2) * stagingBytes_;
}

void CudaIpcTransport::exchange() {
  ++rounds_;
  signal({{&header(rank_)->staged.value}, {rounds_}, 1});
  WaitList w{};
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_) continue;
    w.flag[w.n] = &header(k)->staged.value;
    w.peerFailed[w.n] = &header(k)->failed.value;
    w.target[w.n] = rounds_;
    w.peer[w.n] = k;
    ++w.n;
  }
  waitFor(w);
}

void CudaIpcTransport::enterStaged(const CollectiveDesc& desc, Deadline deadline) {
  enter(desc, deadline);
  exchange();
}

const void* CudaIpcTransport::peerBuffer(int rank) const {
  return staging(rank) + (rounds_ % 2) * stagingBytes_;
}

} // namespace ipc
} // namespace pyddp

