// Tensors in registered memory (transport/registered.h), for Python.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pyddp {

// A contiguous CPU tensor of `sizes` and `dtype` in registered memory,
// zero-filled; it frees the memory when it is freed.
at::Tensor emptyRegistered(const std::vector<int64_t>& sizes, at::ScalarType dtype);
// Whether `t` is a contiguous CPU tensor wholly in registered memory.
bool isRegistered(const at::Tensor& t);

} // namespace pyddp
