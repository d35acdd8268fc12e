// NcclTransport: NCCL send/recv as a pyddp ring transport, so that pyddp's
// ring algorithms can span hosts. Only compiled in CUDA builds.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "transport/nccl_comm.h"
#include "transport/sendrecv_ring.h"
#include "transport/transport.h"

namespace pyddp {
namespace nccl {

// NCCL send/recv as a pyddp ring transport: the ring verbs of sendrecv::SendRecvRing
// as ncclSend/ncclRecv groups to rank+1 / from rank-1 and the reduce
// kernels of kernels/cuda.h, all on the stream given at construction (the
// engine's internal stream). No peer memory is mapped (peerMemory() is
// null): direct algorithms do not apply. The engine must call flush()
// after every collective's transfer, before it records the collective's
// done event (see SendRecvRing::flush). Calls come from the engine's one
// thread for collectives, with the device current (inside a StreamScope);
// abort() may come from any thread.
//
// Bootstrap: rank 0's setup() blob carries a fresh unique id; every blob
// carries the NCCL version, and connect() refuses mismatched versions.
//
// Descriptor check (enter). A host-side comparison would need a round
// trip to every rank and, on a GPU, a wait for the stream, which would
// serialise the host with the device and lose the overlap DDP relies on.
// Instead every enter() enqueues, ahead of the collective's data, a MAX
// all-reduce of the encoded descriptor (encodeWords of common/descriptor.h:
// 14 words, 112 bytes) and a copy of the result to pinned host memory, and records an
// event; enter() then costs the host a few microseconds and the stream one
// tiny all-reduce. Results are read when their event has fired, at the
// latest by the next enter() that finds them done (or by
// checkDescriptors()), on every rank alike (they all get the same reduced
// words). So a mismatch is reported on every rank, by its next collective
// or its timeout, and never passes silently; the mismatched collective
// itself may have moved garbage or hung until its deadline.
class NcclTransport final : public Transport, private LocalOps, private sendrecv::SendRecvOps {
 public:
  // Results of the descriptor checks in flight: a host more than this many
  // collectives ahead of its GPU waits for the oldest check. DDP keeps a
  // few dozen buckets in flight at most.
  static constexpr int kChecksInFlight = 256;

  NcclTransport(int rank, int worldSize, c10::DeviceIndex device, cudaStream_t stream,
                size_t pieceBytes, std::chrono::milliseconds timeout);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  // Transport
  const char* name() const override { return "nccl"; }
  std::string setup() override;
  std::string whyNotConnect(int peer, const std::string& blob) const override;
  void connect(const std::vector<std::string>& blobs) override;
  void connected() override {}
  void enter(const CollectiveDesc& desc, Deadline deadline) override;
  RingLink& ring() override;
  LocalOps& local() override { return *this; }
  PeerMemory* peerMemory() override { return nullptr; }
  // Aborts the communicator: this rank's kernels stop; peers waiting for
  // it fail at their deadline (NCCL does not tell them).
  void abandon(const std::string& why) override;
  void abort() override;

  // Posts the ring send the last verb left pending (see SendRecvRing::flush).
  void flush() override;
  // Reads every descriptor check whose result has arrived; throws
  // DistBackendError when ranks disagreed.
  void checkDescriptors();

 private:
  // LocalOps (and SendRecvOps' copy), on the stream
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
               size_t count) override;

  // SendRecvOps, on the stream
  void post(const void* send, size_t sendBytes, void* recv, size_t recvBytes) override;
  void toPartial(const kernels::ReduceSpec& spec, void* dst, const void* src,
                 size_t count) override;
  void reducePartial(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                     const void* local, size_t count) override;
  void reduceFinal(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                   const void* local, size_t count) override;

  Communicator& comm();
  // Reads check #i's result (its event has fired); throws on a mismatch.
  void readCheck(uint64_t i);

  const int rank_;
  const int worldSize_;
  const c10::DeviceIndex device_;
  const cudaStream_t stream_;
  const size_t pieceBytes_;
  const std::chrono::milliseconds timeout_;

  std::unique_ptr<Communicator> comm_;
  // Device memory: two ring scratch pieces, then the check's words.
  void* deviceBuffer_ = nullptr;
  // Pinned host memory: kChecksInFlight slots of kDescWords words.
  uint64_t* checkSlots_ = nullptr;
  std::array<cudaEvent_t, kChecksInFlight> checkEvents_{};
  std::array<CollectiveDesc, kChecksInFlight> checkDescs_{};
  uint64_t checksIssued_ = 0;  // checks enqueued
  uint64_t checksRead_ = 0;    // checks read, oldest first
  std::unique_ptr<sendrecv::SendRecvRing> ring_;  // once connected
  Clock::time_point deadline_;
};

} // namespace nccl
} // namespace pyddp
