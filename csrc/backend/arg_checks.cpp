#include "backend/arg_checks.h"

#include <cstddef>
#include <limits>

#include <ATen/MemoryOverlap.h>

#include "backend/torch_types.h"
#include "common/check.h"

namespace pyddp {

ArgChecks::ArgChecks(int rank, int size, c10::Device device, std::string server)
    : rank_(rank), size_(size), device_(device), server_(std::move(server)) {}

DataType ArgChecks::tensor(const at::Tensor& t, const char* call,
                                  const char* what) const {
  PYDDP_CHECK_TYPE(t.defined(), "rank ", rank_, ": ", call, ": ", what,
                   " is an undefined tensor");
  PYDDP_CHECK_TYPE(t.device() == device_, "rank ", rank_, ": ", call, ": ", what, " is on ",
                   t.device(), "; ", server_, " serves ", device_,
                   " tensors only");
  PYDDP_CHECK_TYPE(t.layout() == at::kStrided, "rank ", rank_, ": ", call, ": ", what,
                   " has layout ", t.layout(), "; only dense (strided) tensors are supported");
  const auto dtype = dataTypeOf(t.scalar_type());
  PYDDP_CHECK_TYPE(dtype.has_value(), "rank ", rank_, ": ", call, ": ", what, " has dtype ",
                   t.scalar_type(), "; supported: float32, float64, float16, "
                   "bfloat16, int8, uint8, int32, int64");
  return *dtype;
}
DataType ArgChecks::pair(const at::Tensor& output, const at::Tensor& input,
                         const char* call) const {
  const DataType dtype = tensor(input, call, "input");
  PYDDP_CHECK_TYPE(tensor(output, call, "output") == dtype, "rank ", rank_, ": ", call,
                   ": output dtype ", output.scalar_type(), " differs from input dtype ",
                   input.scalar_type());
  return dtype;
}

DataType ArgChecks::single(const char* call, const at::Tensor& output,
                                  const at::Tensor& input, bool outputIsWhole) const {
  const DataType dtype = pair(output, input, call);
  writable(output, call, "output");
  const at::Tensor& whole = outputIsWhole ? output : input;
  const at::Tensor& block = outputIsWhole ? input : output;
  PYDDP_CHECK_VALUE(whole.numel() == block.numel() * size_, "rank ", rank_, ": ", call, ": ",
                    outputIsWhole ? "output" : "input", " has ", whole.numel(),
                    " elements, expected ", block.numel() * size_, " (world_size ", size_,
                    " x ", outputIsWhole ? "input" : "output", "'s ", block.numel(), ")");
  // The two may share memory only as a whole block of the world-sized one
  // (in place: the rank's own): the algorithms read and write them block by
  // block, piece by piece, and a block shifted by part of one would be
  // written before it is read. A tensor that is not contiguous is copied
  // before the collective and so shares nothing with it.
  if (whole.is_contiguous() && block.is_contiguous() &&
      at::get_overlap_status(whole, block) != at::MemOverlapStatus::No) {
    const auto offset = static_cast<const char*>(block.const_data_ptr()) -
        static_cast<const char*>(whole.const_data_ptr());
    PYDDP_CHECK_VALUE(offset >= 0 && offset % static_cast<ptrdiff_t>(block.nbytes()) == 0,
                      "rank ", rank_, ": ", call, ": ", outputIsWhole ? "input" : "output",
                      " overlaps ", outputIsWhole ? "output" : "input",
                      " other than as one of its blocks (in place, it is block ", rank_,
                      ": elements ", rank_ * block.numel(), " to ",
                      (rank_ + 1) * block.numel(), ")");
  }
  return dtype;
}
void ArgChecks::writable(const at::Tensor& t, const char* call,
                                const char* what) const {
  PYDDP_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, "rank ", rank_,
                    ": ", call, ": ", what, " has elements that share memory (an "
                    "expand()ed view?); results cannot be written into it");
}
void ArgChecks::op(RedOp op, DataType dtype, const char* call) const {
  PYDDP_CHECK_TYPE(op != RedOp::Avg || isFloating(dtype), "rank ", rank_, ": ", call,
                   ": ReduceOp.AVG needs a floating-point tensor, got ",
                   toString(dtype), "; use SUM and divide");
  if (!isBitwise(op)) return;
  PYDDP_CHECK_TYPE(!isFloating(dtype), "rank ", rank_, ": ", call, ": ReduceOp.", toString(op),
                   " needs an integer tensor (int8, uint8, int32, int64), got ",
                   toString(dtype));
  // NCCL has no bitwise reductions; pyddp's own CUDA transports (cuda_ipc,
  // nccl_ring) would run the grid kernels' bitwise operators, which no GPU
  // test covers yet, so CUDA tensors are refused alike.
  PYDDP_CHECK_TYPE(device_.is_cpu(), "rank ", rank_, ": ", call, ": ReduceOp.", toString(op),
                   " is supported on CPU tensors only (NCCL has no bitwise reductions)");
}
void ArgChecks::root(int64_t root, const char* call, const char* what) const {
  PYDDP_CHECK_VALUE(root >= 0 && root < size_, "rank ", rank_, ": ", call, ": ", what, "=",
                    root, " is not a rank of this group (world_size ", size_, ")");
}

