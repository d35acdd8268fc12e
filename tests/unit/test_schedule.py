"""The pure ring schedule helpers (csrc/algorithms/schedule.h), without processes.

The ring collectives are only correct if every rank's view of "which block
moves at which step" fits together; these tests check that with a symbolic
simulation of the data flow, independent of any transport.
"""

from __future__ import annotations

import itertools

import pytest

from pyddp._C import _testing as sched


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_balanced_blocks_tile_the_buffer(n):
    for count in range(0, 40):
        blocks = [sched.balanced_block(count, n, b) for b in range(n)]
        begin = 0
        for b, (start, size) in enumerate(blocks):
            assert start == begin
            assert size == count // n + (1 if b < count % n else 0)
            begin += size
        assert begin == count


def test_pieces_tile_a_block():
    for count, piece_elems in itertools.product(range(0, 30), [1, 2, 5, 64]):
        pieces = sched.num_pieces(count, piece_elems)
        spans = [sched.piece(count, piece_elems, p) for p in range(pieces)]
        assert sum(size for _, size in spans) == count
        assert all(0 < size <= piece_elems for _, size in spans)
        assert [start for start, _ in spans] == [p * piece_elems for p in range(pieces)]
        assert sched.piece(count, piece_elems, pieces) == (count, 0)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_what_a_rank_receives_is_what_it_sends_next(n, shift):
    # The fused verbs (recvReduceSend, recvCopySend) forward the block they
    # just received, so the schedule must send at step s+1 what arrived at s.
    for rank, step in itertools.product(range(n), range(n - 2)):
        assert sched.send_block(rank, step + 1, n, shift) == sched.recv_block(rank, step, n, shift)
        assert sched.recv_block(rank, step, n, shift) == sched.send_block((rank - 1) % n, step,
                                                                           n, shift)


def _simulate_reduce(n: int, shift: int) -> list:
    """Symbolic ring reduce: which ranks' contributions each rank holds per block."""
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][block]
    for step in range(n - 1):
        sent = [(sched.send_block(r, step, n, shift), set(held[r][sched.send_block(r, step, n,
                                                                                    shift)]))
                for r in range(n)]
        for r in range(n):
            block, partial = sent[(r - 1) % n]
            assert block == sched.recv_block(r, step, n, shift)
            held[r][block] = held[r][block] | partial
    return held


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_all_reduce_schedule_reduces_and_gathers_every_block(n):
    held = _simulate_reduce(n, shift=0)
    for r in range(n):
        assert held[r][(r + 1) % n] == set(range(n)), "reduce phase must complete block r+1"
    # Gather phase (shift 1): each rank starts from its complete block r+1.
    complete = [{(r + 1) % n} for r in range(n)]
    for step in range(n - 1):
        sent = [sched.send_block(r, step, n, 1) for r in range(n)]
        for r in range(n):
            assert sent[r] in complete[r], "a rank forwards only finished blocks"
        for r in range(n):
            complete[r].add(sent[(r - 1) % n])
    assert all(c == set(range(n)) for c in complete)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_reduce_scatter_schedule_leaves_block_r_on_rank_r(n):
    held = _simulate_reduce(n, shift=-1)
    for r in range(n):
        assert held[r][r] == set(range(n))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_all_gather_schedule_delivers_every_block(n):
    have = [{r} for r in range(n)]
    for step in range(n - 1):
        sent = [sched.send_block(r, step, n, 0) for r in range(n)]
        assert all(sent[r] in have[r] for r in range(n))
        for r in range(n):
            have[r].add(sent[(r - 1) % n])
    assert all(h == set(range(n)) for h in have)


def test_chain_positions_start_at_root():
    for n in range(1, 6):
        for root in range(n):
            positions = [sched.chain_position(r, root, n) for r in range(n)]
            assert positions[root] == 0
            assert sorted(positions) == list(range(n))
            assert all(positions[(root + k) % n] == k for k in range(n))


def test_a_broadcasts_root_writes_a_balanced_share_in_a_multiple_of_a_page():
    page = 4096
    for n in range(1, 6):
        for nbytes in (0, 1, page - 1, page, n * page - 1, n * page, 3 * n * page + 17, 1 << 20):
            tail = sched.root_written_bytes(nbytes, n)
            if n == 1:
                assert tail == 0
                continue
            # a multiple of a page, at most 1/n of the buffer, less than a page short of it
            assert tail % page == 0 and tail <= nbytes / n < tail + page, (n, nbytes, tail)
