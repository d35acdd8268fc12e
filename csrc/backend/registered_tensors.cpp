#include "backend/registered_tensors.h"

#include "common/check.h"
#include "transport/registered.h"

namespace pyddp {

at::Tensor emptyRegistered(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  size_t bytes = c10::elementSize(dtype);
  for (int64_t d : sizes) {
    PYDDP_CHECK_VALUE(d >= 0, "empty: negative size in ", sizes);
    PYDDP_CHECK_VALUE(!__builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes),
                      "empty: ", sizes, " is too large");
  }
  void* data = registered::allocate(bytes);
  try {
    return at::from_blob(data, sizes, [](void* p) { registered::release(p); },
                         at::TensorOptions().dtype(dtype).device(at::kCPU));
  } catch (...) {
    registered::release(data);
    throw;
  }
}

bool isRegistered(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() &&
         registered::locate(t.data_ptr(), t.nbytes()).serial != 0;
}

} // namespace pyddp
