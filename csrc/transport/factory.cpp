#include "transport/factory.h"

#include "common/check.h"
#include "transport/shm.h"

#ifdef PYDDP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "transport/cuda_ipc.h"
#include "transport/nccl_transport.h"
#endif

namespace pyddp {

std::vector<std::string> transportNames() {
#ifdef PYDDP_WITH_CUDA
  return {"shm", "cuda_ipc", "nccl"};
#else
  return {"shm"};
#endif
}

std::string whyNotTransport(const std::string& name, const TransportArgs& args) {
  const bool cpu = args.device < 0;
  if (name == "shm") return cpu ? "" : "shm serves CPU tensors, not CUDA tensors";
  if (name != "cuda_ipc" && name != "nccl") return "there is no transport named '" + name + "'";
#ifdef PYDDP_WITH_CUDA
  if (cpu) return name + " serves CUDA tensors, not CPU tensors";
  if (name == "cuda_ipc" && args.size > ipc::kMaxRanks) {
    return "cuda_ipc serves at most " + std::to_string(ipc::kMaxRanks) + " ranks, not " +
        std::to_string(args.size);
  }
  return "";
#else
  return "pyddp was built without CUDA, so it has no " + name +
      " transport (rebuild against a CUDA build of torch with nvcc installed)";
#endif
}

std::unique_ptr<Transport> makeTransport(const std::string& name, const TransportArgs& args) {
  const std::string why = whyNotTransport(name, args);
  PYDDP_CHECK_VALUE(why.empty(), "rank ", args.rank, ": ", why);
  if (name == "shm") return std::make_unique<shm::ShmTransport>(args.rank, args.size, args.options);
#ifdef PYDDP_WITH_CUDA
  const auto stream = static_cast<cudaStream_t>(args.stream);
  if (name == "cuda_ipc") {
    return std::make_unique<ipc::CudaIpcTransport>(args.rank, args.size, args.options,
                                                   args.device, stream);
  }
  return std::make_unique<nccl::NcclTransport>(
      args.rank, args.size, static_cast<c10::DeviceIndex>(args.device), stream,
      args.options.slotBytes, std::chrono::milliseconds(args.options.timeoutMs));
#else
  return nullptr;  // unreachable: whyNotTransport refused
#endif
}

} // namespace pyddp
