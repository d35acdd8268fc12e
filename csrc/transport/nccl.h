// NCCL for pyddp: a communicator whose every host-side wait is bounded
// (shared by NcclBackend and the ring transport), and NcclTransport, NCCL
// send/recv as a pyddp ring transport, so that pyddp's ring algorithms can
// span hosts. Only compiled in CUDA builds.
//
// Communicators are nonblocking (ncclConfig_t::blocking = 0): NCCL then
// returns ncclInProgress instead of blocking the host while it waits for
// peers (init, first-use connection setup), and the host polls with a
// deadline. A collective that waits for a peer on the device is not a host
// wait: the backend's WorkMonitor notices its deadline and aborts the
// communicator, which makes the waiting kernels exit.
//
// Several ranks on one GPU need NCCL >= 2.30 with
// NCCL_MULTI_RANK_GPU_ENABLE=1 (older NCCL refuses with "Duplicate GPU").
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/p2p.h"
#include "transport/transport.h"

namespace pyddp {
namespace nccl {

// The NCCL library's version (ncclGetVersion): {major, minor, patch}.
std::array<int, 3> version();
std::string versionString();

ncclDataType_t dataType(DataType t);
// AVG is ncclAvg (NCCL >= 2.10).
ncclRedOp_t redOp(RedOp op);

// A fresh ncclUniqueId, as NCCL_UNIQUE_ID_BYTES bytes (works without a GPU).
std::string newUniqueId();

// One rank's NCCL communicator on one device. Thread-safe: calls are
// serialised by a mutex that is released while waiting, so abort() (from a
// monitor thread, or teardown) is never stuck behind a waiting call.
class Communicator {
 public:
  // Joins the communicator of `size` ranks named by uniqueId (bytes from
  // newUniqueId() on one rank); waits for the other ranks until deadline.
  Communicator(const std::string& uniqueId, int rank, int size, c10::DeviceIndex device,
               Clock::time_point deadline);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Runs `calls` (NCCL calls that enqueue work on a stream; `what` names
  // them in errors) and waits, until deadline, for NCCL to finish
  // enqueuing. Throws DistBackendError with NCCL's messages; afterwards the
  // communicator is unusable and must be aborted.
  void run(const char* what, const std::function<ncclResult_t(ncclComm_t)>& calls,
           Clock::time_point deadline);
  // "" or the error NCCL found in work already enqueued
  // (ncclCommGetAsyncError), for monitors.
  std::string asyncError();
  // Ends the communicator gracefully (ncclCommFinalize, bounded by
  // deadline, then ncclCommDestroy); falls back to abort(). Returns
  // whether it ended gracefully.
  bool destroy(Clock::time_point deadline);
  // Frees the communicator at once; its operations still running on the
  // device exit (ncclCommAbort). Idempotent.
  void abort();

 private:
  // Polls a nonblocking call's state until it is not ncclInProgress
  // (releasing mu_ between polls), until deadline; throws on failure.
  void settle(std::unique_lock<std::mutex>& lock, ncclResult_t result, const char* what,
              Clock::time_point deadline, const char* hint);
  void abortLocked();

  const int rank_;
  const c10::DeviceIndex device_;
  std::mutex mu_;
  ncclComm_t comm_ = nullptr;  // mu_; null once aborted or destroyed
};

// NCCL send/recv as a pyddp ring transport: the ring verbs of p2p::P2pRing
// as ncclSend/ncclRecv groups to rank+1 / from rank-1 and the reduce
// kernels of kernels/cuda.h, all on the stream given at construction (the
// backend's internal stream). No peer memory is mapped (peerMemory() is
// null): direct algorithms do not apply. The backend must call flush()
// after every collective's transfer, before it records the collective's
// done event (see P2pRing::flush). Calls come from the backend's one
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
// all-reduce of the encoded descriptor (p2p::encodeDesc: 14 words, 112
// bytes) and a copy of the result to pinned host memory, and records an
// event; enter() then costs the host a few microseconds and the stream one
// tiny all-reduce. Results are read when their event has fired, at the
// latest by the next enter() that finds them done (or by
// checkDescriptors()), on every rank alike (they all get the same reduced
// words). So a mismatch is reported on every rank, by its next collective
// or its timeout, and never passes silently; the mismatched collective
// itself may have moved garbage or hung until its deadline.
class NcclTransport final : public Transport, private LocalOps, private p2p::P2pOps {
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
  void enter(const CollectiveDesc& desc, Clock::time_point deadline) override;
  RingLink& ring() override;
  LocalOps& local() override { return *this; }
  PeerMemory* peerMemory() override { return nullptr; }
  // Aborts the communicator: this rank's kernels stop; peers waiting for
  // it fail at their deadline (NCCL does not tell them).
  void abandon(const std::string& why) override;
  void abort() override;

  // Posts the ring send the last verb left pending (see P2pRing::flush).
  void flush() override;
  // Reads every descriptor check whose result has arrived; throws
  // DistBackendError when ranks disagreed.
  void checkDescriptors();

 private:
  // LocalOps, on the stream
  void copy(void* dst, const void* src, size_t bytes) override;
  void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
               size_t count) override;

  // P2pOps, on the stream
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
  std::unique_ptr<p2p::P2pRing> ring_;  // once connected
  Clock::time_point deadline_;
};

} // namespace nccl
} // namespace pyddp
