#include "transport/emulated_memory.h"

#include <memory>
#include <new>

#include "common/blob.h"
#include "common/check.h"
#include "device/primitives.h"
#include "transport/registered.h"

namespace pyddp {
namespace {

BlobReader readerOf(const std::string& blob, int peer) {
  return BlobReader(blob, "rank " + std::to_string(peer) + "'s shm bootstrap blob");
}

} // namespace

EmulatedMemory::EmulatedMemory(int rank, int worldSize, const device::Geometry& geometry,
                               const char* name)
    : FusedMemory(rank, worldSize, geometry, geometry.bytes()),
      rank_(rank),
      worldSize_(worldSize),
      name_(name),
      words_(std::make_unique<Words>()) {
  PYDDP_CHECK_VALUE(worldSize <= device::kMaxRanks, "the ", name_, " transport serves at most ",
                    device::kMaxRanks, " ranks, got world_size ", worldSize);
}

std::string EmulatedMemory::setup() {
  BlobWriter blob;
  control_.setup(blob);
  auto* h = new (control_.ownData()) device::FusedHeader{};
  h->magic = device::kFusedMagic;
  h->layoutVersion = device::kFusedLayoutVersion;
  h->channels = static_cast<uint32_t>(geometry_.channels);
  h->chunkBytes = geometry_.chunkBytes;
  blob.put("fused_channels", geometry_.channels).put("fused_chunk_bytes", geometry_.chunkBytes);
  return blob.str();
}

std::string EmulatedMemory::whyNotConnect(int peer, const std::string& blob) const {
  const BlobReader r = readerOf(blob, peer);
  std::string why = control_.whyNotConnect(peer, r);
  if (!why.empty()) return why;
  if (r.get<int>("fused_channels") != geometry_.channels ||
      r.get<size_t>("fused_chunk_bytes") != geometry_.chunkBytes) {
    return "rank " + std::to_string(peer) + " uses another geometry of the fused collectives";
  }
  return "";
}

void EmulatedMemory::connect(const std::vector<std::string>& blobs) {
  std::vector<BlobReader> readers;
  for (int peer = 0; peer < worldSize_; ++peer) readers.push_back(readerOf(blobs[peer], peer));
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const std::string why = whyNotConnect(peer, blobs[peer]);
    PYDDP_CHECK_COMM(why.empty(), "rank ", rank_, ": ", name_, " cannot reach ", why);
  }
  control_.connect(readers);
  for (int peer = 0; peer < worldSize_; ++peer) {
    const auto& h = *reinterpret_cast<const device::FusedHeader*>(base(peer));
    PYDDP_CHECK(h.magic == device::kFusedMagic && h.layoutVersion == device::kFusedLayoutVersion &&
                    h.channels == static_cast<uint32_t>(geometry_.channels) &&
                    h.chunkBytes == geometry_.chunkBytes,
                "rank ", rank_, ": rank ", peer,
                "'s fused buffer has an unexpected layout (different pyddp versions?)");
  }
}

char* EmulatedMemory::base(int rank) const {
  // Peers' buffers are mapped read-only: the programs only read them.
  return rank == rank_ ? control_.ownData() : const_cast<char*>(control_.peerData(rank));
}

int64_t EmulatedMemory::error() const {
  return device::loadVolatile(&words_->error);
}

void EmulatedMemory::abort() {
  device::storeVolatile(&words_->abort, 1);
}

void EmulatedMemory::tellPeers() {
  auto* own = reinterpret_cast<device::FusedHeader*>(control_.ownData());
  if (own != nullptr) device::storeRelease(&own->failed.value, 1);
}

std::string EmulatedMemory::exportRegion(const void* data, size_t bytes) const {
  const registered::Ref ref = registered::locate(data, bytes);
  PYDDP_CHECK_VALUE(ref.serial != 0, "rank ", rank_, ": the emulated grid's peers map "
                    "registered memory only: register a CPU tensor made by pyddp.empty (or a "
                    "contiguous view of one)");
  return BlobWriter().putBytes("ref", &ref, sizeof(ref)).str();
}

FusedMemory::PeerRegion EmulatedMemory::mapRegion(int peer, const std::string& blob,
                                                  size_t bytes) const {
  registered::Ref ref{};
  BlobReader(blob, "rank " + std::to_string(peer) + "'s registered tensor")
      .bytes("ref", &ref, sizeof(ref));
  // One mapping, held until the registration ends.
  auto maps = std::make_shared<registered::PeerMaps>();
  const void* data = maps->map(ref, bytes, control_.pid(peer), peer);
  return PeerRegion{static_cast<const char*>(data), std::move(maps)};
}

} // namespace pyddp
