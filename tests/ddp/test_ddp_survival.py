"""pyddp's DDP with on_rank_failure="shrink": a rank killed inside a backward costs the
step that failed, not the job. The survivors apply the same steps (their parameters stay
bitwise equal and match a single process that averages the same ranks' gradients at
every applied step), and a process that joins later receives the state and trains in
step with them.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pyddp
from ddp_cases import Case, batch, make_model, make_optimizer, pack, params, unpack
from harness import Died, RankContext, Ranks
from pyddp import survival

pytestmark = pytest.mark.multiprocess

TIMEOUT = datetime.timedelta(seconds=30)
CASE = Case()  # SGD with momentum: the optimizer's state matters to a joiner
STEPS = 6
KILLED_AT = 3  # the step in whose backward rank 2 dies


def _die_in_backward(model: pyddp.DistributedDataParallel) -> None:
    # The head's gradient is the first one autograd computes: rank 2 dies before it
    # launches a bucket, while its peers wait for it in theirs.
    model.module.head.weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))


def _step(model: pyddp.DistributedDataParallel, opt: torch.optim.Optimizer, x, y) -> bool:
    F.cross_entropy(model(x), y).backward()
    committed = model.should_commit()
    if committed:
        opt.step()
    opt.zero_grad()
    return committed


def _train_through_a_kill(ctx: RankContext) -> bytes:
    store = dist.FileStore(ctx.store_path("ddp-kill"), ctx.world_size)
    group = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=TIMEOUT)
    model = make_model(CASE, ctx.rank)
    opt = make_optimizer(CASE, model.parameters())
    ddp = pyddp.DistributedDataParallel(model, process_group=group, on_rank_failure="shrink",
                                        optimizer=opt, bucket_cap_mb=0.001)
    steps: List[Tuple[bool, int]] = []
    for step in range(STEPS):
        if ctx.rank == 2 and step == KILLED_AT:
            _die_in_backward(ddp)
        world = ddp.process_group.size()
        start = time.monotonic()
        committed = _step(ddp, opt, *batch(CASE, step, 0, ctx.rank))
        steps.append((committed, world, time.monotonic() - start))
    return pack({"params": params(model), "steps": steps, "size": ddp.process_group.size()})


def _reference(steps: List[Tuple[bool, int, float]]) -> dict:
    """One process applying the steps the survivors committed, each averaging the
    gradients of the ranks that were in the group at that step."""
    model = make_model(CASE, 0)
    opt = make_optimizer(CASE, model.parameters())
    for step, (committed, world, _) in enumerate(steps):
        if not committed:
            continue
        for rank in range(world):
            x, y = batch(CASE, step, 0, rank)
            (F.cross_entropy(model(x), y) / world).backward()
        opt.step()
        opt.zero_grad()
    return params(model)


def test_ddp_goes_on_without_a_rank_killed_in_its_backward():
    pool = Ranks(3)
    try:
        results = pool.run_each([_train_through_a_kill] * 3, allow_dead=True, timeout=180)
        assert isinstance(results[2], Died), results[2]
        first, second = unpack(results[0]), unpack(results[1])
        for name in first["params"]:
            assert torch.equal(first["params"][name], second["params"][name]), name
        assert [s[:2] for s in first["steps"]] == [s[:2] for s in second["steps"]]
        committed = [c for c, _, _ in first["steps"]]
        # The step rank 2 died in is applied by no rank; the others by all.
        assert committed == [True] * KILLED_AT + [False] + [True] * (STEPS - KILLED_AT - 1)
        assert first["size"] == 2
        expected = _reference(first["steps"])
        for name, value in first["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-6)
        # The failed step took the failure's detection and the shrink, not the timeout.
        assert first["steps"][KILLED_AT][2] < TIMEOUT.total_seconds() / 3, first["steps"]
    finally:
        pool.close()


TARGET = 8  # committed steps every rank trains to in the join test


def _member(ctx: RankContext) -> bytes:
    store = dist.FileStore(ctx.store_path("ddp-join"), 4)
    group = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=3, timeout=TIMEOUT)
    model = make_model(CASE, ctx.rank)
    opt = make_optimizer(CASE, model.parameters())
    ddp = pyddp.DistributedDataParallel(model, process_group=group, on_rank_failure="shrink",
                                        optimizer=opt)
    waited = False
    while ddp.committed_steps < TARGET:
        if ctx.rank == 2 and ddp.committed_steps == 2:
            _die_in_backward(ddp)
        if ddp.process_group.size() == 2 and not waited:
            # The replacement starts once the survivors have shrunk, and they go on only
            # once it has asked to join, so that it joins before TARGET.
            if ddp.process_group.rank() == 0:
                store.set("test/shrunk", ddp.process_group._lineage)
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while survival.pending_joins(ddp.process_group) == 0:
                assert time.monotonic() < deadline, "no process asked to join"
                time.sleep(0.01)
            waited = True
        _step(ddp, opt, *batch(CASE, ddp.committed_steps, 0, ddp.process_group.rank()))
    return pack({"params": params(model), "size": ddp.process_group.size(),
                 "rank": ddp.process_group.rank()})


def _replacement(ctx: RankContext) -> bytes:
    store = dist.FileStore(ctx.store_path("ddp-join"), 4)
    store.wait(["test/shrunk"], TIMEOUT)
    group = survival.join(store=store, timeout=TIMEOUT, lineage=store.get("test/shrunk").decode())
    try:
        model = make_model(CASE, ctx.rank)  # other weights: the members' must reach it
        opt = make_optimizer(CASE, model.parameters())
        ddp = pyddp.DistributedDataParallel(model, process_group=group,
                                            on_rank_failure="shrink", optimizer=opt)
        joined_at = ddp.committed_steps
        while ddp.committed_steps < TARGET:
            _step(ddp, opt, *batch(CASE, ddp.committed_steps, 0, ddp.process_group.rank()))
        return pack({"params": params(model), "size": ddp.process_group.size(),
                     "rank": ddp.process_group.rank(), "joined_at": joined_at,
                     "momentum": len(opt.state)})
    finally:
        pyddp.destroy_process_group()


def test_a_replacement_joins_and_trains_in_step():
    pool = Ranks(4)
    try:
        results = pool.run_each([_member, _member, _member, _replacement], allow_dead=True,
                                timeout=180)
        assert isinstance(results[2], Died), results[2]
        ranks = [unpack(results[r]) for r in (0, 1, 3)]
        assert [(r["rank"], r["size"]) for r in ranks] == [(0, 3), (1, 3), (2, 3)], ranks
        assert 2 <= ranks[2]["joined_at"] < TARGET, ranks[2]["joined_at"]
        assert ranks[2]["momentum"] > 0  # it received the optimizer's state
        for name in ranks[0]["params"]:
            for other in ranks[1:]:
                assert torch.equal(ranks[0]["params"][name], other["params"][name]), name
    finally:
        pool.close()


def _a_mistake_is_raised(ctx: RankContext) -> str:
    store = dist.FileStore(ctx.store_path("ddp-mistake"), ctx.world_size)
    group = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=TIMEOUT)
    model = make_model(Case(model={"extra": True}), ctx.rank)  # `unused` gets no gradient
    ddp = pyddp.DistributedDataParallel(model, process_group=group, on_rank_failure="shrink")
    x, y = batch(CASE, 0, 0, ctx.rank)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except RuntimeError as error:
        return str(error)
    raise AssertionError("the backward did not raise")


def test_a_mistake_of_the_program_is_raised_not_taken_for_a_lost_rank(two):
    for message in two.run(_a_mistake_is_raised):
        assert "received no gradient in this backward" in message, message
