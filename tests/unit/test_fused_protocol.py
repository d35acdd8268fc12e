"""The fused collectives' pure parts (csrc/device/layout.h, programs.h), which the GPU's
kernels and the emulated grid both run: the decision a wait makes at each look at a flag,
and how a collective splits into channels and rounds, against references computed here.
Error codes: 0 satisfied, 1 timeout, 2 peer failed, 3 aborted, 4 mismatch
(device::ErrorCode).
"""

import pytest

from pyddp._C import _testing as t

SATISFIED, TIMEOUT, PEER_FAILED, ABORTED = 0, 1, 2, 3
MS = 1_000_000
# device::Protocol
ONE_SHOT, TWO_SHOT, ALL_GATHER, REDUCE_SCATTER, BROADCAST, BARRIER = range(6)


def verdict(flag=0, target=1, peer_failed=0, abort=0, elapsed=0, timeout=10 * MS, peer=3):
    return t.fused_wait_verdict(flag, target, peer_failed, abort, elapsed, timeout, peer)


def test_keeps_waiting_until_the_flag_reaches_the_target():
    assert verdict(flag=4, target=5) is None
    assert verdict(flag=5, target=5) == (SATISFIED, -1)
    # Flags only increase: a flag past its target (the peer is ahead) satisfies too.
    assert verdict(flag=9, target=5) == (SATISFIED, -1)


def test_a_reached_target_wins_over_a_peer_failure_and_the_timeout():
    # The data the flag guards is there, whatever happened afterwards.
    assert verdict(flag=5, target=5, peer_failed=1, elapsed=20 * MS) == (SATISFIED, -1)


@pytest.mark.parametrize("peer", [0, 7, 15])
def test_failures_name_the_rank_waited_on(peer):
    assert verdict(peer_failed=1, peer=peer) == (PEER_FAILED, peer)
    assert verdict(elapsed=10 * MS + 1, peer=peer) == (TIMEOUT, peer)
    assert verdict(elapsed=10 * MS, peer=peer) is None  # the timeout is inclusive


def test_abort_ends_every_wait_first():
    assert verdict(flag=5, target=5, abort=1) == (ABORTED, 3)
    assert verdict(peer_failed=1, abort=1, elapsed=20 * MS) == (ABORTED, 3)


def test_peer_failure_is_reported_before_the_timeout():
    assert verdict(peer_failed=1, elapsed=20 * MS) == (PEER_FAILED, 3)


def _expected_plan(protocol, count, size, channels, chunk, element):
    """Channels in 16-byte granules, the last one taking the rest; rounds of a chunk (a
    reduce-scatter's split among the ranks' blocks); channel 0 meets at least once."""
    granule = max(1, 16 // element)
    granules = count // granule
    plans = []
    for c in range(channels):
        base, extra = divmod(granules, channels)
        begin = (c * base + min(c, extra)) * granule
        end = count if c == channels - 1 else begin + (base + (c < extra)) * granule
        per = chunk // element
        per = per // size // granule * granule if protocol == REDUCE_SCATTER else per // granule * granule
        per = per or granule
        elements = end - begin
        rounds = -(-elements // per)
        if rounds == 0 and c == 0:
            rounds = 1
        barriers = rounds * (2 if protocol == TWO_SHOT else 1)
        plans.append((begin, elements, per, rounds, barriers))
    return plans


@pytest.mark.parametrize("protocol", [ONE_SHOT, TWO_SHOT, ALL_GATHER, REDUCE_SCATTER, BROADCAST])
@pytest.mark.parametrize("element", [1, 2, 4, 8])
def test_channels_split_the_elements_in_aligned_parts_and_rounds(protocol, element):
    for count in (0, 1, 15, 16, 17, 1000, 123457):
        for size in (2, 3, 4):
            for channels in (1, 3, 4, 32):
                for chunk in (128, 256, 4096):
                    plans = t.fused_plan(protocol, count, size, channels, chunk, element)
                    assert plans == _expected_plan(protocol, count, size, channels, chunk,
                                                   element), (count, size, channels, chunk)
                    # Every element is in exactly one part, and parts start aligned.
                    assert sum(p[1] for p in plans) == count
                    assert all(p[0] * element % 16 == 0 for p in plans)
                    # A round holds what its chunk holds.
                    per_rank = size if protocol == REDUCE_SCATTER else 1
                    assert all(p[2] * element * per_rank <= max(chunk, 16) for p in plans)


@pytest.mark.parametrize("protocol", [TWO_SHOT, ALL_GATHER, REDUCE_SCATTER, BROADCAST])
def test_a_registered_launch_moves_each_part_at_once_between_its_barriers(protocol):
    # the staged launch's parts, no rounds (nothing is staged), and on every
    # channel, empty or not, three barriers for the all-reduce and two for the others
    for count in (0, 1, 17, 123457):
        for channels in (1, 3, 32):
            staged = t.fused_plan(protocol, count, 3, channels, 256, 4)
            plans = t.fused_plan(protocol, count, 3, channels, 256, 4, registered=True)
            barriers = 3 if protocol == TWO_SHOT else 2
            assert plans == [(first, elements, elements, 0, barriers)
                             for first, elements, *_ in staged], (count, channels)


def test_a_barrier_is_one_meeting_on_channel_0():
    assert t.fused_plan(BARRIER, 0, 2, 4, 256, 1) == [(0, 0, 0, 1, 1)] + [(0, 0, 0, 0, 0)] * 3
