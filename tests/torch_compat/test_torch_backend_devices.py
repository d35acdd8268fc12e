"""Which devices torch.distributed's "pyddp" backend serves.

torch calls a backend's creator once for each group and registers the one c10d Backend it
returns for every device type that the group maps to the backend (a torch ProcessGroup holds
one backend of c10d's custom type); a pyddp engine serves the tensors of one device. So
"pyddp" is registered for CPU tensors alone (pyddp/torch_backend.py). These tests pin both
halves: the registration, and what torch makes of a group that maps CUDA to "pyddp" as well.
"""

from __future__ import annotations

import datetime
import warnings

import pytest
import torch
import torch.distributed as dist

import pyddp
import pyddp.torch_backend
from collective_cases import check_equal, make_input, reference_reduce
from harness import RankContext, Ranks

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_import_registers_pyddp_for_cpu_tensors_alone():
    assert "pyddp" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["pyddp"] == ["cpu"]
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
    assert dist.Backend.backend_capability["pyddp"] == ["cpu"]


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks(2)
    yield pool
    pool.close()


def _group_on(ctx: RankContext, backend: str) -> dict:
    """A default group on ``backend``: which backend object serves each device type, and
    CPU collectives through it against the reference."""
    store = dist.FileStore(ctx.store_path(backend.replace(":", "-").replace(",", "_")),
                           ctx.world_size)
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pg = dist.group.WORLD
        cpu = pg._get_backend(CPU)
        assert isinstance(cpu, pyddp._C.Engine), type(cpu)
        n = ctx.world_size
        for count in (0, 1, 1001):
            inputs = [make_input(r, count, torch.float32) for r in range(n)]
            t = inputs[ctx.rank].clone()
            dist.all_reduce(t)
            check_equal(t, reference_reduce(inputs, dist.ReduceOp.SUM),
                        f"{backend}: all_reduce n={count}")
            out = torch.empty(n * count)
            dist.all_gather_into_tensor(out, inputs[ctx.rank])
            check_equal(out, torch.cat(inputs), f"{backend}: all_gather_into_tensor n={count}")
        types = sorted(d.type for d in pg._device_types)
        return {"device_types": types, "transport": cpu.transport,
                "cuda_is_cpu_engine": "cuda" in types and pg._get_backend(CUDA) is cpu}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_pyddp_serves_cpu_tensors_alone(ranks):
    for got in ranks.run(_group_on, "pyddp"):
        assert got == {"device_types": ["cpu"], "transport": "shm",
                       "cuda_is_cpu_engine": False}


@pytest.mark.multiprocess
def test_a_group_mapping_cuda_to_pyddp_too_gets_one_backend_for_both(ranks):
    # torch made one backend, the CPU engine, and registered it for CUDA too: a CUDA tensor
    # on such a group reaches an engine of CPU tensors, which refuses it. Should torch make
    # a backend per device type, this fails, and "pyddp" could give CUDA an engine of its own.
    for got in ranks.run(_group_on, "cpu:pyddp,cuda:pyddp"):
        assert got == {"device_types": ["cpu", "cuda"], "transport": "shm",
                       "cuda_is_cpu_engine": True}
