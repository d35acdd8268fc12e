"""The README's support table tells the truth: every row of its CPU column is run
through torch.distributed on the "pyddp" backend (2 and 3 ranks) and checked against
an independent reference, or, where the table says "refused", checked to raise the
error text it quotes. A row without a check here, or a check without a row, fails.
"""

from __future__ import annotations

import datetime
import functools
import operator
import os
import re

import pytest
import torch
import torch.distributed as dist

import pyddp  # noqa: F401  (registers the "pyddp" backend)
from collective_cases import BITWISE_OPS, INT_DTYPES, check_equal, make_input, reference_reduce
from harness import RankContext, Ranks
from paths import REPO

README = os.path.join(REPO, "README.md")


def _table() -> dict:
    """First cell -> CPU cell, from the table after the support-table marker."""
    lines = open(README).read().split("<!-- support-table:", 1)[1].splitlines()[1:]
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return rows


def _setup(ctx: RankContext) -> None:
    dist.init_process_group("pyddp", store=dist.FileStore(ctx.store_path("torch"), ctx.world_size),
                            rank=ctx.rank, world_size=ctx.world_size)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def _rank_values(n: int, count: int = 4) -> list:
    return [torch.arange(count, dtype=torch.float32) + 10 * r for r in range(n)]


def _all_reduce(r, n):
    t = _rank_values(n)[r].clone()
    dist.all_reduce(t)
    check_equal(t, sum(_rank_values(n)), "all_reduce")


def _sparse_all_reduce(r, n):
    def rows(k):  # rank k's 2 rows of a 6 x 2 matrix, the second shared by every rank
        return torch.sparse_coo_tensor([[k % 6, 5]], torch.tensor([[1.0, k], [2.0, 3.0]]), (6, 2))
    t = rows(r)
    dist.all_reduce(t)
    expected = functools.reduce(operator.add, [rows(k) for k in range(n)]).coalesce()
    assert t.is_sparse and t.is_coalesced()
    check_equal(t._indices(), expected._indices(), "sparse all_reduce indices")
    check_equal(t._values(), expected._values(), "sparse all_reduce values")


def _broadcast(r, n):
    t = _rank_values(n)[r].clone()
    dist.broadcast(t, src=n - 1)
    check_equal(t, _rank_values(n)[n - 1], "broadcast")


def _reduce(r, n):
    t = _rank_values(n)[r].clone()
    dist.reduce(t, dst=1)
    check_equal(t, sum(_rank_values(n)) if r == 1 else _rank_values(n)[r], "reduce")


def _all_gather(r, n):
    outs = [torch.zeros(4) for _ in range(n)]
    dist.all_gather(outs, _rank_values(n)[r])
    out = torch.zeros(4 * n)
    dist.all_gather_into_tensor(out, _rank_values(n)[r])
    check_equal(torch.cat(outs), torch.cat(_rank_values(n)), "all_gather")
    check_equal(out, torch.cat(_rank_values(n)), "all_gather_into_tensor")


def _gather(r, n):
    outs = [torch.zeros(4) for _ in range(n)] if r == 0 else None
    dist.gather(_rank_values(n)[r], outs, dst=0)
    if r == 0:
        check_equal(torch.cat(outs), torch.cat(_rank_values(n)), "gather")


def _scatter(r, n):
    out = torch.zeros(4)
    dist.scatter(out, _rank_values(n) if r == n - 1 else None, src=n - 1)
    check_equal(out, _rank_values(n)[r], "scatter")


def _reduce_scatter(r, n):
    whole = [torch.arange(4 * n, dtype=torch.float32) + k for k in range(n)]
    out = torch.zeros(4)
    dist.reduce_scatter_tensor(out, whole[r])
    expected = sum(whole)[4 * r:4 * (r + 1)]
    check_equal(out, expected, "reduce_scatter_tensor")
    out2 = torch.zeros(4)
    dist.reduce_scatter(out2, list(whole[r].chunk(n)))
    check_equal(out2, expected, "reduce_scatter")


def _all_to_all_single(r, n):
    # rank s sends s + d + 1 elements to rank d; rank 0 sends nothing to itself
    sizes = [[0 if s == d == 0 else s + d + 1 for d in range(n)] for s in range(n)]
    block = {(s, d): torch.full((sizes[s][d],), float(10 * s + d)) for s in range(n)
             for d in range(n)}
    out = torch.zeros(sum(sizes[s][r] for s in range(n)))
    dist.all_to_all_single(out, torch.cat([block[(r, d)] for d in range(n)]),
                           [sizes[s][r] for s in range(n)], sizes[r])
    check_equal(out, torch.cat([block[(s, r)] for s in range(n)]), "all_to_all_single")


