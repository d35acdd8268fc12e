"""Coalesced calls on every engine kind: one table of bad arguments refused alike by the
one-host engine and the engines across hosts (PYDDP_HOSTID splitting this machine:
gloo alone with one rank per host, the hierarchical layout with two), leaving each
group usable; and ranks that split a call of the same total size differently fail with
a DistBackendError on every rank naming every rank's split, through pyddp's API and
through torch.distributed's "pyddp" backend, where gloo would mix their elements.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import check_equal
from harness import RankContext, Ranks

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)
# Engine kinds: how many simulated hosts the ranks spread over (1: the shm engine).
HOSTS = {"one-host": 1, "hosts": 2}
_groups = itertools.count()


def _group(ctx: RankContext, hosts: int):
    """A fresh group of every rank, its ranks spread over `hosts` simulated hosts."""
    name = f"g{next(_groups)}"
    if hosts > 1:
        os.environ["PYDDP_HOSTID"] = f"host{ctx.rank * hosts // ctx.world_size}"
    try:
        return pyddp.create_group("auto", store=dist.FileStore(ctx.store_path(name),
                                                               ctx.world_size),
                                  rank=ctx.rank, world_size=ctx.world_size, timeout=TIMEOUT)
    finally:
        os.environ.pop("PYDDP_HOSTID", None)


def _ones(*sizes, dtype=torch.float32):
    return [torch.ones(s, dtype=dtype) for s in sizes]


# Each row: a call on group `pg` of world size `n`, the exception it raises and a
# fragment of its message.
def _bad_calls(n: int):
    f, i = torch.float32, torch.int64
    return [
        ("all_reduce_coalesced: no tensors",
         lambda pg: pg.all_reduce_coalesced([]), ValueError, "tensors is empty"),
        ("all_reduce_coalesced: two dtypes",
         lambda pg: pg.all_reduce_coalesced(_ones(3) + _ones(2, dtype=i)), TypeError,
         "every tensor must have dtype"),
        ("all_reduce_coalesced: an expanded tensor",
         lambda pg: pg.all_reduce_coalesced([torch.ones(1).expand(4)]), ValueError,
         "share memory"),
        ("all_reduce_coalesced: AVG of integers",
         lambda pg: pg.all_reduce_coalesced(_ones(3, dtype=i), op=dist.ReduceOp.AVG),
         TypeError, "AVG needs a floating-point tensor"),
        ("all_gather_into_tensor_coalesced: fewer outputs than inputs",
         lambda pg: pg.all_gather_into_tensor_coalesced(_ones(2 * n), _ones(2, 3)),
         ValueError, "1 outputs for 2 inputs"),
        ("all_gather_into_tensor_coalesced: more outputs than inputs",
         lambda pg: pg.all_gather_into_tensor_coalesced(_ones(2 * n, 3 * n), _ones(2)),
         ValueError, "2 outputs for 1 inputs"),
        ("all_gather_into_tensor_coalesced: an output of the wrong size",
         lambda pg: pg.all_gather_into_tensor_coalesced(_ones(2 * n, 3 * n + 1), _ones(2, 3)),
         ValueError, f"output 1 has {3 * n + 1} elements, expected {3 * n}"),
        ("all_gather_into_tensor_coalesced: outputs of another dtype",
         lambda pg: pg.all_gather_into_tensor_coalesced(_ones(2 * n, dtype=i), _ones(2)),
         TypeError, "outputs and inputs differ in dtype"),
        ("reduce_scatter_tensor_coalesced: fewer outputs than inputs",
         lambda pg: pg.reduce_scatter_tensor_coalesced(_ones(2), _ones(2 * n, 3 * n)),
         ValueError, "1 outputs for 2 inputs"),
        ("reduce_scatter_tensor_coalesced: more outputs than inputs",
         lambda pg: pg.reduce_scatter_tensor_coalesced(_ones(2, 3), _ones(2 * n)),
         ValueError, "2 outputs for 1 inputs"),
        ("reduce_scatter_tensor_coalesced: an input of the wrong size",
         lambda pg: pg.reduce_scatter_tensor_coalesced(_ones(2, 3), _ones(2 * n, 3 * n - 1)),
         ValueError, f"input 1 has {3 * n - 1} elements, expected {3 * n}"),
        ("reduce_scatter_tensor_coalesced: BAND of floats",
         lambda pg: pg.reduce_scatter_tensor_coalesced(_ones(2, dtype=f), _ones(2 * n),
                                                       op=dist.ReduceOp.BAND),
         TypeError, "needs an integer tensor"),
        ("all_gather_coalesced: too few output lists",
         lambda pg: pg.all_gather_coalesced([_ones(2)] * (n - 1), _ones(2)), ValueError,
         f"got {n - 1} output lists, expected world_size = {n}"),
        ("all_gather_coalesced: an output list of the wrong length",
         lambda pg: pg.all_gather_coalesced([_ones(2, 3)] * (n - 1) + [_ones(2)], _ones(2, 3)),
         ValueError, f"output list {n - 1} has 1 tensors, expected 2"),
        ("all_gather_coalesced: an output of the wrong shape",
         lambda pg: pg.all_gather_coalesced([_ones(2, 4)] * n, _ones(2, 3)), ValueError,
         "has shape [4], expected [3]"),
    ]


def _good_call(pg, n: int, rank: int, step: int) -> None:
    """A coalesced all-reduce, checked: the group is still usable."""
    ts = [torch.full((3,), float(rank + step)), torch.full((2, 2), float(rank))]
    pg.all_reduce_coalesced(ts)
    check_equal(ts[0], torch.full((3,), float(sum(range(n)) + n * step)), f"after step {step}")
    check_equal(ts[1], torch.full((2, 2), float(sum(range(n)))), f"after step {step}")


def _bad_arguments(ctx: RankContext, hosts: int) -> list:
    pg = _group(ctx, hosts)
    try:
        seen = []
        for step, (what, call, error, says) in enumerate(_bad_calls(ctx.world_size)):
            with pytest.raises(error) as raised:
                call(pg)
            assert says in str(raised.value), (what, str(raised.value))
            assert f"rank {ctx.rank}" in str(raised.value), (what, str(raised.value))
            _good_call(pg, ctx.world_size, ctx.rank, step)
            seen.append(what)
        return seen
    finally:
        pg.shutdown()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param)
    yield pool
    pool.close()


@pytest.mark.parametrize("hosts", sorted(HOSTS), ids=str)
def test_bad_coalesced_arguments_are_refused_alike_by_every_engine(ranks, hosts):
    for seen in ranks.run(_bad_arguments, HOSTS[hosts]):
        assert len(seen) == len(_bad_calls(2)), seen


# --- ranks that split the same total differently ---------------------------------------

# Each call: rank r's tensors of a coalesced call; every rank has the same total size,
# rank 0 split one way and the others another.
def _split_calls(n: int):
    return {
        "all_reduce_coalesced": lambda pg, r: pg.all_reduce_coalesced(
            _ones(3, 5) if r == 0 else _ones(5, 3)),
        "all_gather_into_tensor_coalesced": lambda pg, r: pg.all_gather_into_tensor_coalesced(
            _ones(2 * n, 2 * n) if r == 0 else _ones(4 * n), _ones(2, 2) if r == 0 else _ones(4)),
        "all_gather_coalesced": lambda pg, r: pg.all_gather_coalesced(
            [_ones(2, 2) if r == 0 else _ones(4)] * n, _ones(2, 2) if r == 0 else _ones(4)),
        "reduce_scatter_tensor_coalesced": lambda pg, r: pg.reduce_scatter_tensor_coalesced(
            _ones(1, 3) if r == 0 else _ones(3, 1), _ones(n, 3 * n) if r == 0 else _ones(3 * n, n)),
    }


SPLITS = {"all_reduce_coalesced": ("[3], [5]", "[5], [3]"),
          "all_gather_into_tensor_coalesced": ("[2], [2]", "[4]"),
          "all_gather_coalesced": ("[2], [2]", "[4]"),
          "reduce_scatter_tensor_coalesced": ("[1], [3]", "[3], [1]")}


def _different_splits(ctx: RankContext, hosts: int, call: str) -> str:
    pg = _group(ctx, hosts)
    try:
        with pytest.raises(dist.DistBackendError) as raised:
            _split_calls(ctx.world_size)[call](pg, ctx.rank)
        return str(raised.value)
    finally:
        pg.shutdown()


def _check_names_both_splits(messages: list, call: str) -> None:
    zero, other = SPLITS[call]
    for r, message in enumerate(messages):
        assert "differs between ranks" in message, (r, message)
        assert f"rank {r} [{zero if r == 0 else other}]" in message, (r, message)
        # Each rank names the splits of the ranks it differs from.
        assert ("rank 0 [" + zero + "]" in message) and re.search(
            r"rank [1-9] \[" + re.escape(other) + r"\]", message), (r, message)


@pytest.mark.parametrize("call", sorted(SPLITS))
@pytest.mark.parametrize("hosts", sorted(HOSTS), ids=str)
def test_ranks_that_split_a_coalesced_call_differently_fail_naming_both_splits(ranks, hosts,
                                                                                call):
    _check_names_both_splits(ranks.run(_different_splits, HOSTS[hosts], call), call)


def _torch_different_splits(ctx: RankContext) -> str:
    name = f"t{next(_groups)}"
    pg = dist.new_group(backend="pyddp") if dist.is_initialized() else None
    if pg is None:
        dist.init_process_group("pyddp", store=dist.FileStore(ctx.store_path(name),
                                                              ctx.world_size),
                                rank=ctx.rank, world_size=ctx.world_size, timeout=TIMEOUT)
        pg = dist.new_group(backend="pyddp")
    with pytest.raises(dist.DistBackendError) as raised:
        dist.all_reduce_coalesced(_ones(3, 5) if ctx.rank == 0 else _ones(5, 3), group=pg)
    return str(raised.value)


def test_through_torch_distributed_too(ranks):
    _check_names_both_splits(ranks.run(_torch_different_splits), "all_reduce_coalesced")
