// The fused kernel: programs.h's channel program, one thread block per
// channel. Lean on purpose (docs/building.md: every include costs compile
// time): the CUDA runtime, the plain program headers and the checks.
#include <cuda_runtime.h>

#include "common/check.h"
#include "device/fused_kernels.h"
#include "kernels/reduce.h"

namespace pyddp {
namespace device {
namespace {

template <typename T, typename Op>
__global__ void fused(FusedArgs a) {
  __shared__ int shared;
  runChannel<T, Op>(a, static_cast<int>(blockIdx.x),
                    Team{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)}, &shared);
}

} // namespace

void launchFused(const FusedArgs& a, DataType dtype, RedOp op, int threads, cudaStream_t stream,
                 int rank) {
  const unsigned blocks = a.protocol == Protocol::Barrier ? 1u : static_cast<unsigned>(a.channels);
  // The bitwise operators never reach a CUDA tensor (ArgChecks::op refuses
  // them): only the arithmetic ones are instantiated, for every dtype.
  PYDDP_CHECK(!isBitwise(op), "rank ", rank, ": the fused kernels have no ", toString(op));
  kernels::dispatchType(dtype, [&](auto t) {
    using T = decltype(t);
    switch (op) {
      case RedOp::Sum:
      case RedOp::Avg: fused<T, kernels::SumOp><<<blocks, threads, 0, stream>>>(a); break;
      case RedOp::Product: fused<T, kernels::ProdOp><<<blocks, threads, 0, stream>>>(a); break;
      case RedOp::Min: fused<T, kernels::MinOp><<<blocks, threads, 0, stream>>>(a); break;
      case RedOp::Max: fused<T, kernels::MaxOp><<<blocks, threads, 0, stream>>>(a); break;
      default: break;
    }
  });
  const cudaError_t err = cudaGetLastError();
  PYDDP_CHECK(err == cudaSuccess, "rank ", rank, ": launching the fused ", toString(op),
              " kernel on ", blocks, " channels failed: ", cudaGetErrorString(err));
}

} // namespace device
} // namespace pyddp
