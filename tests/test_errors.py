"""Bad input gets a clear error naming rank and call; nothing hangs.

Covers: collectives before init, wrong devices/sizes/dtypes/ops/roots,
mismatched calls across ranks, a rank that never arrives (timeout), a rank
that dies, a rank that never joins, and shared-memory hygiene throughout.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

import pyddp
from harness import Died, RankContext, Ranks, pyddp_segments

ReduceOp = pyddp.ReduceOp
SHORT = datetime.timedelta(seconds=2)


def _group(ctx: RankContext, name: str, timeout=datetime.timedelta(seconds=30)
           ) -> pyddp.ProcessGroup:
    store = dist.FileStore(ctx.store_path(name), ctx.world_size)
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=timeout)
    ctx.groups[name] = pg
    return pg


def _raises(exc_type, pattern: str, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as error:
        message = str(error)
        assert re.search(pattern, message), f"{message!r} does not match {pattern!r}"
        return message
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__} ({pattern})")


@pytest.fixture(scope="module")
def two():
    pool = Ranks(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def three():
    pool = Ranks(3)
    yield pool
    pool.close()


# --- without processes --------------------------------------------------------


def test_collectives_before_init_raise():
    assert not pyddp.is_initialized()
    for call, args in [(pyddp.all_reduce, (torch.ones(2),)), (pyddp.barrier, ()),
                       (pyddp.broadcast, (torch.ones(2), 0)), (pyddp.get_rank, ())]:
        with pytest.raises(RuntimeError, match="not initialized.*init_process_group"):
            call(*args)


def test_bad_group_arguments():
    with pytest.raises(ValueError, match="backend 'gloo' is not available"):
        pyddp.new_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="timeout"):
        pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(0))
    with pytest.raises(ValueError, match="is not in"):
        pyddp.new_group("shm", store=dist.HashStore(), rank=2, world_size=2)
    options = pyddp.RingOptions()
    options.num_slots = 1
    with pytest.raises(ValueError, match="num_slots"):
        pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1, options=options)
    options = pyddp.RingOptions()
    options.algo, options.direct_max_bytes = pyddp._C.Algo.DIRECT, 0
    with pytest.raises(ValueError, match="algo=direct .* needs direct_max_bytes"):
        options.validate()


def test_bad_settings_in_environment(monkeypatch):
    monkeypatch.setenv("PYDDP_SLOT_BYTES", "100")
    with pytest.raises(ValueError, match="PYDDP_SLOT_BYTES.*multiple of 64"):
        pyddp.RingOptions()
    monkeypatch.setenv("PYDDP_SLOT_BYTES", "lots")
    with pytest.raises(ValueError, match="PYDDP_SLOT_BYTES='lots' is not an integer"):
        pyddp.RingOptions()
    monkeypatch.delenv("PYDDP_SLOT_BYTES")
    monkeypatch.setenv("PYDDP_ALGO", "fastest")
    with pytest.raises(ValueError, match="PYDDP_ALGO='fastest'"):
        pyddp.RingOptions()


def test_rank_that_never_joins_is_named_and_segment_is_private_and_removed():
    path = tempfile.mktemp(prefix="pyddp-join-")
    seen = {}

    def watch():
        deadline = time.time() + 10
        while time.time() < deadline and "mode" not in seen:
            for name in pyddp_segments():
                try:
                    seen["mode"] = stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)
                    seen["name"] = name
                except FileNotFoundError:
                    continue
            time.sleep(0.01)

    before = set(pyddp_segments())
    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        with pytest.raises(dist.DistBackendError, match="rank 1 did not join the process group"):
            pyddp.new_group("shm", store=dist.FileStore(path, 2), rank=0, world_size=2,
                            timeout=SHORT)
    finally:
        watcher.join()
        if os.path.exists(path):
            os.remove(path)
    assert time.monotonic() - start < 15
    assert seen.get("mode") == 0o600, seen
    assert re.fullmatch(r"pyddp-[0-9a-f]{16,}", seen["name"]), seen
    assert set(pyddp_segments()) == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensor_on_shm_backend_is_refused():
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="rank 0: all_reduce: tensor is on cuda"):
            pg.all_reduce(torch.ones(2, device="cuda"))
    finally:
        pg.shutdown()


# --- functions run on every rank --------------------------------------------------


def _bad_inputs(ctx: RankContext) -> None:
    pg = _group(ctx, "bad-inputs")
    n, r = ctx.world_size, ctx.rank
    who = f"rank {r}"
    _raises(TypeError, f"{who}: all_reduce: tensor is on meta.*CPU tensors only",
            pg.all_reduce, torch.ones(2, device="meta"))
    _raises(ValueError, f"{who}: all_gather_single: output has {2 * n + 1} elements, "
            f"expected {2 * n}", pg.all_gather_single, torch.zeros(2 * n + 1), torch.zeros(2))
    _raises(ValueError, f"{who}: reduce_scatter_single: input has 7 elements, expected {3 * n}",
            pg.reduce_scatter_single, torch.zeros(3), torch.zeros(7))
    _raises(ValueError, f"{who}: all_gather: tensor_list has 1 tensors, expected world_size",
            pg.all_gather, [torch.zeros(2)], torch.zeros(2))
    _raises(ValueError, f"{who}: all_gather: tensor_list entry has 3 elements, expected 2",
            pg.all_gather, [torch.zeros(3)] * n, torch.zeros(2))
    _raises(TypeError, f"{who}: all_gather_single: output dtype .* differs",
            pg.all_gather_single, torch.zeros(2 * n, dtype=torch.float64), torch.zeros(2))
    for dtype in (torch.int16, torch.bool, torch.complex64):
        _raises(TypeError, f"{who}: all_reduce: tensor has dtype .*; supported",
                pg.all_reduce, torch.zeros(2, dtype=dtype))
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        _raises(TypeError, f"{who}: all_reduce: .* is not supported", pg.all_reduce,
                torch.zeros(2), op)
    _raises(TypeError, f"{who}: all_reduce: ReduceOp.AVG needs a floating-point tensor",
            pg.all_reduce, torch.zeros(2, dtype=torch.int32), ReduceOp.AVG)
    _raises(TypeError, f"{who}: reduce_scatter_single: ReduceOp.AVG needs a floating",
            pg.reduce_scatter_single, torch.zeros(1, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64), ReduceOp.AVG)
    for src in (-1, n):
        _raises(ValueError, f"{who}: broadcast: src={src} is not a rank of this group",
                pg.broadcast, torch.zeros(2), src)
    _raises(TypeError, f"{who}: all_reduce: tensor must be a torch.Tensor", pg.all_reduce,
            [1.0, 2.0])
    _raises(TypeError, f"{who}: broadcast: src must be an int", pg.broadcast, torch.zeros(1), "0")
    # None of the refused calls reached the peers: the group still works.
    t = torch.ones(3)
    pg.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))


def _mismatch_count(ctx: RankContext) -> str:
    pg = _group(ctx, "mismatch-count")
    message = _raises(dist.DistBackendError, "collective #1 differs between ranks",
                      pg.all_reduce, torch.ones(4 + ctx.rank))
    # The failure left the group unusable, and later calls say so at once.
    _raises(dist.DistBackendError, "earlier collective failed", pg.barrier)
    return message


def _mismatch_kind(ctx: RankContext) -> str:
    pg = _group(ctx, "mismatch-kind")
    if ctx.rank == 0:
        return _raises(dist.DistBackendError, "differs between ranks", pg.broadcast,
                       torch.ones(4), 0)
    return _raises(dist.DistBackendError, "differs between ranks", pg.all_reduce, torch.ones(4))


def _absent_rank(ctx: RankContext) -> tuple:
    pg = _group(ctx, "absent", timeout=SHORT)
    if ctx.rank == ctx.world_size - 1:
        return None, 0.0  # never calls the collective
    start = time.monotonic()
    work = pg.all_reduce(torch.ones(10), async_op=True)
    message = _raises(dist.DistBackendError, "did not arrive", work.wait)
    elapsed = time.monotonic() - start
    assert isinstance(work.exception(), dist.DistBackendError)
    assert work.is_completed()
    return message, elapsed


def _wait_for_dead_peer(ctx: RankContext) -> tuple:
    pg = _group(ctx, "dead", timeout=datetime.timedelta(seconds=60))
    start = time.monotonic()
    message = _raises(dist.DistBackendError, "exited", pg.all_reduce, torch.ones(100_000))
    return message, time.monotonic() - start


def _die(ctx: RankContext) -> None:
    _group(ctx, "dead", timeout=datetime.timedelta(seconds=60))
    time.sleep(0.5)
    os._exit(3)


# --- tests with processes -----------------------------------------------------------


def test_bad_inputs_raise_clear_errors_and_leave_group_usable(two):
    two.run(_bad_inputs)


def test_mismatched_calls_fail_on_every_rank(two):
    messages = two.run(_mismatch_count)
    for m in messages:
        assert "all_reduce(count=4" in m and "all_reduce(count=5" in m, m
    messages = two.run(_mismatch_kind)
    for m in messages:
        assert "broadcast(count=4" in m and "all_reduce(count=4" in m, m


def test_absent_rank_is_named_within_the_timeout(three):
    results = three.run(_absent_rank)
    for message, elapsed in results[:2]:
        assert "rank 2 did not arrive at all_reduce #1 within the timeout of 2000 ms" in message
        assert SHORT.total_seconds() <= elapsed < SHORT.total_seconds() + 10, elapsed


def test_dead_rank_is_named_quickly():
    pool = Ranks(2)
    try:
        (message, elapsed), died = pool.run_each([_wait_for_dead_peer, _die], allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 3
        assert f"rank 1 (pid {pool.pid(1)}) exited" in message, message
        assert elapsed < 20, elapsed
    finally:
        pool.close()
