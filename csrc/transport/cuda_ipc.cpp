#include "transport/cuda_ipc.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <utility>

#include "common/blob.h"
#include "common/check.h"
#include "common/cuda_device.h"

namespace pyddp {
namespace {

// checkCuda, naming this rank; the message is built only on failure.
void cudaCheck(cudaError_t err, int rank, const char* what) {
  if (err != cudaSuccess) checkCuda(err, c10::str("rank ", rank, ": cuda_ipc: ", what).c_str());
}

// The part of the header written once at setup, from magic on.
constexpr size_t kIdentityOffset = offsetof(device::FusedHeader, magic);
constexpr size_t kIdentityBytes = offsetof(device::FusedHeader, probe) - kIdentityOffset;

BlobReader readerOf(const std::string& text, int peer) {
  return BlobReader(text, "rank " + std::to_string(peer) + "'s cuda_ipc bootstrap blob");
}

// Peers' allocations this process opened for registered tensors, by handle,
// with how many registrations hold each: opened at the first, closed after
// the last.
class OpenedHandles {
 public:
  std::shared_ptr<const void> open(const cudaIpcMemHandle_t& handle, int rank, int peer) {
    const std::string key(reinterpret_cast<const char*>(&handle), sizeof(handle));
    const std::lock_guard<std::mutex> lock(mutex_);
    auto it = opened_.find(key);
    if (it == opened_.end()) {
      void* mapped = nullptr;
      cudaCheck(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), rank,
                ("cudaIpcOpenMemHandle of rank " + std::to_string(peer) +
                 "'s registered tensor").c_str());
      it = opened_.emplace(key, Opened{mapped, 0}).first;
    }
    ++it->second.holders;
    return std::shared_ptr<const void>(it->second.mapped, [this, key](const void*) {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto held = opened_.find(key);
      if (--held->second.holders == 0) {
        cudaIpcCloseMemHandle(held->second.mapped);
        opened_.erase(held);
      }
    });
  }

 private:
  struct Opened {
    void* mapped;
    int holders;
  };
  std::mutex mutex_;
  std::map<std::string, Opened> opened_;
};

// One per process, never destroyed: a registration may end while the
// process exits.
OpenedHandles& openedHandles() {
  static auto* handles = new OpenedHandles();
  return *handles;
}

} // namespace

CudaIpcMemory::CudaIpcMemory(int rank, int worldSize, const device::Geometry& geometry,
                             int device)
    : FusedMemory(rank, worldSize, geometry, /*controlData=*/0),
      rank_(rank),
      worldSize_(worldSize),
      device_(device),
      bases_(worldSize, nullptr) {
  PYDDP_CHECK_VALUE(worldSize <= device::kMaxRanks, "the cuda_ipc transport serves at most ",
                    device::kMaxRanks, " ranks, got world_size ", worldSize,
                    "; use the nccl or auto backend");
}

CudaIpcMemory::~CudaIpcMemory() {
  // Errors are ignored: a destructor cannot report them.
  QuietDeviceGuard scope(device_);
  if (hostWords_) hostWords_[kAbortWord] = 1;
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer != rank_ && bases_[peer]) cudaIpcCloseMemHandle(bases_[peer]);
  }
  if (bases_[rank_]) cudaFree(bases_[rank_]);
  if (hostWords_) cudaFreeHost(hostWords_);
}

