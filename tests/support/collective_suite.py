"""The collective suite's correctness cases, run on every rank of a pool.

test_collectives runs them on CPU groups, test_gpu_collectives on CUDA tensors (with
``ctx.state["device"]`` set) under the same group names, test_multihost on groups that
span simulated hosts. Each checks every rank's result against collective_cases'
references.
"""

from __future__ import annotations

import torch

from collective_cases import (BITWISE_OPS, DTYPES, INT_DTYPES, LARGE, ReduceOp, check_equal,
                              digest, dtype_op_pairs, make_input, reference_reduce)
from harness import RankContext

# 1001: uneven blocks for every world size, many pieces in the ring and direct groups.
SMALL_COUNTS = [0, 1, 3, 1001]


def _counts(group: str) -> list:
    return SMALL_COUNTS + ([LARGE] if group in ("auto", "cma") else [])


def _device(ctx: RankContext) -> torch.device:
    """Where the case functions put their tensors: the CPU here; the GPU
    tests run the same functions with ctx.state["device"] set."""
    return ctx.state.get("device", torch.device("cpu"))


def _all_reduce_cases(ctx: RankContext, group: str) -> None:
    pg, dev = ctx.groups[group], _device(ctx)
    for dtype, op in dtype_op_pairs():
        for count in _counts(group):
            inputs = [make_input(r, count, dtype, op) for r in range(ctx.world_size)]
            expected = reference_reduce(inputs, op)
            for rep in range(2):  # twice in a row: state carried between calls
                t = inputs[ctx.rank].to(dev, copy=True)
                pg.all_reduce(t, op)
                check_equal(t.cpu(), expected, f"all_reduce {dtype} {op} count={count} rep={rep}")