def _all_to_all(r, n):
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), float(10 * r + d)) for d in range(n)])
    check_equal(torch.cat(outs), torch.cat([torch.full((2,), float(10 * s + r))
                                            for s in range(n)]), "all_to_all")


def _point_to_point(r, n):
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.zeros(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, left),
                                    dist.P2POp(dist.isend, torch.full((3,), float(r)), right)])
    for work in works:
        work.wait()
    check_equal(got, torch.full((3,), float(left)), "batch_isend_irecv")
    if r < 2:
        t = torch.full((2,), float(r))
        if r == 0:
            dist.send(t, 1, tag=3)
            dist.recv(t, 1, tag=4)
        else:
            dist.recv(t, 0, tag=3)
            dist.send(t + 1, 0, tag=4)
        check_equal(t, torch.full((2,), 1.0 if r == 0 else 0.0), "send and recv")
        work = dist.isend(t, 1 - r, tag=5) if r == 0 else dist.irecv(t, 0, tag=5)
        work.wait()
        # Tags span torch's 32-bit range; torch refuses wider ones.
        for tag in (-2**31, 2**31 - 1):
            t = torch.full((2,), float(r))
            work = dist.isend(t, 1, tag=tag) if r == 0 else dist.irecv(t, 0, tag=tag)
            work.wait()
            check_equal(t, torch.zeros(2), f"a message of tag {tag}")


def _new_group(r, n):
    group = dist.new_group(list(range(1, n)))
    if r > 0:
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=group)
        check_equal(t, torch.full((2,), float(sum(range(1, n)))), "all_reduce in a subgroup")
        dist.destroy_process_group(group)
    # Rank n-1 asks for every rank, the others for all but it: rank n-1 fails
    # (torch calls no backend on a group's non-members), the others agree.
    if r == n - 1:
        with pytest.raises(dist.DistBackendError, match="the ranks disagree on the group"):
            dist.new_group(list(range(n)))
    else:
        group = dist.new_group(list(range(n - 1)))
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=group)
        check_equal(t, torch.full((2,), float(sum(range(n - 1)))), "all_reduce in a subgroup")
        dist.destroy_process_group(group)


def _coalesced(r, n):
    from torch.distributed.distributed_c10d import _coalescing_manager
    a, b = torch.full((2,), float(r)), torch.full((3,), float(r + 1))
    with _coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    check_equal(a, torch.full((2,), float(sum(range(n)))), "coalesced all_reduce")
    check_equal(b, torch.full((3,), float(sum(range(1, n + 1)))), "coalesced all_reduce")
    outs = [torch.zeros(2 * n), torch.zeros(n)]
    with _coalescing_manager():
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(r)))
        dist.all_gather_into_tensor(outs[1], torch.full((1,), float(-r)))
    check_equal(outs[0], torch.arange(n, dtype=torch.float32).repeat_interleave(2),
                "coalesced all_gather_into_tensor")
    check_equal(outs[1], -torch.arange(n, dtype=torch.float32), "coalesced all_gather")
    shards = [torch.zeros(1), torch.zeros(2)]
    with _coalescing_manager():
        dist.reduce_scatter_tensor(shards[0], torch.arange(n, dtype=torch.float32))
        dist.reduce_scatter_tensor(shards[1], torch.ones(2 * n))
    check_equal(shards[0], torch.tensor([float(n * r)]), "coalesced reduce_scatter_tensor")
    check_equal(shards[1], torch.full((2,), float(n)), "coalesced reduce_scatter_tensor")


def _barrier(r, n):
    dist.barrier()


def _monitored_barrier(r, n):
    group = dist.group.WORLD
    group.monitored_barrier(datetime.timedelta(seconds=60))
    group.monitored_barrier(datetime.timedelta(seconds=60), wait_all_ranks=True)
    if r != n - 1:  # rank n-1 stays away; rank 0 names it, the others point at rank 0
        with pytest.raises(RuntimeError) as error:
            group.monitored_barrier(datetime.timedelta(seconds=1))
        named = f"Rank {n - 1} failed to pass monitoredBarrier in 1000 ms" if r == 0 else \
            f"Rank {r} successfully reached monitoredBarrier, but received errors"
        assert named in str(error.value), str(error.value)


def _objects(r, n):
    objs = [None] * n
    dist.all_gather_object(objs, {"r": r})
    assert objs == [{"r": k} for k in range(n)], objs


