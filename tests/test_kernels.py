"""The CPU reduction kernels (csrc/kernels) against torch references, without processes.

Covers every dtype x op, odd lengths and the reduce-N tile boundary, AVG's
final division, half types accumulating in fp32, integer wrap-around and
NaN propagation.
"""

from __future__ import annotations

import pytest
import torch

from pyddp import _C
from pyddp._C import _testing as k

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
LENGTHS = [0, 1, 7, 511, 512, 513, 1031]
HALF = (torch.float16, torch.bfloat16)


def _acc(dtype):
    return torch.float32 if dtype in HALF else dtype


def _combine(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if op in ("SUM", "AVG"):
        return a + b
    if op == "PRODUCT":
        return a * b
    return torch.minimum(a, b) if op == "MIN" else torch.maximum(a, b)


def _values(dtype, n, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 4).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


def _reference(op, dtype, sources, world, finish=True):
    acc = sources[0].to(_acc(dtype))
    for s in sources[1:]:
        acc = _combine(op, acc, s.to(_acc(dtype)))
    if finish and op == "AVG":
        acc = acc / world
    return acc.to(dtype)


def _same(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype.is_floating_point:
        assert torch.equal(actual.isnan(), expected.isnan())
        mask = ~expected.isnan()
        assert torch.equal(actual[mask], expected[mask])
    else:
        assert torch.equal(actual, expected)


def _cases():
    return [(d, op) for d in DTYPES for op in OPS if op != "AVG" or d.is_floating_point]


@pytest.mark.parametrize("dtype,op", _cases())
def test_reduce2_matches_torch(dtype, op):
    red = getattr(_C.RedOp, op)
    for n in LENGTHS:
        a, b = _values(dtype, n, 1), _values(dtype, n, 2)
        for finish in (False, True):
            _same(k.reduce2(red, 3, finish, a, b), _reference(op, dtype, [a, b], 3, finish))
        out0, out1 = k.reduce2_dual(red, 3, a, b)
        expected = _reference(op, dtype, [a, b], 3)
        _same(out0, expected)
        _same(out1, expected)


@pytest.mark.parametrize("dtype,op", _cases())
def test_reduce_n_matches_torch_in_source_order(dtype, op):
    red = getattr(_C.RedOp, op)
    for nsrc in (1, 2, 3, 5):
        for n in LENGTHS:
            sources = [_values(dtype, n, 10 + s) for s in range(nsrc)]
            _same(k.reduce_n(red, nsrc, sources), _reference(op, dtype, sources, nsrc))


def test_half_types_accumulate_in_fp32():
    # 2048 + 1 + 1 in fp16 step by step gives 2048; accumulated in fp32 and
    # rounded once it gives 2050.
    sources = [torch.tensor([2048.0], dtype=torch.float16), torch.tensor([1.0], dtype=torch.float16),
               torch.tensor([1.0], dtype=torch.float16)]
    assert k.reduce_n(_C.RedOp.SUM, 3, sources).item() == 2050.0


def test_integers_wrap_around():
    a = torch.tensor([100, -128, 127], dtype=torch.int8)
    assert k.reduce2(_C.RedOp.SUM, 2, True, a, a).tolist() == [-56, 0, -2]
    b = torch.tensor([2**31 - 1, 65536], dtype=torch.int32)
    assert k.reduce2(_C.RedOp.PRODUCT, 2, True, b, b).tolist() == [1, 0]
    u = torch.tensor([255], dtype=torch.uint8)
    assert k.reduce2(_C.RedOp.SUM, 2, True, u, u).tolist() == [254]


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_nan_wins_min_and_max(op):
    a = torch.tensor([float("nan"), 1.0, 2.0])
    b = torch.tensor([0.0, float("nan"), 1.0])
    out = k.reduce2(getattr(_C.RedOp, op), 2, True, a, b)
    assert out[0].isnan() and out[1].isnan()
    assert out[2].item() == (1.0 if op == "MIN" else 2.0)