void ArgChecks::peer(int64_t peer, const char* call, const char* what) const {
  root(peer, call, what);
  PYDDP_CHECK_VALUE(peer != rank_, "rank ", rank_, ": ", call, ": ", what, "=", peer,
                    " must be another rank of this group, not this rank");
}

void ArgChecks::tag(int64_t tag, const char* call) const {
  PYDDP_CHECK_VALUE(tag >= std::numeric_limits<int32_t>::min() &&
                        tag <= std::numeric_limits<int32_t>::max(),
                    "rank ", rank_, ": ", call, ": tag=", tag, " is not a 32-bit int (tags range "
                    "from ", std::numeric_limits<int32_t>::min(), " to ",
                    std::numeric_limits<int32_t>::max(), ", as torch.distributed's)");
}

void ArgChecks::blockList(const std::vector<at::Tensor>& list, const at::Tensor& input,
                          const char* call, const char* name, bool written) const {
  const std::string entry = std::string(name) + " entry";
  PYDDP_CHECK_VALUE(static_cast<int>(list.size()) == size_, "rank ", rank_, ": ", call, ": ",
                    name, " has ", list.size(), " tensors, expected world_size = ", size_);
  for (const auto& t : list) {
    PYDDP_CHECK_TYPE(tensor(t, call, entry.c_str()) == tensor(input, call, "input"), "rank ",
                     rank_, ": ", call, ": ", name, " entry dtype ", t.scalar_type(),
                     " differs from input dtype ", input.scalar_type());
    PYDDP_CHECK_VALUE(t.numel() == input.numel(), "rank ", rank_, ": ", call, ": ", name,
                      " entry has ", t.numel(), " elements, expected ", input.numel(),
                      " (the input's)");
    if (written) writable(t, call, entry.c_str());
  }
  // The input may be one of the entries (in place), and otherwise share no
  // memory with them, as in single(): a block shifted by part of one would
  // be written before it is read.
  if (!input.is_contiguous()) return;
  for (size_t k = 0; k < list.size(); ++k) {
    if (!list[k].is_contiguous()) continue;
    const auto overlap = at::get_overlap_status(list[k], input);
    PYDDP_CHECK_VALUE(overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::Full,
                      "rank ", rank_, ": ", call, ": ", name, " entry ", k,
                      " overlaps the input other than as the whole input");
  }
}

DataType ArgChecks::sameType(const std::vector<at::Tensor>& tensors, const char* call,
                             const char* what, bool written) const {
  PYDDP_CHECK_VALUE(!tensors.empty(), "rank ", rank_, ": ", call, ": no ", what, " tensors");
  const DataType dtype = tensor(tensors[0], call, what);
  for (const auto& t : tensors) {
    PYDDP_CHECK_TYPE(tensor(t, call, what) == dtype, "rank ", rank_, ": ", call, ": every ",
                     what, " must have dtype ", tensors[0].scalar_type(), ", got ",
                     t.scalar_type());
    if (written) writable(t, call, what);
  }
  return dtype;
}

DataType ArgChecks::coalesced(const std::vector<at::Tensor>& outputs,
                              const std::vector<at::Tensor>& inputs, const char* call,
                              bool outputIsWhole) const {
  const DataType dtype = sameType(inputs, call, "input", false);
  PYDDP_CHECK_VALUE(outputs.size() == inputs.size(), "rank ", rank_, ": ", call, ": ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  PYDDP_CHECK_TYPE(sameType(outputs, call, "output", true) == dtype, "rank ", rank_, ": ", call,
                   ": outputs and inputs differ in dtype");
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& whole = outputIsWhole ? outputs[i] : inputs[i];
    const at::Tensor& block = outputIsWhole ? inputs[i] : outputs[i];
    PYDDP_CHECK_VALUE(whole.numel() == block.numel() * size_, "rank ", rank_, ": ", call, ": ",
                      outputIsWhole ? "output " : "input ", i, " has ", whole.numel(),
                      " elements, expected ", block.numel() * size_, " (world_size x ",
                      outputIsWhole ? "input " : "output ", i, ")");
  }
  return dtype;
}

