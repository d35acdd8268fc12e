#include "backend/cuda_stream.h"

#include "common/check.h"
#include "common/cuda_device.h"

namespace pyddp {
namespace gpu {

namespace {
cudaStream_t createStream(c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = nullptr;
  checkCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            "creating a collective stream");
  return stream;
}
} // namespace

CollectiveStream::CollectiveStream(c10::Device device)
    : device_(device),
      stream_(c10::cuda::getStreamFromExternal(createStream(device), device.index())),
      callerReady_(device.index()) {}

CollectiveStream::~CollectiveStream() {
  // Whatever is still queued must not touch freed memory: let it drain.
  // Errors are ignored (a destructor cannot report them).
  //
  // The stream itself is never destroyed. A tensor a collective used carries
  // it in its record_stream set, and whenever the caller frees that tensor
  // (after the group is gone, too) the caching allocator records an event on
  // the stream; on a destroyed stream that fails inside the tensor's
  // destructor and aborts the process (seen on an H200: a bench rank that
  // destroyed a group, then freed a tensor the group had reduced). Nor is it
  // handed to a later engine, so no two engines ever share a stream's order.
  // A process keeps one stream per GPU engine it made.
  QuietDeviceGuard guard(device_.index());
  cudaStreamSynchronize(stream_.stream());
}

namespace {
// The internal stream, after making it wait for the caller's current
// stream (read before the scope makes the internal stream current).
c10::cuda::CUDAStream afterCaller(CollectiveStream& s, Event& callerReady) {
  c10::cuda::CUDAGuard device(s.device());
  callerReady.record(c10::cuda::getCurrentCUDAStream(s.device().index()).stream());
  callerReady.block(s.stream().stream());
  return s.stream();
}
} // namespace

StreamScope::StreamScope(CollectiveStream& s)
    : internal_(afterCaller(s, s.callerReady_)), guard_(internal_.unwrap()) {}

void StreamScope::use(const at::Tensor& t) const {
  if (t.defined() && t.is_cuda()) t.record_stream(internal_.unwrap());
}

} // namespace gpu
} // namespace pyddp
