// Which posted receive a point-to-point message goes to: MessageLink's
// matching rules (transport.h), kept apart from any transport so that every
// transport's point-to-point messages follow the same ones. Pure
// bookkeeping of one rank's receiving side: no shared memory, no threads,
// no bytes (a message put aside keeps its bytes in its transport; the
// matcher keeps its sender, its transport's number for it and its tag).
// Not thread-safe: its transport serialises the calls.
//
// Rules. A receive is from one peer or from any source (kAnySource); a
// message is from one peer, numbered by its transport (unique per peer).
//  - A message that arrives (arrive()) goes to the receive posted first
//    among those still waiting with its tag, from its sender or from any
//    source; if none waits, it is put aside.
//  - A receive when posted (post()) takes the message put aside first with
//    its tag, from its peer, or from any peer for a receive from any
//    source (the first to arrive, across peers); if there is none, it
//    waits.
// So messages of one (peer, tag) are received in the order they arrive,
// which is their send order on an ordered channel, and tags in any order.
// A message that a receive takes, or a receive that takes one, leaves the
// matcher: the match is its transport's from then on.
//
// Invariants, after every call:
//  - no message put aside has the tag of a receive from any source still
//    waiting, nor the tag of a receive from its sender still waiting;
//  - messages put aside keep their order of arrival, per tag across peers;
//    receives waiting keep their order of posting, per tag.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>

#include "transport/transport.h"

namespace pyddp {

class TagMatcher {
 public:
  static constexpr int kAnySource = MessageLink::kAnySource;

  // A message put aside that a receive took.
  struct Taken {
    int peer;
    uint64_t message;
  };

  // Receive `recv` (an id unique among the receives waiting) from `peer`
  // (or kAnySource) with `tag` is posted: returns the message put aside
  // that it takes, else it waits.
  std::optional<Taken> post(uint64_t recv, int peer, int64_t tag);
  // Message `message` from `peer` with `tag` arrives: returns the waiting
  // receive it goes to, else it is put aside.
  std::optional<uint64_t> arrive(int peer, uint64_t message, int64_t tag);
  // Whether a message from `peer` with `tag` would go to a waiting receive.
  bool wanted(int peer, int64_t tag) const;
  // Whether a receive from any source waits (it may take a message from
  // any peer).
  bool anyWaiting() const { return anyWaiting_ > 0; }
  // Receive `recv` stops waiting without a message (it failed); ignores a
  // receive that is not waiting.
  void withdraw(uint64_t recv);
  // `peer`'s messages will not come (its channel failed): forgets those put
  // aside and the receives waiting for `peer` alone.
  void dropPeer(int peer);

 private:
  struct Waiting {
    uint64_t recv;
    int peer;
  };
  struct Aside {
    int peer;
    uint64_t message;
  };

  std::unordered_map<int64_t, std::deque<Waiting>> waiting_;  // by tag, in post order
  std::unordered_map<uint64_t, int64_t> waitingTag_;          // recv -> its tag
  std::unordered_map<int64_t, std::deque<Aside>> aside_;      // by tag, in arrival order
  size_t anyWaiting_ = 0;
};

} // namespace pyddp
