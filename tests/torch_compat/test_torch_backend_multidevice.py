"""torch.distributed's "pyddp" backend serves the CPU and CUDA tensors of a group.

torch calls a backend's creator once for each group and registers the one c10d Backend it
returns for every device type that the group maps to the backend. pyddp's
(csrc/backend/torch_backend.h) holds an engine per device type and sends each call to the
engine of its tensors' device: the CPU engine, made with the group, and a CUDA engine, made at
the group's first call on CUDA tensors. These tests run on any build and machine: the
registration; CPU collectives of "pyddp" and "cpu:pyddp,cuda:pyddp" groups against the
reference; the refusals of tensors the backend cannot route; and, where no CUDA engine can be
made (a build without CUDA, or no GPU), what the first CUDA call raises and what the group
does after it. No CUDA tensor can be made here, so the CUDA engine is asked for as a call on
CUDA tensors asks for it, through ``_testing.torch_backend_engine``.
tests/torch_compat/test_torch_backend_cuda.py runs the CUDA engine itself on a GPU.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from typing import List, Optional

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import pyddp
import pyddp.torch_backend
from collective_cases import check_equal, make_input, reference_reduce
from harness import RankContext, Ranks, raises

CPU = torch.device("cpu")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
engine_for = pyddp._C._testing.torch_backend_engine


def test_import_registers_pyddp_for_cpu_and_cuda_tensors():
    assert "pyddp" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["pyddp"] == ["cpu", "cuda"]
    plugin = dist.Backend._plugins["PYDDP"]
    assert plugin.creator_fn is pyddp.torch_backend._create_torch_backend
    assert plugin.extended_api
    # torch's own choices for a group that names no backend stay torch's.
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    assert pyddp.register_torch_backend is pyddp.torch_backend.register_torch_backend
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pyddp.register_torch_backend()
    assert dist.Backend._plugins["PYDDP"] is plugin
    assert dist.Backend.backend_capability["pyddp"] == ["cpu", "cuda"]


class _Counting(dist.Store):
    """A store that counts the operations made on it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner = inner
        self.ops = 0

    def set(self, key: str, value) -> None:
        self.ops += 1
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.ops += 1
        return self._inner.get(key)

    def check(self, keys: List[str]) -> bool:
        self.ops += 1
        return self._inner.check(keys)

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        self.ops += 1
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        self.ops += 1
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        self.ops += 1
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self.ops += 1
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        self.ops += 1
        return self._inner.num_keys()


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks(2)
    yield pool
    pool.close()


def _init(ctx: RankContext, backend: str, name: str) -> _Counting:
    store = _Counting(dist.FileStore(ctx.store_path(name), ctx.world_size))
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=60))
    return store


def _cpu_collectives(ctx: RankContext, what: str) -> None:
    """all_reduce, all_gather_into_tensor and broadcast of known inputs on the default group,
    against the reference."""
    n = ctx.world_size
    for count in (0, 1, 1001):
        inputs = [make_input(r, count, torch.float32, salt=count) for r in range(n)]
        t = inputs[ctx.rank].clone()
        dist.all_reduce(t)
        check_equal(t, reference_reduce(inputs, dist.ReduceOp.SUM),
                    f"{what}: all_reduce n={count}")
        out = torch.empty(n * count)
        dist.all_gather_into_tensor(out, inputs[ctx.rank])
        check_equal(out, torch.cat(inputs), f"{what}: all_gather_into_tensor n={count}")
        b = inputs[ctx.rank].clone()
        dist.broadcast(b, src=n - 1)
        check_equal(b, inputs[n - 1], f"{what}: broadcast n={count}")
    dist.barrier()


def _group_on(ctx: RankContext, backend: str) -> dict:
    """A default group on ``backend``: which backend object serves each device type, its
    engines, and CPU collectives through it."""
    _init(ctx, backend, backend.replace(":", "-").replace(",", "_"))
    try:
        pg = dist.group.WORLD
        cpu = pg._get_backend(CPU)
        assert isinstance(cpu, pyddp._C.TorchBackend), type(cpu)
        _cpu_collectives(ctx, backend)
        # 3 collectives for each of 3 counts, and the barrier.
        assert cpu._get_sequence_number_for_group() == 10
        return {"device_types": sorted(d.type for d in pg._device_types),
                "one_backend": pg._get_backend(torch.device("cuda")) is cpu,
                "engines": [(str(e.device), e.transport) for e in cpu.engines],
                "name": cpu.name()}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["pyddp", "cpu:pyddp,cuda:pyddp"])
def test_torch_groups_serve_cpu_tensors_through_one_backend_for_both_devices(ranks, backend):
    # CPU calls alone made no CUDA engine.
    for got in ranks.run(_group_on, backend):
        assert got == {"device_types": ["cpu", "cuda"], "one_backend": True,
                       "engines": [("cpu", "shm")], "name": "pyddp"}


