"""The CPU reduction kernels (csrc/kernels) against torch references, without processes.

Covers every dtype x op, odd lengths and the reduce-N tile boundary, AVG's
final division, half types accumulating in fp32, integer wrap-around, NaN
propagation and the bitwise ops' refusal of floating types; the element-wise
loops under each instruction set this CPU runs (``loop_isa``).
"""

from __future__ import annotations

import pytest
import torch

from pyddp import _C
from pyddp._C import _testing as k

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BITWISE = ("BAND", "BOR", "BXOR")
LENGTHS = [0, 1, 7, 511, 512, 513, 1031]
HALF = (torch.float16, torch.bfloat16)


def _acc(dtype):
    return torch.float32 if dtype in HALF else dtype


def _combine(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if op in ("SUM", "AVG"):
        return a + b
    if op == "PRODUCT":
        return a * b
    if op in BITWISE:
        return {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                "BXOR": torch.bitwise_xor}[op](a, b)
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


@pytest.fixture(params=k.supported_loop_isas(), ids=lambda isa: isa.name.lower())
def loop_isa(request):
    """The kernels' loops compiled for each instruction set this CPU has, in turn."""
    default = k.loop_isa()
    k.use_loop_isa(request.param)
    yield request.param
    k.use_loop_isa(default)


def test_the_loops_run_the_best_instruction_set_by_default():
    assert k.loop_isa() == k.supported_loop_isas()[-1]
    assert k.supported_loop_isas()[0] == k.LoopIsa.BASELINE


def _cases():
    """AVG is for floating types, the bitwise ops for integers."""
    return [(d, op) for d in DTYPES for op in OPS
            if (op != "AVG" or d.is_floating_point) and (op not in BITWISE
                                                         or not d.is_floating_point)]


@pytest.mark.parametrize("dtype,op", _cases())
def test_ring_kernels_match_torch(dtype, op, loop_isa):
    red = getattr(_C.RedOp, op)
    acc = _acc(dtype)
    for n in LENGTHS:
        a, b, c = _values(dtype, n, 1), _values(dtype, n, 2), _values(dtype, n, 3)
        partial = k.to_partial(a)
        _same(partial, a.to(acc))
        partial = k.reduce_partial(red, 3, partial, b)
        _same(partial, _combine(op, a.to(acc), b.to(acc)))
        out, out2 = k.reduce_final(red, 3, partial, c)
        expected = _reference(op, dtype, [a, b, c], 3)
        _same(out, expected)
        _same(out2, expected)


@pytest.mark.parametrize("dtype,op", _cases())
def test_ring_kernels_read_a_first_hop_sent_as_elements(dtype, op, loop_isa):
    # shm sends a reduction's first hop as the sender's elements, not as
    # partials: the steps that read it must give the same as from partials.
    red = getattr(_C.RedOp, op)
    acc = _acc(dtype)
    for n in LENGTHS:
        a, b = _values(dtype, n, 1), _values(dtype, n, 2)
        partial = k.reduce_partial(red, 3, a, b, elements=True)
        _same(partial, _combine(op, a.to(acc), b.to(acc)))
        _same(partial, k.reduce_partial(red, 3, k.to_partial(a), b))
        out, out2 = k.reduce_final(red, 2, a, b, elements=True)
        expected = _reference(op, dtype, [a, b], 2)
        _same(out, expected)
        _same(out2, expected)


@pytest.mark.parametrize("dtype,op", _cases())
def test_reduce_n_matches_torch_in_source_order(dtype, op, loop_isa):
    red = getattr(_C.RedOp, op)
    for nsrc in (1, 2, 3, 5):
        for n in LENGTHS:
            sources = [_values(dtype, n, 10 + s) for s in range(nsrc)]
            _same(k.reduce_n(red, nsrc, sources), _reference(op, dtype, sources, nsrc))


@pytest.mark.parametrize("dtype", HALF)
def test_half_types_accumulate_in_fp32(dtype, loop_isa):
    # 2048 + 1 + 1 rounded to fp16 at every step gives 2048; accumulated in
    # fp32 and rounded once it gives 2050. The ring and direct kernels agree.
    big, one = torch.tensor([2048.0], dtype=dtype), torch.tensor([1.0], dtype=dtype)
    exact = torch.tensor([2050.0]).to(dtype).item()
    assert k.reduce_n(_C.RedOp.SUM, 3, [big, one, one]).item() == exact
    ring = k.reduce_final(_C.RedOp.SUM, 3, k.reduce_partial(_C.RedOp.SUM, 3,
                                                            k.to_partial(big), one), one)[0]
    assert ring.item() == exact


def test_integers_wrap_around(loop_isa):
    def final(op, a):
        return k.reduce_final(op, 2, a, a)[0].tolist()

    assert final(_C.RedOp.SUM, torch.tensor([100, -128, 127], dtype=torch.int8)) == [-56, 0, -2]
    assert final(_C.RedOp.PRODUCT, torch.tensor([2**31 - 1, 65536], dtype=torch.int32)) == [1, 0]
    assert final(_C.RedOp.SUM, torch.tensor([255], dtype=torch.uint8)) == [254]
    big = torch.tensor([2**62], dtype=torch.int64)
    assert k.reduce_n(_C.RedOp.SUM, 4, [big] * 4).tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF])
