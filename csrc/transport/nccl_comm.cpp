#include "transport/nccl_comm.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <thread>

#include "common/check.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 10, 0)
#error "pyddp needs NCCL >= 2.10 (ncclAvg)"
#endif

namespace pyddp {
namespace nccl {
namespace {

// How often the host polls a nonblocking NCCL call. NCCL answers
// ncclInProgress only while it waits for peers (init, the first use of a
// connection), which takes milliseconds: 100 us adds nothing that matters.
constexpr auto kPollInterval = std::chrono::microseconds(100);

constexpr const char* kInitHint =
    " (every rank must create the group within its timeout; several ranks on one GPU need "
    "NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1; NCCL_DEBUG=WARN prints NCCL's reasons)";

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

ncclRedOp_t redOp(RedOp op, int ranks) {
  switch (op) {
    case RedOp::Sum: return ncclSum;
    case RedOp::Avg: return ranks == 1 ? ncclSum : ncclAvg;
    case RedOp::Product: return ncclProd;
    case RedOp::Min: return ncclMin;
    case RedOp::Max: return ncclMax;
    case RedOp::BitAnd:
    case RedOp::BitOr:
    case RedOp::BitXor:
      PYDDP_CHECK_TYPE(false, "NCCL has no bitwise reduction: ReduceOp.", toString(op),
                       " is not supported on NCCL");
      break;
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

} // namespace nccl
} // namespace pyddp