std::string CudaIpcMemory::setup() {
  QuietDeviceGuard scope(device_);
  cudaCheck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), rank_,
            "creating the setup stream");
  void* base = nullptr;
  cudaCheck(cudaMalloc(&base, geometry_.bytes()), rank_, "cudaMalloc of the IPC buffer");
  bases_[rank_] = static_cast<char*>(base);
  cudaCheck(cudaMemsetAsync(base, 0, geometry_.bytes(), stream_), rank_,
            "clearing the IPC buffer");
  std::random_device entropy;
  token_ = (static_cast<uint64_t>(entropy()) << 32) | entropy();
  device::FusedHeader init{};
  init.magic = device::kFusedMagic;
  init.layoutVersion = device::kFusedLayoutVersion;
  init.channels = static_cast<uint32_t>(geometry_.channels);
  init.chunkBytes = geometry_.chunkBytes;
  init.token = token_;
  cudaCheck(cudaMemcpyAsync(bases_[rank_] + kIdentityOffset,
                            reinterpret_cast<const char*>(&init) + kIdentityOffset,
                            kIdentityBytes, cudaMemcpyHostToDevice, stream_),
            rank_, "writing the IPC buffer's header");
  void* words = nullptr;
  cudaCheck(cudaHostAlloc(&words, kWordsBytes, cudaHostAllocMapped), rank_,
            "cudaHostAlloc of the error words");
  hostWords_ = static_cast<int64_t*>(words);
  std::memset(words, 0, kWordsBytes);
  hostWords_[kOneWord] = 1;
  void* devWords = nullptr;
  cudaCheck(cudaHostGetDevicePointer(&devWords, words, 0), rank_, "mapping the error words");
  deviceWords_ = static_cast<int64_t*>(devWords);

  BlobWriter control;
  control_.setup(control);
  cudaIpcMemHandle_t handle;
  cudaCheck(cudaIpcGetMemHandle(&handle, base), rank_, "cudaIpcGetMemHandle");
  // Peers must see the cleared flags and the token.
  cudaCheck(cudaStreamSynchronize(stream_), rank_, "finishing the IPC buffer's setup");
  return BlobWriter()
      .putBytes("control", control.str())
      .putBytes("handle", &handle, sizeof(handle))
      .put("token", token_)
      .put("fused_channels", geometry_.channels)
      .put("fused_chunk_bytes", geometry_.chunkBytes)
      .str();
}

std::string CudaIpcMemory::whyNotConnect(int peer, const std::string& blob) const {
  const BlobReader r = readerOf(blob, peer);
  std::string why = control_.whyNotConnect(
      peer, BlobReader(r.bytes("control"), "rank " + std::to_string(peer) +
                                               "'s shm bootstrap blob"));
  if (!why.empty()) return why;
  if (r.get<int>("fused_channels") != geometry_.channels ||
      r.get<size_t>("fused_chunk_bytes") != geometry_.chunkBytes) {
    return "rank " + std::to_string(peer) + " uses another geometry of the fused collectives";
  }
  return "";
}

