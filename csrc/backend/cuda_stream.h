// A GPU engine's internal stream, and a collective's visit to it: the
// internal stream first waits for everything the caller queued on its
// current stream, then is the current stream while the collective is
// enqueued (so ATen ops for temporaries and copies run there too); tensors
// that cross streams are protected with record_stream. As torch's
// ProcessGroupNCCL does. Only compiled in CUDA builds.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "backend/cuda_work.h"

namespace pyddp {
namespace gpu {

// An engine's internal stream on one device: a stream of its own, not one
// of torch's pool (which other code shares) nor an earlier engine's: a
// collective that waits on a peer must never hold up unrelated work queued
// behind it. It outlives the engine (cuda_stream.cpp says why).
class CollectiveStream {
 public:
  explicit CollectiveStream(c10::Device device);
  ~CollectiveStream();
  CollectiveStream(const CollectiveStream&) = delete;
  CollectiveStream& operator=(const CollectiveStream&) = delete;
  c10::Device device() const { return device_; }
  const c10::cuda::CUDAStream& stream() const { return stream_; }

 private:
  friend class StreamScope;
  const c10::Device device_;
  const c10::cuda::CUDAStream stream_;
  // Recorded on the caller's stream by each StreamScope. One event serves
  // every collective: cudaStreamWaitEvent captures the event's state when
  // it is called, so re-recording it later does not affect earlier waits.
  Event callerReady_;
};

// One collective's visit to the internal stream. Construction: the
// internal stream waits for the caller's current stream on that device,
// and becomes the current stream. Destruction: the caller's stream (and
// device) are current again. Not thread-safe: the executor serialises
// collectives (their order on the stream is their order on every rank).
class StreamScope {
 public:
  explicit StreamScope(CollectiveStream& s);
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

  cudaStream_t stream() const { return internal_.stream(); }
  // `t` (allocated by the caller, on its stream) is used by the collective:
  // the caching allocator must not hand its memory to another tensor before
  // the internal stream is past this point, even if the caller frees it.
  void use(const at::Tensor& t) const;

 private:
  const c10::cuda::CUDAStream internal_;
  c10::cuda::CUDAStreamGuard guard_;
};

} // namespace gpu
} // namespace pyddp
