// Argument checks shared by the engines, done before anything is queued
// (so a refused call leaves the group usable). Messages name the rank, the
// call and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "common/types.h"

namespace pyddp {

class ArgChecks {
 public:
  // `server` names what serves `device`'s tensors in messages, e.g. "this
  // group's shm transport".
  ArgChecks(int rank, int size, c10::Device device, std::string server);

  // A dense tensor of a supported dtype on the device; returns the dtype.
  DataType tensor(const at::Tensor& t, const char* call, const char* what) const;
  // No two elements share memory (results are written into it).
  void writable(const at::Tensor& t, const char* call, const char* what) const;
  // all_gather_single and reduce_scatter_single: one rank-sized tensor and
  // one world-sized tensor of the same dtype, sharing memory (if at all) as
  // one of the world-sized tensor's blocks; returns that dtype.
  DataType single(const char* call, const at::Tensor& output, const at::Tensor& input,
                  bool outputIsWhole) const;
  void op(RedOp op, DataType dtype, const char* call) const;
  void root(int64_t root, const char* call, const char* what) const;
  // Another rank of the group, for point-to-point.
  void peer(int64_t peer, const char* call, const char* what) const;
  // A point-to-point tag: a C int, as torch.distributed's (the tags of the
  // collectives' own messages lie below every int, so none can be taken).
  void tag(int64_t tag, const char* call) const;
  // A world-sized list of tensors each shaped as `input` (in elements and
  // dtype), writable when `written`: all_gather's tensor_list, gather's
  // gather_list, scatter's scatter_list.
  void blockList(const std::vector<at::Tensor>& list, const at::Tensor& input, const char* call,
                 const char* name, bool written = true) const;
  // The one dtype of a coalesced call's tensors (writable when `written`).
  DataType sameType(const std::vector<at::Tensor>& tensors, const char* call, const char* what,
                    bool written) const;
  // A coalesced all-gather (outputIsWhole) or reduce-scatter: as many
  // outputs as inputs, all of one dtype, the outputs writable, and each
  // world-sized tensor world_size times its rank-sized one in elements;
  // returns the dtype.
  DataType coalesced(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                     const char* call, bool outputIsWhole) const;
  // all_gather_coalesced's lists: `inputs` of one dtype, and world_size
  // output lists, each shaped as `inputs` (tensor by tensor, in dtype and
  // shape, as gloo checks them); returns the dtype.
  DataType coalescedLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                          const std::vector<at::Tensor>& inputs, const char* call) const;

  // Element counts and offsets of the world_size blocks of an all-to-all
  // buffer: splits[k] rows (dim 0) each of `row` elements, or equal blocks
  // when `splits` is empty.
  struct Blocks {
    std::vector<size_t> counts;
    std::vector<size_t> offsets;
  };
  // all_to_all_single's tensors and splits, checked: one dtype, a writable
  // output, rows (dim 0) of one size, splits that add up to the rows.
  struct AllToAll {
    DataType dtype;
    int64_t row;  // elements per row
    Blocks out;
    Blocks in;
  };
  AllToAll allToAll(const at::Tensor& output, const at::Tensor& input,
                    const std::vector<int64_t>& outputSplits,
                    const std::vector<int64_t>& inputSplits, const char* call) const;
  // all_to_all's lists: world_size inputs and outputs of one dtype, the
  // outputs writable; block k of each is its tensor k, in elements (row 1).
  AllToAll allToAllLists(const std::vector<at::Tensor>& outputs,
                         const std::vector<at::Tensor>& inputs, const char* call) const;

 private:
  // `output`'s dtype equals `input`'s, both checked by tensor(); returns it.
  DataType pair(const at::Tensor& output, const at::Tensor& input, const char* call) const;
  int64_t rowElements(const at::Tensor& output, const at::Tensor& input, const char* call) const;
  Blocks splits(const at::Tensor& t, const std::vector<int64_t>& splits, int64_t row,
                const char* call, const char* what) const;

  const int rank_;
  const int size_;
  const c10::Device device_;
  const std::string server_;
};

} // namespace pyddp
