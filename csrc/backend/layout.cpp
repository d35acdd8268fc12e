#include "backend/layout.h"

#include <algorithm>
#include <sstream>

#include "backend/bootstrap.h"
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

} // namespace pyddp
