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
fed modelled times here, without processes, and must follow them.
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
EVERY, RUN = _testing.CmaChooser.EXPLORE_EVERY, _testing.CmaChooser.EXPLORE_RUN
FIRST, WINDOW = _testing.CmaChooser.FIRST_EXPLORE, _testing.CmaChooser.WINDOW
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


def test_smaller_messages_take_the_staged_path(ranks):
    assert set(ranks.run(_reads, COUNT - 1)) == {(0, 0, 0, 0, 0)}


def _registered_reads(ctx: RankContext) -> tuple:
    """Kernel reads and peer tensors mapped by _reads on registered tensors."""
    before = _testing.registered_maps_made()
    return _reads(ctx, COUNT, True), _testing.registered_maps_made() - before


def test_registered_tensors_are_mapped_not_read_through_the_kernel(ranks):
    results = ranks.run(_registered_reads)
    n = len(results)
    # all_gather maps each peer's input, broadcast the root's (on the other
    # ranks), reduce_scatter each peer's input; all_reduce, below its
    # registered window, reads them through the kernel as it would plain ones
    all_reduce = _reduction_reads(COUNT, n)[0]
    assert results == [((0, 0, all_reduce, 0, 0), 2 * (n - 1) + (0 if r == 1 else 1))
                       for r in range(n)]


@pytest.mark.parametrize("group", ["never", "ring"])
def test_groups_that_do_not_read_through_the_kernel_run_as_before(ranks, group):
    assert set(ranks.run(_reads, COUNT, False, group)) == {(0, 0, 0, 0, 0)}


def _auto_picks(ctx: RankContext) -> list:
    """Kernel reads of each of the auto group's first all_gathers of a size
    (its default cma_min_bytes, 64 KiB per rank)."""
    count = ctx.groups["auto"].options.cma_min_bytes // 4
    return [_reads(ctx, count, group="auto")[0] for _ in range(2 * RUN)]


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


@needs_kernel_reads
def test_a_root_whose_receiver_gave_up_before_it_looked_does_not_write():
    (said0, writes), (said1, at_return, kept) = _given_up((PAUSE_MS, 0))
    assert writes == 0
    assert bool((at_return == 0).all()) and kept
    assert "timed out" in said0 and "rank 1 gave up" in said0, said0


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


# --- rank 0's choice, fed modelled times -----------------------------------------

# ns per byte per rank, from benchmarks/studies/single-copy-through-the-kernel.md:
# all_gather of 1 MiB, the slots near (about 200 us) and far (about
# 280 us), the kernel copy at about 180 us either way.
SLOTS_NEAR, SLOTS_FAR, KERNEL = 200e3 / (1 << 20), 280e3 / (1 << 20), 180e3 / (1 << 20)
SIZE = 1 << 20
KIND = "all_gather"


def _call(chooser, kernel_cost, slots_cost, size=SIZE, kind=KIND):
    """One collective as rank 0 runs it, timed if the chooser asks; returns
    whether it read through the kernel."""
    kernel, timed = chooser.next(kind, size)
    if timed:
        chooser.observe(kind, size, kernel, (kernel_cost if kernel else slots_cost) * size)
    return kernel


def _calls(chooser, kernel_cost, slots_cost, n, **kwargs):
    return [_call(chooser, kernel_cost, slots_cost, **kwargs) for _ in range(n)]


def test_forced_modes_are_kept_and_not_timed():
    for mode, kernel in ((ALWAYS, True), (NEVER, False)):
        chooser = _testing.CmaChooser(mode)
        assert all(chooser.next(KIND, SIZE) == (kernel, False) for _ in range(100))
        assert chooser.prefers_kernel("broadcast", SIZE) == kernel


def _exploring(first: int, last: int) -> list:
    """The calls from `first` to `last` (counted from 1) that explore: runs of
    RUN from FIRST and its doublings below EVERY, then from every EVERY-th."""
    starts = [FIRST << k for k in range(EVERY.bit_length()) if FIRST << k < EVERY]
    starts += range(EVERY, last + 1, EVERY)
    return [c for start in starts for c in range(start, start + RUN) if first <= c <= last]


def test_the_exploring_runs_start_at_16_32_and_64_then_every_128():
    assert (FIRST, EVERY, RUN) == (16, 128, 4)  # the schedule the tests below spell out
    assert _exploring(1, 400) == [c for s in (16, 32, 64, 128, 256, 384)
                                  for c in range(s, s + 4)]


