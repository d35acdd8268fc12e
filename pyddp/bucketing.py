"""Gradient bucket assignment: which parameters are all-reduced together.

Pure functions over sizes and keys (no tensors, no processes), so the rules
can be unit tested on their own. ``DistributedDataParallel`` calls
``assign_buckets`` once at construction.

The rules are torch DDP's (``torch.distributed._compute_bucket_assignment_by_size``
followed by the reversal in ``DistributedDataParallel._ddp_init_helper``):

- Parameters are taken in reverse registration order, the usual order in which
  backward produces their gradients.
- A bucket holds parameters of one key (dtype and device) only; each key fills
  its own bucket.
- A bucket is closed as soon as it holds at least its cap, so a parameter
  larger than the cap ends a bucket rather than being split. The first bucket
  of each key has ``first_cap`` (torch uses 1 MiB so the last layers' gradients
  start moving early), the later ones ``cap``.
- A parameter whose gradient is sparse (``nn.Embedding``/``EmbeddingBag`` with
  ``sparse=True``) has a bucket of its own: a sparse gradient is all-reduced
  on its own, never packed.
- Buckets are ordered by their first parameter in the reversed order: the
  order in which they become ready, and the order they are all-reduced in.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Sequence, Tuple

DEFAULT_CAP_BYTES = 25 * 1024 * 1024
"""torch DDP's default ``bucket_cap_mb`` (25 MiB)."""

DEFAULT_FIRST_CAP_BYTES = 1024 * 1024
"""torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: the first bucket's cap under the default cap."""


def assign_buckets(numels: Sequence[int], element_sizes: Sequence[int], keys: Sequence[Hashable],
                   cap_bytes: int, first_cap_bytes: int,
                   sparse: Sequence[bool] = ()) -> List[Tuple[int, ...]]:
    """Buckets for tensors given in registration order, in the order they are reduced.

    ``numels[i]``, ``element_sizes[i]`` and ``keys[i]`` describe tensor ``i``;
    tensors with different keys never share a bucket, and a tensor with
    ``sparse[i]`` (empty: none) is a bucket alone. Each bucket is a tuple of
    tensor indices in reverse registration order; every index appears exactly
    once.
    """
    if not len(numels) == len(element_sizes) == len(keys):
        raise ValueError(f"assign_buckets: {len(numels)} numels, {len(element_sizes)} element "
                         f"sizes and {len(keys)} keys; expected one of each per tensor")
    if sparse and len(sparse) != len(numels):
        raise ValueError(f"assign_buckets: {len(sparse)} sparse flags for {len(numels)} "
                         "tensors; expected one per tensor, or none")
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"assign_buckets: caps must be positive, got cap_bytes={cap_bytes}, "
                         f"first_cap_bytes={first_cap_bytes}")
    closed: List[List[int]] = []
    open_buckets: Dict[Hashable, List[int]] = {}
    open_bytes: Dict[Hashable, int] = {}
    closed_per_key: Dict[Hashable, int] = {}
    for index in reversed(range(len(numels))):
        if sparse and sparse[index]:
            closed.append([index])
            continue
        key = keys[index]
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + numels[index] * element_sizes[index]
        limit = first_cap_bytes if closed_per_key.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            closed.append(bucket)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            open_buckets[key] = []
            open_bytes[key] = 0
    closed.extend(bucket for bucket in open_buckets.values() if bucket)
    # bucket[0] is the bucket's largest index, i.e. its first in reversed order.
    closed.sort(key=lambda bucket: -bucket[0])
    return [tuple(bucket) for bucket in closed]