@pytest.mark.parametrize("op", BITWISE)
def test_bitwise_ops_refuse_floating_types(dtype, op):
    a = torch.ones(3, dtype=dtype)
    red = getattr(_C.RedOp, op)
    with pytest.raises(RuntimeError, match=f"{op} reduction on floating dtype"):
        k.reduce_n(red, 2, [a, a])
    with pytest.raises(RuntimeError, match=f"{op} reduction on floating dtype"):
        k.reduce_final(red, 2, a, a, elements=True)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_nan_wins_min_and_max(dtype, op, loop_isa):
    # 19 elements: whole vectors of the half types' vector pass (two of 8
    # lanes, or one of 16 for two bfloat16 operands) and a tail through the
    # tiles, NaN on either side in both.
    a = torch.tensor([float("nan"), 1.0, 2.0] * 6 + [float("nan")]).to(dtype)
    b = torch.tensor([0.0, float("nan"), 1.0] * 6 + [3.0]).to(dtype)
    red = getattr(_C.RedOp, op)
    expected = _reference(op, dtype, [a, b], 2)
    assert expected.isnan().sum() == 13
    _same(k.reduce_final(red, 2, k.to_partial(a), b)[0], expected)
    _same(k.reduce_final(red, 2, a, b, elements=True)[0], expected)
    _same(k.reduce_n(red, 2, [a, b]), expected)
    _same(k.reduce_partial(red, 2, a, b, elements=True),
          _combine(op, a.to(_acc(dtype)), b.to(_acc(dtype))))


def _every_value(dtype):
    """Every bit pattern of a 16-bit float type, NaNs and infinities included."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


def _rounding_cases(dtype):
    """fp32 values to round to ``dtype``: every value it has, the midpoints of neighbours
    (ties, which go to even), points a quarter of the way either side of each midpoint,
    values past its largest finite one, fp32 denormals, infinities and NaN."""
    exact = _every_value(dtype).float()
    finite = exact[exact.isfinite()].unique().double()  # sorted
    low, high = finite[:-1], finite[1:]
    mid = (low + high) / 2  # exact in fp32: one bit more than dtype's
    edges = torch.tensor([3.4e38, -3.4e38, 65519.0, 65520.0, -65536.0, 1e-40, -1e-45, 0.0, -0.0,
                          float("inf"), float("-inf"), float("nan"), -float("nan")],
                         dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    spread = torch.randn(50000, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 30, (50000,), generator=gen).double())
    return torch.cat([exact.double(), mid, (3 * low + high) / 4, (low + 3 * high) / 4, edges,
                      spread]).float()


def _same_bits(actual, expected):
    """Bitwise equal, except that any NaN matches any NaN (payloads differ between the
    vector and scalar conversions)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    ints = torch.int16 if actual.element_size() == 2 else torch.int32
    assert torch.equal(actual[~nan].view(ints), expected[~nan].view(ints))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_half_conversions_equal_torchs_on_every_value(dtype, vector):
    # "vector" takes the vector conversions where this CPU has them
    # (k.vector_half_conversions()), the scalar ones elsewhere.
    halves = _every_value(dtype)
    _same_bits(k.widen(halves, vector), halves.float())
    wide = _rounding_cases(dtype)
    _same_bits(k.narrow(wide, torch.empty(wide.shape, dtype=dtype), vector), wide.to(dtype))
    for n in LENGTHS:  # the vector loop's scalar tail
        part = wide[1000:1000 + n]
        _same_bits(k.narrow(part, torch.empty(n, dtype=dtype), vector), part.to(dtype))
        _same_bits(k.widen(halves[:n], vector), halves[:n].float())