def _reduce_scatter_cases(ctx: RankContext, group: str) -> None:
    pg, dev = ctx.groups[group], _device(ctx)
    n = ctx.world_size
    counts = SMALL_COUNTS + ([LARGE // n] if group in ("auto", "cma") else [])
    for dtype, op in dtype_op_pairs():
        for count in counts:
            inputs = [make_input(r, count * n, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)[ctx.rank * count:(ctx.rank + 1) * count]
            for rep in range(2):
                out = torch.full((count,), 7, dtype=dtype, device=dev)
                pg.reduce_scatter_single(out, inputs[ctx.rank].to(dev, copy=True), op)
                check_equal(out.cpu(), expected, f"reduce_scatter {dtype} {op} count={count} rep={rep}")
            # The output as a block of the input: this rank's (in place), or a peer's,
            # which this rank's result overwrites (the peers must have read it).
            for b in (ctx.rank, (ctx.rank + 1) % n):
                whole = inputs[ctx.rank].to(dev, copy=True)
                out = whole[b * count:(b + 1) * count]
                pg.reduce_scatter_single(out, whole, op)
                check_equal(out.cpu(), expected,
                            f"reduce_scatter {dtype} {op} count={count} into block {b}")


def _bitwise_cases(ctx: RankContext, group: str) -> None:
    """BAND, BOR and BXOR on every integer type (CPU tensors only), with
    all_reduce, reduce_scatter_single, reduce (its root varies with the size)
    and the coalesced all-reduce and reduce-scatter."""
    pg, n = ctx.groups[group], ctx.world_size
    for dtype in INT_DTYPES:
        for op in BITWISE_OPS:
            for count in SMALL_COUNTS:
                what = f"{dtype} {op} count={count}"
                inputs = [make_input(r, count, dtype, op) for r in range(n)]
                expected = reference_reduce(inputs, op)
                t = inputs[ctx.rank].clone()
                pg.all_reduce(t, op)
                check_equal(t, expected, f"all_reduce {what}")
                root = count % n
                t = inputs[ctx.rank].clone()
                pg.reduce(t, root, op)
                check_equal(t, expected if ctx.rank == root else inputs[ctx.rank],
                            f"reduce {what} root={root}")
                whole = [make_input(r, count * n, dtype, op, salt=1) for r in range(n)]
                out = torch.zeros(count, dtype=dtype)
                pg.reduce_scatter_single(out, whole[ctx.rank], op)
                block = reference_reduce(whole, op)[ctx.rank * count:(ctx.rank + 1) * count]
                check_equal(out, block, f"reduce_scatter {what}")
            # The coalesced forms: one collective over the packed tensors.
            parts = [[make_input(r, count, dtype, op, salt=2) for r in range(n)]
                     for count in (n, 333 * n)]
            mine = [p[ctx.rank].clone() for p in parts]
            pg.all_reduce_coalesced(mine, op)
            for t, p in zip(mine, parts):
                check_equal(t, reference_reduce(p, op), f"all_reduce_coalesced {dtype} {op}")
            outs = [torch.zeros(len(p[0]) // n, dtype=dtype) for p in parts]
            pg.reduce_scatter_tensor_coalesced(outs, [p[ctx.rank] for p in parts], op)
            for out, p in zip(outs, parts):
                k = len(out)
                check_equal(out, reference_reduce(p, op)[ctx.rank * k:(ctx.rank + 1) * k],
                            f"reduce_scatter_tensor_coalesced {dtype} {op}")


def _all_gather_cases(ctx: RankContext, group: str) -> None:
    pg, dev = ctx.groups[group], _device(ctx)
    n = ctx.world_size
    for dtype in DTYPES:
        for count in _counts(group):
            inputs = [make_input(r, count, dtype) for r in range(n)]
            expected = torch.cat(inputs)
            for rep in range(2):
                out = torch.full((n * count,), 5, dtype=dtype, device=dev)
                pg.all_gather_single(out, inputs[ctx.rank].to(dev, copy=True))
                check_equal(out.cpu(), expected,
                            f"all_gather_single {dtype} count={count} rep={rep}")
                outs = [torch.full((count,), 5, dtype=dtype, device=dev) for _ in range(n)]
                pg.all_gather(outs, inputs[ctx.rank].to(dev, copy=True))
                for r in range(n):
                    check_equal(outs[r].cpu(), inputs[r], f"all_gather {dtype} count={count} [{r}]")
            # The input as a block of the output: this rank's (in place), or a peer's,
            # which the peer's block overwrites (it must be read before).
            for b in (ctx.rank, (ctx.rank + 1) % n):
                out = torch.full((n * count,), 5, dtype=dtype, device=dev)
                block = out[b * count:(b + 1) * count]
                block.copy_(inputs[ctx.rank])
                pg.all_gather_single(out, block)
                check_equal(out.cpu(), expected,
                            f"all_gather_single {dtype} count={count} from block {b}")


def _broadcast_cases(ctx: RankContext, group: str) -> None:
    pg, dev = ctx.groups[group], _device(ctx)
    for dtype in DTYPES:
        for count in _counts(group):
            for src in range(ctx.world_size):
                for rep in range(2):
                    expected = make_input(src, count, dtype, salt=rep)
                    t = make_input(ctx.rank, count, dtype, salt=rep).to(dev)
                    pg.broadcast(t, src)
                    check_equal(t.cpu(), expected, f"broadcast {dtype} count={count} src={src}")


def _half_types_accumulate_in_fp32(ctx: RankContext, group: str) -> None:
    # Rank 0 holds 2048, the others 1: rounding each partial sum to half
    # precision would lose the ones; accumulating in fp32 keeps them.
    n = ctx.world_size
    for dtype in (torch.float16, torch.bfloat16):
        expected = torch.full((1001,), 2048.0 + n - 1).to(dtype)
        t = torch.full((1001,), 2048.0 if ctx.rank == 0 else 1.0, dtype=dtype,
                       device=_device(ctx))
        ctx.groups[group].all_reduce(t)
        check_equal(t.cpu(), expected, f"{dtype} sum in {group}")


def _random_floats(ctx: RankContext, group: str) -> list:
    # Non-integer values: the result depends on the order of additions, which
    # must be the same on every rank.
    gen = torch.Generator().manual_seed(1234 + ctx.rank)
    digests = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT):
            t = torch.randn(70001, generator=gen).to(dtype).to(_device(ctx))
            ctx.groups[group].all_reduce(t, op)
            digests.append(digest(t.cpu()))
    return digests
