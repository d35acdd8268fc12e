"""pyddp as a torch.distributed backend: ``init_process_group("pyddp")``.

Each rank's default torch.distributed group is pyddp's; a gloo group and a
pyddp-API group on the same ranks serve as references. Collectives called
through torch.distributed must give what an independent computation gives
(and what pyddp's own API gives), and torch's DistributedDataParallel must
train to the same parameters on pyddp as on gloo.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import (BITWISE_OPS, DTYPES, INT_DTYPES, ReduceOp, check_equal,
                              check_object_collectives, dtype_op_pairs, make_input,
                              reference_reduce)
from harness import RankContext, Ranks

pytestmark = pytest.mark.multiprocess

COUNTS = [0, 1, 1001, 70000]


def _setup(ctx: RankContext) -> None:
    n = ctx.world_size
    dist.init_process_group("pyddp", store=dist.FileStore(ctx.store_path("torch"), n),
                            rank=ctx.rank, world_size=n, timeout=datetime.timedelta(seconds=60))
    ctx.state["gloo"] = dist.new_group(backend="gloo")
    ctx.groups["own"] = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("own"), n),
                                        rank=ctx.rank, world_size=n,
                                        timeout=datetime.timedelta(seconds=60))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


# --- functions run on every rank -------------------------------------------


def _backend_is_pyddp(ctx: RankContext) -> str:
    return dist.get_backend()


def _all_reduce(ctx: RankContext) -> None:
    own = ctx.groups["own"]
    for dtype, op in dtype_op_pairs():
        for count in COUNTS:
            inputs = [make_input(r, count, dtype, op) for r in range(ctx.world_size)]
            t = inputs[ctx.rank].clone()
            dist.all_reduce(t, op=op)
            check_equal(t, reference_reduce(inputs, op), f"all_reduce {dtype} {op} n={count}")
            mine = inputs[ctx.rank].clone()
            own.all_reduce(mine, op)
            check_equal(t, mine, f"all_reduce {dtype} {op} n={count} against pyddp's API")


def _reduce_and_broadcast(ctx: RankContext) -> None:
    n = ctx.world_size
    for dtype in DTYPES:
        for count in COUNTS:
            for root in range(n):
                inputs = [make_input(r, count, dtype, salt=root) for r in range(n)]
                t = inputs[ctx.rank].clone()
                dist.reduce(t, dst=root, op=ReduceOp.MAX)
                # Only the destination receives the result; the others keep their input.
                expected = reference_reduce(inputs, ReduceOp.MAX) if ctx.rank == root \
                    else inputs[ctx.rank]
                check_equal(t, expected, f"reduce {dtype} n={count} dst={root}")
                b = inputs[ctx.rank].clone()
                dist.broadcast(b, src=root)
                check_equal(b, inputs[root], f"broadcast {dtype} n={count} src={root}")


def _gathers_and_scatters(ctx: RankContext) -> None:
    n, rank = ctx.world_size, ctx.rank
    own = ctx.groups["own"]
    for dtype in DTYPES:
        for count in COUNTS:
            inputs = [make_input(r, count, dtype) for r in range(n)]
            outs = [torch.full((count,), 3, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, inputs[rank])
            for r in range(n):
                check_equal(outs[r], inputs[r], f"all_gather {dtype} n={count} [{r}]")
            whole = torch.empty(n * count, dtype=dtype)
            dist.all_gather_into_tensor(whole, inputs[rank])
            check_equal(whole, torch.cat(inputs), f"all_gather_into_tensor {dtype} n={count}")
            mine = torch.empty(n * count, dtype=dtype)
            own.all_gather_single(mine, inputs[rank])
            check_equal(whole, mine, f"all_gather_into_tensor {dtype} n={count} against pyddp")
            root = count % n
            gathered = [torch.empty(count, dtype=dtype) for _ in range(n)] if rank == root \
                else None
            dist.gather(inputs[rank], gathered, dst=root)
            if rank == root:
                for r in range(n):
                    check_equal(gathered[r], inputs[r], f"gather {dtype} n={count} [{r}]")
            out = torch.full((count,), 3, dtype=dtype)
            dist.scatter(out, [make_input(r, count, dtype, salt=9) for r in range(n)]
                         if rank == root else None, src=root)
            check_equal(out, make_input(rank, count, dtype, salt=9), f"scatter {dtype} n={count}")


def _reduce_scatter(ctx: RankContext) -> None:
    n, rank = ctx.world_size, ctx.rank
    for dtype, op in dtype_op_pairs():
        for count in COUNTS:
            inputs = [make_input(r, n * count, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)[rank * count:(rank + 1) * count]
            out = torch.full((count,), 3, dtype=dtype)
            dist.reduce_scatter_tensor(out, inputs[rank], op=op)
            check_equal(out, expected, f"reduce_scatter_tensor {dtype} {op} n={count}")
            out_list = torch.full((count,), 3, dtype=dtype)
            dist.reduce_scatter(out_list, list(inputs[rank].chunk(n)) if count else
                                [torch.empty(0, dtype=dtype)] * n, op=op)
            check_equal(out_list, expected, f"reduce_scatter {dtype} {op} n={count}")


def _async_and_objects(ctx: RankContext) -> None:
    n, rank = ctx.world_size, ctx.rank
    t = torch.full((5,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    # torch DDP's default comm hook reads the future's value.
    (result,) = work.get_future().wait()
    expected = torch.full((5,), float(n * (n + 1) // 2))
    check_equal(result, expected, "async all_reduce future")
    assert work.wait() and work.is_completed()
    check_equal(t, expected, "async all_reduce in place")
    check_object_collectives(rank, n)
    dist.barrier()


def _unsupported(ctx: RankContext) -> None:
    # recv without src: the first message from any rank, whose sender it returns.
    if ctx.rank == 0:
        got = set()
        for _ in range(ctx.world_size - 1):
            t = torch.zeros(2)
            src = dist.recv(t)
            check_equal(t, torch.full((2,), float(src)), "recv without src")
            got.add(src)
        assert got == set(range(1, ctx.world_size)), got
        t = torch.zeros(2)
        work = dist.irecv(t, tag=1)
        work.wait()
        check_equal(t, torch.full((2,), float(work._source_rank())), "irecv without src")
    else:
        dist.send(torch.full((2,), float(ctx.rank)), 0)
        if ctx.rank == ctx.world_size - 1:
            dist.send(torch.full((2,), float(ctx.rank)), 0, tag=1)
    with pytest.raises(ValueError, match=r"allreduce: the pyddp backend does not support "
                                         r"ReduceOp\.PREMUL_SUM"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(TypeError, match=r"all_reduce: ReduceOp\.BXOR needs an integer tensor"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR)
    with pytest.raises(TypeError, match="AVG needs a floating-point tensor"):
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
    # The group is still usable after argument errors (none reached the transport).
    t = torch.ones(3)
    dist.all_reduce(t)
    check_equal(t, torch.full((3,), float(ctx.world_size)), "all_reduce after errors")


def _bitwise_against_gloo(ctx: RankContext) -> None:
    """BAND, BOR and BXOR on pyddp give what they give on gloo, from the same inputs."""
    n, gloo = ctx.world_size, ctx.state["gloo"]
    for dtype in INT_DTYPES:
        for op in BITWISE_OPS:
            for count in (0, 1, 1001):
                what = f"{dtype} {op} n={count}"
                mine = make_input(ctx.rank, count, dtype, op)
                ours, theirs = mine.clone(), mine.clone()
                dist.all_reduce(ours, op=op)
                dist.all_reduce(theirs, op=op, group=gloo)
                check_equal(ours, theirs, f"all_reduce {what} against gloo")
                ours, theirs = mine.clone(), mine.clone()
                dist.reduce(ours, dst=n - 1, op=op)
                dist.reduce(theirs, dst=n - 1, op=op, group=gloo)
                if ctx.rank == n - 1:
                    check_equal(ours, theirs, f"reduce {what} against gloo")
                whole = make_input(ctx.rank, n * count, dtype, op, salt=1)
                ours, theirs = torch.zeros(count, dtype=dtype), torch.zeros(count, dtype=dtype)
                dist.reduce_scatter_tensor(ours, whole, op=op)
                dist.reduce_scatter_tensor(theirs, whole, op=op, group=gloo)
                check_equal(ours, theirs, f"reduce_scatter_tensor {what} against gloo")


def _train_torch_ddp(ctx: RankContext, backend: str) -> list:
    """Four SGD steps of torch's DDP on a shard of a fixed data set."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    # Rank-specific initial weights: DDP must broadcast rank 0's at construction.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(ctx.rank)
    group = None if backend == "pyddp" else ctx.state["gloo"]
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8 * ctx.world_size, 20, generator=gen)
    y = torch.randint(0, 3, (8 * ctx.world_size,), generator=gen)
    shard = slice(8 * ctx.rank, 8 * (ctx.rank + 1))
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[shard]), y[shard]).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


