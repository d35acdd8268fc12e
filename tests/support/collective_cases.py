"""Inputs and independent references for collective tests.

Every rank can rebuild every rank's input (seeded by rank and case), so each
rank checks its own result against a reference computed with plain torch
ops over all ranks' inputs. Inputs are small integers so every result is
exact, whatever the reduction order; for the bitwise ops, random bytes, so
every bit of every integer type takes part.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import List

import numpy as np
import torch
import torch.distributed as dist

import pyddp

ReduceOp = pyddp.ReduceOp

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
HALF = (torch.float16, torch.bfloat16)
INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64]
# CPU tensors only (NCCL has none); integer types only.
BITWISE_OPS = [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
_NUMPY_BITWISE = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
                  ReduceOp.BXOR: np.bitwise_xor}

# At least 4 MiB of float32, and not divisible by any world size tested.
LARGE = 4 * 1024 * 1024 // 4 + 3


def dtype_op_pairs():
    """Every dtype x op that pyddp supports on every device (AVG is for floating
    types only); BITWISE_OPS are for integers on CPU tensors."""
    return [(d, op) for d in DTYPES for op in OPS
            if op != ReduceOp.AVG or d.is_floating_point]


def make_input(rank: int, count: int, dtype: torch.dtype, op=ReduceOp.SUM, salt: int = 0
               ) -> torch.Tensor:
    # zlib.crc32, not hash(): str hashes differ between processes.
    seed = zlib.crc32(repr((rank, count, str(dtype), str(op), salt)).encode())
    gen = torch.Generator().manual_seed(seed)
    if op in BITWISE_OPS:
        raw = torch.randint(0, 256, (count * dtype.itemsize,), generator=gen, dtype=torch.uint8)
        return raw.view(dtype)
    if op == ReduceOp.PRODUCT:
        # |product| <= 2**4 over 4 ranks: exact in every dtype, no wrap.
        choices = torch.tensor([1, 2] if dtype == torch.uint8 else [-2, -1, 1, 2])
        values = choices[torch.randint(len(choices), (count,), generator=gen)]
    else:
        low = 0 if dtype == torch.uint8 else -8
        values = torch.randint(low, 9, (count,), generator=gen)
    return values.to(dtype)


def reference_reduce(inputs: List[torch.Tensor], op) -> torch.Tensor:
    dtype = inputs[0].dtype
    if op in BITWISE_OPS:
        return torch.from_numpy(_NUMPY_BITWISE[op].reduce(np.stack([t.numpy() for t in inputs])))
    stack = torch.stack([t.to(torch.float64) for t in inputs])
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        out = stack.sum(0)
    elif op == ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op == ReduceOp.MIN:
        out = stack.amin(0)
    else:
        out = stack.amax(0)
    if op == ReduceOp.AVG:
        # Documented semantics: half types divide in fp32, others in their own type.
        acc = torch.float32 if dtype in HALF else dtype
        return (out.to(acc) / len(inputs)).to(dtype)
    return out.to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero()
        i = bad[0].tolist() if len(bad) else None
        raise AssertionError(
            f"{what}: {len(bad)} of {actual.numel()} elements differ; first at {i}: "
            f"got {actual[tuple(i)] if i is not None else '?'}, "
            f"expected {expected[tuple(i)] if i is not None else '?'}")


def check_object_collectives(rank: int, n: int) -> None:
    """torch.distributed's object collectives on the default group, against the objects sent."""
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    assert objects == [{"rank": r, "text": "x" * r} for r in range(n)], objects
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [f"from {n - 1}"], box
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("g", r) for r in range(n)], gathered
    got = [None]
    dist.scatter_object_list(got, [f"s{r}" for r in range(n)] if rank == 0 else None, src=0)
    assert got == [f"s{rank}"], got
