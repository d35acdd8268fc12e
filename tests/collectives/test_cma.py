"""Cross-memory attach: all_gather, broadcast, all_reduce and reduce_scatter
read a peer's plain tensor through the kernel (process_vm_readv), one copy
instead of two (a reduction copies each piece into scratch, then reduces
it); a broadcast's root writes part of each receiver's meanwhile
(process_vm_writev).

Results are checked against single-process references (collective_cases)
here, and on every dtype, size and world size by the ``cma`` group of
test_collectives. Which path a collective took is seen through the number of
such reads and writes this process has made (``_testing.process_reads``,
``process_writes``). Rank 0's
choice between the kernel and the ring's slots (backend/cma_chooser.h) is
fed modelled times in tests/unit/test_cma_chooser.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import ReduceOp, check_equal, make_input, reference_reduce
from harness import Died, RankContext, Ranks, process_exited, pyddp_segments, raises
from pyddp._C import _testing
from test_registered import _as_nobody_rank_1_closed, _group, registered_copy

MIN_BYTES = 64 * 1024
COUNT = MIN_BYTES // 4  # float32 elements per rank: exactly cma_min_bytes
ALWAYS, AUTO, NEVER = pyddp.CmaReads.ALWAYS, pyddp.CmaReads.AUTO, pyddp.CmaReads.NEVER
RUN = _testing.CmaChooser.EXPLORE_RUN
CAP_SYS_PTRACE = 19  # capability(7)'s bit in /proc/self/status


def _why_the_kernel_refuses_reads() -> Optional[str]:
    """Why the kernel refuses this user's processes each other's memory,
    by ptrace's rules (ptrace(2), "Ptrace access mode checking"); None where
    it lets them. The ranks are siblings, which Yama's ptrace_scope 1 lets
    only a process with CAP_SYS_PTRACE trace (Ubuntu's default, for a user
    other than root)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read())
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, ValueError):
        return None
    if scope == 0 or (scope < 3 and caps >> CAP_SYS_PTRACE & 1):
        return None
    return f"kernel.yama.ptrace_scope is {scope}"


REFUSED = _why_the_kernel_refuses_reads()
needs_kernel_reads = pytest.mark.skipif(
    REFUSED is not None, reason=f"the kernel refuses cross-memory reads here: {REFUSED}")


def _setup(ctx: RankContext) -> None:
    ctx.groups["cma"] = _group(ctx, "cma", cma=ALWAYS, cma_min_bytes=MIN_BYTES)
    ctx.groups["auto"] = _group(ctx, "auto")
    ctx.groups["never"] = _group(ctx, "never", cma=NEVER)
    ctx.groups["ring"] = _group(ctx, "ring", algo=pyddp.Algo.RING, cma=ALWAYS)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def _reads(ctx: RankContext, count: int, registered: bool = False, group: str = "cma") -> tuple:
    """Kernel reads made by an all_gather, a broadcast from rank 1, an
    all_reduce and a reduce_scatter of `count` float32 per rank (the
    reduce_scatter's output), each checked, and kernel writes made by the
    broadcast."""
    pg, n = ctx.groups[group], ctx.world_size
    own = registered_copy if registered else torch.Tensor.clone
    made = []
    inputs = [make_input(r, count, torch.float32) for r in range(n)]
    before = _testing.process_reads()
    out = torch.full((n * count,), 5.0)
    pg.all_gather_single(out, own(inputs[ctx.rank]))
    check_equal(out, torch.cat(inputs), f"all_gather count={count}")
    made.append(_testing.process_reads() - before)
    before, written = _testing.process_reads(), _testing.process_writes()
    t = own(make_input(ctx.rank, count, torch.float32, salt=1))
    pg.broadcast(t, 1)
    check_equal(t, make_input(1, count, torch.float32, salt=1), f"broadcast count={count}")
    made.append(_testing.process_reads() - before)
    written = _testing.process_writes() - written
    before = _testing.process_reads()
    t = own(inputs[ctx.rank])
    pg.all_reduce(t)
    check_equal(t, reference_reduce(inputs, ReduceOp.SUM), f"all_reduce count={count}")
    made.append(_testing.process_reads() - before)
    before = _testing.process_reads()
    wholes = [make_input(r, n * count, torch.float32, salt=2) for r in range(n)]
    out = torch.full((count,), 5.0)
    pg.reduce_scatter_single(out, own(wholes[ctx.rank]))
    expected = reference_reduce(wholes, ReduceOp.SUM)[ctx.rank * count:(ctx.rank + 1) * count]
    check_equal(out, expected, f"reduce_scatter count={count}")
    made.append(_testing.process_reads() - before)
    return (*made, written)


