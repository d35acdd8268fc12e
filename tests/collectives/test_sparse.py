"""Sparse COO all-reduce and DDP with sparse gradients.

On 2 and 3 spawned ranks: all_reduce of sparse tensors (2-D sparse, hybrid
embedding-gradient layout, uncoalesced inputs with repeated indices, ranks
with no entries, every dtype) through pyddp's own API and through
torch.distributed's "pyddp" backend, each result checked exactly (integer
values) against gloo's on the same inputs and against a one-process sum of
every rank's tensor; twice in a row, synchronous and async. Refusals: ops
other than SUM (as gloo), tensors whose sizes differ between ranks (every
rank fails alike and the group still works). DDP: a model with
EmbeddingBag(sparse=True) trained by pyddp's DDP (on pyddp's group, with and
without a comm hook, and on torch.distributed's "pyddp" group) and by torch's
DDP over "pyddp", against torch's DDP over gloo.
"""

from __future__ import annotations

import datetime
import functools
import operator
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pyddp
from harness import RankContext, Ranks, raises

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=60)


def _setup(ctx: RankContext) -> None:
    n = ctx.world_size
    ctx.groups["pyddp"] = pyddp.create_group(
        "shm", store=dist.FileStore(ctx.store_path("pyddp"), n), rank=ctx.rank, world_size=n,
        timeout=TIMEOUT)
    dist.init_process_group("pyddp", store=dist.FileStore(ctx.store_path("torch"), n),
                            rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    ctx.state["gloo"] = dist.new_group(backend="gloo")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


def _inputs(rank: int, n: int, dtype: torch.dtype, case: str, step: int) -> torch.Tensor:
    """Rank ``rank``'s sparse tensor of ``case``: small integer values, uncoalesced (repeated
    indices), so the exact sum is known. Every rank can build every rank's."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + len(case))
    if case == "empty" or (case == "some-empty" and rank == 1):
        nnz = 0
    else:
        nnz = 3 + rank * 4
    if case == "hybrid":  # an embedding's gradient: rows of a 7 x 3 weight
        sizes, sparse_dim = (7, 3), 1
    else:
        sizes, sparse_dim = (5, 6), 2
    indices = torch.stack([torch.randint(0, sizes[d], (nnz,), generator=g)
                           for d in range(sparse_dim)])
    values = torch.randint(-4, 5, (nnz, *sizes[sparse_dim:]), generator=g).to(dtype)
    return torch.sparse_coo_tensor(indices, values, sizes)


CASES = ["2d", "hybrid", "some-empty", "empty"]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bfloat16]


def _check_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.is_sparse and actual.is_coalesced(), f"{what}: not a coalesced sparse tensor"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} "
        f"{tuple(expected.shape)}")
    assert torch.equal(actual._indices(), expected._indices()), (
        f"{what}: indices {actual._indices().tolist()}, expected {expected._indices().tolist()}")
    assert torch.equal(actual._values(), expected._values()), (
        f"{what}: values {actual._values().tolist()}, expected {expected._values().tolist()}")


def _sparse_cases(ctx: RankContext, api: str) -> None:
    """``api``: "pyddp" (pyddp.all_reduce on pyddp's group), "torch" (dist.all_reduce on the
    "pyddp" backend), or a group name of ctx.groups with no gloo reference (other hosts)."""
    r, n = ctx.rank, ctx.world_size
    gloo = ctx.state.get("gloo")
    for dtype in DTYPES:
        for case in CASES:
            for step in range(2):
                mine = _inputs(r, n, dtype, case, step)
                expected = functools.reduce(operator.add, [_inputs(k, n, dtype, case, step)
                                                            for k in range(n)]).coalesce()
                what = f"{api} {case} {dtype} step {step}"
                t = mine.clone()
                async_op = step == 1
                if api == "torch":
                    work = dist.all_reduce(t, async_op=async_op)
                else:
                    group = ctx.groups[api]
                    work = group.all_reduce(t, async_op=async_op)
                if async_op:
                    work.wait()
                    (value,) = work.get_future().value()
                    _check_same(value, expected, what + " (future)")
                _check_same(t, expected, what)
                if gloo is not None:
                    reference = mine.clone()
                    dist.all_reduce(reference, group=gloo)
                    _check_same(t, reference, what + " against gloo")


def test_sparse_all_reduce(ranks):
    ranks.run(_sparse_cases, "pyddp")
    ranks.run(_sparse_cases, "torch")


def _refusals(ctx: RankContext) -> None:
    r, n = ctx.rank, ctx.world_size
    pg = ctx.groups["pyddp"]
    t = _inputs(r, n, torch.float32, "2d", 0)
    raises(ValueError, "sparse tensors are all-reduced with ReduceOp.SUM only",
           pg.all_reduce, t, pyddp.ReduceOp.MAX)
    raises(Exception, "ReduceOp.SUM only", dist.all_reduce, t.clone(), dist.ReduceOp.MAX)
    # The last rank's tensor has another size: every rank fails, naming it.
    sizes = (5, 7) if r == n - 1 else (5, 6)
    odd = torch.sparse_coo_tensor(t._indices(), t._values(), sizes)
    raises(ValueError, re.escape(f"rank {n - 1}'s sparse tensor (sizes [5, 7], sparse_dim 2, "
                                 "dtype Float) differs from rank 0's (sizes [5, 6]"),
           pg.all_reduce, odd)
    # Both groups still work.
    for run in (pg.all_reduce, dist.all_reduce):
        ones = torch.ones(3)
        run(ones)
        assert torch.equal(ones, torch.full((3,), float(n))), ones


def test_refusals_leave_the_group_usable(ranks):
    ranks.run(_refusals)


# --- DDP with a sparse embedding ---------------------------------------------------------

ROWS, DIM, BAG, STEPS = 40, 6, 5, 4


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(DIM, 2)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(indices))


def _batch(rank: int, step: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    # Each rank draws from its own half of the rows and from rows every rank uses.
    return (torch.randint(0, ROWS // 2 + rank * 5, (4, BAG), generator=g),
            torch.randn(4, 2, generator=g))


def _train_sparse(ctx: RankContext, how: str) -> dict:
    """Trains Bags for STEPS steps wrapped by ``how``; returns the final parameters and the
    first step's embedding gradient (which must stay sparse)."""
    torch.manual_seed(7)
    model = Bags()
    if how == "pyddp":
        wrapped = pyddp.DistributedDataParallel(model, process_group=ctx.groups["pyddp"])
    elif how == "pyddp-with-a-comm-hook":
        group = ctx.groups["pyddp"]
        wrapped = pyddp.DistributedDataParallel(model, process_group=group)

        def average(state, bucket):
            # A sparse bucket's buffer is the parameter's gradient itself, undivided.
            work = group.all_reduce(bucket.buffer().div_(ctx.world_size), async_op=True)
            return work.get_future()
        wrapped.register_comm_hook(None, average)
    elif how == "pyddp-ddp-over-torch":
        wrapped = pyddp.DistributedDataParallel(model, process_group=dist.group.WORLD)
    elif how == "torch-ddp-over-pyddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=ctx.state["gloo"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first_grad = None
    for step in range(STEPS):
        indices, target = _batch(ctx.rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(indices), target).backward()
        grad = model.embedding.weight.grad
        assert grad.is_sparse, f"{how}: the embedding's gradient is {grad.layout}"
        if first_grad is None:
            first_grad = grad.coalesce()
        optimizer.step()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grad": first_grad}


def _ddp(ctx: RankContext) -> None:
    reference = _train_sparse(ctx, "torch-ddp-over-gloo")
    for how in ("pyddp", "pyddp-with-a-comm-hook", "pyddp-ddp-over-torch",
                "torch-ddp-over-pyddp"):
        got = _train_sparse(ctx, how)
        torch.testing.assert_close(got["grad"], reference["grad"], rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{how}: first embedding gradient: {m}")
        for name, value in reference["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{how}: {name}: {m}")


def test_ddp_with_a_sparse_embedding_trains_as_torch_ddp_over_gloo(ranks):
    ranks.run(_ddp)
