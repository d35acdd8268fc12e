#include "backend/sparse.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "backend/torch_types.h"
#include "common/check.h"

namespace pyddp {
namespace sparse {
namespace {

enum Word : int64_t { kDtype = 0, kSparseDim = 1, kDenseDim = 2, kNnz = 3, kSizes = 4 };

int64_t denseNumel(const std::vector<int64_t>& sizes, int64_t sparseDim) {
  int64_t n = 1;
  for (size_t d = static_cast<size_t>(sparseDim); d < sizes.size(); ++d) n *= sizes[d];
  return n;
}

std::string describe(const int64_t* h) {
  std::vector<int64_t> sizes(h + kSizes, h + kSizes + h[kSparseDim] + h[kDenseDim]);
  return c10::str("sizes ", c10::IntArrayRef(sizes), ", sparse_dim ", h[kSparseDim], ", dtype ",
                  static_cast<at::ScalarType>(h[kDtype]));
}

} // namespace

at::Tensor coalescedInput(const at::Tensor& tensor, RedOp op, int rank, c10::Device device,
                          const char* call) {
  PYDDP_CHECK_TYPE(tensor.layout() == at::kSparse, "rank ", rank, ": ", call, ": tensor has "
                   "layout ", tensor.layout(), "; of the sparse layouts only COO "
                   "(torch.sparse_coo) is supported");
  PYDDP_CHECK_TYPE(tensor.device() == device, "rank ", rank, ": ", call, ": tensor is on ",
                   tensor.device(), "; this group serves ", device, " tensors");
  PYDDP_CHECK_TYPE(dataTypeOf(tensor.scalar_type()).has_value(), "rank ", rank, ": ", call,
                   ": tensor has dtype ", tensor.scalar_type(), "; supported: float32, float64, "
                   "float16, bfloat16, int8, uint8, int32, int64");
  PYDDP_CHECK_VALUE(op == RedOp::Sum, "rank ", rank, ": ", call, ": ReduceOp.", toString(op),
                    " on a sparse tensor; sparse tensors are all-reduced with ReduceOp.SUM only "
                    "(as gloo does)");
  PYDDP_CHECK_VALUE(tensor.dim() <= kMaxDims, "rank ", rank, ": ", call, ": the sparse tensor has ",
                    tensor.dim(), " dimensions; at most ", kMaxDims, " are supported");
  return tensor.coalesce();
}

at::Tensor headerOf(const at::Tensor& coalesced) {
  at::Tensor header = at::full({kHeaderWords}, -1, at::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  h[kDtype] = static_cast<int64_t>(coalesced.scalar_type());
  h[kSparseDim] = coalesced.sparse_dim();
  h[kDenseDim] = coalesced.dense_dim();
  h[kNnz] = coalesced._nnz();
  for (int64_t d = 0; d < coalesced.dim(); ++d) h[kSizes + d] = coalesced.size(d);
  return header;
}

Blocks plan(const at::Tensor& headers, int rank, int size, const char* call) {
  const int64_t* all = headers.const_data_ptr<int64_t>();
  const int64_t* first = all;
  for (int k = 1; k < size; ++k) {
    const int64_t* h = all + k * kHeaderWords;
    // Every rank compares every rank with rank 0, so all fail alike.
    PYDDP_CHECK_VALUE(std::equal(h, h + kNnz, first) &&
                          std::equal(h + kSizes, h + kHeaderWords, first + kSizes),
                      "rank ", rank, ": ", call, ": rank ", k, "'s sparse tensor (",
                      describe(h), ") differs from rank 0's (", describe(first),
                      "); every rank must pass a tensor of the same sizes, sparse_dim and dtype");
  }
  Blocks b;
  b.dtype = static_cast<at::ScalarType>(first[kDtype]);
  b.sparseDim = first[kSparseDim];
  b.sizes.assign(first + kSizes, first + kSizes + first[kSparseDim] + first[kDenseDim]);
  const int64_t perNnz = static_cast<int64_t>(sizeof(int64_t)) * b.sparseDim +
      denseNumel(b.sizes, b.sparseDim) * static_cast<int64_t>(c10::elementSize(b.dtype));
  for (int k = 0; k < size; ++k) {
    b.nnz.push_back(all[k * kHeaderWords + kNnz]);
    const auto bytes = roundUp(static_cast<size_t>(b.nnz.back() * perNnz), sizeof(int64_t));
    b.bytes = std::max(b.bytes, static_cast<int64_t>(bytes));
  }
  return b;
}

at::Tensor pack(const at::Tensor& coalesced, int64_t bytes) {
  at::Tensor block = at::zeros({bytes}, at::kByte);
  const at::Tensor indices = coalesced._indices().contiguous();
  const at::Tensor values = coalesced._values().contiguous();
  // A tensor without elements (no nonzeros, or a block of 0 bytes) may have
  // no data at all, and memcpy takes no null pointer, even for 0 bytes.
  if (indices.nbytes() > 0) std::memcpy(block.data_ptr(), indices.const_data_ptr(),
                                        indices.nbytes());
  if (values.nbytes() > 0) {
    std::memcpy(static_cast<char*>(block.data_ptr()) + indices.nbytes(),
                values.const_data_ptr(), values.nbytes());
  }
  return block;
}

at::Tensor sum(const at::Tensor& gathered, const Blocks& b) {
  std::vector<int64_t> valueShape(b.sizes.begin() + b.sparseDim, b.sizes.end());
  const int64_t valueNumel = denseNumel(b.sizes, b.sparseDim);
  std::vector<at::Tensor> indices, values;
  for (size_t k = 0; k < b.nnz.size(); ++k) {
    const int64_t nnz = b.nnz[k];
    const at::Tensor block = gathered.narrow(0, static_cast<int64_t>(k) * b.bytes, b.bytes);
    const int64_t indexBytes = nnz * b.sparseDim * static_cast<int64_t>(sizeof(int64_t));
    indices.push_back(block.narrow(0, 0, indexBytes).view(at::kLong).view({b.sparseDim, nnz}));
    std::vector<int64_t> shape{nnz};
    shape.insert(shape.end(), valueShape.begin(), valueShape.end());
    values.push_back(block
                         .narrow(0, indexBytes,
                                 nnz * valueNumel * static_cast<int64_t>(c10::elementSize(b.dtype)))
                         .view(b.dtype)
                         .view(shape));
  }
  return at::_sparse_coo_tensor_unsafe(at::cat(indices, 1), at::cat(values, 0), b.sizes,
                                       at::TensorOptions().dtype(b.dtype))
      .coalesce();
}

} // namespace sparse
} // namespace pyddp
