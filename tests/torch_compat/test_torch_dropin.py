"""pyddp as a drop-in for torch.distributed: the details torch's own suite found.

- TORCH_DISTRIBUTED_DEBUG=DETAIL: torch wraps every group in its
  ProcessGroupWrapper, which checks each collective across ranks (with c10d's
  sequence number) before pyddp runs it.
- pyddp's DistributedDataParallel over torch.distributed's groups: the
  default group of a script that called only
  ``torch.distributed.init_process_group``, ``group.WORLD``, on "pyddp" and on
  gloo.
- Refused calls name what the user called, not only c10d's internal op.

References: gloo groups on the same ranks (sequence numbers), pyddp's own
group and a single process (training), values every rank can compute.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import check_equal, check_object_collectives, make_input, reference_reduce
from ddp_cases import (Case, assert_close_records, assert_identical_records, make_model, pack,
                       reference, train, unpack)
from harness import RankContext, Ranks
from pyddp.ddp import DistributedDataParallel, allreduce_hook

TIMEOUT = datetime.timedelta(seconds=60)
CPU = torch.device("cpu")


def _setup(ctx: RankContext, backend: str) -> None:
    """torch's default group on ``backend``; a "pyddp" and a gloo group of torch's over
    every rank; a group of pyddp's own ("own"). pyddp has no default group."""
    n = ctx.world_size
    # torch read TORCH_DISTRIBUTED_DEBUG when this module was imported, before
    # the harness set the pool's environment.
    dist.set_debug_level_from_env()
    dist.init_process_group(backend, store=dist.FileStore(ctx.store_path("torch"), n),
                            rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    ctx.state["pyddp"] = dist.group.WORLD if backend == "pyddp" else \
        dist.new_group(backend="pyddp")
    ctx.state["gloo"] = dist.new_group(backend="gloo")
    ctx.groups["own"] = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("own"), n),
                                        rank=ctx.rank, world_size=n, timeout=TIMEOUT)


def _setup_pyddp(ctx: RankContext) -> None:
    _setup(ctx, "pyddp")


def _setup_gloo(ctx: RankContext) -> None:
    _setup(ctx, "gloo")


@pytest.fixture(scope="module", params=["pyddp", "gloo"])
def plain(request):
    """2 ranks, torch's default group on ``request.param``."""
    pool = Ranks(2, setup=_setup_pyddp if request.param == "pyddp" else _setup_gloo)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def detail():
    """3 ranks under TORCH_DISTRIBUTED_DEBUG=DETAIL, torch's default group on "pyddp"."""
    pool = Ranks(3, setup=_setup_pyddp, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    yield pool
    pool.close()


# --- functions run on every rank ---------------------------------------------------


def _wrapped(ctx: RankContext) -> list:
    """The class and name of the backend torch's groups on "pyddp" call."""
    backend = ctx.state["pyddp"]._get_backend(CPU)
    return [type(backend).__name__, backend.name()]


def _sequence_numbers(ctx: RankContext) -> dict:
    """c10d's sequence number of the "pyddp" and the gloo group after each of the same calls,
    counted from the first; the "pyddp" one also after a refused call."""
    out = {}
    for name in ("pyddp", "gloo"):
        group = ctx.state[name]
        number = group._get_backend(CPU)._get_sequence_number_for_group
        start = number()
        counts = []
        dist.all_reduce(torch.ones(8), group=group)
        counts.append(number() - start)
        first = dist.all_reduce(torch.ones(8), group=group, async_op=True)
        if ctx.rank == 0:
            # Holds rank 0's worker (future callbacks run on it), so the
            # ranks' queues differ while the next collectives are issued.
            first.get_future().then(lambda _: time.sleep(0.3))
        works = [dist.all_reduce(torch.ones(1 << 16), group=group, async_op=True)
                 for _ in range(2)]
        counts.append(number() - start)
        for work in [first, *works]:
            work.wait()
        dist.barrier(group=group)
        counts.append(number() - start)
        objects = [None] * ctx.world_size
        dist.all_gather_object(objects, ctx.rank, group=group)
        counts.append(number() - start)
        if name == "pyddp":
            with pytest.raises(TypeError, match="ReduceOp.BAND needs an integer tensor"):
                dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, group=group)
            counts.append(number() - start)
        out[name] = counts
    return out


def _objects_and_subgroups(ctx: RankContext) -> None:
    """Object collectives on the default group, and collectives on subgroups of "pyddp"
    made with new_group: one of every rank, one without rank 1."""
    n, rank = ctx.world_size, ctx.rank
    check_object_collectives(rank, n)

    for members in (list(range(n)), [r for r in range(n) if r != 1]):
        group = dist.new_group(members, backend="pyddp")
        if rank not in members:
            continue
        assert dist.get_world_size(group) == len(members)
        objects = [None] * len(members)
        dist.all_gather_object(objects, ("member", rank), group=group)
        assert objects == [("member", r) for r in members], objects
        inputs = {r: make_input(r, 1001, torch.float32, salt=len(members)) for r in members}
        t = inputs[rank].clone()
        dist.all_reduce(t, group=group)
        check_equal(t, reference_reduce(list(inputs.values()), dist.ReduceOp.SUM),
                    f"all_reduce on ranks {members}")
        box = [rank]
        dist.broadcast_object_list(box, group=group, group_src=len(members) - 1)
        assert box == [members[-1]], box
        dist.destroy_process_group(group)