def test_auto_measures_both_paths_then_takes_the_cheaper_and_explores_the_other():
    chooser = _testing.CmaChooser(AUTO)
    # a run through the kernel, a run through the slots, then the cheaper:
    # the kernel (far cores)
    picks = _calls(chooser, KERNEL, SLOTS_FAR, 3 * EVERY + RUN)
    assert picks[:2 * RUN] == [True] * RUN + [False] * RUN
    # a run of calls explores the slots from calls FIRST, 2 FIRST, ... and
    # each EVERY-th on
    assert [i + 1 for i, kernel in enumerate(picks) if not kernel] == \
        list(range(RUN + 1, 2 * RUN + 1)) + _exploring(2 * RUN + 1, 3 * EVERY + RUN)
    # The slots get cheaper (the cores moved near): the next exploration
    # measures them below the kernel, and they are taken from then on.
    chooser2 = _testing.CmaChooser(AUTO)
    _calls(chooser2, KERNEL, SLOTS_FAR, EVERY - 1)
    assert chooser2.prefers_kernel(KIND, SIZE)
    # the first, cold, is not timed; the next two are two of the three
    # samples whose median is the estimate
    _calls(chooser2, KERNEL, SLOTS_NEAR * 0.8, 2)
    assert chooser2.prefers_kernel(KIND, SIZE)
    _calls(chooser2, KERNEL, SLOTS_NEAR * 0.8, 1)
    assert not chooser2.prefers_kernel(KIND, SIZE)
    assert _calls(chooser2, KERNEL, SLOTS_NEAR * 0.8, EVERY - 2) == [False] * (EVERY - 3) + [True]


def _priced(chooser, n, cost):
    """`n` collectives of SIZE as rank 0 runs them, the i-th through a path
    that costs cost(i, kernel, switched) ns per byte (switched: another path
    than the call before's), timed if the chooser asks; each (path, timed)."""
    calls = []
    for i in range(n):
        kernel, timed = chooser.next(KIND, SIZE)
        if timed:
            switched = bool(calls) and kernel != calls[-1][0]
            chooser.observe(KIND, SIZE, kernel, cost(i, kernel, switched) * SIZE)
        calls.append((kernel, timed))
    return calls


def test_the_first_call_after_a_switch_is_not_timed():
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, SLOTS_FAR, EVERY - 1)
    # The slots, explored, are 1.1x dearer than the kernel; the kernel's
    # first call back costs 1.4x its own (cold caches): not a sample of
    # what it costs.
    calls = _priced(chooser, RUN + 2, lambda i, kernel, switched:
                    (KERNEL if kernel else KERNEL * 1.1) * (1.4 if switched else 1.0))
    assert calls == [(False, False)] + [(False, True)] * (RUN - 1) + [(True, False), (True, True)]
    assert chooser.prefers_kernel(KIND, SIZE)


def test_an_exploring_run_is_judged_by_its_warm_calls():
    # The first two calls of the slots after the kernel can both be cold (a
    # broadcast's); a lone explored call would have kept the kernel.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, SLOTS_FAR, EVERY - 1)
    calls = _priced(chooser, RUN + 2, lambda i, kernel, switched:
                    KERNEL if kernel else 2 * SLOTS_NEAR if i < 2 else SLOTS_NEAR * 0.8)
    assert [kernel for kernel, _ in calls] == [False] * (RUN + 2)
    assert not chooser.prefers_kernel(KIND, SIZE)


def test_a_first_pick_from_cold_calls_is_looked_at_again_within_a_few_calls():
    # The kernel's first calls cost 1.6x its later ones and as much as the
    # slots (all_reduce of 4 MiB per rank, far cores): the slots are picked
    # after the first runs, and the kernel is taken from its first
    # exploring run on, FIRST calls in.
    chooser = _testing.CmaChooser(AUTO)
    picks = _priced(chooser, FIRST + 2 * RUN, lambda i, kernel, switched:
                    (KERNEL * 1.6 if i < RUN else KERNEL) if kernel else KERNEL * 1.55)
    assert [kernel for kernel, _ in picks[2 * RUN:FIRST - 1]] == [False] * (FIRST - 1 - 2 * RUN)
    assert [kernel for kernel, _ in picks[FIRST - 1:]] == [True] * (2 * RUN + 1)
    assert chooser.prefers_kernel(KIND, SIZE)