DataType ArgChecks::coalescedLists(const std::vector<std::vector<at::Tensor>>& outputLists,
                                   const std::vector<at::Tensor>& inputs,
                                   const char* call) const {
  const DataType dtype = sameType(inputs, call, "input", false);
  PYDDP_CHECK_VALUE(static_cast<int>(outputLists.size()) == size_, "rank ", rank_, ": ", call,
                    ": got ", outputLists.size(), " output lists, expected world_size = ", size_);
  for (size_t r = 0; r < outputLists.size(); ++r) {
    const auto& list = outputLists[r];
    PYDDP_CHECK_VALUE(list.size() == inputs.size(), "rank ", rank_, ": ", call, ": output list ",
                      r, " has ", list.size(), " tensors, expected ", inputs.size(),
                      " (one per input)");
    for (size_t i = 0; i < list.size(); ++i) {
      PYDDP_CHECK_TYPE(tensor(list[i], call, "output") == dtype, "rank ", rank_, ": ", call,
                       ": output ", i, " of list ", r, " has dtype ", list[i].scalar_type(),
                       ", expected ", inputs[i].scalar_type(), " (input ", i, "'s)");
      PYDDP_CHECK_VALUE(list[i].sizes() == inputs[i].sizes(), "rank ", rank_, ": ", call,
                        ": output ", i, " of list ", r, " has shape ", list[i].sizes(),
                        ", expected ", inputs[i].sizes(), " (input ", i, "'s)");
      writable(list[i], call, "output");
    }
  }
  return dtype;
}

ArgChecks::AllToAll ArgChecks::allToAll(const at::Tensor& output, const at::Tensor& input,
                                        const std::vector<int64_t>& outputSplits,
                                        const std::vector<int64_t>& inputSplits,
                                        const char* call) const {
  AllToAll a;
  a.dtype = pair(output, input, call);
  writable(output, call, "output");
  a.row = rowElements(output, input, call);
  a.out = splits(output, outputSplits, a.row, call, "output");
  a.in = splits(input, inputSplits, a.row, call, "input");
  return a;
}

ArgChecks::AllToAll ArgChecks::allToAllLists(const std::vector<at::Tensor>& outputs,
                                             const std::vector<at::Tensor>& inputs,
                                             const char* call) const {
  PYDDP_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ &&
                        static_cast<int>(inputs.size()) == size_,
                    "rank ", rank_, ": ", call, ": got ", outputs.size(), " outputs and ",
                    inputs.size(), " inputs, expected world_size = ", size_, " of each");
  AllToAll a;
  a.dtype = sameType(inputs, call, "input", false);
  PYDDP_CHECK_TYPE(sameType(outputs, call, "output", true) == a.dtype, "rank ", rank_, ": ",
                   call, ": every input and output must have dtype ", inputs[0].scalar_type());
  a.row = 1;
  size_t inAt = 0, outAt = 0;
  for (int k = 0; k < size_; ++k) {
    a.in.counts.push_back(inputs[k].numel());
    a.in.offsets.push_back(inAt);
    inAt += inputs[k].numel();
    a.out.counts.push_back(outputs[k].numel());
    a.out.offsets.push_back(outAt);
    outAt += outputs[k].numel();
  }
  return a;
}

int64_t ArgChecks::rowElements(const at::Tensor& output, const at::Tensor& input,
                               const char* call) const {
  auto row = [](const at::Tensor& t) {
    int64_t n = 1;
    for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
    return n;
  };
  PYDDP_CHECK_VALUE(row(output) == row(input), "rank ", rank_, ": ", call, ": output rows have ",
                    row(output), " elements, input rows ", row(input),
                    "; the tensors must agree in every dimension but the first");
  return row(input);
}

ArgChecks::Blocks ArgChecks::splits(const at::Tensor& t, const std::vector<int64_t>& splits,
                                    int64_t row, const char* call, const char* what) const {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  Blocks b;
  if (splits.empty()) {
    PYDDP_CHECK_VALUE(rows % size_ == 0, "rank ", rank_, ": ", call, ": ", what, " has ", rows,
                      " rows, which world_size ", size_, " does not divide; pass ", what,
                      "_split_sizes");
    b.counts.assign(size_, static_cast<size_t>(rows / size_ * row));
  } else {
    PYDDP_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "rank ", rank_, ": ", call,
                      ": ", what, "_split_sizes has ", splits.size(),
                      " entries, expected world_size = ", size_);
    int64_t sum = 0;
    for (int64_t s : splits) {
      PYDDP_CHECK_VALUE(s >= 0, "rank ", rank_, ": ", call, ": ", what, "_split_sizes holds ", s,
                        "; sizes cannot be negative");
      sum += s;
      b.counts.push_back(static_cast<size_t>(s * row));
    }
    PYDDP_CHECK_VALUE(sum == rows, "rank ", rank_, ": ", call, ": ", what,
                      "_split_sizes add up to ", sum, " rows, but ", what, " has ", rows);
  }
  size_t at = 0;
  for (size_t c : b.counts) {
    b.offsets.push_back(at);
    at += c;
  }
  return b;
}

} // namespace pyddp
