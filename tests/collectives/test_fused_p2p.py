"""The fused engine's point-to-point messages and the collectives built without a channel
program of their own, on the emulated grid (backend "emulated": the fused engine with CPU
tensors, over the same messages as the shm transport).

On 2 and 3 spawned ranks, against references every rank rebuilds from the ranks and
indices (collective_cases.make_input): send/recv and isend/irecv of several dtypes and
sizes, 0 elements included; FIFO order per pair and tag with tags received out of order;
a receive from any source returning its sender; batch_isend_irecv ring exchanges;
all_to_all_single with even, uneven and empty splits and all_to_all over lists; gather,
scatter and reduce to every root; monitored_barrier; and one sequence of all of them
giving bit for bit what backend "shm" gives.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import message_cases
import pyddp
from collective_cases import ReduceOp, check_equal, digest, make_input, reference_reduce
from harness import RankContext, Ranks

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)
# 256-byte slots and chunks: messages of a few hundred elements take many pieces.
SLOT = 256
COUNTS = [0, 1, 3, 1001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64]


def _group(ctx: RankContext, backend: str):
    options = pyddp.GroupOptions()
    options.slot_bytes = SLOT
    return pyddp.create_group(backend, store=dist.FileStore(ctx.store_path(backend),
                                                            ctx.world_size),
                              rank=ctx.rank, world_size=ctx.world_size, timeout=TIMEOUT,
                              options=options)


def _setup(ctx: RankContext) -> None:
    for backend in ("emulated", "shm"):
        ctx.groups[backend] = _group(ctx, backend)
    # the fused engine on the emulated grid, not a transport engine
    assert ctx.groups["emulated"].transports() == {"cpu": "emulated"}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


# --- point-to-point --------------------------------------------------------------


def _pairs(ctx: RankContext) -> None:
    """Every ordered pair, blocking and non-blocking, lower rank sending first."""
    pg, n, r = ctx.groups["emulated"], ctx.world_size, ctx.rank
    for dtype in DTYPES:
        for count in COUNTS:
            for peer in range(n):
                if peer == r:
                    continue
                mine = make_input(r, count, dtype, salt=peer)
                got = torch.full((count,), 5, dtype=dtype)
                if r < peer:
                    pg.send(mine, peer)
                    assert pg.recv(got, peer) == peer
                else:
                    pg.recv(got, peer)
                    pg.send(mine, peer)
                check_equal(got, make_input(peer, count, dtype, salt=r),
                            f"send/recv {dtype} {count} from {peer}")
                got = torch.full((count,), 5, dtype=dtype)
                works = [pg.irecv(got, peer, tag=count), pg.isend(mine, peer, tag=count)]
                for w in works:
                    w.wait()
                check_equal(got, make_input(peer, count, dtype, salt=r),
                            f"isend/irecv {dtype} {count} from {peer}")


def test_send_and_recv_of_every_dtype_and_size(ranks):
    ranks.run(_pairs)


def _fifo(ctx: RankContext) -> None:
    """Rank 0 sends 4 messages on each of 6 tags to every peer, tags interleaved; the peers
    receive the tags in reverse order and each tag's messages in the order they were sent."""
    pg, n, r = ctx.groups["emulated"], ctx.world_size, ctx.rank
    tags, per_tag = range(6), 4

    def message(dst: int, tag: int, i: int) -> torch.Tensor:
        return torch.full((37,), 1000.0 * dst + 10.0 * tag + i)

    if r == 0:
        works = [pg.isend(message(dst, tag, i), dst, tag)
                 for i in range(per_tag) for tag in tags for dst in range(1, n)]
        for w in works:
            w.wait()
        return
    got = {(tag, i): torch.zeros(37) for tag in tags for i in range(per_tag)}
    works = [pg.irecv(got[(tag, i)], 0, tag) for tag in reversed(tags) for i in range(per_tag)]
    for w in works:
        w.wait()
    for (tag, i), t in got.items():
        check_equal(t, message(r, tag, i), f"tag {tag} message {i}")


def test_fifo_per_pair_and_tag(ranks):
    ranks.run(_fifo)


def _any_source(ctx: RankContext) -> None:
    """Every rank but 0 sends rank 0 two messages tagged 5, which rank 0 receives from any
    source, each naming its sender; then irecv(src=None) names it through the Work."""
    pg, n, r = ctx.groups["emulated"], ctx.world_size, ctx.rank
    if r != 0:
        works = [pg.isend(torch.full((3,), 100.0 * r + seq), 0, tag=5) for seq in range(2)]
        works.append(pg.isend(torch.full((4,), r, dtype=torch.int64), 0, tag=7))
        for w in works:
            w.wait()
        return
    seen = {k: [] for k in range(1, n)}
    for _ in range(2 * (n - 1)):
        t = torch.zeros(3)
        src = pg.recv(t, tag=5)
        check_equal(t, torch.full((3,), t[0].item()), "any-source message")
        seen[src].append(t[0].item())
    # each sender's messages, in the order it sent them
    assert seen == {k: [100.0 * k, 100.0 * k + 1] for k in range(1, n)}, seen
    bufs = [torch.zeros(4, dtype=torch.int64) for _ in range(1, n)]
    works = [pg.irecv(b, tag=7) for b in bufs]
    sources = []
    for w, b in zip(works, bufs):
        w.wait()
        sources.append(w._source_rank())
        check_equal(b, torch.full((4,), sources[-1], dtype=torch.int64), "irecv(src=None)")
    assert sorted(sources) == list(range(1, n)), sources


