"""The grid kernels of csrc/kernels (elementwise.h, cuda.h) against numpy references.

The same bodies run two ways: over an emulated grid on the CPU (several
(blocks, threads) shapes, always) and as the real CUDA kernels (tests marked
``cuda``, skipped without a GPU). Covered: every dtype x op, odd sizes, operands
aligned, all shifted by the same number of elements (a scalar head, then 16-byte
packs) and shifted by different amounts (all scalar), in-place aliasing, dst2,
reduceN's source order and source limit, copy at every byte alignment, and
bitwise agreement with the CPU kernels (kernels/cpu.cpp). On the emulated grid
the tests also check which split (head, packs) each call took.

References are computed by numpy element-wise in the accumulator type (fp32 for
half types, rounded once at the end, bfloat16 by hand), wrapping integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
import torch

from pyddp import _C
from pyddp._C import _testing as k

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BITWISE = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
HALF = (torch.float16, torch.bfloat16)
SIZES = [0, 1, 7, 8, 9, 1023, 40_003]
# On a GPU also a size whose packs outnumber the largest grid's threads
# (1024 blocks x 512 threads), so the grid-stride loop wraps there too.
GPU_SIZES = SIZES + [3_000_005]
GRIDS = [(1, 1), (1, 32), (3, 7), (5, 64)]
LARGE = 1024  # sizes above this run on one emulated grid only, to keep the file fast
LAYOUTS = ["aligned", "shifted", "mixed"]
SHIFT = 3
NP_TYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8,
            torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _cases():
    """AVG is for floating types, the bitwise ops for integers."""
    return [(d, op) for d in DTYPES for op in OPS
            if (op != "AVG" or d.is_floating_point) and (op not in BITWISE
                                                         or not d.is_floating_point)]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in HALF else dtype


def _width(dtype: torch.dtype) -> int:
    return 16 // torch.empty(0, dtype=dtype).element_size()


# ---------------------------------------------------------------- references


def _to_np(t: torch.Tensor) -> np.ndarray:
    """The tensor's values in its accumulator type (exact widening)."""
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    if t.dtype == torch.float16:
        return t.numpy().astype(np.float32)
    return t.numpy().copy()


def _from_np(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Rounds accumulator values to dtype once, to nearest even."""
    if dtype == torch.bfloat16:
        bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[np.isnan(a)] = 0x7FC0
        return torch.from_numpy(rounded.view(np.int16)).view(torch.bfloat16)
    with np.errstate(all="ignore"):
        narrow = a.astype(np.float16 if dtype == torch.float16 else NP_TYPES[dtype])
    return torch.from_numpy(narrow)


def _combine(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        if op in ("SUM", "AVG"):
            return a + b
        if op == "PRODUCT":
            return a * b
        if op in BITWISE:
            return BITWISE[op](a, b)
        return np.minimum(a, b) if op == "MIN" else np.maximum(a, b)


def _finish(op: str, acc: np.ndarray, world: int) -> np.ndarray:
    if op != "AVG":
        return acc
    with np.errstate(all="ignore"):
        return acc / acc.dtype.type(world)


def _reduce(op: str, sources: list[torch.Tensor]) -> np.ndarray:
    acc = _to_np(sources[0])
    for s in sources[1:]:
        acc = _combine(op, acc, _to_np(s))
    return acc


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random values over the whole range; floats include inf, -inf and NaN."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        v = torch.randn(n, generator=gen, dtype=torch.float64) * 4
        if n > 13:
            v[seed % 5] = float("nan")
            v[6 + seed % 3] = float("inf") if seed % 2 else -float("inf")
        return v.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


def _same(actual: torch.Tensor, expected: torch.Tensor, nan_bits: bool = False) -> None:
    """Bitwise equal; NaNs only have to be NaN unless nan_bits."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype.is_floating_point and not nan_bits:
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan), "NaN positions differ"
        actual, expected = actual[~nan], expected[~nan]
    bits = BITS[actual.element_size()]
    mismatch = (actual.view(bits) != expected.view(bits)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.numel()} of {actual.numel()} differ, first at {mismatch[0].item()}: "
        f"{actual[mismatch[0]].item()} != {expected[mismatch[0]].item()}")


