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
  QuietDeviceGuard guard(device_.index());
  cudaStreamSynchronize(stream_.stream());
  cudaStreamDestroy(stream_.stream());
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
