// Coalesced collectives as one collective over one flat buffer: packs the
// tensors of a call into the buffer a single all-reduce, all-gather or
// reduce-scatter moves, and unpacks the result. Shared by the engines, so
// every engine lays the buffers out alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace pyddp {

struct Packed {
  at::Tensor input;
  at::Tensor output;  // may be `input` (all-reduce, in place)
  // Copies the collective's result from `output` into the caller's tensors.
  std::function<void()> unpack;
};

// tensors[i] reduced in place: input = output = their concatenation.
Packed packAllReduce(const std::vector<at::Tensor>& tensors);
// outputs[i] (size x inputs[i].numel() elements) = every rank's inputs[i]:
// input = concat(inputs); output = size blocks of that length, rank r's
// block holding rank r's inputs in order.
Packed packAllGather(const std::vector<at::Tensor>& outputs,
                     const std::vector<at::Tensor>& inputs, int size);
// outputLists[r][i] (shaped as inputs[i]) = rank r's inputs[i]: input and
// output as packAllGather's.
Packed packAllGatherLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                          const std::vector<at::Tensor>& inputs, int size);
// outputs[i] = block rank of inputs[i] (size x outputs[i].numel() elements)
// reduced over the ranks: input = size blocks, block r holding block r of
// every input in order; output = concat(outputs).
Packed packReduceScatter(const std::vector<at::Tensor>& outputs,
                         const std::vector<at::Tensor>& inputs, int size);

} // namespace pyddp
