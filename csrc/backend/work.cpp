#include "backend/work.h"

namespace pyddp {

RingWork::RingWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

void RingWork::complete() {
  finish();
  future_->markCompleted(c10::IValue(outputs_));
}

void RingWork::fail(std::exception_ptr error) {
  finish(error);
  future_->setError(error);
}

} // namespace pyddp