def _same_as_reference(actual: torch.Tensor, acc: np.ndarray) -> None:
    _same(actual, _from_np(acc, actual.dtype))


# ---------------------------------------------------------------- operands


def _place(values: torch.Tensor, offset: int, device: str, dtype: Optional[torch.dtype] = None):
    """A contiguous view at element `offset` of a fresh (16-byte aligned) buffer."""
    dtype = dtype or values.dtype
    buf = torch.full((values.numel() + offset,), 0, dtype=dtype, device=device)
    assert buf.data_ptr() % 16 == 0
    view = buf[offset:]
    view.copy_(values)
    return view


def _offsets(layout: str, n_operands: int, width: int) -> list[int]:
    """Element offsets of each operand: all 16-byte aligned; all at SHIFT
    modulo the pack width (one head aligns them all); or at 0, 1, 2, ...
    (no head aligns the first two)."""
    if layout == "aligned":
        return [0] * n_operands
    if layout == "shifted":
        return [SHIFT + i * width for i in range(n_operands)]
    return list(range(n_operands))


def _expected_split(layout: str, n: int, width: int) -> tuple[int, int, int]:
    if n == 0:
        return (0, 0, 0)
    head = 0 if layout == "aligned" else (-SHIFT) % width
    packs = (n - head) // width if layout != "mixed" and n > head else 0
    return (width, head, packs) if packs else (width, 0, 0)


@dataclass
class Target:
    """Runs a grid kernel on the emulated grid (CPU tensors) or the GPU."""

    device: str

    def grids(self, n: int) -> list:
        if self.device == "cuda":
            return [None]
        return GRIDS if n <= LARGE else GRIDS[-1:]

    def sizes(self) -> list[int]:
        return GPU_SIZES if self.device == "cuda" else SIZES

    def run(self, name: str, grid, *args):
        """Calls _testing.emulated_<name>(grid, *args) or cuda_<name>(*args);
        returns the split the emulation used, or None on the GPU."""
        if self.device == "cuda":
            getattr(k, "cuda_" + name)(*args)
            return None
        return getattr(k, "emulated_" + name)(grid, *args)


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def target(request) -> Target:
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
        assert k.has_cuda_kernels, "a GPU is present but pyddp was built without CUDA kernels"
        return Target("cuda")
    return Target("cpu")


def _check_split(got, layout: str, n: int, width: int) -> None:
    if got is not None:
        assert tuple(got) == _expected_split(layout, n, width), (layout, n)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype,op", _cases())
def test_ring_kernels(target, dtype, op):
    """toPartial -> reducePartial -> reduceFinal, as a 3-rank ring does it."""
    red, acc_t, w, dev = getattr(_C.RedOp, op), _acc(dtype), _width(dtype), target.device
    for n in target.sizes():
        a, b, c = _values(dtype, n, 1), _values(dtype, n, 2), _values(dtype, n, 3)
        acc_ab = _reduce(op, [a, b])
        expected = _finish(op, _reduce(op, [a, b, c]), 3)
        cpu_partial = k.reduce_partial(red, 3, k.to_partial(a), b)
        cpu_final = k.reduce_final(red, 3, cpu_partial, c)[0]
        for layout in LAYOUTS:
            for grid in target.grids(n):
                o = _offsets(layout, 4, w)
                p0 = _place(torch.zeros(n), o[0], dev, acc_t)
                split = target.run("to_partial", grid, p0, _place(a, o[1], dev))
                _check_split(split, layout, n, w)
                _same(p0, a.to(acc_t), nan_bits=dev == "cpu")

                p1 = _place(torch.zeros(n), o[0], dev, acc_t)
                split = target.run("reduce_partial", grid, red, 3, p1, _place(p0, o[1], dev),
                                   _place(b, o[2], dev))
                _check_split(split, layout, n, w)
                _same(p1, torch.from_numpy(acc_ab))
                _same(p1, cpu_partial, nan_bits=dev == "cpu")

                out = _place(torch.zeros(n, dtype=dtype), o[0], dev)
                out2 = _place(torch.zeros(n, dtype=dtype), o[1], dev) if layout != "mixed" else None
                split = target.run("reduce_final", grid, red, 3, out, out2,
                                   _place(p1, o[2], dev), _place(c, o[3], dev))
                _check_split(split, layout, n, w)
                _same_as_reference(out, expected)
                _same(out, cpu_final, nan_bits=dev == "cpu")
                if out2 is not None:
                    _same(out2, out, nan_bits=True)


