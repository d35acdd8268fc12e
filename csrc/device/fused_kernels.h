// The fused collectives' kernel: one launch per collective, a thread block
// per channel running programs.h's channel program. Only compiled in CUDA
// builds (PYDDP_WITH_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include "common/types.h"
#include "device/programs.h"

namespace pyddp {
namespace device {

// Enqueues collective `a` on `stream` (blocks of `threads` threads, one per
// channel); throws, naming `rank`, if the launch fails.
void launchFused(const FusedArgs& a, DataType dtype, RedOp op, int threads, cudaStream_t stream,
                 int rank);

} // namespace device
} // namespace pyddp
