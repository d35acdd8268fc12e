"""The algorithm a rank picks by size: small all_gathers and reduce_scatters take the
direct algorithm, larger ones the ring or registered memory. Seen through the
descriptor check, which names the algorithm of each rank when a rank configured to
always take the ring meets one that picks by size.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import pyddp
from harness import RankContext, raises

pytestmark = pytest.mark.multiprocess


def _gather_algo_by_size(ctx: RankContext) -> list:
    """Rank 0 picks the algorithm by size, rank 1 always takes the ring: they
    agree on an all_gather that stages more than direct_max_bytes per rank
    (and less than registered memory's 64 KiB), and differ on a small one; a
    reduce_scatter differs on a small one too, and also on a larger one,
    which may read registered inputs under auto. (expected algo, message)
    for each difference, each on a group of its own."""
    n, r = ctx.world_size, ctx.rank
    # float32 elements: one past direct_max_bytes, below registered memory's 64 KiB
    past_direct = pyddp.GroupOptions().direct_max_bytes // 4 + 1
    assert 4 * past_direct < 64 * 1024, "the all_gather case needs a size between the two"

    def all_gather(pg, k):
        pg.all_gather_single(torch.empty(n * k), torch.ones(k))

    def reduce_scatter(pg, k):
        pg.reduce_scatter_single(torch.empty(k), torch.ones(n * k))

    cases = [("direct", all_gather, 4), ("direct", reduce_scatter, 4),
             ("registered", reduce_scatter, past_direct)]
    messages = []
    for i, (expected, call, count) in enumerate(cases):
        options = pyddp.GroupOptions()
        options.algo = pyddp.Algo.AUTO if r == 0 else pyddp.Algo.RING
        pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path(f"by-size-{i}"), n),
                             rank=r, world_size=n, timeout=datetime.timedelta(seconds=30),
                             options=options)
        ctx.groups[f"by-size-{i}"] = pg
        if call is all_gather:
            call(pg, past_direct)  # the ring on both ranks
        messages.append((expected, raises(dist.DistBackendError, "differs between ranks",
                                          call, pg, count)))
    return messages


def test_small_all_gather_and_reduce_scatter_take_the_direct_algorithm(two):
    for messages in two.run(_gather_algo_by_size):
        for expected, message in messages:
            assert f"algo={expected}" in message and "algo=ring" in message, message