@pytest.mark.parametrize("dtype,op", _cases())
def test_reduce_n(target, dtype, op):
    """Sources combined left to right in fp32 (half types), finished once."""
    red, w, dev = getattr(_C.RedOp, op), _width(dtype), target.device
    for nsrc in (1, 2, 5, 16):
        for n in target.sizes():
            if nsrc == 16 and n > LARGE:
                continue
            sources = [_values(dtype, n, 10 + s) for s in range(nsrc)]
            expected = _finish(op, _reduce(op, sources), nsrc)
            cpu = k.reduce_n(red, nsrc, sources)
            for layout in LAYOUTS:
                for grid in target.grids(n):
                    o = _offsets(layout, nsrc + 1, w)
                    dst = _place(torch.zeros(n, dtype=dtype), o[0], dev)
                    srcs = [_place(s, o[i + 1], dev) for i, s in enumerate(sources)]
                    split = target.run("reduce_n", grid, red, nsrc, dst, srcs)
                    _check_split(split, layout, n, w)
                    _same_as_reference(dst, expected)
                    _same(dst, cpu, nan_bits=dev == "cpu")


@pytest.mark.parametrize("dtype,op", _cases())
def test_in_place(target, dtype, op):
    """Outputs aliasing inputs element for element, as ring steps use them."""
    red, acc_t, w, dev = getattr(_C.RedOp, op), _acc(dtype), _width(dtype), target.device
    n = 1023
    a, b, c = _values(dtype, n, 4), _values(dtype, n, 5), _values(dtype, n, 6)
    for layout in ("aligned", "shifted"):
        o = _offsets(layout, 2, w)
        for grid in target.grids(n):
            if acc_t == dtype:
                x = _place(a, o[0], dev)
                target.run("to_partial", grid, x, x)
                _same(x, a, nan_bits=True)
            partial = _place(a.to(acc_t), o[0], dev)
            target.run("reduce_partial", grid, red, 2, partial, partial, _place(b, o[1], dev))
            _same(partial, torch.from_numpy(_reduce(op, [a, b])))
            local = _place(c, o[1], dev)
            target.run("reduce_final", grid, red, 3, local, None, partial, local)
            _same_as_reference(local, _finish(op, _reduce(op, [a, b, c]), 3))
            srcs = [_place(a, o[0], dev), _place(b, o[0], dev), _place(c, o[0], dev)]
            target.run("reduce_n", grid, red, 3, srcs[0], srcs)
            _same_as_reference(srcs[0], _finish(op, _reduce(op, [a, b, c]), 3))


@pytest.mark.parametrize("dtype", HALF)
def test_half_types_accumulate_in_fp32(target, dtype):
    # 2048 + 1 + 1 rounded to the half type at every step stays 2048;
    # accumulated in fp32 and rounded once it is 2050.
    dev = target.device
    n = 1023
    big, one = torch.full((n,), 2048.0, dtype=dtype), torch.ones(n, dtype=dtype)
    exact = torch.full((n,), 2050.0, dtype=dtype)
    for grid in target.grids(n):
        dst = torch.empty(n, dtype=dtype, device=dev)
        target.run("reduce_n", grid, _C.RedOp.SUM, 3, dst, [big.to(dev), one.to(dev), one.to(dev)])
        _same(dst, exact)
        partial = torch.empty(n, device=dev)
        target.run("to_partial", grid, partial, big.to(dev))
        target.run("reduce_partial", grid, _C.RedOp.SUM, 3, partial, partial, one.to(dev))
        target.run("reduce_final", grid, _C.RedOp.SUM, 3, dst, None, partial, one.to(dev))
        _same(dst, exact)


