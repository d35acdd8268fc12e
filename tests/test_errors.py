"""Bad input gets a clear error naming rank and call; nothing hangs.

Covers: collectives before init, wrong devices/sizes/dtypes/ops/roots,
mismatched calls across ranks, a rank that never arrives (timeout), a rank
that dies, a rank that never joins, and shared-memory hygiene throughout.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import re
import signal
import tempfile
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import pyddp
from collective_cases import check_equal
from harness import Died, RankContext, Ranks, pyddp_segments, raises

ReduceOp = pyddp.ReduceOp
SHORT = datetime.timedelta(seconds=2)


def _group(ctx: RankContext, name: str, timeout=datetime.timedelta(seconds=30)
           ) -> pyddp.ProcessGroup:
    store = dist.FileStore(ctx.store_path(name), ctx.world_size)
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=timeout)
    ctx.groups[name] = pg
    return pg


def _ring_group(ctx: RankContext, name: str, timeout: datetime.timedelta) -> pyddp.ProcessGroup:
    """A group that always uses the ring; each rank may pass its own timeout."""
    options = pyddp.RingOptions()
    options.algo = pyddp.Algo.RING
    pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path(name), ctx.world_size),
                         rank=ctx.rank, world_size=ctx.world_size, timeout=timeout,
                         options=options)
    ctx.groups[name] = pg
    return pg


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
    options.algo, options.direct_max_bytes = pyddp.Algo.DIRECT, 0
    with pytest.raises(ValueError, match="algo=direct .* needs direct_max_bytes"):
        options.validate()
    options = pyddp.RingOptions()
    options.algo, options.direct_max_bytes = pyddp.Algo.TWO_SHOT, 0
    with pytest.raises(ValueError, match="algo=two_shot .* needs direct_max_bytes"):
        options.validate()
    # A subgroup by ranks is made from the default group, which does not exist here.
    with pytest.raises(RuntimeError, match="new_group: the default process group is not "
                                           "initialized"):
        pyddp.new_group([0, 1])


@pytest.mark.skipif(pyddp._C.has_cuda, reason="checks a CPU-only build")
def test_gpu_backends_are_refused_by_a_cpu_build():
    for backend in ("cuda_ipc", "nccl"):
        with pytest.raises(ValueError, match=f"backend '{backend}' is not available"):
            pyddp.new_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(TypeError, match="built without CUDA"):
        pyddp._C.make_engine(dist.HashStore(), 0, 1, pyddp.RingOptions(), torch.device("cuda", 0),
                             "auto")


@pytest.mark.skipif(not pyddp._C.has_cuda or torch.cuda.is_available(),
                    reason="checks a CUDA build on a machine without a GPU")
def test_gpu_backends_without_a_gpu_fail_clearly():
    for backend in ("cuda_ipc", "nccl"):
        with pytest.raises(RuntimeError, match=f"backend '{backend}' needs a CUDA device"):
            pyddp.new_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def test_rank_that_never_joins_is_named_and_nothing_is_left():
    path = tempfile.mktemp(prefix="pyddp-join-")
    before = set(pyddp_segments())
    start = time.monotonic()
    try:
        with pytest.raises(dist.DistBackendError, match="rank 1 did not join the process group"):
            pyddp.new_group("shm", store=dist.FileStore(path, 2), rank=0, world_size=2,
                            timeout=SHORT)
    finally:
        if os.path.exists(path):
            os.remove(path)
    assert time.monotonic() - start < 15
    assert set(pyddp_segments()) == before


def test_segments_are_private_unguessable_and_removed():
    before = set(pyddp_segments())
    names = set()
    for _ in range(3):
        name, mode = pyddp._C._testing.probe_shm_segment()
        assert mode == 0o600, oct(mode)
        assert re.fullmatch(r"/pyddp-[0-9a-f]{16,}", name), name
        names.add(name)
    assert len(names) == 3
    assert set(pyddp_segments()) == before


def _join_alone_then_get_killed(path: str) -> None:
    pyddp.new_group("shm", store=dist.FileStore(path, 2), rank=0, world_size=2,
                    timeout=datetime.timedelta(seconds=60))


def test_rank_killed_while_waiting_for_peers_leaves_no_segment():
    path = tempfile.mktemp(prefix="pyddp-kill-")
    before = set(pyddp_segments())
    proc = mp.get_context("spawn").Process(target=_join_alone_then_get_killed, args=(path,))
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # inside new_group, waiting for rank 1
        proc.kill()
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if os.path.exists(path):
            os.remove(path)
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


def test_the_direct_entries_pass_on_what_they_do_not_take_and_outlive_their_group():
    """The CPU engine's direct entries (what ProcessGroup's synchronous small-message
    calls go through) run the calls whose arguments they take, by position or keyword,
    defaults left out, and pass every other call, as it was given, to the general path:
    an asynchronous one, not a CPU tensor, an op that is not one of the members they were
    given, a src that is not an int rank of the group, arguments that do not fit the
    signature. A group destroyed under them refuses their calls."""
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    ops = [(ReduceOp.SUM, pyddp._C.RedOp.SUM), (ReduceOp.MAX, pyddp._C.RedOp.MAX)]
    passed_on = []

    def general(name):
        def call(*args, **kwargs):
            passed_on.append((name, args, kwargs))
            return "general"
        return call
    names = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "barrier")
    now = pg._cpu_engine.direct_entries(ops, {name: general(name) for name in names})
    t = torch.arange(4.0)
    passed = [("all_reduce", (), {}), ("all_reduce", (t, ReduceOp.SUM, False, 1), {}),
              ("all_reduce", (t,), {"opp": ReduceOp.SUM}), ("all_reduce", (t,), {"tensor": t}),
              ("all_reduce", (t, ReduceOp.SUM, True), {}), ("all_reduce", (t,), {"async_op": 1}),
              ("all_reduce", (t,), {"async_op": None}), ("barrier", (t,), {}),
              ("barrier", (), {"async_op": True}), ("all_reduce", ([1.0],), {}),
              ("all_reduce", (t.to("meta"),), {}), ("all_reduce", (t, ReduceOp.AVG), {}),
              ("all_reduce", (t, 0), {}), ("all_reduce", (t,), {"op": int(pyddp._C.RedOp.SUM)}),
              ("all_gather_single", (t, [1.0]), {}), ("all_gather_single", (t,), {}),
              ("reduce_scatter_single", (t, t, "max"), {}),
              ("reduce_scatter_single", (t,), {"input": t, "async_op": True}),
              ("broadcast", (t, "0"), {}), ("broadcast", (t, False), {}),
              ("broadcast", (t,), {"src": 2 ** 70}), ("broadcast", (t, 0.0), {}),
              ("broadcast", (t,), {})]
    for name, args, kwargs in passed:
        assert now[name](*args, **kwargs) == "general", (name, args, kwargs)
        assert passed_on.pop() == (name, args, kwargs) and not passed_on
    # An int that is no rank of the group is the engine's to refuse, as on every path.
    for src in (1, -1, 2 ** 40):
        with pytest.raises(ValueError, match=f"broadcast: src={src} is not a rank of this group"):
            now["broadcast"](t, src)
    assert not passed_on
    torch.testing.assert_close(t, torch.arange(4.0), rtol=0, atol=0)
    # None of those reached the group: its collectives run, here through the entries.
    out = torch.empty(4)
    assert now["all_gather_single"](out, t) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert now["reduce_scatter_single"](output=out, input=t * 2, op=ReduceOp.MAX) is None
    torch.testing.assert_close(out, t * 2, rtol=0, atol=0)
    assert now["all_gather_single"](out, input=t, async_op=False) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert now["broadcast"](out, src=0) is None and now["all_reduce"](out) is None
    assert now["all_reduce"](tensor=out, op=ReduceOp.MAX) is None and now["barrier"](False) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert not passed_on
    pg.shutdown()
    del pg
    with pytest.raises(RuntimeError, match="barrier on a process group that was destroyed"):
        now["barrier"]()


def test_a_group_answers_through_its_direct_entries_as_through_its_methods(monkeypatch):
    """ProcessGroup sets the direct entries on the group under its methods' names: the
    calls they do not run reach the methods (an asynchronous call returns a Work, a
    misuse raises the method's error); a subclass's own method, a patched method and the
    barrier of a group that serves CUDA tensors too are left in place; and the entries,
    which pass calls on through a weak reference, do not keep the group alive: a group
    dropped is freed at once, and an entry kept apart from it then fails."""
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.arange(4.0)
    assert vars(pg)["all_reduce"] is pg.all_reduce and pg.all_reduce(t, async_op=False) is None
    work = pg.all_reduce(t, ReduceOp.MAX, async_op=True)
    assert isinstance(work, pyddp.Work) and work.wait()
    out = torch.empty(4)
    assert pg.all_gather_into_tensor(out, t) is None and pg.reduce_scatter_tensor(out, t) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"all_reduce\(\) got an unexpected keyword"):
        pg.all_reduce(t, opp=ReduceOp.SUM)
    with pytest.raises(ValueError, match="rank 0: broadcast: src=1 is not a rank of this group"):
        pg.broadcast(t, 1)
    entries = weakref.ref(pg.barrier)
    group = weakref.ref(pg)
    kept = pg.all_reduce
    del pg
    assert group() is None and entries() is None  # freed without the cycle collector
    with pytest.raises(RuntimeError, match="rank 0: all_reduce on a process group that was "
                       "destroyed"):
        kept(t, async_op=True)
    with pytest.raises(RuntimeError, match="all_reduce on a process group that was destroyed"):
        kept(t)

    calls = []

    class Counting(pyddp.ProcessGroup):
        def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
            calls.append(op)
            return super().all_reduce(tensor, op, async_op)
    mine = Counting("shm", dist.HashStore(), "counting", 0, 1, datetime.timedelta(seconds=30),
                    pyddp.RingOptions())
    try:
        assert "all_reduce" not in vars(mine) and "barrier" in vars(mine)
        assert mine.all_reduce(t, ReduceOp.MAX) is None and calls == [ReduceOp.MAX]
    finally:
        mine.shutdown()

    def patched(group, *args, **kwargs):
        calls.append("patched")
    monkeypatch.setattr(pyddp.ProcessGroup, "broadcast", patched)
    monkeypatch.setattr(pyddp._C, "device_types_of", lambda backend: ["cpu", "cuda"])
    both = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert "barrier" not in vars(both) and "all_reduce" in vars(both)
        assert both.barrier() is None and both.broadcast(t, 0) is None
        assert calls[-1] == "patched"
    finally:
        both.shutdown()


# --- functions run on every rank --------------------------------------------------


def _bad_inputs(ctx: RankContext) -> None:
    pg = _group(ctx, "bad-inputs")
    n, r = ctx.world_size, ctx.rank
    who = f"rank {r}"
    raises(TypeError, f"{who}: all_reduce: tensor is on meta; .* serves cpu tensors",
            pg.all_reduce, torch.ones(2, device="meta"))
    raises(ValueError, f"{who}: all_gather_single: output has {2 * n + 1} elements, "
            f"expected {2 * n}", pg.all_gather_single, torch.zeros(2 * n + 1), torch.zeros(2))
    raises(ValueError, f"{who}: reduce_scatter_single: input has 7 elements, expected {3 * n}",
            pg.reduce_scatter_single, torch.zeros(3), torch.zeros(7))
    raises(ValueError, f"{who}: all_gather: tensor_list has 1 tensors, expected world_size",
            pg.all_gather, [torch.zeros(2)], torch.zeros(2))
    raises(ValueError, f"{who}: all_gather: tensor_list entry has 3 elements, expected 2",
            pg.all_gather, [torch.zeros(3)] * n, torch.zeros(2))
    raises(TypeError, f"{who}: all_gather_single: output dtype .* differs",
            pg.all_gather_single, torch.zeros(2 * n, dtype=torch.float64), torch.zeros(2))
    for dtype in (torch.int16, torch.bool, torch.complex64):
        raises(TypeError, f"{who}: all_reduce: tensor has dtype .*; supported",
                pg.all_reduce, torch.zeros(2, dtype=dtype))
    raises(TypeError, f"{who}: all_reduce: .*PREMUL_SUM is not supported", pg.all_reduce,
            torch.zeros(2), ReduceOp.PREMUL_SUM)
    for op, name in ((ReduceOp.BAND, "BAND"), (ReduceOp.BOR, "BOR"), (ReduceOp.BXOR, "BXOR")):
        raises(TypeError, f"{who}: all_reduce: ReduceOp.{name} needs an integer tensor "
                r"\(int8, uint8, int32, int64\), got float32", pg.all_reduce, torch.zeros(2), op)
    raises(TypeError, f"{who}: all_reduce: ReduceOp.AVG needs a floating-point tensor",
            pg.all_reduce, torch.zeros(2, dtype=torch.int32), ReduceOp.AVG)
    raises(TypeError, f"{who}: reduce_scatter_single: ReduceOp.AVG needs a floating",
            pg.reduce_scatter_single, torch.zeros(1, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64), ReduceOp.AVG)
    for src in (-1, n):
        raises(ValueError, f"{who}: broadcast: src={src} is not a rank of this group",
                pg.broadcast, torch.zeros(2), src)
    raises(TypeError, f"{who}: all_reduce: tensor must be a torch.Tensor", pg.all_reduce,
            [1.0, 2.0])
    raises(TypeError, f"{who}: broadcast: tensor must be a torch.Tensor", pg.broadcast, 1.0, 0)
    raises(TypeError, f"{who}: all_gather_single: input must be a torch.Tensor",
            pg.all_gather_single, torch.zeros(2 * n), [0.0, 0.0])
    raises(TypeError, f"{who}: reduce_scatter_single: input must be a torch.Tensor",
            pg.reduce_scatter_single, torch.zeros(1), None)
    for call, args in (("broadcast", (torch.ones(2, device="meta"), 0)),
                       ("all_gather_single", (torch.zeros(2 * n), torch.ones(2, device="meta"))),
                       ("reduce_scatter_single", (torch.zeros(1),
                                                  torch.ones(n, device="meta")))):
        raises(TypeError, f"{who}: {call}: (tensor|input) is on meta", getattr(pg, call), *args)
    raises(TypeError, f"{who}: broadcast: src must be an int", pg.broadcast, torch.zeros(1), "0")
    # None of the refused calls reached the peers: the group still works, and
    # takes a ReduceOp instance (not a member) on the small-message calls too.
    t = torch.ones(3)
    pg.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    out = torch.zeros(1)
    pg.reduce_scatter_single(out, torch.arange(float(n)) + r, ReduceOp(ReduceOp.MAX))
    assert out.item() == r + n - 1


def _mismatch_count(ctx: RankContext) -> str:
    pg = _group(ctx, "mismatch-count")
    message = raises(dist.DistBackendError, "collective #1 differs between ranks",
                      pg.all_reduce, torch.ones(4 + ctx.rank))
    # The failure left the group unusable, and later calls say so at once.
    raises(dist.DistBackendError, "earlier collective failed", pg.barrier)
    return message


def _mismatch_kind(ctx: RankContext) -> str:
    pg = _group(ctx, "mismatch-kind")
    if ctx.rank == 0:
        return raises(dist.DistBackendError, "differs between ranks", pg.broadcast,
                       torch.ones(4), 0)
    return raises(dist.DistBackendError, "differs between ranks", pg.all_reduce, torch.ones(4))


def _absent_rank(ctx: RankContext) -> tuple:
    pg = _group(ctx, "absent", timeout=SHORT)
    if ctx.rank == ctx.world_size - 1:
        return None, 0.0  # never calls the collective
    start = time.monotonic()
    work = pg.all_reduce(torch.ones(10), async_op=True)
    message = raises(dist.DistBackendError, "did not arrive", work.wait)
    elapsed = time.monotonic() - start
    assert isinstance(work.exception(), dist.DistBackendError)
    assert work.is_completed()
    return message, elapsed


def _wait_for_dead_peer(ctx: RankContext) -> tuple:
    pg = _group(ctx, "dead", timeout=datetime.timedelta(seconds=60))
    start = time.monotonic()
    message = raises(dist.DistBackendError, "exited", pg.all_reduce, torch.ones(100_000))
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


def _mismatch_fields(ctx: RankContext) -> list:
    """One mismatch per descriptor field; each on a fresh group (a mismatch breaks it)."""
    n, r = ctx.world_size, ctx.rank
    calls = [
        ("dtype", lambda pg: pg.all_reduce(torch.ones(4, dtype=torch.float32 if r else
                                                       torch.float64))),
        ("op", lambda pg: pg.all_reduce(torch.ones(4), ReduceOp.MAX if r else ReduceOp.SUM)),
        ("root", lambda pg: pg.broadcast(torch.ones(4), r)),
    ]
    messages = []
    for field, call in calls:
        pg = _group(ctx, f"mismatch-{field}")
        messages.append(raises(dist.DistBackendError, "differs between ranks", call, pg))
    # The algorithm is part of the call too: ranks configured differently
    # (PYDDP_ALGO) must not run different algorithms against each other.
    options = pyddp.RingOptions()
    options.algo = pyddp.Algo.DIRECT if r == 0 else pyddp.Algo.RING
    pg = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("mismatch-algo"), n),
                         rank=r, world_size=n, timeout=datetime.timedelta(seconds=30),
                         options=options)
    ctx.groups["mismatch-algo"] = pg
    messages.append(raises(dist.DistBackendError, "differs between ranks", pg.all_reduce,
                            torch.ones(4)))
    return messages


def _gather_algo_by_size(ctx: RankContext) -> list:
    """Rank 0 picks the algorithm by size, rank 1 always takes the ring: they
    agree on an all_gather that stages more than direct_max_bytes per rank
    (and less than registered memory's 64 KiB), and differ on a small one; a
    reduce_scatter differs on a small one too, and also on a larger one,
    which may read registered inputs under auto. (expected algo, message)
    for each difference, each on a group of its own."""
    n, r = ctx.world_size, ctx.rank
    # float32 elements: one past direct_max_bytes, below registered memory's 64 KiB
    past_direct = pyddp.RingOptions().direct_max_bytes // 4 + 1
    assert 4 * past_direct < 64 * 1024, "the all_gather case needs a size between the two"

    def all_gather(pg, k):
        pg.all_gather_single(torch.empty(n * k), torch.ones(k))

    def reduce_scatter(pg, k):
        pg.reduce_scatter_single(torch.empty(k), torch.ones(n * k))

    cases = [("direct", all_gather, 4), ("direct", reduce_scatter, 4),
             ("registered", reduce_scatter, past_direct)]
    messages = []
    for i, (expected, call, count) in enumerate(cases):
        options = pyddp.RingOptions()
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


def _mismatched_geometry(ctx: RankContext) -> str:
    options = pyddp.RingOptions()
    options.slot_bytes = 128 * (ctx.rank + 1)
    return raises(ValueError, "use different shm geometry", pyddp.new_group, "shm",
                   store=dist.FileStore(ctx.store_path("geometry"), ctx.world_size),
                   rank=ctx.rank, world_size=ctx.world_size,
                   timeout=datetime.timedelta(seconds=30), options=options)


def _overlapping_output(ctx: RankContext) -> None:
    pg = _group(ctx, "overlap")
    raises(ValueError, f"rank {ctx.rank}: all_reduce: tensor has elements that share memory",
            pg.all_reduce, torch.ones(1).expand(4))
    raises(ValueError, "broadcast: tensor has elements that share memory", pg.broadcast,
            torch.ones(1).expand(4), 0)
    n, r, k = ctx.world_size, ctx.rank, 4
    whole = torch.ones(n * k + 1)
    # shifted by one element from a block of the world-sized tensor
    raises(ValueError, f"reduce_scatter_single: output overlaps input other than as one of its "
           f"blocks \\(in place, it is block {r}: elements {r * k} to {(r + 1) * k}\\)",
           pg.reduce_scatter_single, whole[r * k + 1:(r + 1) * k + 1], whole[:n * k])
    raises(ValueError, "all_gather_single: input overlaps output other than as one of its "
           "blocks", pg.all_gather_single, whole[:n * k], whole[1:k + 1])
    blocks = list(whole[:n * k].split(k))
    raises(ValueError, f"all_gather: tensor_list entry {r} overlaps the input other than as "
           "the whole input", pg.all_gather, blocks, whole[r * k + 1:(r + 1) * k + 1])
    t = torch.ones(4)
    pg.all_reduce(t)  # refused calls never reached the peers
    assert torch.equal(t, torch.full((4,), float(ctx.world_size)))


def _gil_released_while_waiting(ctx: RankContext) -> int:
    pg = _group(ctx, "gil")
    if ctx.rank == 1:
        time.sleep(1.0)
        pg.all_reduce(torch.ones(4))
        return 0
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    pg.all_reduce(torch.ones(4))  # blocks about a second for rank 1
    stop.set()
    thread.join()
    return ticks[0]


def _small_calls_after_dropped_works(ctx: RankContext) -> None:
    # A small synchronous call keeps the GIL while it spins; the worker may
    # be dropping the previous job, whose tensor then takes the GIL, with
    # the queue locked. Each round: an async all_reduce whose Work nobody
    # keeps, then a synchronous one right behind it.
    pg = _group(ctx, "dropped")
    queued = torch.full((4096,), float(ctx.rank))
    for i in range(300):
        pg.all_reduce(queued, op=pyddp.ReduceOp.MAX, async_op=True)
        small = torch.ones(4)
        pg.all_reduce(small)
        assert torch.equal(small, torch.full((4,), 2.0)), (i, small)
    pg.barrier()
    assert torch.equal(queued, torch.full((4096,), 1.0))


def _wait_with_timeout(ctx: RankContext) -> None:
    pg = _group(ctx, "wait-timeout")
    if ctx.rank == 1:
        time.sleep(1.5)
    work = pg.all_reduce(torch.ones(4), async_op=True)
    if ctx.rank == 0:
        raises(dist.DistBackendError, "rank 0: all_reduce #1 did not complete within the 100 ms "
                "given to Work.wait", work.wait, datetime.timedelta(milliseconds=100))
    assert work.wait(datetime.timedelta(seconds=30))
    assert work.get_future().value()[0].tolist() == [2.0] * 4


def _destroy_with_pending_work(ctx: RankContext) -> tuple:
    pg = _group(ctx, "destroy", timeout=datetime.timedelta(seconds=60))
    if ctx.rank == 1:
        return None, 0.0  # never joins these collectives
    running = pg.all_reduce(torch.ones(100), async_op=True)
    queued = pg.all_reduce(torch.ones(100), async_op=True)
    time.sleep(0.3)
    start = time.monotonic()
    pg.shutdown()
    elapsed = time.monotonic() - start
    first = raises(dist.DistBackendError, "destroyed while all_reduce #1 waited", running.wait)
    raises(dist.DistBackendError, "destroyed before this all_reduce ran", queued.wait)
    raises(RuntimeError, "destroyed", pg.all_reduce, torch.ones(1))
    return first, elapsed


def _give_up_travels(ctx: RankContext, count: int) -> tuple:
    # Rank 1 waits 2 s for rank 0, gives up, and says so; rank 0 arrives
    # later with a 60 s timeout and must fail at once, naming rank 1's reason.
    # 100_000 elements take the ring; 4 the direct algorithm in one round,
    # whose arrival carries the staged data: rank 0 finds rank 1's share
    # there and must still fail.
    timeout = datetime.timedelta(seconds=60 if ctx.rank == 0 else 2)
    pg = _ring_group(ctx, f"give-up-{count}", timeout) if count > 4 else _group(
        ctx, f"give-up-{count}", timeout)
    if ctx.rank == 0:
        time.sleep(4.0)
    start = time.monotonic()
    message = raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(count))
    return message, time.monotonic() - start


def _finish_then_leave(ctx: RankContext) -> str:
    # Rank 1 arrives first at a one-round all_reduce (its share staged with
    # its arrival) and is stopped there; rank 0 arrives, finishes and
    # destroys its group; rank 1, resumed, finds rank 0's share and that rank
    # 0 left: the collective rank 0 finished is no reason to fail, the next is.
    pg = _group(ctx, "finish-leave")
    t = torch.full((4,), float(ctx.rank + 1))
    if ctx.rank == 0:
        time.sleep(1.0)
        pg.all_reduce(t)
        pg.shutdown()
        assert torch.equal(t, torch.full((4,), 3.0)), t
        return ""
    work = pg.all_reduce(t, async_op=True)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)  # the test's timer sends SIGCONT
    work.wait()
    assert torch.equal(t, torch.full((4,), 3.0)), t
    return raises(dist.DistBackendError, ".", pg.all_reduce, t)


def _with_rank_1_resumed(after: float, fn) -> list:
    """fn's results on 2 fresh ranks; rank 1 may stop itself (SIGSTOP) and is
    resumed `after` seconds from the start."""
    pool = Ranks(2)
    resume = threading.Timer(after, os.kill, args=(pool.pid(1), signal.SIGCONT))
    resume.start()
    try:
        return pool.run(fn)
    finally:
        resume.cancel()
        os.kill(pool.pid(1), signal.SIGCONT)
        pool.close()


def test_a_rank_that_finished_and_left_fails_its_peers_only_after():
    _, message1 = _with_rank_1_resumed(3.0, _finish_then_leave)
    assert ("rank 0 gave up on collective #2 while rank 1 waited for it in all_reduce #2: "
            "rank 0 destroyed its process group") in message1, message1


def test_every_descriptor_field_is_checked(two):
    for messages in two.run(_mismatch_fields):
        dtype, op, root, algo = messages
        assert "dtype=float64" in dtype and "dtype=float32" in dtype, dtype
        assert "op=SUM" in op and "op=MAX" in op, op
        assert "src=0" in root and "src=1" in root, root
        assert "algo=direct" in algo and "algo=ring" in algo, algo


def test_small_all_gather_and_reduce_scatter_take_the_direct_algorithm(two):
    for messages in two.run(_gather_algo_by_size):
        for expected, message in messages:
            assert f"algo={expected}" in message and "algo=ring" in message, message


def test_ranks_with_different_geometry_refuse_to_connect(two):
    for message in two.run(_mismatched_geometry):
        assert "slot_bytes 128 vs 256" in message or "slot_bytes 256 vs 128" in message, message


def test_outputs_that_overlap_themselves_or_their_inputs_are_refused(two):
    two.run(_overlapping_output)


def test_blocking_collective_releases_the_gil(two):
    ticks, _ = two.run(_gil_released_while_waiting)
    assert ticks > 1000, ticks


def test_small_synchronous_calls_behind_dropped_works_do_not_deadlock(two):
    two.run(_small_calls_after_dropped_works)


def test_work_wait_timeout_names_the_call(two):
    two.run(_wait_with_timeout)


def test_destroy_fails_running_and_queued_work_quickly(two):
    (message, elapsed), _ = two.run(_destroy_with_pending_work)
    assert elapsed < 5, elapsed


@pytest.mark.parametrize("count", [100_000, 4], ids=["ring", "direct-one-round"])
def test_a_rank_that_gives_up_fails_its_peers_at_once(two, count):
    (message0, elapsed0), (message1, _) = two.run(_give_up_travels, count)
    assert "rank 0 did not arrive at all_reduce #1" in message1, message1
    assert "rank 1 gave up on collective #1" in message0, message0
    assert "rank 0 did not arrive" in message0, message0
    assert elapsed0 < 10, elapsed0


def _broadcast_then_exit(ctx: RankContext) -> None:
    pg = _group(ctx, "leave-early")
    pg.broadcast(torch.arange(4_000_000, dtype=torch.float32), 0)
    os._exit(0)  # done with its part; the others may still be copying


def _receive_broadcast(ctx: RankContext) -> bool:
    pg = _group(ctx, "leave-early")
    t = torch.zeros(4_000_000)
    pg.broadcast(t, 0)
    return bool(torch.equal(t, torch.arange(4_000_000, dtype=torch.float32)))


def test_a_rank_that_finished_and_exited_is_not_blamed():
    pool = Ranks(3)
    try:
        died, ok1, ok2 = pool.run_each([_broadcast_then_exit, _receive_broadcast,
                                        _receive_broadcast], allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 0
        assert ok1 and ok2
    finally:
        pool.close()


def _subgroups_that_disagree(ctx: RankContext) -> list:
    parent = _group(ctx, "parent")
    r = ctx.rank
    messages = []
    # Rank 2 asks for another group than ranks 0 and 1 (as it does when it
    # skipped their new_group([0, 1]) and calls the next one); then each
    # rank asks for another pair.
    for asked in ([[0, 1], [0, 1], [0, 1, 2]], [[0, 1], [1, 2], [0, 2]]):
        messages.append(raises(dist.DistBackendError, "the ranks disagree on the group",
                               pyddp.new_group, asked[r], group=parent))
    # The parent and the groups its ranks agree on work as before.
    sub = pyddp.new_group([0, 2], group=parent)
    if r == 1:
        assert isinstance(sub, pyddp.NonMemberGroup)
    else:
        t = torch.full((2,), float(r + 1))
        sub.all_reduce(t)
        check_equal(t, torch.full((2,), 4.0), "all_reduce in the subgroup agreed on")
        sub.shutdown()
    t = torch.full((3,), float(r))
    parent.all_reduce(t)
    check_equal(t, torch.full((3,), 3.0), "all_reduce in the parent")
    # A rank that never calls new_group is named at the timeout.
    if r < 2:
        messages.append(raises(dist.DistBackendError, "did not call", pyddp.new_group, [0, 1],
                               timeout=SHORT, group=parent))
    return messages


def test_ranks_that_disagree_on_a_subgroup_all_fail_naming_every_request(three):
    results = three.run(_subgroups_that_disagree)
    for r, messages in enumerate(results):
        assert messages[0].startswith(f"pyddp: rank {r}: new_group #1 of group "), messages[0]
        assert ("the ranks disagree on the group: ranks 0, 1 asked for ranks [0, 1] of a group "
                "of 3; rank 2 asked for ranks [0, 1, 2] of a group of 3") in messages[0], messages
        assert ("rank 0 asked for ranks [0, 1] of a group of 3; rank 1 asked for ranks [1, 2] of "
                "a group of 3; rank 2 asked for ranks [0, 2] of a group of 3") in messages[1], \
            messages
        if r < 2:
            assert ("rank 2 did not call new_group #4 of group " in messages[2] and
                    f"within {int(SHORT.total_seconds() * 1000)} ms" in messages[2]), messages


def _flag(ctx: RankContext, name: str) -> str:
    return ctx.store_path(f"flag-{name}")


def _wait_for_flag(ctx: RankContext, name: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(_flag(ctx, name)):
        assert time.monotonic() < deadline, f"rank {ctx.rank}: no flag {name} within 60 s"
        time.sleep(0.01)


_CALLS = {
    "barrier": lambda pg: pg.barrier(),
    "all_reduce": lambda pg: pg.all_reduce(torch.ones(1000)),
    "broadcast": lambda pg: pg.broadcast(torch.ones(1000), 0),
}


def _a_dead_rank_and_a_late_one(ctx: RankContext) -> dict:
    groups = {call: _group(ctx, f"late-{call}") for call in _CALLS}
    teardown = _group(ctx, "teardown")
    if ctx.rank == 2:
        os._exit(3)
    seen = {}
    for call, pg in groups.items():
        if ctx.rank == 1:
            # Rank 0 comes only once rank 1 gave up: rank 1 must not wait for it.
            seen[call] = raises(dist.DistBackendError, ".", _CALLS[call], pg)
            open(_flag(ctx, call), "w").close()
        else:
            _wait_for_flag(ctx, call)
            seen[call] = raises(dist.DistBackendError, ".", _CALLS[call], pg)
    # Rank 0 learns that rank 2 died (its send fails) and destroys its group
    # while rank 1 waits for a message from it: rank 1 is told of rank 2.
    if ctx.rank == 0:
        teardown.send(torch.ones(2), 1, 7)
        raises(dist.DistBackendError, "exited", teardown.send, torch.ones(2), 2, 7)
        teardown.shutdown()
    else:
        teardown.recv(torch.zeros(2), 0, 7)
        seen["teardown"] = raises(dist.DistBackendError, ".", teardown.recv, torch.zeros(2), 0, 7)
    return seen


def test_a_dead_rank_is_named_while_a_live_one_is_late_and_wins_over_teardowns():
    pool = Ranks(3)
    try:
        seen0, seen1, died = pool.run_each([_a_dead_rank_and_a_late_one] * 3, allow_dead=True)
        assert isinstance(died, Died) and died.exitcode == 3
        dead = f"rank 2 (pid {pool.pid(2)}) exited"
        for call in _CALLS:
            assert f"{dead} before it arrived at {call} #1; rank 1 was waiting for rank 0" in \
                seen1[call], seen1[call]
            # Rank 0 came late and hears why rank 1 gave up, or sees rank 2 itself.
            assert dead in seen0[call], seen0[call]
        assert f"{dead}; then rank 0 destroyed its process group" in seen1["teardown"], seen1
    finally:
        pool.close()


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYDDP_SLOT_BYTES", "4096")
    monkeypatch.setenv("PYDDP_NUM_SLOTS", "3")
    monkeypatch.setenv("PYDDP_DIRECT_MAX_BYTES", "0")
    monkeypatch.setenv("PYDDP_ALGO", "ring")
    monkeypatch.setenv("PYDDP_SLOT_STORES", "streaming")
    options = pyddp.RingOptions()
    assert (options.slot_bytes, options.num_slots, options.direct_max_bytes, options.algo,
            options.slot_stores) == (4096, 3, 0, pyddp.Algo.RING, pyddp.SlotStores.STREAMING)
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert pg.options.slot_bytes == 4096 and pg.options.algo == pyddp.Algo.RING
        assert pg.options.slot_stores == pyddp.SlotStores.STREAMING
    finally:
        pg.shutdown()
    assert pyddp._C.settings()["PYDDP_ALGO"] == "ring"
    assert pyddp._C.settings()["PYDDP_SLOT_STORES"] == "streaming"
    for text, kind in (("cached", pyddp.SlotStores.CACHED), ("auto", pyddp.SlotStores.AUTO)):
        monkeypatch.setenv("PYDDP_SLOT_STORES", text)
        assert pyddp.RingOptions().slot_stores == kind
    monkeypatch.delenv("PYDDP_SLOT_STORES")
    assert pyddp.RingOptions().slot_stores == pyddp.SlotStores.AUTO
    options = pyddp.RingOptions()
    assert (options.cma, options.cma_min_bytes) == (pyddp.CmaReads.AUTO, 64 * 1024)
    monkeypatch.setenv("PYDDP_CMA_MIN_BYTES", "1048576")
    monkeypatch.setenv("PYDDP_CMA", "never")
    options = pyddp.RingOptions()
    assert (options.cma, options.cma_min_bytes) == (pyddp.CmaReads.NEVER, 1 << 20)
    monkeypatch.setenv("PYDDP_CMA", "always")
    assert pyddp.RingOptions().cma == pyddp.CmaReads.ALWAYS


def _stall_inside(ctx: RankContext) -> str:
    # Rank 0 arrives late; rank 1 has arrived (it waits in the arrival
    # barrier) when it stops itself, so rank 0 finds every rank inside the
    # collective and then waits for rank 1's first piece until its deadline.
    pg = _ring_group(ctx, "stall", datetime.timedelta(seconds=2 if ctx.rank == 0 else 60))
    if ctx.rank == 0:
        time.sleep(1.5)
        return raises(dist.DistBackendError, ".", pg.all_reduce, torch.ones(100_000))
    work = pg.all_reduce(torch.ones(100_000), async_op=True)
    time.sleep(0.75)
    os.kill(os.getpid(), signal.SIGSTOP)  # the test's timer sends SIGCONT
    return raises(dist.DistBackendError, ".", work.wait)


def test_a_peer_stalled_inside_the_collective_is_named():
    message0, message1 = _with_rank_1_resumed(6.0, _stall_inside)
    assert ("all_reduce #1 timed out after 2000 ms on rank 0 waiting for rank 1 "
            "(every rank entered the collective)") in message0, message0
    assert "rank 0 gave up on collective #1" in message1, message1