def _refused(pattern):
    def check(r, n, call):
        with pytest.raises(Exception, match=re.escape(pattern)):
            call()
        t = torch.ones(2)
        dist.all_reduce(t)  # the group still works
        check_equal(t, torch.full((2,), float(n)), "all_reduce after a refusal")
    return check


def _recv_anysource(r, n):
    if r == 0:
        got = []
        for _ in range(n - 1):
            t = torch.zeros(1)
            src = dist.recv(t)
            check_equal(t, torch.tensor([float(src)]), "recv without src")
            got.append(src)
        assert sorted(got) == list(range(1, n)), got
    else:
        dist.send(torch.tensor([float(r)]), 0)


def _bitwise_ops(r, n):
    for dtype in INT_DTYPES:
        for op in BITWISE_OPS:
            inputs = [make_input(k, 5, dtype, op) for k in range(n)]
            expected = reference_reduce(inputs, op)
            t = inputs[r].clone()
            dist.all_reduce(t, op=op)
            check_equal(t, expected, f"all_reduce {dtype} {op}")
            t = inputs[r].clone()
            dist.reduce(t, dst=0, op=op)
            check_equal(t, expected if r == 0 else inputs[r], f"reduce {dtype} {op}")
            whole = [make_input(k, 2 * n, dtype, op, salt=1) for k in range(n)]
            out = torch.zeros(2, dtype=dtype)
            dist.reduce_scatter_tensor(out, whole[r], op=op)
            check_equal(out, reference_reduce(whole, op)[2 * r:2 * r + 2],
                        f"reduce_scatter_tensor {dtype} {op}")
    with pytest.raises(TypeError, match="ReduceOp.BAND needs an integer tensor"):
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND)


def _premul_sum(r, n, pattern):
    _refused(pattern)(r, n, lambda: dist.all_reduce(torch.ones(1),
                                                    op=dist._make_nccl_premul_sum(2.0)))


def _all_gather_coalesced(r, n):
    ins = [torch.full((2, 3), float(r)), torch.arange(4, dtype=torch.float32) * (r + 1)]
    outs = [[torch.zeros(2, 3), torch.zeros(4)] for _ in range(n)]
    dist.all_gather_coalesced(outs, ins)
    for k in range(n):
        check_equal(outs[k][0], torch.full((2, 3), float(k)), "all_gather_coalesced")
        check_equal(outs[k][1], torch.arange(4, dtype=torch.float32) * (k + 1),
                    "all_gather_coalesced")


CHECKS = {
    "`all_reduce`": _all_reduce,
    "`all_reduce` of a sparse COO tensor": _sparse_all_reduce,
    "`broadcast`": _broadcast,
    "`reduce`": _reduce,
    "`all_gather`, `all_gather_into_tensor`": _all_gather,
    "`gather`": _gather,
    "`scatter`": _scatter,
    "`reduce_scatter`, `reduce_scatter_tensor`": _reduce_scatter,
    "`all_to_all_single` (even, uneven, empty splits)": _all_to_all_single,
    "`all_to_all`": _all_to_all,
    "`send`, `recv`, `isend`, `irecv`, `batch_isend_irecv`": _point_to_point,
    "`recv` without `src`": _recv_anysource,
    "`new_group`": _new_group,
    "coalesced (`allreduce_coalesced`, `allgather_into_tensor_coalesced`, "
    "`reduce_scatter_tensor_coalesced`)": _coalesced,
    "`barrier`": _barrier,
    "`monitored_barrier` (`ProcessGroup.monitored_barrier`, `pyddp.monitored_barrier`)":
        _monitored_barrier,
    "`all_gather_object`, `broadcast_object_list`, `gather_object`, `scatter_object_list`":
        _objects,
    "`ReduceOp.BAND`, `BOR`, `BXOR`": _bitwise_ops,
    "`ReduceOp.PREMUL_SUM`": _premul_sum,
    "`all_gather_coalesced` (deprecated list form)": _all_gather_coalesced,
}


def _run_row(ctx: RankContext, name: str, cell: str) -> None:
    check = CHECKS[name]
    if cell.startswith("refused"):
        check(ctx.rank, ctx.world_size, re.search(r'"(.*)"', cell).group(1))
    else:
        assert cell.startswith("yes"), (name, cell)
        check(ctx.rank, ctx.world_size)


def test_every_row_has_a_check_and_every_check_a_row():
    assert set(_table()) == set(CHECKS)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CHECKS))
def test_the_cpu_column(ranks, name):
    ranks.run(_run_row, name, _table()[name])