def test_receive_from_any_source_returns_the_sender(ranks):
    ranks.run(_any_source)


def _batch(ctx: RankContext) -> None:
    message_cases.ring_exchanges(ctx.groups["emulated"], ctx.world_size, ctx.rank, DTYPES,
                                 COUNTS)


def test_batch_isend_irecv_ring_exchanges(ranks):
    ranks.run(_batch)


# --- collectives without a channel program ---------------------------------------------


def _all_to_all(ctx: RankContext) -> None:
    pg, n, r = ctx.groups["emulated"], ctx.world_size, ctx.rank
    message_cases.all_to_all(pg, n, r)
    # between fused collectives, asynchronously
    t = make_input(r, 100, torch.float32)
    work = pg.all_reduce(t, async_op=True)
    out = torch.zeros(2 * n)
    a2a = pg.all_to_all_single(out, torch.arange(2.0 * n) + 100 * r, async_op=True)
    work.wait()
    a2a.wait()
    check_equal(t, reference_reduce([make_input(k, 100, torch.float32) for k in range(n)],
                                    ReduceOp.SUM), "all_reduce before all_to_all")
    check_equal(out, torch.tensor([100.0 * s + 2 * r + i for s in range(n) for i in range(2)]),
                "all_to_all after all_reduce")


def test_all_to_all_with_uneven_splits_and_lists(ranks):
    ranks.run(_all_to_all)


def _rooted(ctx: RankContext) -> None:
    message_cases.rooted(ctx.groups["emulated"], ctx.world_size, ctx.rank, DTYPES, COUNTS,
                         [0, 61, 1001])


def test_gather_scatter_and_reduce_to_every_root(ranks):
    ranks.run(_rooted)


def _monitored(ctx: RankContext) -> None:
    pg = ctx.groups["emulated"]
    for wait_all in (False, True):
        pg.monitored_barrier(datetime.timedelta(seconds=30), wait_all_ranks=wait_all)


def test_monitored_barrier(ranks):
    ranks.run(_monitored)


# --- the same as shm -------------------------------------------------------------------


def _sequence(ctx: RankContext, backend: str) -> list:
    """Every call of this file once, results as digests, for comparing backends."""
    pg, n, r = ctx.groups[backend], ctx.world_size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        got = torch.zeros(513, dtype=dtype)
        works = [pg.isend(make_input(r, 513, dtype, salt=1), right, 3), pg.irecv(got, left, 3)]
        for w in works:
            w.wait()
        results.append(digest(got))
        split = message_cases.splits(n, "uneven")
        inp = make_input(r, sum(split[r]), dtype, salt=2)
        out = torch.zeros(sum(split[s][r] for s in range(n)), dtype=dtype)
        pg.all_to_all_single(out, inp, [split[s][r] for s in range(n)], split[r])
        results.append(digest(out))
        outs = [torch.zeros(s + 1, dtype=dtype) for s in range(n)]
        pg.all_to_all(outs, [make_input(r, r + 1, dtype, salt=d) for d in range(n)])
        results += [digest(t) for t in outs]
        t = make_input(r, 777, dtype, salt=3)
        pg.reduce(t, n - 1)
        results.append(digest(t))
        gathered = [torch.zeros(5, dtype=dtype) for _ in range(n)]
        pg.gather(make_input(r, 5, dtype, salt=4), gathered if r == 0 else None, 0)
        results += [digest(t) for t in gathered]
        out = torch.zeros(9, dtype=dtype)
        pg.scatter(out, [make_input(k, 9, dtype, salt=5) for k in range(n)] if r == 0 else None,
                   0)
        results.append(digest(out))
    if r != 0:
        pg.send(torch.full((2,), float(r)), 0, 11)
    else:
        received = []
        for _ in range(n - 1):
            t = torch.zeros(2)
            src = pg.recv(t, tag=11)
            received.append((src, digest(t)))
        # any source: the senders in whichever order their messages came
        results += sorted(received)
    return results


def _both(ctx: RankContext) -> tuple:
    return _sequence(ctx, "emulated"), _sequence(ctx, "shm")


def test_the_same_calls_give_what_shm_gives(ranks):
    for rank, (fused, shm) in enumerate(ranks.run(_both)):
        assert fused == shm, f"rank {rank}"