def _mismatch_caught_before_pyddp(ctx: RankContext) -> None:
    number = ctx.state["pyddp"]._get_backend(CPU)._get_sequence_number_for_group()
    with pytest.raises(RuntimeError, match=r"Detected mismatch between collectives on ranks.*"
                       rf"SequenceNumber={number}, OpType=ALLREDUCE"):
        dist.all_reduce(torch.ones(3 + ctx.rank))
    # The wrapper refused before pyddp moved anything: the group goes on.
    t = torch.ones(4)
    dist.all_reduce(t)
    check_equal(t, torch.full((4,), float(ctx.world_size)), "all_reduce after the mismatch")


def _refusals(ctx: RankContext) -> None:
    """Calls that reach a c10d entry point pyddp does not serve, on a "pyddp" group."""
    group, n = ctx.state["pyddp"], ctx.world_size

    # c10d's coalescing of a device's operations, which gloo refuses as well.
    cases = [
        (lambda: group._start_coalescing(CPU),
         "torch.distributed._coalescing_manager with a device, or batch_isend_irecv (c10d's "
         "startCoalescing)"),
    ]
    for call, described in cases:
        with pytest.raises(NotImplementedError) as error:
            call()
        assert isinstance(error.value, RuntimeError)  # what c10d's own refusals raise
        assert f"pyddp: rank {ctx.rank}: {described}: the pyddp backend does not support it" \
            in str(error.value), str(error.value)
    # Nothing reached the transport: the group goes on.
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    check_equal(t, torch.full((3,), float(n)), "all_reduce after the refusals")


CASES = {
    "plain": Case(),
    "unused parameters, comm hook": Case(model={"extra": True},
                                         ddp={"find_unused_parameters": True},
                                         extra_ranks=(0,)),
}


def _train(ctx: RankContext, case_name: str, over: str) -> bytes:
    """pyddp's DDP trained over torch's default group given as None ("default") or as
    group.WORLD ("world"), or over pyddp's own group ("own")."""
    case = CASES[case_name]
    model = make_model(case, ctx.rank)
    group = {"default": None, "world": dist.group.WORLD, "own": ctx.groups["own"]}[over]
    ddp = DistributedDataParallel(model, process_group=group, **case.ddp)
    assert ddp.process_group is (ctx.groups["own"] if over == "own" else dist.group.WORLD)
    if case.ddp:
        ddp.register_comm_hook(group, allreduce_hook)
    return pack(train(case, model, ddp, ctx.rank, ddp.no_sync))


# --- tests -------------------------------------------------------------------


def _check_training(pool: Ranks) -> None:
    for case_name, case in CASES.items():
        runs = {over: [unpack(r) for r in pool.run(_train, case_name, over)]
                for over in ("default", "world", "own")}
        own = runs["own"]
        assert_identical_records(own, f"{case_name}: over pyddp's own group")
        for over in ("default", "world"):
            # Two ranks' sums, or pyddp's engine: bitwise what pyddp's own group gives.
            for rank in range(pool.world_size):
                assert_identical_records([own[rank], runs[over][rank]],
                                         f"{case_name}: over torch's group ({over}) on rank "
                                         f"{rank}, against pyddp's own")
        assert_close_records(own[0], reference(case, pool.world_size),
                             f"{case_name}: against one process")
        moved = [name for name, p in own[0][-1]["params"].items()
                 if not torch.equal(p, own[0][0]["params"][name])]
        assert moved, f"{case_name}: training changed no parameter"


@pytest.mark.multiprocess
def test_ddp_over_torchs_default_group_trains_as_over_pyddps_own(plain):
    _check_training(plain)


@pytest.mark.multiprocess
def test_ddp_over_torchs_default_group_under_detail(detail):
    _check_training(detail)


def test_ddp_without_any_process_group_refuses_at_once():
    assert not pyddp.is_initialized() and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no process group: call pyddp.init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="process_group must be a pyddp.ProcessGroup or a "
                                        "torch.distributed ProcessGroup, got str"):
        DistributedDataParallel(torch.nn.Linear(2, 2), process_group="gloo")


@pytest.mark.multiprocess
def test_detail_wraps_every_pyddp_group(detail):
    assert detail.run(_wrapped) == [["_ProcessGroupWrapper", "pyddp"]] * detail.world_size


def _check_sequence_numbers(pool: Ranks) -> None:
    counts = pool.run(_sequence_numbers)
    for rank in range(pool.world_size):
        # One per collective issued (all_gather_object issues two), as gloo counts,
        # whatever each rank's queue holds; a refused call is not issued.
        assert counts[rank]["gloo"] == [1, 4, 5, 7], counts
        assert counts[rank]["pyddp"] == [1, 4, 5, 7, 7], counts


@pytest.mark.multiprocess
def test_sequence_numbers_count_issued_collectives_as_gloo(plain):
    _check_sequence_numbers(plain)


@pytest.mark.multiprocess
def test_sequence_numbers_under_detail(detail):
    _check_sequence_numbers(detail)


@pytest.mark.multiprocess
def test_object_collectives_and_subgroups_under_detail(detail):
    detail.run(_objects_and_subgroups)


@pytest.mark.multiprocess
def test_detail_catches_mismatched_collectives_and_the_group_goes_on(detail):
    detail.run(_mismatch_caught_before_pyddp)


@pytest.mark.multiprocess
def test_refused_calls_name_the_users_call(plain):
    plain.run(_refusals)


@pytest.mark.multiprocess
def test_refused_calls_name_the_users_call_under_detail(detail):
    detail.run(_refusals)