def test_a_preferred_path_that_gets_dearer_is_left_within_a_window_of_calls():
    chooser = _testing.CmaChooser(AUTO)
    # past the exploring run from call EVERY // 2, the last before call
    # EVERY, and the first call back (not timed)
    _calls(chooser, KERNEL, SLOTS_NEAR * 1.2, EVERY // 2 + RUN)
    assert chooser.prefers_kernel(KIND, SIZE)
    # The kernel copy gets 2x dearer (the machine's other jobs): its estimate
    # is the median of its last WINDOW samples, so it stays while most of
    # them are the cheaper ones, and the slots win at the next call.
    picks = _calls(chooser, 2 * KERNEL, SLOTS_NEAR * 1.2, WINDOW // 2 + 2)
    assert picks == [True] * (WINDOW // 2 + 1) + [False]
    assert not chooser.prefers_kernel(KIND, SIZE)


def test_a_path_is_ranked_by_the_median_of_its_recent_samples():
    # Samples that spread up to 1.4x above each path's cost, the slots' 1.4x
    # the kernel's: ranked by their latest sample, the two swapped places
    # now and then; by the median of the window, the kernel is kept.
    chooser = _testing.CmaChooser(AUTO)
    spread = [1.1, 1.0, 1.4, 1.3, 1.05, 1.2]
    picks = _priced(chooser, 3 * EVERY, lambda i, kernel, switched:
                    (KERNEL if kernel else KERNEL * 1.4) * spread[i % len(spread)])
    slots = [i + 1 for i, (kernel, _) in enumerate(picks) if not kernel]
    assert slots[RUN:] == _exploring(2 * RUN + 1, 3 * EVERY)


def test_a_lucky_low_sample_of_the_other_path_does_not_move_the_choice():
    # The slots cost 1.3x the kernel, but the first timed call of an
    # exploring run of them took 0.9x (measured: the slots' first timed
    # calls after the kernel's, 46-51 us against 52-60 later): a floor of
    # the window would take the slots for a window of calls.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, KERNEL * 1.3, EVERY - 1)
    picks = _priced(chooser, RUN + WINDOW, lambda i, kernel, switched:
                    KERNEL if kernel else KERNEL * (0.9 if i == 1 else 1.3))
    assert [kernel for kernel, _ in picks] == [False] * RUN + [True] * WINDOW
    assert chooser.prefers_kernel(KIND, SIZE)


def test_one_slow_call_does_not_move_the_choice():
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, 2 * KERNEL, 10)
    chooser.observe(KIND, SIZE, True, 1000 * KERNEL * SIZE)  # preempted for a time slice
    assert chooser.prefers_kernel(KIND, SIZE)


def test_a_near_tie_keeps_the_slots():
    advantage = _testing.CmaChooser.KERNEL_ADVANTAGE
    chooser = _testing.CmaChooser(AUTO)
    n = EVERY + RUN + 3
    picks = _calls(chooser, KERNEL, KERNEL * advantage * 0.99, n)
    # the kernel only where a run explores it
    explored = _exploring(2 * RUN + 1, n)
    assert [i + 1 for i, kernel in enumerate(picks) if kernel and i >= 2 * RUN] == explored
    chooser2 = _testing.CmaChooser(AUTO)
    _calls(chooser2, KERNEL, KERNEL * advantage * 1.05, 2 * RUN)
    assert chooser2.prefers_kernel(KIND, SIZE)


def test_the_kernel_once_taken_is_kept_while_it_is_cheaper_at_all():
    # With one threshold, two paths near it swapped places with their noise.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, SLOTS_FAR, 10)
    assert chooser.prefers_kernel(KIND, SIZE)
    # the slots get within 1.1x of the kernel: explored, never taken
    assert _calls(chooser, KERNEL, KERNEL * 1.1, 2 * EVERY).count(False) == \
        len(_exploring(11, 2 * EVERY + 10))
    assert chooser.prefers_kernel(KIND, SIZE)
    # the slots get cheaper: taken from their next exploration on (call
    # 3 * EVERY; these are calls 2 * EVERY + 11 on)
    picks = _calls(chooser, KERNEL, KERNEL * 0.95, EVERY)
    assert picks.index(False) == EVERY - 11 and picks[EVERY - 11:] == [False] * 11


KINDS = ("all_gather", "broadcast", "all_reduce", "reduce_scatter")


def test_each_kind_and_power_of_two_is_chosen_for_alone():
    chooser = _testing.CmaChooser(AUTO)
    # 1 MiB: the kernel for every other kind, beginning with all_gather
    for i, kind in enumerate(KINDS):
        _calls(chooser, KERNEL, SLOTS_FAR if i % 2 == 0 else SLOTS_NEAR * 0.5, 10, kind=kind)
    _calls(chooser, KERNEL, SLOTS_NEAR * 0.5, 10, size=4 * SIZE)  # all_gather of 4 MiB: the slots
    assert [chooser.prefers_kernel(kind, SIZE) for kind in KINDS] == [True, False, True, False]
    assert chooser.prefers_kernel(KIND, 2 * SIZE - 1)
    assert not chooser.prefers_kernel(KIND, 4 * SIZE)
    # not measured yet: the kernel is tried first, its first call (cold) not timed
    assert chooser.next(KIND, 16 * SIZE) == (True, False)


def test_the_four_collectives_with_a_kernel_path_are_chosen_for_and_no_other():
    assert [_testing.CmaChooser.chooses(k) for k in KINDS] == [True] * 4
    for kind in ("barrier", "reduce", "gather", "scatter", "all_to_all", "send"):
        assert not _testing.CmaChooser.chooses(kind)
        raises(RuntimeError, "does not read through the kernel",
               _testing.CmaChooser(AUTO).next, kind, SIZE)


def test_samples_that_are_not_times_are_ignored():
    # A near tie keeps the slots; a kernel sample taken as a time (NaN
    # counts as the smallest, a negative one is below any) would make the
    # kernel look cheaper.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, KERNEL, 10)
    for bad in (float("nan"), -1.0, float("inf")):
        chooser.observe(KIND, SIZE, True, bad)
        assert not chooser.prefers_kernel(KIND, SIZE), bad
