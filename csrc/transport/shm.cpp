#include "transport/shm.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "common/blob.h"
#include "common/check.h"
#include "transport/shm_channel.h"
#include "transport/wait_policy.h"

namespace pyddp {
namespace shm {
namespace {

// What a slot holds: sendPartial sends elements, recvReduceSend partials.
kernels::Incoming incoming(Hop hop) {
  return hop == Hop::First ? kernels::Incoming::Elements : kernels::Incoming::Partials;
}

} // namespace

ShmTransport::ShmTransport(int rank, int worldSize, const GroupOptions& options)
    : rank_(rank),
      worldSize_(worldSize),
      slotBytes_(options.slotBytes),
      numSlots_(options.numSlots),
      directBytes_(roundUp(options.stagingBytes(), kCacheLine)),
      cma_(options.cma),
      cmaMinBytes_(options.cmaMinBytes),
      pieceSpinPhase_(Backoff::pieceSpinPhaseFor(worldSize)),
      control_(rank, worldSize, dataBytes()),
      memory_(rank, worldSize, options.cma, control_),
      lanes_(rank, worldSize, control_, options),
      stores_(options.slotStores),
      stagingStores_(options.slotStores, SlotStoreChooser::kMinChosenStagedBytes,
                     SlotStoreChooser::kStagedStreamingAdvantage) {
  options.validate();
}

ShmTransport::~ShmTransport() = default;

size_t ShmTransport::dataBytes() const {
  return sizeof(DataHeader) + static_cast<size_t>(numSlots_) * slotBytes_ + 2 * directBytes_;
}

std::string ShmTransport::setup() {
  BlobWriter blob;
  control_.setup(blob);
  auto* h = new (control_.ownData()) DataHeader{};
  h->magic = kDataMagic;
  h->layoutVersion = kDataLayoutVersion;
  h->numSlots = numSlots_;
  h->slotBytes = slotBytes_;
  h->directBytes = directBytes_;
  // The geometry travels with the blob, so that every rank can refuse a
  // mismatch before mapping anything.
  blob.put("data_layout", kDataLayoutVersion)
      .put("slot_bytes", slotBytes_)
      .put("num_slots", numSlots_)
      .put("staging_bytes", directBytes_)
      .put("cma", static_cast<int>(cma_))
      .put("cma_min_bytes", cmaMinBytes_);
  memory_.setup(blob);
  return blob.str();
}

std::string ShmTransport::whyNotConnect(int peer, const std::string& blob) const {
  return control_.whyNotConnect(peer, BlobReader(blob, "rank " + std::to_string(peer) +
                                                           "'s shm bootstrap blob"));
}

void ShmTransport::connect(const std::vector<std::string>& blobs) {
  PYDDP_CHECK(static_cast<int>(blobs.size()) == worldSize_, "expected ",
              worldSize_, " bootstrap blobs, got ", blobs.size());
  std::vector<BlobReader> readers;
  for (int peer = 0; peer < worldSize_; ++peer) {
    readers.emplace_back(blobs[peer], "rank " + std::to_string(peer) + "'s shm bootstrap blob");
  }
  // Refuse before mapping anything, so every rank fails with the same reason.
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const std::string why = control_.whyNotConnect(peer, readers[peer]);
    PYDDP_CHECK(why.empty(), "rank ", rank_, ": shm transport cannot reach ", why);
    const BlobReader& b = readers[peer];
    const auto slotBytes = b.get<size_t>("slot_bytes");
    const auto numSlots = b.get<int>("num_slots");
    const auto directBytes = b.get<size_t>("staging_bytes");
    const auto cma = b.get<int>("cma");
    const auto cmaMinBytes = b.get<size_t>("cma_min_bytes");
    PYDDP_CHECK_VALUE(
        slotBytes == slotBytes_ && numSlots == numSlots_ && directBytes == directBytes_ &&
            cma == static_cast<int>(cma_) && cmaMinBytes == cmaMinBytes_,
        "rank ", rank_, " and rank ", peer,
        " use different shm geometry (slot_bytes ", slotBytes_, " vs ", slotBytes,
        ", num_slots ", numSlots_, " vs ", numSlots, ", staging bytes ", directBytes_,
        " vs ", directBytes, ", cma ", static_cast<int>(cma_), " vs ", cma,
        ", cma_min_bytes ", cmaMinBytes_, " vs ", cmaMinBytes,
        "): set PYDDP_SLOT_BYTES, PYDDP_NUM_SLOTS, PYDDP_DIRECT_MAX_BYTES, PYDDP_CMA and "
        "PYDDP_CMA_MIN_BYTES alike on all ranks");
  }
  control_.connect(readers);
  std::vector<ProcessWords*> words(worldSize_);
  for (int peer = 0; peer < worldSize_; ++peer) {
    const DataHeader& h = data(peer);
    PYDDP_CHECK(h.magic == kDataMagic && h.layoutVersion == kDataLayoutVersion &&
                    h.numSlots == numSlots_ && h.slotBytes == slotBytes_ &&
                    h.directBytes == directBytes_,
                "rank ", rank_, ": rank ", peer,
                "'s shm segment has an unexpected layout (different pyddp versions, or a "
                "corrupted or forged store value?)");
    // Peers' words are only read; the protocol's types are shared with this
    // rank's own, which it writes.
    words[peer] = const_cast<ProcessWords*>(&h.process);
  }
  memory_.connect(readers, std::move(words));
  const int right = (rank_ + 1) % worldSize_;
  const int left = (rank_ + worldSize_ - 1) % worldSize_;
  DataHeader& own = ownData();
  ring_ = SlotSender(control_.ownData() + sizeof(DataHeader), slotBytes_, numSlots_, &own.posted,
                     &data(right).consumed);
  fromLeft_ = SlotReceiver(slots(left), slotBytes_, numSlots_, &data(left).posted,
                           &own.consumed);
}

void ShmTransport::connected() {
  control_.connected();
  memory_.connected();
}

void ShmTransport::abandon(const std::string& why) {
  giveUp(why, /*onNext=*/false);
}

void ShmTransport::leave(const std::string& why) {
  const std::string dead = control_.deadPeer();
  giveUp(dead.empty() ? why : dead + "; then " + why, /*onNext=*/true);
}

void ShmTransport::giveUp(const std::string& why, bool onNext) {
  control_.giveUp(why, onNext);
  // A second caller, too, returns only once no write into this process is
  // under way.
  memory_.refuseWrites();
}

void ShmTransport::abort() {
  control_.abort();
  lanes_.abort();
}

void ShmTransport::enter(const CollectiveDesc& desc, Deadline deadline) {
  control_.enter(desc, deadline);
}

char* ShmTransport::claimSendSlot() {
  const int right = (rank_ + 1) % worldSize_;
  control_.waitFor(right, pieceSpinPhase_, [&] { return ring_.canSend(); });
  return ring_.slot();
}

void ShmTransport::awaitRingTaken() {
  const int right = (rank_ + 1) % worldSize_;
  control_.waitFor(right, pieceSpinPhase_, [&] { return ring_.drained(); });
}

const char* ShmTransport::awaitRecvSlot() {
  const int left = (rank_ + worldSize_ - 1) % worldSize_;
  control_.waitFor(left, pieceSpinPhase_, [&] { return fromLeft_.canReceive(); });
  return fromLeft_.slot();
}

bool ShmTransport::writeShared(SlotStoreChooser& stores, void* dst, const void* src,
                               size_t bytes, bool local) {
  const SlotStoreChooser::Pick pick = stores.next(bytes, local);
  const auto start = pick.timed ? Clock::now() : Clock::time_point();
  if (pick.streaming) {
    kernels::streamingCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
  if (pick.timed) {
    stores.observe(pick.streaming, bytes,
                   std::chrono::duration<double, std::nano>(Clock::now() - start).count());
  }
  return pick.streaming;
}

void ShmTransport::send(const void* src, size_t bytes) {
  writeShared(stores_, claimSendSlot(), src, bytes, /*local=*/true);
  ring_.post();
}

void ShmTransport::sendCopy(const void* src, void* dst, size_t bytes) {
  char* slot = claimSendSlot();
  const bool streamed = writeShared(stores_, slot, src, bytes, /*local=*/true);
  ring_.post();
  // My copy while the next rank reads the piece, from whichever of the two
  // is in this core's cache: the slot it just wrote (only this rank's later
  // sends rewrite it), or the source it just read when the stores streamed.
  if (dst != src) std::memcpy(dst, streamed ? src : slot, bytes);
}

void ShmTransport::recv(void* dst, size_t bytes) {
  std::memcpy(dst, awaitRecvSlot(), bytes);
  fromLeft_.release();
}

void ShmTransport::recvCopySend(void* dst, size_t bytes) {
  const char* in = awaitRecvSlot();
  // Forward first: the next rank's hop starts while we keep our copy.
  writeShared(stores_, claimSendSlot(), in, bytes, /*local=*/false);
  ring_.post();
  std::memcpy(dst, in, bytes);
  fromLeft_.release();
}

// The first hop goes as elements: as partials, a half type's would double
// the bytes of a 2-rank reduce-scatter.
void ShmTransport::sendPartial(const kernels::ReduceSpec& spec, const void* local,
                               size_t count) {
  send(local, count * elementSize(spec.dtype));
}

void ShmTransport::recvReduceSend(const kernels::ReduceSpec& spec, Hop hop,
                                  const void* local, size_t count) {
  const char* in = awaitRecvSlot();
  kernels::reducePartial(spec, claimSendSlot(), in, incoming(hop), local, count);
  ring_.post();
  fromLeft_.release();
}

void ShmTransport::recvReduceCopy(const kernels::ReduceSpec& spec, Hop hop,
                                  const void* local, void* dst, size_t count) {
  kernels::reduceFinal(spec, dst, nullptr, awaitRecvSlot(), incoming(hop), local, count);
  fromLeft_.release();
}

void ShmTransport::recvReduceCopySend(const kernels::ReduceSpec& spec, Hop hop,
                                      const void* local, void* dst, size_t count) {
  const char* in = awaitRecvSlot();
  kernels::reduceFinal(spec, dst, claimSendSlot(), in, incoming(hop), local, count);
  ring_.post();
  fromLeft_.release();
}

void ShmTransport::copy(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) std::memcpy(dst, src, bytes);
}

void ShmTransport::stage(void* dst, const void* src, size_t bytes) {
  writeShared(stagingStores_, dst, src, bytes, /*local=*/true);
}

void ShmTransport::reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src,
                           int nsrc, size_t count) {
  kernels::reduceN(spec, dst, src, nsrc, count);
}

void* ShmTransport::stagingBuffer() {
  return control_.ownData() + sizeof(DataHeader) + static_cast<size_t>(numSlots_) * slotBytes_ +
      ((rounds_ + 1) % 2) * directBytes_;
}

void ShmTransport::exchange() {
  ++rounds_;
  ownData().staged.value.store(rounds_, std::memory_order_release);
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_) continue;
    const auto& staged = data(k).staged.value;
    control_.waitFor(k, control_.spinPhase(),
                     [&] { return staged.load(std::memory_order_acquire) >= rounds_; });
  }
}

void ShmTransport::enterStaged(const CollectiveDesc& desc, Deadline deadline) {
  ++rounds_;
  control_.enter(desc, deadline);
  // The peer's failed line is written only when it gives up: a cache hit.
  for (int k = 0; k < worldSize_; ++k) {
    if (k != rank_) control_.failIfGaveUp(k, desc.seq);
  }
}

const void* ShmTransport::peerBuffer(int rank) const {
  return staging(rank) + (rounds_ % 2) * directBytes_;
}

} // namespace shm
} // namespace pyddp
