"""Where ranks' GPUs are, and whether their kernels can run at once (kernelsTakeTurns in
csrc/backend/layout.h), which decides between the fused kernels over cuda_ipc and the same
programs on host threads ("cuda_host"): a table of placements (GPU UUID, MPS serving the
process: 1, 0, or -1 where the driver does not say) against the verdict. No GPU is needed.
"""

from __future__ import annotations

import pytest

from pyddp._C import _testing as t

A, B = "GPU-aaaa", "GPU-bbbb"


@pytest.mark.parametrize("places", [
    [(A, 0)],                       # one rank
    [(A, 0), (B, 0)],               # a GPU each: nothing is shared
    [(A, 1), (A, 1)],               # shared, MPS serves both
    [(A, 1), (A, 1), (B, 0)],       # the unshared GPU needs no MPS
    [(A, -1), (B, -1), (A + "x", 0)],
])
def test_kernels_run_at_once(places):
    assert t.kernels_take_turns(places) == ""


@pytest.mark.parametrize("places, shared, unserved", [
    ([(A, 0), (A, 0)], "ranks 0,1 share GPU GPU-aaaa", "ranks 0, 1"),
    ([(A, 1), (A, 0)], "ranks 0,1 share GPU GPU-aaaa", "rank 1:"),
    ([(B, 1), (A, 1), (A, -1)], "ranks 1,2 share GPU GPU-aaaa",
     "rank 2 (the driver does not say)"),
    ([(A, 1), (B, 0), (A, 1), (B, 1)], "ranks 1,3 share GPU GPU-bbbb", "rank 1:"),
])
def test_a_shared_gpu_without_mps_for_every_rank_on_it_takes_turns(places, shared, unserved):
    why = t.kernels_take_turns(places)
    assert why.startswith(shared), why
    assert f"MPS does not serve {unserved}" in why, why
    assert "take turns" in why, why
