"""Bucket assignment (pyddp.bucketing), without processes.

Hand-worked cases pin each rule; a randomised comparison checks the whole
assignment against torch's own C++ implementation
(``torch.distributed._compute_bucket_assignment_by_size``) fed the
parameters in reverse registration order, as torch DDP's bucket rebuild does.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from pyddp.bucketing import DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES, assign_buckets

F32, F64, F16 = torch.float32, torch.float64, torch.float16


def _assign(numels, dtypes, cap, first_cap=None):
    return assign_buckets(numels, [d.itemsize for d in dtypes], dtypes, cap,
                          cap if first_cap is None else first_cap)


def _indices(buckets):
    return [list(b) for b in buckets]


def test_reverse_registration_order_in_one_bucket():
    assert _assign([3, 4, 5], [F32] * 3, cap=1 << 20) == [(2, 1, 0)]


def test_a_bucket_closes_once_it_reaches_its_cap():
    # 4-byte elements, cap 40 bytes = 10 elements: 6 + 4 reaches it exactly.
    assert _indices(_assign([1, 4, 6, 2], [F32] * 4, cap=40)) == [[3, 2, 1], [0]]
    assert _indices(_assign([5, 4, 6], [F32] * 3, cap=40)) == [[2, 1], [0]]


def test_a_parameter_larger_than_the_cap_ends_its_bucket_unsplit():
    assert _indices(_assign([2, 100, 3, 1], [F32] * 4, cap=16)) == [[3, 2], [1], [0]]


def test_first_bucket_has_its_own_cap():
    # first cap 8 bytes (2 elements), then 40 bytes (10 elements)
    numels = [5, 5, 5, 5, 1, 1]
    assert _indices(_assign(numels, [F32] * 6, cap=40, first_cap=8)) == [[5, 4], [3, 2], [1, 0]]


def test_dtypes_never_share_a_bucket_and_each_has_a_first_bucket():
    numels = [4, 4, 4, 4, 4, 4]
    dtypes = [F32, F64, F32, F64, F32, F64]
    buckets = _assign(numels, dtypes, cap=64, first_cap=16)
    # f32 (16 bytes each): first cap 16 closes [4], then 64 takes [2, 0].
    # f64 (32 bytes each): first cap closes [5], then [3, 1] reach 64.
    assert _indices(buckets) == [[5], [4], [3, 1], [2, 0]]
    for b in buckets:
        assert len({dtypes[i] for i in b}) == 1


def test_buckets_are_ordered_by_their_first_parameter_in_reversed_order():
    # The f16 bucket closes first, but the f32 one (left open) starts with parameter 4.
    buckets = _assign([1, 400, 1, 400, 1], [F32, F16, F32, F16, F32], cap=1000)
    assert _indices(buckets) == [[4, 2, 0], [3, 1]]


def test_empty_and_bad_input():
    assert assign_buckets([], [], [], 10, 10) == []
    with pytest.raises(ValueError, match="one of each per tensor"):
        assign_buckets([1, 2], [4], [F32, F32], 10, 10)
    with pytest.raises(ValueError, match="caps must be positive"):
        assign_buckets([1], [4], [F32], 0, 10)


def test_defaults_are_torchs():
    assert DEFAULT_FIRST_CAP_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert DEFAULT_CAP_BYTES == 25 * 1024 * 1024


def _torch_reference(numels, dtypes, cap, first_cap, sparse=()):
    """torch's assignment of the reversed tensor list, mapped back to registration indices."""
    n = len(numels)
    reversed_tensors = [torch.empty(numels[i], dtype=dtypes[i]) for i in reversed(range(n))]
    limits = [first_cap, cap] if first_cap != cap else [cap]
    positions, _ = dist._compute_bucket_assignment_by_size(
        reversed_tensors, limits, [sparse[i] for i in reversed(range(n))] if sparse else [])
    return [[n - 1 - p for p in bucket] for bucket in positions]


@pytest.mark.parametrize("seed", range(40))
def test_matches_torch_on_random_models(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    numels = [rng.choice([1, 7, 64, 1000, 4096, 30000]) for _ in range(n)]
    kinds = rng.choice([[F32], [F32, F64], [F32, F16, F64]])
    dtypes = [rng.choice(kinds) for _ in range(n)]
    cap = rng.choice([4, 1000, 50_000, 400_000])
    first_cap = rng.choice([cap, max(1, cap // 8)])
    buckets = _assign(numels, dtypes, cap, first_cap)
    assert _indices(buckets) == _torch_reference(numels, dtypes, cap, first_cap)


@pytest.mark.parametrize("seed", range(20))
def test_sparse_gradients_have_buckets_of_their_own_as_in_torch(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 30)
    numels = [rng.choice([1, 7, 64, 1000, 4096]) for _ in range(n)]
    dtypes = [rng.choice([F32, F64]) for _ in range(n)]
    sparse = [rng.random() < 0.3 for _ in range(n)]
    cap = rng.choice([4, 1000, 50_000])
    buckets = assign_buckets(numels, [d.itemsize for d in dtypes], dtypes, cap, cap, sparse)
    for bucket in buckets:
        assert len(bucket) == 1 or not any(sparse[i] for i in bucket), (bucket, sparse)
    assert _indices(buckets) == _torch_reference(numels, dtypes, cap, cap, sparse)
