#include "backend/executor.h"

#include "backend/cpu_executor.h"
#ifdef PYDDP_WITH_CUDA
#include "backend/device_executor.h"
#endif

namespace pyddp {

EngineExecutor makeExecutor(int rank, c10::Device device, std::chrono::milliseconds timeout) {
  EngineExecutor made;
  if (device.is_cpu()) {
    auto cpu = std::make_unique<CpuExecutor>(rank, timeout.count());
    made.cpu = cpu.get();
    made.owner = std::move(cpu);
  } else {
#ifdef PYDDP_WITH_CUDA
    auto gpu = std::make_unique<DeviceExecutor>(rank, device, timeout);
    made.device = gpu.get();
    made.owner = std::move(gpu);
#endif
  }
  return made;
}

} // namespace pyddp