def _reduction_reads(count: int, n: int) -> tuple:
    """The kernel reads of _reads' all_reduce and reduce_scatter on any rank:
    a piece of its block per peer and piece, then (all_reduce) each other
    block whole from the rank that reduced it."""
    piece = _testing.kernel_piece_bytes(n) // 4
    block = -(-count // n)  # the longest block, as balanced blocks are
    return ((n - 1) * -(-block // piece) + n - 1, (n - 1) * -(-count // piece))


@pytest.mark.multiprocess
@needs_kernel_reads
def test_collectives_from_cma_min_bytes_read_each_peer_through_the_kernel(ranks):
    results = ranks.run(_reads, COUNT)
    n = len(results)
    # all_gather: one read per peer; broadcast: one per rank but the root,
    # which writes into each of them; all_reduce and reduce_scatter: a read
    # per piece of each peer's block, which the test's count keeps at one
    assert _testing.root_written_bytes(COUNT * 4, n) > 0
    all_reduce, reduce_scatter = _reduction_reads(COUNT, n)
    assert (all_reduce, reduce_scatter) == (2 * (n - 1), n - 1)
    assert results == [(n - 1, 0, all_reduce, reduce_scatter, n - 1) if r == 1
                       else (n - 1, 1, all_reduce, reduce_scatter, 0) for r in range(n)]


@pytest.mark.multiprocess
@needs_kernel_reads
def test_a_reduction_reads_a_peers_block_piece_by_piece(ranks):
    # 5 pieces of each block of the reduce_scatter, the last one short; the
    # all_reduce's blocks are a 1/n of the tensor
    n = ranks.world_size
    count = 5 * _testing.kernel_piece_bytes(n) // 4 - 3
    results = ranks.run(_reads, count)
    all_reduce, reduce_scatter = _reduction_reads(count, n)
    assert reduce_scatter == 5 * (n - 1)
    assert [r[2:4] for r in results] == [(all_reduce, reduce_scatter)] * n


def test_the_peers_pieces_fill_the_scratch_in_whole_pages():
    scratch, page = _testing.KERNEL_SCRATCH_BYTES, 4096
    for n in range(2, 130):
        piece = _testing.kernel_piece_bytes(n)
        assert piece % page == 0 and piece >= page, n
        # as large as fits, unless a page each is already too much
        assert (n - 1) * piece <= scratch < (n - 1) * (piece + page) or piece == page, n
        assert _testing.kernel_scratch_bytes(n) == (n - 1) * piece, n
    assert _testing.kernel_scratch_bytes(1) == 0


@pytest.mark.multiprocess
def test_smaller_messages_take_the_staged_path(ranks):
    assert set(ranks.run(_reads, COUNT - 1)) == {(0, 0, 0, 0, 0)}


def _registered_reads(ctx: RankContext) -> tuple:
    """Kernel reads and peer tensors mapped by _reads on registered tensors."""
    before = _testing.registered_maps_made()
    return _reads(ctx, COUNT, True), _testing.registered_maps_made() - before


@pytest.mark.multiprocess
def test_registered_tensors_are_mapped_not_read_through_the_kernel(ranks):
    results = ranks.run(_registered_reads)
    n = len(results)
    # all_gather maps each peer's input, broadcast the root's (on the other
    # ranks), reduce_scatter each peer's input; all_reduce, below its
    # registered window, reads them through the kernel as it would plain ones
    all_reduce = _reduction_reads(COUNT, n)[0]
    assert results == [((0, 0, all_reduce, 0, 0), 2 * (n - 1) + (0 if r == 1 else 1))
                       for r in range(n)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("group", ["never", "ring"])
def test_groups_that_do_not_read_through_the_kernel_run_as_before(ranks, group):
    assert set(ranks.run(_reads, COUNT, False, group)) == {(0, 0, 0, 0, 0)}


def _auto_picks(ctx: RankContext) -> list:
    """Kernel reads of each of the auto group's first all_gathers of a size
    (its default cma_min_bytes, 64 KiB per rank)."""
    count = ctx.groups["auto"].options.cma_min_bytes // 4
    return [_reads(ctx, count, group="auto")[0] for _ in range(2 * RUN)]


@pytest.mark.multiprocess
@needs_kernel_reads
def test_every_rank_takes_the_path_rank_0_picks(ranks):
    # Rank 0's chooser measures the kernel path first, then the slots, a run
    # of calls each: the other ranks, which choose nothing, follow it.
    picks = ranks.run(_auto_picks)
    n = len(picks)
    assert picks == [[n - 1] * RUN + [0] * RUN] * n


def _refusals(ctx: RankContext) -> tuple:
    return tuple(ctx.groups[g]._cpu_engine.process_refusal
                 for g in ("cma", "auto", "never", "ring"))


@pytest.mark.multiprocess
def test_the_groups_say_why_they_do_not_read_through_the_kernel(ranks):
    # The kernel allows it between processes of one user that may trace
    # each other; where it does not, the groups that would read say so.
    for rank, (cma, auto, never, ring) in enumerate(ranks.run(_refusals)):
        if REFUSED is None:
            assert cma == auto == ""
        else:
            assert cma == auto and auto.startswith("process_vm_readv of rank ") and \
                "Operation not permitted" in auto, (rank, auto)
        assert never == "cma (PYDDP_CMA) is never"
        assert ring == "algo is ring, not auto"


def _uneven(ctx: RankContext, setting: str) -> str:
    values = {"cma_min_bytes": MIN_BYTES * (ctx.rank + 1),
              "cma": ALWAYS if ctx.rank == 0 else AUTO}
    return raises(ValueError, setting, _group, ctx, "uneven " + setting,
                  **{setting: values[setting]})


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", ["cma", "cma_min_bytes"])
def test_ranks_with_different_settings_fail_naming_them(ranks, setting):
    for said in ranks.run(_uneven, setting):
        assert "PYDDP_CMA and PYDDP_CMA_MIN_BYTES alike on all ranks" in said


def _one_rank_closed(ctx: RankContext) -> tuple:
    ctx.groups["cma"] = _group(ctx, "cma", cma=ALWAYS, cma_min_bytes=1)
    return ctx.groups["cma"]._cpu_engine.process_refusal, _reads(ctx, COUNT)


def _closed_setup(ctx: RankContext) -> None:
    # Named from this module so that the ranks import it while still root:
    # as nobody they may not read it (a checkout under a directory of mode
    # 0700, as mktemp -d makes).
    _as_nobody_rank_1_closed(ctx)


@pytest.mark.multiprocess
@needs_kernel_reads
@pytest.mark.skipif(os.geteuid() != 0, reason="making ranks of another user needs root")
def test_a_rank_whose_peer_cannot_be_read_makes_the_group_read_through_slots():
    # Rank 1 is not dumpable: the kernel refuses rank 0's reads of it (as it
    # refuses ptrace), and both ranks learn it while connecting.
    pool = Ranks(2, setup=_closed_setup)
    try:
        (said0, reads0), (said1, reads1) = pool.run(_one_rank_closed)
    finally:
        pool.close()
    assert reads0 == reads1 == (0, 0, 0, 0, 0)
    assert said0.startswith("process_vm_readv of rank 1 (pid ") and \
        "Operation not permitted" in said0, said0
    assert said1 == "rank 0 cannot read every peer's memory through the kernel", said1


# --- a peer killed before its reader read its tensor -----------------------------


def _collective(pg: pyddp.ProcessGroup, op: str, t: torch.Tensor, **kwargs):
    """A broadcast from rank 1, or an all_reduce, of t."""
    return pg.broadcast(t, 1, **kwargs) if op == "broadcast" else pg.all_reduce(t, **kwargs)


def _reader(ctx: RankContext, peer_pid: int, op: str) -> tuple:
    pg = _group(ctx, "killed", cma=ALWAYS, cma_min_bytes=1)
    deadline = time.monotonic() + 30
    while not process_exited(peer_pid):
        assert time.monotonic() < deadline, "rank 1 did not die"
        time.sleep(0.01)
    before = _testing.process_reads()
    said = raises(dist.DistBackendError, "exited", _collective, pg, op, torch.zeros(COUNT))
    return said, _testing.process_reads() - before


def _killed_in_its_collective(ctx: RankContext, peer_pid: int, op: str) -> None:
    pg = _group(ctx, "killed", cma=ALWAYS, cma_min_bytes=1)
    _collective(pg, op, torch.ones(COUNT), async_op=True)
    # The collective arrives (stages where its tensor lies) within
    # milliseconds, then waits for rank 0, which arrives only once this rank
    # is dead: a second leaves ample room.
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.multiprocess
@needs_kernel_reads
@pytest.mark.parametrize("op", ["broadcast", "all_reduce"])
def test_a_rank_killed_before_its_tensor_is_read_is_named_and_nothing_is_left(op):
    # The broadcast's root, or the peer whose block of the all_reduce's
    # tensor rank 0 reduces from a copy
    pool = Ranks(2)
    try:
        pid = pool.pid(1)
        (said, reads), died = pool.run_each([_reader, _killed_in_its_collective], pid, op,
                                            allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(died, Died) and died.exitcode == -signal.SIGKILL, died
    assert f"rank 1 (pid {pid}) exited while rank 0 read its tensor in {op} #" in said, said
    assert reads == 0
    assert pyddp_segments() == []


# --- a receiver that gives up while the root may write into it ------------------

# The receiver's timeout, inside which the root must arrive (and, in
# _given_up's second case, look at the receiver); the root's pause is well
# past it, so the receiver gives up during the pause.
TIMEOUT_S = 3.0
PAUSE_MS = 8000


def _broadcast_given_up(ctx: RankContext, pauses: tuple) -> tuple:
    """A broadcast from rank 0 whose write into rank 1 pauses `pauses` (ms
    before the root looks whether rank 1 still takes it, and after); rank 1
    gives up meanwhile. Rank 0 returns its error and the writes it made;
    rank 1 its error, the tail of its tensor when its call returned, and
    whether its tensor, refilled then, still held that fill after the root
    woke."""
    pg = _group(ctx, "given_up", TIMEOUT_S, cma=ALWAYS, cma_min_bytes=1)
    if ctx.rank == 0:
        _testing.pause_process_writes(*pauses)
        written = _testing.process_writes()
        try:
            said = raises(dist.DistBackendError, "rank 1 gave up", pg.broadcast,
                          torch.ones(COUNT), 0)
        finally:
            _testing.pause_process_writes(0, 0)
        return said, _testing.process_writes() - written
    t = torch.zeros(COUNT)
    said = raises(dist.DistBackendError, "timed out", pg.broadcast, t, 0)
    tail = _testing.root_written_bytes(COUNT * 4, 2) // 4
    at_return = t[-tail:].clone()
    t.fill_(7.0)  # the caller owns its tensor again
    time.sleep(sum(pauses) / 1000 + 1.0)  # past any write the root could still make
    return said, at_return, bool((t == 7.0).all())


def _given_up(pauses: tuple) -> tuple:
    pool = Ranks(2)
    try:
        results = tuple(pool.run(_broadcast_given_up, pauses, timeout=120))
    finally:
        pool.close()
    assert pyddp_segments() == []
    return results


@pytest.mark.multiprocess
@needs_kernel_reads
def test_a_root_whose_receiver_gave_up_before_it_looked_does_not_write():
    (said0, writes), (said1, at_return, kept) = _given_up((PAUSE_MS, 0))
    assert writes == 0
    assert bool((at_return == 0).all()) and kept
    assert "timed out" in said0 and "rank 1 gave up" in said0, said0


@pytest.mark.multiprocess
@needs_kernel_reads
def test_a_receiver_that_gives_up_during_the_roots_write_returns_after_it():
    (said0, writes), (said1, at_return, kept) = _given_up((0, PAUSE_MS))
    # the write went in before rank 1's call returned, and nothing after
    assert writes == 1
    assert bool((at_return == 1).all()) and kept
    assert "timed out" in said0 and "rank 1 gave up" in said0, said0


def _receiver_of_a_killed_writer(ctx: RankContext) -> str:
    pg = _group(ctx, "killed_writer", cma=ALWAYS, cma_min_bytes=1)
    return raises(dist.DistBackendError, "exited", pg.broadcast, torch.zeros(COUNT), 1)


def _writer_killed_in_its_write(ctx: RankContext) -> None:
    pg = _group(ctx, "killed_writer", cma=ALWAYS, cma_min_bytes=1)
    # The write announced, its copy not begun: the receiver, once it finds
    # this rank dead, must stop waiting for the write to end.
    _testing.pause_process_writes(0, 60_000)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    pg.broadcast(torch.ones(COUNT), 1)


@pytest.mark.multiprocess
@needs_kernel_reads
def test_a_receiver_whose_writer_died_announcing_a_write_is_not_held():
    pool = Ranks(2)
    try:
        pid = pool.pid(1)
        said, died = pool.run_each([_receiver_of_a_killed_writer, _writer_killed_in_its_write],
                                   allow_dead=True, timeout=60)
    finally:
        pool.close()
    assert isinstance(died, Died) and died.exitcode == -signal.SIGKILL, died
    assert f"rank 1 (pid {pid}) exited" in said, said
    assert pyddp_segments() == []
