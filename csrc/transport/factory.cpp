#include "transport/factory.h"

#include "common/check.h"
#include "transport/shm.h"

#ifdef PYDDP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "transport/nccl_transport.h"
#endif

namespace pyddp {

std::vector<std::string> transportNames() {
#ifdef PYDDP_WITH_CUDA
  return {"shm", "nccl"};
#else
  return {"shm"};
#endif
}

std::string whyNotTransport(const std::string& name, const TransportArgs& args) {
  const bool cpu = args.device < 0;
  if (name == "shm") return cpu ? "" : "shm serves CPU tensors, not CUDA tensors";
  if (name != "nccl") return "there is no transport named '" + name + "'";
#ifdef PYDDP_WITH_CUDA
  if (cpu) return name + " serves CUDA tensors, not CPU tensors";
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
  return std::make_unique<nccl::NcclTransport>(
      args.rank, args.size, static_cast<c10::DeviceIndex>(args.device), stream,
      args.options.slotBytes, std::chrono::milliseconds(args.options.timeoutMs));
#else
  return nullptr;  // unreachable: whyNotTransport refused
#endif
}

} // namespace pyddp
