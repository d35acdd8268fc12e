#include "transport/tag_matcher.h"

#include <algorithm>

namespace pyddp {
namespace {

// Erases the first entry of `map[tag]` that `pred` accepts, and the tag's
// entry once empty; returns the erased entry.
template <typename Map, typename Pred>
std::optional<typename Map::mapped_type::value_type> takeFirst(Map& map, int64_t tag,
                                                               Pred pred) {
  const auto entries = map.find(tag);
  if (entries == map.end()) return std::nullopt;
  auto& queue = entries->second;
  const auto it = std::find_if(queue.begin(), queue.end(), pred);
  if (it == queue.end()) return std::nullopt;
  const auto taken = *it;
  queue.erase(it);
  if (queue.empty()) map.erase(entries);
  return taken;
}

} // namespace

std::optional<TagMatcher::Taken> TagMatcher::post(uint64_t recv, int peer, int64_t tag) {
  const auto aside =
      takeFirst(aside_, tag, [&](const Aside& a) { return peer == kAnySource || a.peer == peer; });
  if (aside) return Taken{aside->peer, aside->message};
  waiting_[tag].push_back(Waiting{recv, peer});
  waitingTag_[recv] = tag;
  if (peer == kAnySource) ++anyWaiting_;
  return std::nullopt;
}

std::optional<uint64_t> TagMatcher::arrive(int peer, uint64_t message, int64_t tag) {
  const auto recv = takeFirst(
      waiting_, tag, [&](const Waiting& w) { return w.peer == peer || w.peer == kAnySource; });
  if (!recv) {
    aside_[tag].push_back(Aside{peer, message});
    return std::nullopt;
  }
  waitingTag_.erase(recv->recv);
  if (recv->peer == kAnySource) --anyWaiting_;
  return recv->recv;
}

bool TagMatcher::wanted(int peer, int64_t tag) const {
  const auto entries = waiting_.find(tag);
  return entries != waiting_.end() &&
      std::any_of(entries->second.begin(), entries->second.end(),
                  [&](const Waiting& w) { return w.peer == peer || w.peer == kAnySource; });
}

void TagMatcher::withdraw(uint64_t recv) {
  const auto tag = waitingTag_.find(recv);
  if (tag == waitingTag_.end()) return;
  const auto gone =
      takeFirst(waiting_, tag->second, [&](const Waiting& w) { return w.recv == recv; });
  waitingTag_.erase(tag);
  if (gone->peer == kAnySource) --anyWaiting_;
}

void TagMatcher::dropPeer(int peer) {
  for (auto it = aside_.begin(); it != aside_.end();) {
    std::erase_if(it->second, [&](const Aside& a) { return a.peer == peer; });
    it = it->second.empty() ? aside_.erase(it) : std::next(it);
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    std::erase_if(it->second, [&](const Waiting& w) {
      if (w.peer != peer) return false;
      waitingTag_.erase(w.recv);
      return true;
    });
    it = it->second.empty() ? waiting_.erase(it) : std::next(it);
  }
}

} // namespace pyddp
