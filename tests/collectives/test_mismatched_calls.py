"""Ranks that disagree: on the collective they call (its kind, size, dtype, op, root or
algorithm), on the geometry of their shm segments, or on a subgroup's members. Every
rank fails with a DistBackendError naming both sides, and a rank that never calls
new_group is named at the timeout.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import check_equal
from harness import RankContext, raises
from shm_groups import SHORT, named_group

pytestmark = pytest.mark.multiprocess

ReduceOp = pyddp.ReduceOp


def _mismatch_count(ctx: RankContext) -> str:
    pg = named_group(ctx, "mismatch-count")
    message = raises(dist.DistBackendError, "collective #1 differs between ranks",
                      pg.all_reduce, torch.ones(4 + ctx.rank))
    # The failure left the group unusable, and later calls say so at once.
    raises(dist.DistBackendError, "earlier collective failed", pg.barrier)
    return message


def _mismatch_kind(ctx: RankContext) -> str:
    pg = named_group(ctx, "mismatch-kind")
    if ctx.rank == 0:
        return raises(dist.DistBackendError, "differs between ranks", pg.broadcast,
                       torch.ones(4), 0)
    return raises(dist.DistBackendError, "differs between ranks", pg.all_reduce, torch.ones(4))


def _mismatch_fields(ctx: RankContext) -> list:
    """One mismatch per descriptor field; each on a fresh group (a mismatch breaks it)."""
    n, r = ctx.world_size, ctx.rank
    calls = [
        ("dtype", lambda pg: pg.all_reduce(torch.ones(4, dtype=torch.float32 if r else
                                                       torch.float64))),
        ("op", lambda pg: pg.all_reduce(torch.ones(4), ReduceOp.MAX if r else ReduceOp.SUM)),
        ("root", lambda pg: pg.broadcast(torch.ones(4), r)),
    ]
    messages = []
    for field, call in calls:
        pg = named_group(ctx, f"mismatch-{field}")
        messages.append(raises(dist.DistBackendError, "differs between ranks", call, pg))
    # The algorithm is part of the call too: ranks configured differently
    # (PYDDP_ALGO) must not run different algorithms against each other.
    options = pyddp.GroupOptions()
    options.algo = pyddp.Algo.DIRECT if r == 0 else pyddp.Algo.RING
    pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("mismatch-algo"), n),
                         rank=r, world_size=n, timeout=datetime.timedelta(seconds=30),
                         options=options)
    ctx.groups["mismatch-algo"] = pg
    messages.append(raises(dist.DistBackendError, "differs between ranks", pg.all_reduce,
                            torch.ones(4)))
    return messages


def _mismatched_geometry(ctx: RankContext) -> str:
    options = pyddp.GroupOptions()
    options.slot_bytes = 128 * (ctx.rank + 1)
    return raises(ValueError, "use different shm geometry", pyddp.new_group, "shm",
                   store=dist.FileStore(ctx.store_path("geometry"), ctx.world_size),
                   rank=ctx.rank, world_size=ctx.world_size,
                   timeout=datetime.timedelta(seconds=30), options=options)


def _subgroups_that_disagree(ctx: RankContext) -> list:
    parent = named_group(ctx, "parent")
    r = ctx.rank
    messages = []
    # Rank 2 asks for another group than ranks 0 and 1 (as it does when it
    # skipped their new_group([0, 1]) and calls the next one); then each
    # rank asks for another pair.
    for asked in ([[0, 1], [0, 1], [0, 1, 2]], [[0, 1], [1, 2], [0, 2]]):
        messages.append(raises(dist.DistBackendError, "the ranks disagree on the group",
                               pyddp.new_group, asked[r], group=parent))
    # The parent and the groups its ranks agree on work as before.
    sub = pyddp.new_group([0, 2], group=parent)
    if r == 1:
        assert isinstance(sub, pyddp.NonMemberGroup)
    else:
        t = torch.full((2,), float(r + 1))
        sub.all_reduce(t)
        check_equal(t, torch.full((2,), 4.0), "all_reduce in the subgroup agreed on")
        sub.shutdown()
    t = torch.full((3,), float(r))
    parent.all_reduce(t)
    check_equal(t, torch.full((3,), 3.0), "all_reduce in the parent")
    # A rank that never calls new_group is named at the timeout.
    if r < 2:
        messages.append(raises(dist.DistBackendError, "did not call", pyddp.new_group, [0, 1],
                               timeout=SHORT, group=parent))
    return messages


def test_mismatched_calls_fail_on_every_rank(two):
    messages = two.run(_mismatch_count)
    for m in messages:
        assert "all_reduce(count=4" in m and "all_reduce(count=5" in m, m
    messages = two.run(_mismatch_kind)
    for m in messages:
        assert "broadcast(count=4" in m and "all_reduce(count=4" in m, m


def test_every_descriptor_field_is_checked(two):
    for messages in two.run(_mismatch_fields):
        dtype, op, root, algo = messages
        assert "dtype=float64" in dtype and "dtype=float32" in dtype, dtype
        assert "op=SUM" in op and "op=MAX" in op, op
        assert "src=0" in root and "src=1" in root, root
        assert "algo=direct" in algo and "algo=ring" in algo, algo


def test_ranks_with_different_geometry_refuse_to_connect(two):
    for message in two.run(_mismatched_geometry):
        assert "slot_bytes 128 vs 256" in message or "slot_bytes 256 vs 128" in message, message


def test_ranks_that_disagree_on_a_subgroup_all_fail_naming_every_request(three):
    results = three.run(_subgroups_that_disagree)
    for r, messages in enumerate(results):
        assert messages[0].startswith(f"pyddp: rank {r}: new_group #1 of group "), messages[0]
        assert ("the ranks disagree on the group: ranks 0, 1 asked for ranks [0, 1] of a group "
                "of 3; rank 2 asked for ranks [0, 1, 2] of a group of 3") in messages[0], messages
        assert ("rank 0 asked for ranks [0, 1] of a group of 3; rank 1 asked for ranks [1, 2] of "
                "a group of 3; rank 2 asked for ranks [0, 2] of a group of 3") in messages[1], \
            messages
        if r < 2:
            assert ("rank 2 did not call new_group #4 of group " in messages[2] and
                    f"within {int(SHORT.total_seconds() * 1000)} ms" in messages[2]), messages