# --- tests -------------------------------------------------------------------


def test_default_backend_is_pyddp(ranks):
    assert ranks.run(_backend_is_pyddp) == ["pyddp"] * ranks.world_size


def test_all_reduce(ranks):
    ranks.run(_all_reduce)


def test_reduce_and_broadcast(ranks):
    ranks.run(_reduce_and_broadcast)


def test_gathers_and_scatters(ranks):
    ranks.run(_gathers_and_scatters)


def test_reduce_scatter(ranks):
    ranks.run(_reduce_scatter)


def test_async_work_and_object_collectives(ranks):
    ranks.run(_async_and_objects)


def test_bitwise_ops_agree_with_gloo(ranks):
    ranks.run(_bitwise_against_gloo)


def test_unsupported_operations_fail_loudly(ranks):
    ranks.run(_unsupported)


def test_torch_ddp_trains_as_on_gloo(ranks):
    on_pyddp = ranks.run(_train_torch_ddp, "pyddp")
    on_gloo = ranks.run(_train_torch_ddp, "gloo")
    for rank in range(ranks.world_size):
        # Summation order may differ between the backends: close, not equal.
        for a, b in zip(on_pyddp[rank], on_gloo[rank]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # Every rank holds bitwise the same parameters.
        for a, b in zip(on_pyddp[rank], on_pyddp[0]):
            assert np.array_equal(a, b), f"rank {rank} differs from rank 0 on pyddp"
    # The training moved the parameters (the comparison is not vacuous).
    torch.manual_seed(0)
    initial = torch.nn.Linear(20, 64).weight.detach().numpy()
    assert not np.allclose(on_pyddp[0][0], initial)


def _pyddp_mappings() -> int:
    """How many of pyddp's shared-memory segments this process maps now."""
    with open("/proc/self/maps") as maps:
        return sum("/dev/shm/pyddp-" in line for line in maps)


def _destroy_unmaps(ctx: RankContext) -> tuple:
    """A destroyed "pyddp" group's engine goes at once, with its mappings (pyddp keeps a
    weak reference to every engine for its exit hook; it must not keep one alive)."""
    before = _pyddp_mappings()
    group = dist.new_group(backend="pyddp")
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    made = _pyddp_mappings()
    dist.destroy_process_group(group)
    del group
    return made - before, _pyddp_mappings() - before


def test_a_destroyed_group_unmaps_its_memory_at_once(ranks):
    for made, left in ranks.run(_destroy_unmaps):
        assert made >= ranks.world_size and left == 0, (made, left)


def _per_call_timeout(ctx: RankContext) -> str:
    """c10d's per-call timeout bounds that call alone, here far below the group's 60 s."""
    group = dist.new_group(backend="pyddp", timeout=datetime.timedelta(seconds=60))
    try:
        if ctx.rank != 0:
            return ""  # never joins the collective
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(milliseconds=700)
        backend = group._get_backend(torch.device("cpu"))
        with pytest.raises(dist.DistBackendError) as error:
            backend.allreduce([torch.ones(4)], opts).wait()
        return str(error.value)
    finally:
        # The other ranks keep the group until rank 0 timed out: a rank that
        # destroys it tells rank 0 at once, which is not what this tests.
        dist.barrier(group=ctx.state["gloo"])
        dist.destroy_process_group(group)


def test_the_per_call_timeout_bounds_the_call(ranks):
    message = ranks.run(_per_call_timeout)[0]
    assert "did not arrive at all_reduce #1 within the timeout of 700 ms" in message, message


def _requests(n: int) -> dict:
    """The ranks each rank asks for, by case: rank n-1 asks for more than the others; each
    rank asks for itself and the next (cyclic); rank 0 alone and the others together."""
    return {
        "one asks for more": [list(range(n - 1))] * (n - 1) + [list(range(n))],
        "cyclic": [sorted({r, (r + 1) % n}) for r in range(n)],
        "two groups under one name": [[0]] + [list(range(1, n))] * (n - 1),
    }


def _torch_subgroups(ctx: RankContext, case: str) -> tuple:
    asked = _requests(ctx.world_size)[case][ctx.rank]
    try:
        group = dist.new_group(asked, backend="pyddp", timeout=datetime.timedelta(seconds=60))
    except dist.DistBackendError as error:
        return "failed", str(error)
    try:
        t = torch.full((2,), float(ctx.rank + 1))
        dist.all_reduce(t, group=group)
        return "ok", t.tolist()
    finally:
        dist.destroy_process_group(group)


def test_subgroups_whose_members_disagree_fail_and_never_meet(ranks):
    n = ranks.world_size
    for case, requests in _requests(n).items():
        results = ranks.run(_torch_subgroups, case)
        for r, (outcome, value) in enumerate(results):
            # torch calls the backend on a group's members alone: a rank fails when one of
            # the members it asked for asked for other members.
            disagree = [m for m in requests[r] if requests[m] != requests[r]]
            if disagree:
                assert outcome == "failed", (case, r, value)
                assert (f"rank {r}: torch.distributed.new_group: the ranks disagree on the "
                        "group: ") in value, (case, value)
                for m in disagree + [r]:
                    assert f"asked for ranks {requests[m]} of a world of {n}" in value, value
            else:
                expected = float(sum(m + 1 for m in requests[r]))
                assert (outcome, value) == ("ok", [expected, expected]), (case, r)
