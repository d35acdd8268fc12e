// The launchers of cuda.h: one __global__ template over the grid bodies of
// elementwise.h. Which body runs, on which split, is decided by
// grid_launch.h exactly as for the emulated grid the CPU tests run; this
// file adds only the launch configuration and the error check. Kept lean
// (no torch headers beyond c10's exception and scalar types) so it compiles
// in seconds.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/check.h"
#include "kernels/cuda.h"
#include "kernels/grid_launch.h"

namespace pyddp {
namespace kernels {
namespace cuda {
namespace {

static_assert(kMaxSources == grid::kMaxSources, "cuda.h and elementwise.h disagree on sources");

// Launch configuration. Initial values, not yet measured on a GPU (none was
// available when they were chosen): 512 threads per block is what NCCL's
// simple protocol uses for its copy/reduce loops; 1024 blocks is about 8 per
// SM on a 132-SM H100, more than can be resident at once, so one launch
// fills the GPU and the grid-stride loop covers larger inputs. Both to be
// tuned with the GPU benchmark (smaller grids may interfere less with
// compute running beside a collective).
constexpr unsigned kThreads = 512;
constexpr unsigned kMaxBlocks = 1024;

template <typename F>
__global__ void __launch_bounds__(kThreads) elementwise(F f, size_t count, grid::Split split) {
  grid::gridMap(grid::GridPos{blockIdx.x, gridDim.x, threadIdx.x, blockDim.x}, f, count, split);
}

struct StreamLaunch {
  cudaStream_t stream;
  const char* name;

  template <typename F>
  void operator()(const F& f, size_t count, const grid::Split& split) const {
    const size_t blocks = (split.steps(count, F::kWidth) + kThreads - 1) / kThreads;
    elementwise<F><<<static_cast<unsigned>(std::min<size_t>(blocks, kMaxBlocks)), kThreads, 0,
                     stream>>>(f, count, split);
    const cudaError_t err = cudaGetLastError();
    PYDDP_CHECK(err == cudaSuccess, "launching the CUDA ", name, " kernel (", count,
                " elements) failed: ", cudaGetErrorString(err));
  }
};

} // namespace

void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count,
               cudaStream_t stream) {
  grid::toPartial(spec, dst, src, count, StreamLaunch{stream, "toPartial"});
}

void reducePartial(const ReduceSpec& spec, void* dst, const void* partial, const void* local,
                   size_t count, cudaStream_t stream) {
  grid::reducePartial(spec, dst, partial, local, count, StreamLaunch{stream, "reducePartial"});
}

void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* partial,
                 const void* local, size_t count, cudaStream_t stream) {
  grid::reduceFinal(spec, dst, dst2, partial, local, count, StreamLaunch{stream, "reduceFinal"});
}

void reduceN(const ReduceSpec& spec, void* dst, const void* const* src, int nsrc, size_t count,
             cudaStream_t stream) {
  grid::reduceN(spec, dst, src, nsrc, count, StreamLaunch{stream, "reduceN"});
}

void copy(void* dst, void* dst2, const void* src, size_t bytes, cudaStream_t stream) {
  grid::copy(dst, dst2, src, bytes, StreamLaunch{stream, "copy"});
}

} // namespace cuda
} // namespace kernels
} // namespace pyddp
