#include "backend/coalesce.h"

#include <ATen/ATen.h>

namespace pyddp {
namespace {

std::vector<at::Tensor> flattened(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return flat;
}

// Writes consecutive slices of `from` into `to`, one per tensor.
void scatterSlices(const at::Tensor& from, const std::vector<at::Tensor>& to) {
  int64_t at = 0;
  for (const auto& t : to) {
    t.copy_(from.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
}

} // namespace

Packed packAllReduce(const std::vector<at::Tensor>& tensors) {
  const at::Tensor flat = at::cat(flattened(tensors));
  return Packed{flat, flat, [flat, tensors] { scatterSlices(flat, tensors); }};
}

Packed packAllGather(const std::vector<at::Tensor>& outputs,
                     const std::vector<at::Tensor>& inputs, int size) {
  const at::Tensor input = at::cat(flattened(inputs));
  const int64_t block = input.numel();
  const at::Tensor output = at::empty({block * size}, input.options());
  return Packed{input, output, [output, outputs, block, size] {
                  int64_t offset = 0;  // of output i in each rank's block
                  for (const auto& o : outputs) {
                    const int64_t n = o.numel() / size;
                    std::vector<at::Tensor> pieces;
                    for (int r = 0; r < size; ++r) {
                      pieces.push_back(output.narrow(0, r * block + offset, n));
                    }
                    o.copy_(at::cat(pieces).view(o.sizes()));
                    offset += n;
                  }
                }};
}

Packed packAllGatherLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                          const std::vector<at::Tensor>& inputs, int size) {
  const at::Tensor input = at::cat(flattened(inputs));
  const int64_t block = input.numel();
  const at::Tensor output = at::empty({block * size}, input.options());
  return Packed{input, output, [output, outputLists, block] {
                  for (size_t r = 0; r < outputLists.size(); ++r) {
                    scatterSlices(output.narrow(0, static_cast<int64_t>(r) * block, block),
                                  outputLists[r]);
                  }
                }};
}

Packed packReduceScatter(const std::vector<at::Tensor>& outputs,
                         const std::vector<at::Tensor>& inputs, int size) {
  std::vector<at::Tensor> blocks;
  blocks.reserve(inputs.size() * size);
  for (int r = 0; r < size; ++r) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t n = outputs[i].numel();
      blocks.push_back(inputs[i].reshape({-1}).narrow(0, r * n, n));
    }
  }
  const at::Tensor input = at::cat(blocks);
  const at::Tensor output = at::empty({input.numel() / size}, input.options());
  return Packed{input, output, [output, outputs] { scatterSlices(output, outputs); }};
}

} // namespace pyddp
