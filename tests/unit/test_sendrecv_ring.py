"""pyddp's ring over a point-to-point library (transport/sendrecv_ring.h: the ring
verbs as send/receive groups, as NCCL's ring transport runs them) and the
descriptor check by words (common/descriptor.h), under the real ring algorithms
over a simulated network of threads (csrc/testing/sendrecv_sim.h) in which a
send completes only once its receiver has posted the matching receive, as NCCL
allows: results are checked against references, and a pairing that could
deadlock on a GPU fails here.
"""

from __future__ import annotations

import pytest
import torch

from collective_cases import (DTYPES, ReduceOp, check_equal, dtype_op_pairs, make_input,
                              reference_reduce)
from pyddp import _C

RED_OPS = {ReduceOp.SUM: _C.RedOp.SUM, ReduceOp.AVG: _C.RedOp.AVG,
           ReduceOp.PRODUCT: _C.RedOp.PRODUCT, ReduceOp.MIN: _C.RedOp.MIN,
           ReduceOp.MAX: _C.RedOp.MAX}

SIM_COUNTS = [0, 1, 3, 1001]
# 64-byte pieces: 16 float32 or 8 float64 elements, so 1001 elements take many.
SIM_PIECE = 64


def _sim(kind, inputs, ops, **kw):
    outputs, errors = _C._testing.sendrecv_ring(kind, inputs, [RED_OPS[o] for o in ops],
                                           kw.pop("piece_bytes", SIM_PIECE), **kw)
    return outputs, errors


def _ok(errors):
    assert errors == [""] * len(errors), errors


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_all_reduce(n):
    for dtype, op in dtype_op_pairs():
        for count in SIM_COUNTS:
            inputs = [make_input(r, count, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)
            outputs, errors = _sim("all_reduce", inputs, [op] * n, repeats=2)
            _ok(errors)
            for r in range(n):
                check_equal(outputs[r], expected, f"rank {r} {dtype} {op} count={count}")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sim_all_reduce_in_place(n):
    for dtype in DTYPES:
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            for count in SIM_COUNTS:
                inputs = [make_input(r, count, dtype, op) for r in range(n)]
                outputs, errors = _sim("all_reduce", inputs, [op] * n, in_place=True)
                _ok(errors)
                for r in range(n):
                    check_equal(outputs[r], reference_reduce(inputs, op),
                                f"rank {r} {dtype} {op} count={count} in place")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_reduce_scatter(n):
    for dtype, op in dtype_op_pairs():
        for count in SIM_COUNTS:
            inputs = [make_input(r, count * n, dtype, op) for r in range(n)]
            expected = reference_reduce(inputs, op)
            outputs, errors = _sim("reduce_scatter", inputs, [op] * n, repeats=2)
            _ok(errors)
            for r in range(n):
                check_equal(outputs[r], expected[r * count:(r + 1) * count],
                            f"rank {r} {dtype} {op} count={count}")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_all_gather(n):
    for dtype in DTYPES:
        for count in SIM_COUNTS:
            inputs = [make_input(r, count, dtype) for r in range(n)]
            outputs, errors = _sim("all_gather", inputs, [ReduceOp.SUM] * n, repeats=2)
            _ok(errors)
            for r in range(n):
                check_equal(outputs[r], torch.cat(inputs), f"rank {r} {dtype} count={count}")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sim_broadcast(n):
    for dtype in (torch.float64, torch.int8, torch.bfloat16):
        for count in SIM_COUNTS:
            for root in range(n):
                inputs = [make_input(r, count, dtype) for r in range(n)]
                outputs, errors = _sim("broadcast", inputs, [ReduceOp.SUM] * n, root=root,
                                       repeats=2)
                _ok(errors)
                for r in range(n):
                    check_equal(outputs[r], inputs[root], f"rank {r} root={root} count={count}")


def test_sim_barrier():
    _, errors = _sim("barrier", [torch.empty(0)] * 3, [ReduceOp.SUM] * 3, repeats=3)
    _ok(errors)


def test_sim_pieces_of_one_element():
    """8-byte pieces: a float64 piece per step, partials of half types 2 per piece."""
    for dtype in (torch.float64, torch.float16, torch.int64):
        inputs = [make_input(r, 37, dtype) for r in range(3)]
        outputs, errors = _sim("all_reduce", inputs, [ReduceOp.SUM] * 3, piece_bytes=8)
        _ok(errors)
        for out in outputs:
            check_equal(out, reference_reduce(inputs, ReduceOp.SUM), f"{dtype}")


def test_sim_missing_flush_is_caught():
    """The chain's root ends on a send: without flush() it never goes out."""
    inputs = [torch.arange(100, dtype=torch.float32)] * 3
    _, errors = _sim("broadcast", inputs, [ReduceOp.SUM] * 3, root=1, flush=False,
                     timeout_ms=2000)
    assert any("rank 1 finished broadcast #1 with a send still pending" in e
               for e in errors), errors
    assert all(errors), errors


def test_sim_descriptor_mismatch_fails_on_every_rank():
    def run(kind, inputs, ops, **kw):
        _, errors = _sim(kind, inputs, ops, **kw)
        assert all(errors), errors
        return errors

    x = torch.ones(10)
    # count
    errors = run("all_reduce", [x, torch.ones(11), x], [ReduceOp.SUM] * 3)
    for e in errors:
        assert "collective #1 differs between ranks" in e and "count from 10 to 11" in e, e
    assert "rank 1 called all_reduce(count=11, dtype=float32, op=SUM, algo=ring)" in errors[1]
    # op and dtype
    errors = run("all_reduce", [x, x.double()], [ReduceOp.SUM, ReduceOp.MAX])
    assert all("dtype from float32 to float64" in e and "op from SUM to MAX" in e
               for e in errors), errors
    # a rank one collective ahead (it skipped one)
    errors = run("all_gather", [x, x], [ReduceOp.SUM] * 2, seqs=[4, 5])
    assert all("sequence number from 4 to 5" in e for e in errors), errors
    # agreeing ranks at any sequence number pass
    _, errors = _sim("broadcast", [x, x], [ReduceOp.SUM] * 2, root=1, seqs=[9, 9])
    _ok(errors)
