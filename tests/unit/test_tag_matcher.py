"""The matching of point-to-point messages to receives (transport/tag_matcher.h).

A transport's receiving side asks a TagMatcher which posted receive a
message goes to, and which message put aside a receive takes; here it runs
on its own, without processes. Hand-written cases state the rules' outcomes
outright; random sequences of calls are checked against `Model`, the rules
of MessageLink (transport/transport.h) written the plainest way, and
against the guarantees they give (FIFO per pair and tag, tags matched).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyddp._C import _testing as t

ANY = t.TagMatcher.ANY_SOURCE


class Model:
    """Two lists scanned in order: receives waiting, in post order, and
    messages put aside, in arrival order."""

    def __init__(self):
        self.waiting = []  # (recv, peer, tag)
        self.aside = []  # (peer, message, tag)

    def post(self, recv, peer, tag):
        for i, (p, m, g) in enumerate(self.aside):
            if g == tag and peer in (ANY, p):
                del self.aside[i]
                return (p, m)
        self.waiting.append((recv, peer, tag))
        return None

    def arrive(self, peer, message, tag):
        for i, (r, p, g) in enumerate(self.waiting):
            if g == tag and p in (ANY, peer):
                del self.waiting[i]
                return r
        self.aside.append((peer, message, tag))
        return None

    def wanted(self, peer, tag):
        return any(g == tag and p in (ANY, peer) for _, p, g in self.waiting)

    def any_waiting(self):
        return any(p == ANY for _, p, _ in self.waiting)

    def withdraw(self, recv):
        self.waiting = [w for w in self.waiting if w[0] != recv]

    def drop_peer(self, peer):
        self.aside = [a for a in self.aside if a[0] != peer]
        self.waiting = [w for w in self.waiting if w[1] != peer]


def test_messages_of_one_peer_and_tag_are_received_in_arrival_order():
    m = t.TagMatcher()
    for message in (1, 2, 3):
        assert m.arrive(1, message, 7) is None
    assert [m.post(recv, 1, 7) for recv in (10, 11, 12)] == [(1, 1), (1, 2), (1, 3)]
    assert m.post(13, 1, 7) is None
    # Receives first: they take the messages in the order they were posted.
    assert m.arrive(1, 4, 7) == 13
    for recv in (14, 15):
        assert m.post(recv, 1, 7) is None
    assert [m.arrive(1, message, 7) for message in (5, 6)] == [14, 15]


def test_tags_are_received_in_any_order():
    m = t.TagMatcher()
    for message, tag in ((1, 5), (2, 6), (3, 5), (4, 6)):
        assert m.arrive(1, message, tag) is None
    assert m.post(10, 1, 6) == (1, 2)
    assert m.post(11, 1, 5) == (1, 1)
    assert m.post(12, 1, 6) == (1, 4)
    assert m.post(13, 1, 5) == (1, 3)
    # Receives waiting on several tags each get a message of their own tag.
    for recv, tag in ((20, 8), (21, 9), (22, 8)):
        assert m.post(recv, 1, tag) is None
    assert m.arrive(1, 5, 9) == 21
    assert m.arrive(1, 6, 8) == 20
    assert m.arrive(1, 7, 9) is None
    assert m.arrive(1, 8, 8) == 22


def test_a_message_goes_to_the_receive_posted_first_named_or_from_any_source():
    m = t.TagMatcher()
    assert m.post(10, 1, 5) is None
    assert m.post(11, ANY, 5) is None
    assert m.arrive(1, 1, 5) == 10
    assert m.arrive(1, 2, 5) == 11

    m = t.TagMatcher()
    assert m.post(10, ANY, 5) is None
    assert m.post(11, 1, 5) is None
    assert m.arrive(1, 1, 5) == 10
    assert m.arrive(1, 2, 5) == 11


def test_a_named_receive_waits_for_its_own_peer():
    m = t.TagMatcher()
    assert m.post(10, 2, 5) is None
    assert m.post(11, ANY, 5) is None
    assert m.arrive(1, 1, 5) == 11  # the receive from rank 2 does not want it
    assert m.arrive(1, 2, 5) is None
    assert m.arrive(2, 1, 5) == 10
    # A receive from rank 2 does not take rank 1's message put aside.
    assert m.post(12, 2, 5) is None
    assert m.post(13, 1, 5) == (1, 2)
    assert m.arrive(2, 2, 5) == 12


def test_a_receive_from_any_source_takes_the_message_put_aside_first():
    m = t.TagMatcher()
    for peer, message, tag in ((2, 1, 3), (1, 1, 4), (1, 2, 3), (2, 2, 3), (3, 1, 3)):
        assert m.arrive(peer, message, tag) is None
    assert m.post(10, ANY, 3) == (2, 1)
    assert m.post(11, ANY, 3) == (1, 2)
    # A named receive takes its peer's next one: FIFO per pair and tag holds
    # whichever kind of receive takes the messages.
    assert m.post(12, 2, 3) == (2, 2)
    assert m.post(13, ANY, 3) == (3, 1)
    assert m.post(14, ANY, 3) is None
    assert m.post(15, ANY, 4) == (1, 1)
    assert m.arrive(3, 2, 3) == 14


def test_wanted_and_any_waiting_follow_the_waiting_receives():
    m = t.TagMatcher()
    assert not m.wanted(1, 5) and not m.any_waiting()
    assert m.post(10, 1, 5) is None
    assert m.wanted(1, 5)
    assert not m.wanted(2, 5) and not m.wanted(1, 6) and not m.any_waiting()
    assert m.post(11, ANY, 6) is None
    assert m.any_waiting() and m.wanted(2, 6) and m.wanted(1, 6)
    assert m.arrive(3, 1, 6) == 11
    assert not m.any_waiting() and not m.wanted(2, 6)
    assert m.arrive(1, 1, 5) == 10
    assert not m.wanted(1, 5)


def test_a_withdrawn_receive_takes_nothing():
    m = t.TagMatcher()
    for recv, peer in ((10, 1), (11, ANY), (12, 1)):
        assert m.post(recv, peer, 5) is None
    m.withdraw(10)
    m.withdraw(11)
    assert not m.any_waiting()
    m.withdraw(99)  # not waiting: nothing to do
    m.withdraw(10)
    assert m.arrive(1, 1, 5) == 12
    assert m.arrive(1, 2, 5) is None
    m.withdraw(12)  # matched already: nothing to do
    assert m.post(13, 1, 5) == (1, 2)


def test_a_dropped_peer_leaves_nothing_aside_and_no_receive_waiting_for_it():
    m = t.TagMatcher()
    for peer, message in ((1, 1), (2, 1), (1, 2)):
        assert m.arrive(peer, message, 5) is None
    assert m.post(10, 1, 9) is None
    assert m.post(11, ANY, 9) is None
    m.drop_peer(1)
    assert m.post(12, ANY, 5) == (2, 1)
    assert m.post(13, ANY, 5) is None
    # The receive from any source still waits, and may take rank 1's too.
    assert m.any_waiting() and m.wanted(1, 9)
    assert m.arrive(2, 2, 9) == 11
    assert not m.wanted(1, 9)


PEERS = [1, 2, 3]
TAGS = [0, 1, 2]
STEP = st.one_of(
    st.tuples(st.just("post"), st.sampled_from([ANY] + PEERS), st.sampled_from(TAGS)),
    st.tuples(st.just("arrive"), st.sampled_from(PEERS), st.sampled_from(TAGS)),
    st.tuples(st.just("withdraw"), st.integers(1, 40)),
    st.tuples(st.just("drop"), st.sampled_from(PEERS)),
)
BOUNDED = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


def run(steps):
    """Runs `steps` on a TagMatcher and on Model, comparing every answer;
    returns the matches made: recv -> (peer, message), and what each
    receive and message was."""
    m, model = t.TagMatcher(), Model()
    next_recv, next_message = 1, {p: 1 for p in PEERS}
    receives, messages, matches = {}, {}, {}
    for step in steps:
        if step[0] == "post":
            _, peer, tag = step
            recv, next_recv = next_recv, next_recv + 1
            receives[recv] = (peer, tag)
            taken = m.post(recv, peer, tag)
            assert taken == model.post(recv, peer, tag), step
            if taken is not None:
                matches[recv] = taken
        elif step[0] == "arrive":
            _, peer, tag = step
            message = next_message[peer]
            next_message[peer] += 1
            messages[(peer, message)] = tag
            recv = m.arrive(peer, message, tag)
            assert recv == model.arrive(peer, message, tag), step
            if recv is not None:
                matches[recv] = (peer, message)
        elif step[0] == "withdraw":
            m.withdraw(step[1])  # posted or not, waiting or not
            model.withdraw(step[1])
        else:
            m.drop_peer(step[1])
            model.drop_peer(step[1])
        assert m.any_waiting() == model.any_waiting()
        for peer in PEERS:
            for tag in TAGS:
                assert m.wanted(peer, tag) == model.wanted(peer, tag), (peer, tag)
        # The matcher's invariant, on the model it agrees with: nothing put
        # aside is wanted by a receive still waiting.
        for peer, _, tag in model.aside:
            assert not model.wanted(peer, tag)
    return receives, messages, matches


@BOUNDED
@given(st.lists(STEP, max_size=60))
def test_random_sequences_match_the_model(steps):
    run(steps)


@BOUNDED
@given(st.lists(STEP, max_size=60))
def test_random_sequences_keep_the_guarantees(steps):
    receives, messages, matches = run(steps)
    # Each message goes to one receive, of its tag and, if named, its peer.
    assert len(set(matches.values())) == len(matches)
    for recv, (peer, message) in matches.items():
        want_peer, tag = receives[recv]
        assert messages[(peer, message)] == tag
        assert want_peer in (ANY, peer)
    # FIFO per pair and tag: the receives that took a peer's messages of
    # one tag took them in the order they were posted.
    taken = {}
    for recv in sorted(matches):
        peer, message = matches[recv]
        taken.setdefault((peer, messages[(peer, message)]), []).append(message)
    for order in taken.values():
        assert order == sorted(order)