@pytest.mark.parametrize("dst_off,dst2_off,src_off", [
    (0, 0, 0), (0, None, 0), (1, 1, 1), (3, None, 3), (2, 2, 2), (4, 4, 4), (8, 8, 8),
    (0, 8, 0), (4, 0, 0), (2, None, 6), (1, 0, 0), (0, 2, 5),
])
def test_copy(target, dst_off, dst2_off, src_off):
    """Bytes copied at every alignment, in the widest unit that divides every
    address and the length, vectorised when one head aligns all operands."""
    dev = target.device
    for nbytes in [0, 1, 7, 8, 9, 15, 16, 17, 1023, 4096, 40_003]:
        src_values = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        offs = [o for o in (dst_off, dst2_off, src_off) if o is not None]
        common = np.bitwise_or.reduce(offs + [nbytes])
        unit = next(u for u in (8, 4, 2, 1) if common % u == 0)
        width = 16 // unit
        count = nbytes // unit
        congruent = len({o % 16 for o in offs}) == 1
        head = (-offs[0]) % 16 // unit
        packs = (count - head) // width if congruent and count > head else 0
        expected_split = (0, 0, 0) if count == 0 else (
            (width, head, packs) if packs else (width, 0, 0))
        for grid in target.grids(nbytes):
            dst = _place(torch.zeros(nbytes, dtype=torch.uint8), dst_off, dev)
            dst2 = None if dst2_off is None else _place(
                torch.zeros(nbytes, dtype=torch.uint8), dst2_off, dev)
            split = target.run("copy", grid, dst, dst2, _place(src_values, src_off, dev))
            if split is not None:
                assert tuple(split) == expected_split, (nbytes, grid)
            assert torch.equal(dst.cpu(), src_values)
            if dst2 is not None:
                assert torch.equal(dst2.cpu(), src_values)


def test_integer_avg_is_refused(target):
    dev = target.device
    x = torch.ones(8, dtype=torch.int32, device=dev)
    with pytest.raises(RuntimeError, match="AVG reduction on integer dtype int32"):
        target.run("reduce_partial", (1, 1), _C.RedOp.AVG, 2, x.clone(), x, x)
    with pytest.raises(RuntimeError, match="AVG reduction on integer dtype int32"):
        target.run("reduce_n", (1, 1), _C.RedOp.AVG, 2, x.clone(), [x, x])


@pytest.mark.parametrize("op", list(BITWISE))
def test_bitwise_ops_on_floating_types_are_refused(target, op):
    dev = target.device
    x = torch.ones(8, dtype=torch.float32, device=dev)
    with pytest.raises(RuntimeError, match=f"{op} reduction on floating dtype float32"):
        target.run("reduce_partial", (1, 1), getattr(_C.RedOp, op), 2, x.clone(), x, x)
    with pytest.raises(RuntimeError, match=f"{op} reduction on floating dtype float32"):
        target.run("reduce_n", (1, 1), getattr(_C.RedOp, op), 2, x.clone(), [x, x])


def test_reduce_n_source_limit(target):
    dev = target.device
    srcs = [torch.ones(8, device=dev) for _ in range(17)]
    with pytest.raises(RuntimeError, match="1 to 16 sources in one launch, got 17"):
        target.run("reduce_n", (1, 1), _C.RedOp.SUM, 17, torch.empty(8, device=dev), srcs)


def test_operand_not_element_aligned_is_refused():
    # A float32 operand one byte off its element boundary: refused before any
    # thread would load it (on a GPU, a misaligned address fault).
    raw = np.zeros(64, dtype=np.uint8)
    odd = torch.from_numpy(np.frombuffer(raw.data, dtype=np.uint8)[1:41].view(np.float32))
    assert odd.data_ptr() % 4 == 1
    with pytest.raises(RuntimeError, match="is not aligned to its 4-byte elements"):
        k.emulated_reduce_partial((1, 1), _C.RedOp.SUM, 2, torch.empty(10), odd, torch.ones(10))


def test_emulated_grid_needs_a_thread():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="at least one block and one thread"):
        k.emulated_to_partial((0, 32), x.clone(), x)
    with pytest.raises(ValueError, match="at least one block and one thread"):
        k.emulated_to_partial((4, 0), x.clone(), x)


@pytest.mark.skipif(not k.has_cuda_kernels or torch.cuda.is_available(),
                    reason="needs a CUDA build of pyddp on a machine without a usable GPU")
def test_failed_launch_raises():
    with pytest.raises(RuntimeError, match=r"launching the CUDA copy kernel \(128 elements\) failed: "):
        k.cuda_copy_without_gpu()
