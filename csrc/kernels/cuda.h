// CUDA element-wise kernels over raw device buffers: the same operations
// and arithmetic as cpu.h (bodies shared through reduce.h), enqueued on a
// stream. Only compiled in CUDA builds (PYDDP_WITH_CUDA). Every pointer may
// be any device address this process can read or write, including a peer's
// buffer mapped with CUDA IPC; each launch returns at once and reports
// launch errors by throwing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/cpu.h"

namespace pyddp {
namespace kernels {
namespace cuda {

// Most sources reduceN takes in one launch (they travel as a kernel argument).
constexpr int kMaxSources = 16;

// dst (partials) = src (elements), converted.
void toPartial(const ReduceSpec& spec, void* dst, const void* src, size_t count,
               cudaStream_t stream);
// dst (partials) = partial op local (elements).
void reducePartial(const ReduceSpec& spec, void* dst, const void* partial,
                   const void* local, size_t count, cudaStream_t stream);
// dst (elements) = finish(partial op local); dst2, when not null, too.
void reduceFinal(const ReduceSpec& spec, void* dst, void* dst2, const void* partial,
                 const void* local, size_t count, cudaStream_t stream);
// dst = finish(src[0] op ... op src[nsrc-1]), in source order; nsrc <= kMaxSources.
void reduceN(const ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
             size_t count, cudaStream_t stream);
// dst = src, bytes long; dst2, when not null, too. A kernel rather than
// cudaMemcpyAsync, so that one source read feeds both copies.
void copy(void* dst, void* dst2, const void* src, size_t bytes, cudaStream_t stream);

} // namespace cuda
} // namespace kernels
} // namespace pyddp