def _cuda_refused(ctx: RankContext) -> dict:
    """The first CUDA call where no CUDA engine can be made, what later ones raise, and the
    group's CPU calls after them."""
    store = _init(ctx, "pyddp", "refused")
    try:
        backend = dist.group.WORLD._get_backend(CPU)
        with pytest.raises(Exception) as first:
            engine_for(backend, CUDA0)
        first_message = str(first.value)
        ops = store.ops
        with pytest.raises(type(first.value)) as again:
            engine_for(backend, CUDA0)
        # The failure is kept: raised again without meeting the peers again.
        assert store.ops == ops, "a later CUDA call went to the store"
        # The first CUDA call fixed the group's CUDA device, which it could not serve.
        other = raises(TypeError, "tensors on cuda:1, but this group's CUDA tensors are on "
                       "cuda:0", engine_for, backend, CUDA1)
        _cpu_collectives(ctx, "after the refused CUDA engine")
        assert [str(e.device) for e in backend.engines] == ["cpu"]
        return {"type": type(first.value), "first": first_message,
                "again": str(again.value), "other": other}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA engine can be made here")
def test_torch_backend_cuda_engine_refused_once_is_refused_at_once_and_cpu_goes_on(ranks):
    for rank, got in enumerate(ranks.run(_cuda_refused)):
        assert got["first"].startswith(f"pyddp: rank {rank}: "), got["first"]
        assert got["type"] is TypeError
        if pyddp._C.has_cuda:
            assert got["first"].endswith(
                "torch sees 0 CUDA devices in this process, so it cannot serve cuda:0 tensors "
                "(check the GPU driver and CUDA_VISIBLE_DEVICES)"), got["first"]
        else:
            assert got["first"].endswith(
                "pyddp was built without CUDA, so it has no transport for cuda:0 tensors "
                "(rebuild against a CUDA build of torch with nvcc installed)"), got["first"]
        assert got["again"] == got["first"]
        assert "a group serves one CUDA device per process" in got["other"], got["other"]


def _threads_at_the_first_cuda_call(ctx: RankContext) -> List[str]:
    """Threads that reach the group's first CUDA call at once all get the one failure."""
    _init(ctx, "pyddp", "threads")
    try:
        backend = dist.group.WORLD._get_backend(CPU)
        start = threading.Barrier(4)
        messages: List[str] = []

        def call() -> None:
            start.wait(timeout=30)
            try:
                engine_for(backend, CUDA0)
            except Exception as error:  # the failure is the result
                messages.append(str(error))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a thread did not return"
        _cpu_collectives(ctx, "after threads at the first CUDA call")
        return messages
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA engine can be made here")
def test_torch_backend_threads_at_the_first_cuda_call_share_its_failure(ranks):
    for rank, messages in enumerate(ranks.run(_threads_at_the_first_cuda_call)):
        assert len(messages) == 4, messages
        assert len(set(messages)) == 1, messages
        assert messages[0].startswith(f"pyddp: rank {rank}: "), messages[0]


def _refusals(ctx: RankContext) -> dict:
    """Calls the backend cannot route: tensors of two devices in one call, tensors of a
    device type it does not serve; and a CUDA call on a destroyed group."""
    _init(ctx, "pyddp", "refusals")
    backend = dist.group.WORLD._get_backend(CPU)
    meta = torch.empty(4, device="meta")
    cpu = torch.ones(4)
    out = {
        "two devices": raises(TypeError, "tensors on cpu and on meta in one call",
                              backend.allgather, [[torch.empty(4), meta]], [cpu],
                              c10d.AllgatherOptions()),
        "other device": raises(TypeError, "tensors on meta; the pyddp backend serves CPU and "
                               "CUDA tensors", backend.allreduce, [meta],
                               c10d.AllreduceOptions()),
    }
    # Nothing was queued: the group goes on.
    _cpu_collectives(ctx, "after the refusals")
    dist.destroy_process_group()
    out["destroyed"] = raises(RuntimeError, "on a process group that was destroyed",
                              engine_for, backend, CUDA0)
    return out


@pytest.mark.multiprocess
def test_torch_backend_refuses_what_it_cannot_route(ranks):
    for rank, got in enumerate(ranks.run(_refusals)):
        assert got["two devices"] == (
            f"pyddp: rank {rank}: torch.distributed.all_gather or all_gather_object (c10d's "
            "allgather): tensors on cpu and on meta in one call; the pyddp backend runs a call "
            "on the tensors of one device")
        assert got["other device"] == (
            f"pyddp: rank {rank}: torch.distributed.all_reduce (c10d's allreduce): tensors on "
            "meta; the pyddp backend serves CPU and CUDA tensors")
        assert got["destroyed"] == (
            f"pyddp: rank {rank}: torch.distributed.all_reduce (c10d's allreduce) on a process "
            "group that was destroyed")
