"""Calls refused in this process, at once, with an error naming what was wrong: collectives
before a default group exists, groups asked for with bad arguments or a backend this build
or machine cannot serve, and a group's calls given arguments torch would refuse. No
process is started.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pyddp
from harness import raises


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
    options = pyddp.GroupOptions()
    options.num_slots = 1
    with pytest.raises(ValueError, match="num_slots"):
        pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1, options=options)
    options = pyddp.GroupOptions()
    options.algo, options.direct_max_bytes = pyddp.Algo.DIRECT, 0
    with pytest.raises(ValueError, match="algo=direct .* needs direct_max_bytes"):
        options.validate()
    options = pyddp.GroupOptions()
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
        pyddp._C.make_engine(dist.HashStore(), 0, 1, pyddp.GroupOptions(), torch.device("cuda", 0),
                             "auto")


@pytest.mark.skipif(not pyddp._C.has_cuda or torch.cuda.is_available(),
                    reason="checks a CUDA build on a machine without a GPU")
def test_gpu_backends_without_a_gpu_fail_clearly():
    for backend in ("cuda_ipc", "nccl"):
        with pytest.raises(RuntimeError, match=f"backend '{backend}' needs a CUDA device"):
            pyddp.new_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensor_on_shm_backend_is_refused():
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="rank 0: all_reduce: tensor is on cuda"):
            pg.all_reduce(torch.ones(2, device="cuda"))
    finally:
        pg.shutdown()


def test_arguments_are_checked_like_torch():
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        raises(ValueError, r"rank 0: broadcast: src=1099511627776 is not a rank of this group",
                pg.broadcast, torch.ones(2), 2**40)
        raises(ValueError, r"rank 0: broadcast: src=-1 is not a rank", pg.broadcast,
                torch.ones(2), -1)
        raises(TypeError, "broadcast: src must be an int", pg.broadcast, torch.ones(2), 0.0)
        raises(TypeError, "broadcast: src must be an int", pg.broadcast, torch.ones(2), True)
        for src in (np.int64(0), np.uint8(0), torch.tensor(0)):
            t = torch.arange(3.0)
            pg.broadcast(t, src)
            assert t.tolist() == [0.0, 1.0, 2.0]
        for op in (0, 4, "SUM", None):
            raises(TypeError, r"rank 0: all_reduce: op must be a ReduceOp", pg.all_reduce,
                    torch.ones(2), op)
        raises(TypeError, r"reduce_scatter_single: op must be a ReduceOp",
                pg.reduce_scatter_single, torch.ones(1), torch.ones(1), 0)
        work = pg.all_reduce(torch.ones(2), async_op=True)
        for bad in (datetime.timedelta(seconds=-1), datetime.timedelta(0)):
            raises(ValueError, "timeout must be positive", work.wait, bad)
        raises(TypeError, "timeout must be a datetime.timedelta", work.wait, 5)
        assert work.wait(datetime.timedelta(seconds=30))
        assert work.result()[0].tolist() == [1.0, 1.0]
    finally:
        pg.shutdown()
