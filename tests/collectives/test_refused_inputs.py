"""Bad inputs to a group's collectives on every rank: each is refused at once on the rank
that made it, with a TypeError or ValueError naming the rank, the call and what was wrong
(a device, size, dtype, op or root it does not take, an output that overlaps itself or
its input), and none reaches the peers: the group goes on working.
"""

from __future__ import annotations

import pytest
import torch

import pyddp
from harness import RankContext, raises
from shm_groups import named_group

pytestmark = pytest.mark.multiprocess

ReduceOp = pyddp.ReduceOp


def _bad_inputs(ctx: RankContext) -> None:
    pg = named_group(ctx, "bad-inputs")
    n, r = ctx.world_size, ctx.rank
    who = f"rank {r}"
    raises(TypeError, f"{who}: all_reduce: tensor is on meta; .* serves cpu tensors",
            pg.all_reduce, torch.ones(2, device="meta"))
    raises(ValueError, f"{who}: all_gather_single: output has {2 * n + 1} elements, "
            f"expected {2 * n}", pg.all_gather_single, torch.zeros(2 * n + 1), torch.zeros(2))
    raises(ValueError, f"{who}: reduce_scatter_single: input has 7 elements, expected {3 * n}",
            pg.reduce_scatter_single, torch.zeros(3), torch.zeros(7))
    raises(ValueError, f"{who}: all_gather: tensor_list has 1 tensors, expected world_size",
            pg.all_gather, [torch.zeros(2)], torch.zeros(2))
    raises(ValueError, f"{who}: all_gather: tensor_list entry has 3 elements, expected 2",
            pg.all_gather, [torch.zeros(3)] * n, torch.zeros(2))
    raises(TypeError, f"{who}: all_gather_single: output dtype .* differs",
            pg.all_gather_single, torch.zeros(2 * n, dtype=torch.float64), torch.zeros(2))
    for dtype in (torch.int16, torch.bool, torch.complex64):
        raises(TypeError, f"{who}: all_reduce: tensor has dtype .*; supported",
                pg.all_reduce, torch.zeros(2, dtype=dtype))
    raises(TypeError, f"{who}: all_reduce: .*PREMUL_SUM is not supported", pg.all_reduce,
            torch.zeros(2), ReduceOp.PREMUL_SUM)
    for op, name in ((ReduceOp.BAND, "BAND"), (ReduceOp.BOR, "BOR"), (ReduceOp.BXOR, "BXOR")):
        raises(TypeError, f"{who}: all_reduce: ReduceOp.{name} needs an integer tensor "
                r"\(int8, uint8, int32, int64\), got float32", pg.all_reduce, torch.zeros(2), op)
    raises(TypeError, f"{who}: all_reduce: ReduceOp.AVG needs a floating-point tensor",
            pg.all_reduce, torch.zeros(2, dtype=torch.int32), ReduceOp.AVG)
    raises(TypeError, f"{who}: reduce_scatter_single: ReduceOp.AVG needs a floating",
            pg.reduce_scatter_single, torch.zeros(1, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64), ReduceOp.AVG)
    for src in (-1, n):
        raises(ValueError, f"{who}: broadcast: src={src} is not a rank of this group",
                pg.broadcast, torch.zeros(2), src)
    raises(TypeError, f"{who}: all_reduce: tensor must be a torch.Tensor", pg.all_reduce,
            [1.0, 2.0])
    raises(TypeError, f"{who}: broadcast: tensor must be a torch.Tensor", pg.broadcast, 1.0, 0)
    raises(TypeError, f"{who}: all_gather_single: input must be a torch.Tensor",
            pg.all_gather_single, torch.zeros(2 * n), [0.0, 0.0])
    raises(TypeError, f"{who}: reduce_scatter_single: input must be a torch.Tensor",
            pg.reduce_scatter_single, torch.zeros(1), None)
    for call, args in (("broadcast", (torch.ones(2, device="meta"), 0)),
                       ("all_gather_single", (torch.zeros(2 * n), torch.ones(2, device="meta"))),
                       ("reduce_scatter_single", (torch.zeros(1),
                                                  torch.ones(n, device="meta")))):
        raises(TypeError, f"{who}: {call}: (tensor|input) is on meta", getattr(pg, call), *args)
    raises(TypeError, f"{who}: broadcast: src must be an int", pg.broadcast, torch.zeros(1), "0")
    # None of the refused calls reached the peers: the group still works, and
    # takes a ReduceOp instance (not a member) on the small-message calls too.
    t = torch.ones(3)
    pg.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    out = torch.zeros(1)
    pg.reduce_scatter_single(out, torch.arange(float(n)) + r, ReduceOp(ReduceOp.MAX))
    assert out.item() == r + n - 1


def _overlapping_output(ctx: RankContext) -> None:
    pg = named_group(ctx, "overlap")
    raises(ValueError, f"rank {ctx.rank}: all_reduce: tensor has elements that share memory",
            pg.all_reduce, torch.ones(1).expand(4))
    raises(ValueError, "broadcast: tensor has elements that share memory", pg.broadcast,
            torch.ones(1).expand(4), 0)
    n, r, k = ctx.world_size, ctx.rank, 4
    whole = torch.ones(n * k + 1)
    # shifted by one element from a block of the world-sized tensor
    raises(ValueError, f"reduce_scatter_single: output overlaps input other than as one of its "
           f"blocks \\(in place, it is block {r}: elements {r * k} to {(r + 1) * k}\\)",
           pg.reduce_scatter_single, whole[r * k + 1:(r + 1) * k + 1], whole[:n * k])
    raises(ValueError, "all_gather_single: input overlaps output other than as one of its "
           "blocks", pg.all_gather_single, whole[:n * k], whole[1:k + 1])
    blocks = list(whole[:n * k].split(k))
    raises(ValueError, f"all_gather: tensor_list entry {r} overlaps the input other than as "
           "the whole input", pg.all_gather, blocks, whole[r * k + 1:(r + 1) * k + 1])
    t = torch.ones(4)
    pg.all_reduce(t)  # refused calls never reached the peers
    assert torch.equal(t, torch.full((4,), float(ctx.world_size)))


def test_bad_inputs_raise_clear_errors_and_leave_group_usable(two):
    two.run(_bad_inputs)


def test_outputs_that_overlap_themselves_or_their_inputs_are_refused(two):
    two.run(_overlapping_output)