void CudaIpcMemory::connect(const std::vector<std::string>& blobs) {
  QuietDeviceGuard scope(device_);
  std::vector<BlobReader> controls;
  for (int peer = 0; peer < worldSize_; ++peer) {
    const BlobReader r = readerOf(blobs[peer], peer);
    controls.emplace_back(r.bytes("control"),
                          "rank " + std::to_string(peer) + "'s shm bootstrap blob");
    if (peer == rank_) continue;
    const std::string why = whyNotConnect(peer, blobs[peer]);
    PYDDP_CHECK_COMM(why.empty(), "rank ", rank_, ": cuda_ipc cannot reach ", why);
  }
  control_.connect(controls);
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const BlobReader r = readerOf(blobs[peer], peer);
    cudaIpcMemHandle_t handle;
    r.bytes("handle", &handle, sizeof(handle));
    void* mapped = nullptr;
    cudaCheck(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), rank_,
              ("cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s buffer").c_str());
    bases_[peer] = static_cast<char*>(mapped);
    // Prove access: read the peer's header through the mapping, write this
    // rank's token into its probe slot and read it back.
    device::FusedHeader theirs{};
    cudaCheck(cudaMemcpyAsync(reinterpret_cast<char*>(&theirs) + kIdentityOffset,
                              bases_[peer] + kIdentityOffset, kIdentityBytes,
                              cudaMemcpyDeviceToHost, stream_),
              rank_, "reading a peer's IPC buffer");
    cudaCheck(cudaStreamSynchronize(stream_), rank_, "reading a peer's IPC buffer");
    PYDDP_CHECK_COMM(theirs.magic == device::kFusedMagic &&
                         theirs.layoutVersion == device::kFusedLayoutVersion,
                     "rank ", rank_, ": cuda_ipc: rank ", peer, "'s buffer has an unexpected "
                     "layout (magic ", theirs.magic, ", version ", theirs.layoutVersion,
                     "): different pyddp versions?");
    PYDDP_CHECK_COMM(theirs.token == r.get<uint64_t>("token"), "rank ", rank_,
                     ": cuda_ipc: reading rank ", peer,
                     "'s buffer returned the wrong token: peer memory is not accessible");
    uint64_t seen = 0;
    uint64_t* probe = &header(peer)->probe[rank_];
    cudaCheck(cudaMemcpyAsync(probe, &token_, sizeof(token_), cudaMemcpyHostToDevice, stream_),
              rank_, "writing a peer's IPC buffer");
    cudaCheck(cudaMemcpyAsync(&seen, probe, sizeof(seen), cudaMemcpyDeviceToHost, stream_),
              rank_, "reading back a peer's IPC buffer");
    cudaCheck(cudaStreamSynchronize(stream_), rank_, "reading back a peer's IPC buffer");
    PYDDP_CHECK_COMM(seen == token_, "rank ", rank_, ": cuda_ipc: a write to rank ", peer,
                     "'s buffer did not read back: peer memory is not writable");
  }
}

int64_t CudaIpcMemory::error() const {
  return hostWords_ ? static_cast<volatile int64_t*>(hostWords_)[kErrorWord] : 0;
}

void CudaIpcMemory::abort() {
  if (hostWords_) static_cast<volatile int64_t*>(hostWords_)[kAbortWord] = 1;
}

void CudaIpcMemory::tellPeers() {
  if (!hostWords_ || !stream_) return;
  QuietDeviceGuard scope(device_);
  cudaMemcpyAsync(&header(rank_)->failed.value, hostWords_ + kOneWord, sizeof(uint64_t),
                  cudaMemcpyHostToDevice, stream_);
}

std::string CudaIpcMemory::exportRegion(const void* data, size_t bytes) const {
  QuietDeviceGuard scope(device_);
  size_t allocationBytes = 0;
  void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(const_cast<void*>(data),
                                                                  &allocationBytes);
  const size_t offset = static_cast<size_t>(static_cast<const char*>(data) -
                                            static_cast<const char*>(base));
  PYDDP_CHECK_VALUE(offset + bytes <= allocationBytes, "rank ", rank_, ": a registered CUDA "
                    "tensor must lie in one allocation of torch's caching allocator");
  cudaIpcMemHandle_t handle;
  cudaCheck(cudaIpcGetMemHandle(&handle, base), rank_,
            "cudaIpcGetMemHandle of a registered tensor (memory of an allocator with "
            "expandable segments, PYTORCH_CUDA_ALLOC_CONF, has no IPC handle)");
  return BlobWriter().putBytes("handle", &handle, sizeof(handle)).put("offset", offset).str();
}

// `bytes`: CUDA does not say how long an opened allocation is; the
// engine checked that every rank registered as many.
FusedMemory::PeerRegion CudaIpcMemory::mapRegion(int peer, const std::string& blob,
                                                 size_t /*bytes*/) const {
  QuietDeviceGuard scope(device_);
  const BlobReader r(blob, "rank " + std::to_string(peer) + "'s registered tensor");
  cudaIpcMemHandle_t handle;
  r.bytes("handle", &handle, sizeof(handle));
  std::shared_ptr<const void> held = openedHandles().open(handle, rank_, peer);
  const char* data = static_cast<const char*>(held.get()) + r.get<size_t>("offset");
  return PeerRegion{data, std::move(held)};
}

} // namespace pyddp
