"""The cuda_ipc transport's wait decision (transport/cuda_ipc_protocol.h).

The device kernels call the same __host__ __device__ function on every look
at a flag; here it runs on the CPU. Error codes: 0 satisfied, 1 timeout,
2 peer failed, 3 aborted (ipc::ErrorCode).
"""

import pytest

from pyddp._C import _testing as t

SATISFIED, TIMEOUT, PEER_FAILED, ABORTED = 0, 1, 2, 3
MS = 1_000_000


def verdict(flag=0, target=1, peer_failed=0, abort=0, elapsed=0, timeout=10 * MS, peer=3):
    return t.ipc_wait_verdict(flag, target, peer_failed, abort, elapsed, timeout, peer)


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
