"""Point-to-point messages and the collectives built on them, on pyddp's own API.

On 2, 3 and 4 spawned ranks, against references every rank rebuilds from every
rank's inputs (collective_cases.py): send/recv in both orders, isend/irecv with
many tags out of order, FIFO within a tag, batch_isend_irecv ring exchanges,
0-byte and 64 MiB messages, non-contiguous tensors, point-to-point interleaved
with collectives, hundreds of messages taken in reverse tag order, collectives
between ranks with 100 unreceived messages between them, and unexpected
messages held aside only up to their budget; all-to-all with even, uneven and zero-length splits and over
lists; gather, scatter and reduce to every root; coalesced all-reduce,
all-gather and reduce-scatter; subgroups (new_group, new_subgroups, non-members).
Failures: a receive whose sender never comes fails within the timeout naming
the sender, a send whose receiver died fails naming it and removes its channel's
name at once (the failing process may never reach its teardown), a size or dtype mismatch fails on both ranks, split sizes that
disagree fail naming both ranks, and the arguments that make no sense are
refused at once.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import message_cases
import pyddp
from collective_cases import DTYPES, ReduceOp, check_equal, make_input, reference_reduce
from harness import Died, RankContext, Ranks, pyddp_segments

pytestmark = pytest.mark.multiprocess

COUNTS = [0, 1, 3, 1001]
BIG = 16 * 1024 * 1024  # float32 elements: 64 MiB


def _setup(ctx: RankContext) -> None:
    n = ctx.world_size
    # 256-byte slots: messages of a few hundred elements take many pieces.
    options = pyddp.GroupOptions()
    options.slot_bytes = 256
    ctx.groups["small"] = pyddp.create_group(
        "shm", store=dist.FileStore(ctx.store_path("small"), n), rank=ctx.rank, world_size=n,
        timeout=datetime.timedelta(seconds=60), options=options)
    pyddp.init_process_group("shm", store=dist.FileStore(ctx.store_path("default"), n),
                             rank=ctx.rank, world_size=n, timeout=datetime.timedelta(seconds=60))
    ctx.groups["default"] = pyddp.get_default_group()


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def two():
    pool = Ranks(2, setup=_setup)
    yield pool
    pool.close()


# --- point-to-point --------------------------------------------------------------


def _ring_exchanges(ctx: RankContext, group: str) -> None:
    message_cases.ring_exchanges(ctx.groups[group], ctx.world_size, ctx.rank, DTYPES, COUNTS)


def test_ring_exchanges(ranks):
    ranks.run(_ring_exchanges, "small")
    ranks.run(_ring_exchanges, "default")


def _blocking_pairs(ctx: RankContext) -> None:
    """Even ranks send then receive, odd ranks receive then send; then the other way round."""
    pg, r = ctx.groups["small"], ctx.rank
    if r >= 2 * (ctx.world_size // 2):
        return  # the odd one out of an odd world has no partner
    peer = r ^ 1
    for i, sender_first in enumerate((r % 2 == 0, r % 2 == 1)):
        mine = make_input(r, 777, torch.float64, salt=i)
        got = torch.zeros(777, dtype=torch.float64)
        if sender_first:
            pyddp.send(mine, peer, pg)
            assert pyddp.recv(got, peer, pg) == peer
        else:
            pyddp.recv(got, peer, pg)
            pyddp.send(mine, peer, pg)
        check_equal(got, make_input(peer, 777, torch.float64, salt=i), "blocking pair")


def test_blocking_send_and_recv_in_both_orders(ranks):
    ranks.run(_blocking_pairs)


def _tags(ctx: RankContext) -> None:
    pg = ctx.groups["small"]
    if ctx.rank == 0:
        # 20 tags, then 4 messages on one tag.
        works = [pg.isend(torch.full((50,), float(tag)), 1, tag) for tag in range(20)]
        works += [pg.isend(torch.full((50,), 100.0 + i), 1, 7) for i in range(4)]
        for work in works:
            work.wait()
    elif ctx.rank == 1:
        got = {tag: torch.zeros(50) for tag in range(20)}
        works = [pg.irecv(got[tag], 0, tag) for tag in reversed(range(20))]
        fifo = [torch.zeros(50) for _ in range(4)]
        works += [pg.irecv(t, 0, 7) for t in fifo]
        for work in works:
            work.wait()
        for tag in range(20):
            check_equal(got[tag], torch.full((50,), float(tag)), f"tag {tag}")
        for i, t in enumerate(fifo):
            check_equal(t, torch.full((50,), 100.0 + i), f"message {i} of tag 7, in send order")


def test_tags_match_in_any_order_and_fifo_within_a_tag(ranks):
    ranks.run(_tags)


def _big_and_strided(ctx: RankContext) -> None:
    pg, peer = ctx.groups["default"], 1 - ctx.rank
    mine = torch.full((BIG,), float(ctx.rank + 1))
    got = torch.zeros(BIG)
    works = [pg.isend(mine, peer), pg.irecv(got, peer)]
    for work in works:
        work.wait()
    assert bool((got == peer + 1).all()), "64 MiB message"
    # A transposed view sent, and received into every other element.
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * ctx.rank
    into = torch.zeros(24)
    works = [pg.isend(base.t(), peer, 5), pg.irecv(into[::2].view(4, 3), peer, 5)]
    for work in works:
        work.wait()
    expected = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * peer).t()
    check_equal(into[::2].view(4, 3), expected, "strided receive")
    check_equal(into[1::2], torch.zeros(12), "elements between the strided ones untouched")


def test_large_and_non_contiguous_messages(two):
    two.run(_big_and_strided)


def _interleaved(ctx: RankContext) -> None:
    """An isend in flight while both ranks run collectives: it moves in the background."""
    pg, peer = ctx.groups["default"], 1 - ctx.rank
    got = torch.zeros(1000)
    send = pg.isend(torch.full((1000,), float(ctx.rank)), peer, 3)
    for _ in range(3):
        t = torch.ones(5)
        pg.all_reduce(t)
        check_equal(t, torch.full((5,), 2.0), "all_reduce beside a send")
    pg.recv(got, peer, 3)
    send.wait()
    check_equal(got, torch.full((1000,), float(peer)), "message beside collectives")


def test_point_to_point_beside_collectives(two):
    two.run(_interleaved)


def _missing_sender(ctx: RankContext) -> str:
    pg = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("short"), 2),
                            rank=ctx.rank, world_size=2, timeout=datetime.timedelta(seconds=1))
    try:
        if ctx.rank == 1:
            return ""
        with pytest.raises(dist.DistBackendError) as error:
            pg.recv(torch.zeros(4), 1, 9)
        return str(error.value)
    finally:
        pg.shutdown()


def test_a_receive_whose_sender_never_comes_fails_naming_it(two):
    message = two.run(_missing_sender)[0]
    assert "recv from rank 1 (tag 9" in message, message
    assert "did not complete within its timeout: rank 1 has not sent it" in message, message


def _send_to_the_dead(ctx: RankContext) -> tuple:
    pg = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("dead"), 2),
                            rank=ctx.rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if ctx.rank == 1:
        os._exit(3)
    before = pyddp_segments()
    with pytest.raises(dist.DistBackendError) as error:
        pg.send(torch.ones(10), 1, 5)
    return str(error.value), before, pyddp_segments()


def test_a_send_whose_receiver_died_fails_naming_it_and_leaves_no_channel():
    pool = Ranks(2)
    try:
        (message, before, after), died = pool.run_each([_send_to_the_dead] * 2, allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 3
        assert "send to rank 1 (tag 5" in message, message
        assert f"rank 1 (pid {pool.pid(1)}) exited" in message, message
        # The channel existed only between the send and its failure.
        assert after == before, (before, after)
    finally:
        pool.close()


def _mismatch(ctx: RankContext) -> str:
    pg = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("mismatch"), 2),
                            rank=ctx.rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    try:
        with pytest.raises(dist.DistBackendError) as size:
            if ctx.rank == 0:
                pg.send(torch.zeros(5), 1)
            else:
                pg.recv(torch.zeros(6), 0)
        with pytest.raises(dist.DistBackendError) as dtype:
            if ctx.rank == 0:
                pg.send(torch.zeros(4, dtype=torch.int32), 1, 2)
            else:
                pg.recv(torch.zeros(4, dtype=torch.float32), 0, 2)
        # Nothing was copied, and the channel goes on.
        t = torch.full((3,), float(ctx.rank))
        if ctx.rank == 0:
            pg.send(t, 1, 4)
        else:
            pg.recv(t, 0, 4)
            check_equal(t, torch.zeros(3), "a message after the refused ones")
        return str(size.value) + "\n" + str(dtype.value)
    finally:
        pg.shutdown()


def test_a_size_or_dtype_mismatch_fails_on_both_ranks(two):
    for message in two.run(_mismatch):
        size, dtype = message.split("\n")
        assert "recv from rank 0 (tag 0, 24 bytes of float32) does not match what rank 0 sent " \
               "(20 bytes of float32)" in size, size
        assert "(16 bytes of int32)" in dtype and "16 bytes of float32" in dtype, dtype


# --- unexpected messages ------------------------------------------------------------


def _reverse_tags(ctx: RankContext, count: int) -> None:
    pg = ctx.groups["small"]
    if ctx.rank == 0:
        works = [pg.isend(torch.full((70,), float(tag)), 1, tag) for tag in range(count)]
        for work in works:
            work.wait()
    elif ctx.rank == 1:
        for tag in reversed(range(count)):
            got = torch.zeros(70)
            pg.recv(got, 0, tag)
            check_equal(got, torch.full((70,), float(tag)), f"tag {tag} of {count}")


def test_any_number_of_messages_are_received_in_reverse_tag_order(two):
    # More messages than a channel's verdict queue holds (64), each taken
    # only after every later one: none waits for the verdict of another.
    two.run(_reverse_tags, 65)
    two.run(_reverse_tags, 300)


def _collectives_behind_unreceived_sends(ctx: RankContext) -> None:
    pg, r = ctx.groups["small"], ctx.rank
    # Rank 0 leaves 100 messages to rank 1 unreceived (each of many pieces);
    # the collectives between the same ranks do not wait behind them.
    pending = [pg.isend(torch.full((200,), float(i)), 1, 7) for i in range(100)] if r == 0 \
        else []
    inp = torch.arange(4, dtype=torch.float32) + 10 * r
    out = torch.zeros(4)
    pg.all_to_all_single(out, inp)
    check_equal(out, torch.tensor([0.0, 1.0, 10.0, 11.0]) + 2 * r, "all_to_all_single")
    gathered = [torch.zeros(3) for _ in range(2)] if r == 1 else None
    pg.gather(torch.full((3,), float(r + 1)), gathered, 1)
    if r == 1:
        for k in range(2):
            check_equal(gathered[k], torch.full((3,), float(k + 1)), f"gather from {k}")
    t = torch.full((5,), float(r))
    pg.all_reduce(t)
    check_equal(t, torch.full((5,), 1.0), "all_reduce")
    if r == 1:
        for i in range(100):
            got = torch.zeros(200)
            pg.recv(got, 0, 7)
            check_equal(got, torch.full((200,), float(i)), f"message {i} of tag 7")
    for work in pending:
        work.wait()


def test_collectives_do_not_wait_behind_unreceived_messages(two):
    two.run(_collectives_behind_unreceived_sends)


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _bounded_aside(ctx: RankContext) -> tuple:
    options = pyddp.GroupOptions()
    options.p2p_buffer_bytes = 8 << 20
    # Rank 1 gives up on its receive of tag 2 after 2 s; rank 0's sends wait
    # for rank 1 to receive them after that.
    pg = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("budget"), 2),
                            rank=ctx.rank, world_size=2, options=options,
                            timeout=datetime.timedelta(seconds=60 if ctx.rank == 0 else 2))
    count, size = 40, 1 << 20  # float32 elements: 40 messages of 4 MiB
    try:
        if ctx.rank == 0:
            works = [pg.isend(torch.full((size,), float(i)), 1, 1) for i in range(count)]
            works.append(pg.isend(torch.full((8,), -1.0), 1, 2))
            for work in works:
                work.wait()
            return "", 0
        before = _rss_bytes()
        # Tag 2 comes after 160 MiB of tag 1 that no receive wants: 8 MiB of
        # it may be held aside, the rest waits in rank 0's channel.
        with pytest.raises(dist.DistBackendError) as error:
            pg.recv(torch.zeros(8), 0, 2)
        grown = _rss_bytes() - before
        for i in range(count):
            got = torch.empty(size)
            pg.recv(got, 0, 1)
            assert bool((got == float(i)).all()), f"message {i} of tag 1"
        last = torch.zeros(8)
        pg.recv(last, 0, 2)
        check_equal(last, torch.full((8,), -1.0), "the message behind the buffered ones")
        return str(error.value), grown
    finally:
        pg.shutdown()


def test_unexpected_messages_are_buffered_up_to_a_budget(two):
    message, grown = two.run(_bounded_aside)[1]
    # Unbounded, all 160 MiB would have been copied aside.
    assert grown < 48 << 20, grown
    assert "rank 1: recv from rank 0 (tag 2, 32 bytes of float32) did not complete within its " \
           "timeout: rank 0 sent messages ahead of it that no receive was posted for" in message, \
        message
    assert "the limit is 8388608, PYDDP_P2P_BUFFER_BYTES" in message, message


def _refused(ctx: RankContext) -> None:
    pg = ctx.groups["small"]
    who = f"rank {ctx.rank}"
    with pytest.raises(ValueError, match=f"{who}: send: dst={ctx.rank} must be another rank"):
        pg.send(torch.zeros(1), ctx.rank)
    with pytest.raises(ValueError, match=f"{who}: send: dst={ctx.world_size} is not a rank"):
        pg.send(torch.zeros(1), ctx.world_size)
    with pytest.raises(TypeError, match="send: tensor has dtype ComplexFloat"):
        pg.send(torch.zeros(1, dtype=torch.complex64), (ctx.rank + 1) % ctx.world_size)
    with pytest.raises(ValueError, match="batch_isend_irecv: expected a non-empty list"):
        pyddp.batch_isend_irecv([])


def test_bad_point_to_point_arguments_are_refused(ranks):
    ranks.run(_refused)


def _collective_tags_are_out_of_reach(ctx: RankContext) -> None:
    # A fresh group: its first all_to_all is collective #1, whose messages
    # carried the tag INT64_MIN + 1 that a user's isend could once give too.
    pg = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("tags"), 2),
                            rank=ctx.rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        peer, r = 1 - ctx.rank, ctx.rank
        collective_tag = -2**63 + 1
        for tag in (collective_tag, -2**31 - 1, 2**31, 2**63 - 1):
            for call in ("send", "recv"):
                op = getattr(pg, "i" + call)
                with pytest.raises(ValueError, match=f"rank {r}: {call}: tag={tag} is not a "
                                   "32-bit int"):
                    op(torch.full((1,), 99.0), peer, tag)
                # The engine refuses it too (torch.distributed's calls reach it directly).
                engine = getattr(pg._cpu_engine, call)
                with pytest.raises(ValueError, match=f"rank {r}: {call}: tag={tag} is not a "
                                   "32-bit int"):
                    engine(torch.full((1,), 99.0), peer, tag, True)
        # The ends of the range are users' tags, and reach no collective.
        extremes = [pg.isend(torch.full((1,), 10.0 * r + k), peer, tag)
                    for k, tag in enumerate((-2**31, 2**31 - 1))]
        out = torch.full((2,), -1.0)
        pg.all_to_all_single(out, torch.tensor([2.0 * r, 2.0 * r + 1]))
        check_equal(out, torch.tensor([float(r), 2.0 + r]), "all_to_all beside user messages")
        for k, tag in enumerate((-2**31, 2**31 - 1)):
            got = torch.zeros(1)
            pg.recv(got, peer, tag)
            check_equal(got, torch.full((1,), 10.0 * peer + k), f"the message of tag {tag}")
        for work in extremes:
            work.wait()
    finally:
        pg.shutdown()


def test_collective_tags_are_out_of_reach_of_user_tags(two):
    two.run(_collective_tags_are_out_of_reach)


def _any_source(ctx: RankContext, group: str, post_order: bool = True) -> None:
    """Rank 0 receives from any rank: messages put aside before the receive, receives posted
    before the messages, and receives from any rank mixed with receives from one rank, which
    take the messages in the order they were posted; without ``post_order`` (gloo's
    recvAnysource, across hosts) a receive from rank 1 may take rank 1's message before a
    receive from any rank posted earlier, as with gloo itself."""
    pg, n, r = ctx.groups[group], ctx.world_size, ctx.rank
    senders = range(1, n)
    # 1. Messages put aside: rank 0 first takes each sender's tag-9 message, which follows
    # its three tag-5 messages in the channel, so those wait aside.
    if r > 0:
        works = [pg.isend(torch.full((3,), 100.0 * r + seq), 0, tag=5) for seq in range(3)]
        works.append(pg.isend(torch.full((2,), -float(r)), 0, tag=9))
        for w in works:
            w.wait()
    else:
        for k in senders:
            t = torch.zeros(2)
            assert pg.recv(t, src=k, tag=9) == k
            check_equal(t, torch.full((2,), -float(k)), "tag 9 from its sender")
        seen = {k: [] for k in senders}
        for _ in range(3 * (n - 1)):
            t = torch.zeros(3)
            src = pg.recv(t, tag=5)
            assert int(t[0]) // 100 == src, (src, t)
            check_equal(t, torch.full((3,), t[0].item()), "any-source message")
            seen[src].append(int(t[0]) % 100)
        assert seen == {k: [0, 1, 2] for k in senders}, seen  # FIFO per sender
    # 2. Receives posted before anything was sent; the Work names the sender.
    if r == 0:
        bufs = [torch.zeros(4, dtype=torch.int64) for _ in senders]
        works = [pg.irecv(b, tag=7) for b in bufs]
    pg.barrier()
    if r > 0:
        sent = pg.isend(torch.full((4,), r, dtype=torch.int64), 0, tag=7)
        sent.wait()
        # A send has no source rank, as gloo's (torch's Work refuses the question).
        with pytest.raises(RuntimeError, match="sourceRank"):
            sent._source_rank()
    else:
        sources = []
        for w, b in zip(works, bufs):
            w.wait()
            sources.append(w._source_rank())
            check_equal(b, torch.full((4,), sources[-1], dtype=torch.int64), "irecv(src=None)")
        assert sorted(sources) == list(senders), sources
    # 3. A receive from rank 1 and one from any rank take rank 1's messages in post order.
    for any_first in (False, True):
        if r == 0:
            a, b = torch.zeros(1), torch.zeros(1)
            first = pg.irecv(a, None if any_first else 1, tag=3)
            second = pg.irecv(b, 1 if any_first else None, tag=3)
        pg.barrier()
        if r == 1:
            pg.send(torch.tensor([1.0]), 0, tag=3)
            pg.send(torch.tensor([2.0]), 0, tag=3)
        elif r == 0:
            first.wait()
            second.wait()
            if post_order or not any_first:
                assert (a.item(), b.item()) == (1.0, 2.0), (a, b, any_first)
            else:
                assert sorted([a.item(), b.item()]) == [1.0, 2.0], (a, b, any_first)
            assert first._source_rank() == second._source_rank() == 1
        pg.barrier()


def test_receive_from_any_source(ranks):
    ranks.run(_any_source, "small")
    ranks.run(_any_source, "default")


# --- all-to-all ----------------------------------------------------------------


def _all_to_all(ctx: RankContext, group: str) -> None:
    message_cases.all_to_all(ctx.groups[group], ctx.world_size, ctx.rank)


def test_all_to_all(ranks):
    ranks.run(_all_to_all, "small")
    ranks.run(_all_to_all, "default")


def _split_mismatch(ctx: RankContext) -> str:
    n = ctx.world_size
    pg = pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("splits"), n),
                            rank=ctx.rank, world_size=n, timeout=datetime.timedelta(seconds=10))
    try:
        # Rank 0 expects 2 rows from rank 1, which sends it 1.
        out_splits = [1] * n
        if ctx.rank == 0:
            out_splits[1] = 2
        out = torch.zeros(sum(out_splits))
        try:
            pg.all_to_all_single(out, torch.zeros(n), out_splits, [1] * n)
        except dist.DistBackendError as error:
            return str(error)
        return ""
    finally:
        pg.shutdown()


def test_split_sizes_that_disagree_fail_naming_both_ranks(two):
    for message in two.run(_split_mismatch):
        assert "rank 0: recv from rank 1" in message and "does not match what rank 1 sent" in \
            message, message


# --- gather, scatter, reduce ------------------------------------------------------


def _rooted(ctx: RankContext, group: str) -> None:
    message_cases.rooted(ctx.groups[group], ctx.world_size, ctx.rank, DTYPES, COUNTS, COUNTS)


def test_gather_scatter_and_reduce_to_every_root(ranks):
    ranks.run(_rooted, "small")
    ranks.run(_rooted, "default")


def _large_reduce(ctx: RankContext) -> None:
    pg, n = ctx.groups["default"], ctx.world_size
    count = 1_000_003  # ring reduce, blocks of unequal size
    inputs = [make_input(k, count, torch.float32) for k in range(n)]
    for root in range(n):
        t = inputs[ctx.rank].clone()
        pg.reduce(t, root)
        check_equal(t, reference_reduce(inputs, ReduceOp.SUM) if ctx.rank == root
                    else inputs[ctx.rank], f"large reduce root={root}")


def test_large_reduce(ranks):
    ranks.run(_large_reduce)


# --- coalesced ---------------------------------------------------------------------


def _coalesced(ctx: RankContext, group: str) -> None:
    pg, n, r = ctx.groups[group], ctx.world_size, ctx.rank
    sizes = [0, 1, 5, 300]
    for dtype, op in [(torch.float32, ReduceOp.SUM), (torch.int32, ReduceOp.MAX),
                      (torch.bfloat16, ReduceOp.AVG)]:
        inputs = [[make_input(k, s, dtype, op, salt=i) for i, s in enumerate(sizes)]
                  for k in range(n)]
        ts = [t.clone() for t in inputs[r]]
        pg.all_reduce_coalesced(ts, op)
        for i in range(len(sizes)):
            check_equal(ts[i], reference_reduce([inputs[k][i] for k in range(n)], op),
                        f"all_reduce_coalesced {dtype} tensor {i}")
        outs = [torch.full((n * s,), 4, dtype=dtype) for s in sizes]
        pg.all_gather_into_tensor_coalesced(outs, inputs[r])
        for i in range(len(sizes)):
            check_equal(outs[i], torch.cat([inputs[k][i] for k in range(n)]),
                        f"all_gather_into_tensor_coalesced {dtype} tensor {i}")
        # the list form, with shaped tensors, twice (synchronous, then async)
        shaped = [[x.reshape(-1, 1) if x.numel() != 5 else x for x in inputs[k]]
                  for k in range(n)]
        for async_op in (False, True):
            lists = [[torch.full_like(x, 4) for x in shaped[r]] for _ in range(n)]
            work = pg.all_gather_coalesced(lists, shaped[r], async_op=async_op)
            if async_op:
                work.wait()
            for k in range(n):
                for i in range(len(sizes)):
                    check_equal(lists[k][i], shaped[k][i],
                                f"all_gather_coalesced {dtype} rank {k} tensor {i}")
        wholes = [[make_input(k, n * s, dtype, op, salt=10 + i) for i, s in enumerate(sizes)]
                  for k in range(n)]
        outs = [torch.full((s,), 4, dtype=dtype) for s in sizes]
        pg.reduce_scatter_tensor_coalesced(outs, wholes[r], op)
        for i, s in enumerate(sizes):
            full = reference_reduce([wholes[k][i] for k in range(n)], op)
            check_equal(outs[i], full[r * s:(r + 1) * s],
                        f"reduce_scatter_tensor_coalesced {dtype} tensor {i}")


def test_coalesced_collectives(ranks):
    ranks.run(_coalesced, "small")
    ranks.run(_coalesced, "default")


# --- subgroups -----------------------------------------------------------------------


def _subgroups(ctx: RankContext) -> list:
    n, r = ctx.world_size, ctx.rank
    members = [0, n - 1]
    sub = pyddp.new_group(members)
    evens = pyddp.new_group(list(range(0, n, 2)))
    mine, all_pairs = pyddp.new_subgroups(2) if n % 2 == 0 else (None, [])
    seen = {}
    if r in members:
        assert sub.size() == 2 and sub.rank() == members.index(r) and sub.ranks == members
        t = torch.full((3,), float(r + 1))
        sub.all_reduce(t)
        check_equal(t, torch.full((3,), float(n + 1)), "all_reduce in a subgroup")
        # point-to-point inside the subgroup, by subgroup rank
        got = torch.zeros(2)
        works = [sub.isend(torch.full((2,), float(r)), 1 - sub.rank()),
                 sub.irecv(got, 1 - sub.rank())]
        for work in works:
            work.wait()
        check_equal(got, torch.full((2,), float(members[1 - sub.rank()])), "subgroup p2p")
    else:
        assert isinstance(sub, pyddp.NonMemberGroup)
        with pytest.raises(RuntimeError, match=f"rank {r} is not a member of this group"):
            sub.all_reduce(torch.ones(1))
        seen["non-member refused"] = True
    if r % 2 == 0:
        t = torch.full((2,), float(r))
        evens.all_reduce(t)
        check_equal(t, torch.full((2,), float(sum(range(0, n, 2)))), "even ranks")
    if mine is not None:
        assert len(all_pairs) == n // 2 and mine.ranks == [r - r % 2, r - r % 2 + 1]
        t = torch.full((1,), float(r))
        mine.all_reduce(t, op=ReduceOp.MAX)
        check_equal(t, torch.full((1,), float(r - r % 2 + 1)), "new_subgroups")
        mine.shutdown()
    # The parent is unaffected by its subgroups' traffic.
    t = torch.ones(4)
    pyddp.all_reduce(t)
    check_equal(t, torch.full((4,), float(n)), "the default group after subgroups")
    for g in (sub, evens):
        if isinstance(g, pyddp.ProcessGroup):
            g.shutdown()
    return sorted(seen)


def test_subgroups_by_ranks(ranks):
    results = ranks.run(_subgroups)
    n = len(results)
    for r, seen in enumerate(results):
        assert seen == ([] if r in (0, n - 1) else ["non-member refused"]), (r, seen)


def _bad_subgroups(ctx: RankContext) -> None:
    with pytest.raises(ValueError, match="new_group: ranks must be distinct"):
        pyddp.new_group([0, 0])
    with pytest.raises(ValueError, match=f"ranks entry={ctx.world_size} is not a rank"):
        pyddp.new_group([0, ctx.world_size])
    with pytest.raises(ValueError, match="group_size 5 must divide"):
        pyddp.new_subgroups(5)


def test_bad_subgroup_arguments(two):
    two.run(_bad_subgroups)
