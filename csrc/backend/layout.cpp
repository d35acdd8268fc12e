#include "backend/layout.h"

#include <algorithm>
#include <sstream>

#include "backend/bootstrap.h"
#include "common/blob.h"
#include "common/check.h"
#include "common/host.h"

namespace pyddp {

int HostMap::localRank(int rank) const {
  const auto& on = ranksOn[hostOf[rank]];
  return static_cast<int>(std::find(on.begin(), on.end(), rank) - on.begin());
}

bool HostMap::even() const {
  return std::all_of(ranksOn.begin(), ranksOn.end(),
                     [&](const auto& r) { return r.size() == ranksOn[0].size(); });
}

std::string HostMap::describe() const {
  std::ostringstream s;
  s << hosts() << (hosts() == 1 ? " host: " : " hosts: ");
  for (int h = 0; h < hosts(); ++h) {
    s << (h ? "; " : "") << (ranksOn[h].size() == 1 ? "rank " : "ranks ");
    for (size_t i = 0; i < ranksOn[h].size(); ++i) s << (i ? "," : "") << ranksOn[h][i];
    s << " on " << names[h];
  }
  return s.str();
}

HostMap exchangeHosts(c10d::Store& store, int rank, int size,
                      std::chrono::milliseconds timeout) {
  const auto ids = bootstrap::allGather(store, "hosts", hostId(), rank, size, timeout);
  HostMap map;
  map.hostOf.assign(size, -1);
  for (int r = 0; r < size; ++r) {
    const auto known = std::find(map.names.begin(), map.names.end(), ids[r]);
    if (known == map.names.end()) {
      map.names.push_back(ids[r]);
      map.ranksOn.push_back({});
    }
    const int h = static_cast<int>(std::find(map.names.begin(), map.names.end(), ids[r]) -
                                   map.names.begin());
    map.hostOf[r] = h;
    map.ranksOn[h].push_back(r);
  }
  return map;
}

std::string kernelsTakeTurns(const std::vector<GpuPlace>& places) {
  for (size_t first = 0; first < places.size(); ++first) {
    std::vector<size_t> sharing{first};
    for (size_t r = first + 1; r < places.size(); ++r) {
      if (places[r].uuid == places[first].uuid) sharing.push_back(r);
    }
    if (sharing.size() < 2) continue;
    std::vector<std::string> unserved;
    for (const size_t r : sharing) {
      if (places[r].mps != 1) {
        unserved.push_back(std::to_string(r) + (places[r].mps == -1 ? " (the driver does not "
                                                                      "say)" : ""));
      }
    }
    if (unserved.empty()) continue;
    std::ostringstream s;
    s << "ranks ";
    for (size_t i = 0; i < sharing.size(); ++i) s << (i ? "," : "") << sharing[i];
    s << " share GPU " << places[first].uuid << " and MPS does not serve rank"
      << (unserved.size() > 1 ? "s " : " ") << c10::Join(", ", unserved)
      << ": kernels of different processes take turns on a GPU without MPS, so a kernel "
         "that waits for a peer's spins until the GPU switches processes";
    return s.str();
  }
  return "";
}

std::vector<GpuPlace> exchangeGpus(c10d::Store& store, int rank, int size, const GpuPlace& mine,
                                   std::chrono::milliseconds timeout) {
  const auto blobs = bootstrap::allGather(
      store, "gpus", BlobWriter().put("uuid", mine.uuid).put("mps", mine.mps).str(), rank, size,
      timeout);
  std::vector<GpuPlace> places;
  for (int r = 0; r < size; ++r) {
    const BlobReader blob(blobs[r], "rank " + std::to_string(r) + "'s GPU");
    places.push_back(GpuPlace{blob.str("uuid"), blob.get<int>("mps")});
  }
  return places;
}

} // namespace pyddp
