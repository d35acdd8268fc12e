// A FIFO of pieces through a ring of slots in shared memory, one writer and
// one reader: the shm ring link's (one per rank, to its right neighbour)
// and every point-to-point channel's (shm_channel.h). The slots belong to
// the sender's memory; `posted` is the sender's counter, `consumed` the
// receiver's, each on its own cache line and written only by its owner.
//
// Protocol. Pieces are numbered over the FIFO's life, from 0; both counters
// start at 0 and only increase.
//   Send piece k: once consumed >= k + 1 - numSlots (acquire: slot
//     k % numSlots was read), write the slot, then store posted = k + 1
//     (release).
//   Receive piece k: once posted >= k + 1 (acquire: the slot is written),
//     read the slot, then store consumed = k + 1 (release).
// Invariant: the sender is at most numSlots pieces ahead of the receiver,
// so no slot is rewritten while read. Slots written with streaming stores
// are fenced (sfence) before `posted` is stored: a release store does not
// order them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "transport/shm_control.h"

namespace pyddp {
namespace shm {

class SlotSender {
 public:
  SlotSender() = default;
  // `slots`: numSlots slots of `stride` bytes each.
  SlotSender(char* slots, size_t stride, int numSlots, Counter* posted, const Counter* consumed)
      : slots_(slots), stride_(stride), numSlots_(numSlots), posted_(posted),
        consumed_(consumed) {}

  // Whether the next piece's slot is free.
  bool canSend() const {
    return sent_ < static_cast<uint64_t>(numSlots_) ||
        consumed_->value.load(std::memory_order_acquire) >= sent_ + 1 - numSlots_;
  }
  // The next piece's slot, once canSend().
  char* slot() const { return slots_ + (sent_ % numSlots_) * stride_; }
  // The slot is written: the receiver may read it.
  void post() { posted_->value.store(++sent_, std::memory_order_release); }
  // Whether the receiver has read every piece posted so far.
  bool drained() const { return consumed_->value.load(std::memory_order_acquire) >= sent_; }
  uint64_t sent() const { return sent_; }

 private:
  char* slots_ = nullptr;
  size_t stride_ = 0;
  int numSlots_ = 0;
  Counter* posted_ = nullptr;
  const Counter* consumed_ = nullptr;
  uint64_t sent_ = 0;
};

class SlotReceiver {
 public:
  SlotReceiver() = default;
  SlotReceiver(const char* slots, size_t stride, int numSlots, const Counter* posted,
               Counter* consumed)
      : slots_(slots), stride_(stride), numSlots_(numSlots), posted_(posted),
        consumed_(consumed) {}

  // Whether the next piece has been posted.
  bool canReceive() const {
    return posted_->value.load(std::memory_order_acquire) > received_;
  }
  // Pieces posted so far (acquire).
  uint64_t posted() const { return posted_->value.load(std::memory_order_acquire); }
  // The next piece's slot, once canReceive().
  const char* slot() const { return slots_ + (received_ % numSlots_) * stride_; }
  // The slot is read: the sender may reuse it.
  void release() { consumed_->value.store(++received_, std::memory_order_release); }
  uint64_t received() const { return received_; }

 private:
  const char* slots_ = nullptr;
  size_t stride_ = 0;
  int numSlots_ = 0;
  const Counter* posted_ = nullptr;
  Counter* consumed_ = nullptr;
  uint64_t received_ = 0;
};

} // namespace shm
} // namespace pyddp
