"""torch's parallelism stack on CUDA tensors over the "pyddp" backend.

A torch.distributed group of "pyddp" serves CUDA tensors through a CUDA engine it makes at
its first call on CUDA tensors (csrc/backend/torch_backend.h; pyddp's "auto": cuda_ipc where
every rank maps every peer's GPU memory, else NCCL). Four ranks (rank r on GPU r modulo the
GPUs there are; on one GPU they share it) run torch's DistributedDataParallel, FSDP2
(fully_shard), DTensor on a 2-D device mesh and torch.distributed.pipelining on CUDA tensors
with "pyddp" as the default group's backend, and again on a reference: NCCL on the same CUDA
tensors where NCCL can run the ranks (a GPU each, or NCCL >= 2.30 sharing one), else gloo on
CPU tensors (gloo does not move CUDA tensors between pairs of ranks, which pipelining needs).
The default group is switched, not a side group, because device meshes, FSDP2 and the
pipeline schedules build their subgroups with the default group's backend. The cases and
their helpers are tests/test_torch_stack.py's, which runs them on CPU tensors, here with the
tensors on the device under test.

Results must match the reference's: exactly where the inputs are small integers (DTensor),
closely where floating-point sums run in each backend's own order or on another device
(training). Over cuda_ipc the calls that move messages between pairs of ranks (pipelining's
sends and receives, DTensor's shard-to-shard all-to-all) take the shm transport's messages,
staged through host memory, and must match the reference too.

Every test is marked ``cuda`` and skips without a GPU (tests/test_gpu_collectives.py's marks).
"""

from __future__ import annotations

import datetime
import itertools
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pyddp

from harness import RankContext, Ranks
from pyddp.bench import peers
from test_torch_backend_multidevice import _Counting, _cpu_collectives
from test_torch_stack import (SHAPES, _bits, _default_group, _flatten, _ints, _model, _name,
                              _partial_cases, _partial_local, _placements)

WORLD = 4

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not pyddp._C.has_cuda, reason="pyddp was built without CUDA"),
]
def _shares_gpu() -> bool:
    return torch.cuda.device_count() < WORLD


def _reference() -> str:
    """The backend the "pyddp" runs are compared with: NCCL where it can run the ranks."""
    if _shares_gpu() and tuple(torch.cuda.nccl.version()[:2]) < peers.NCCL_MULTI_RANK_GPU_VERSION:
        return "gloo"
    return "nccl"


def _setup(ctx: RankContext) -> None:
    import pyddp  # noqa: F401  (registers "pyddp" before any group is made)

    device = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    ctx.state["cuda"] = device


@pytest.fixture(scope="module")
def ranks():
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if _shares_gpu() else {}
    pool = Ranks(WORLD, setup=_setup, env=env)
    yield pool
    pool.close()


def _device(ctx: RankContext, backend: str) -> torch.device:
    """Where a case runs its tensors: the rank's GPU, or the CPU for gloo."""
    return torch.device("cpu") if backend == "gloo" else ctx.state["cuda"]


def _run_both(ranks: Ranks, fn, *args):
    """fn on "pyddp" (CUDA tensors), then on the reference: per-rank results of each."""
    return ranks.run(fn, "pyddp", *args), ranks.run(fn, _reference(), *args)


def _cuda_transport(group: dist.ProcessGroup, device: torch.device) -> str:
    """The transport of a "pyddp" group's CUDA engine, made by a first CUDA call."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    engines = group._get_backend(device).engines
    assert [e.device.type for e in engines] == ["cpu", "cuda"], engines
    assert engines[1].device == device, (engines[1].device, device)
    return engines[1].transport


def _assert_close(mine, ref, what: str) -> None:
    mine, ref = list(_flatten(mine)), list(_flatten(ref))
    assert len(mine) == len(ref), what
    for a, b in zip(mine, ref):
        # Four ranks' sums in each backend's order, on the GPU or on the CPU: a few ulps.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _train_steps(ctx: RankContext, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 device: torch.device, steps: int) -> np.ndarray:
    """``steps`` steps of _model()'s classification task, this rank on its share of the
    batch: the losses."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4 * ctx.world_size, 12, generator=gen)
    y = torch.randint(0, 5, (4 * ctx.world_size,), generator=gen)
    shard = slice(4 * ctx.rank, 4 * (ctx.rank + 1))
    x, y = x[shard].to(device), y[shard].to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


# --- the CUDA engine's creation ----------------------------------------------------------


def _cuda_call_that_peers_never_join(ctx: RankContext) -> dict:
    """Rank 0 alone makes a CUDA call on a group with a short timeout: its CUDA engine's
    bootstrap waits for peers that never come and fails; the next CUDA call raises the same
    at once, without the store; then every rank's CPU calls go on."""
    store = _Counting(dist.FileStore(ctx.store_path("lonely"), ctx.world_size))
    dist.init_process_group("pyddp", store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=2))
    side = dist.FileStore(ctx.store_path("lonely-side"), ctx.world_size)
    try:
        out = {}
        if ctx.rank == 0:
            t = torch.ones(4, device=ctx.state["cuda"])
            with pytest.raises(dist.DistBackendError) as first:
                dist.all_reduce(t)
            ops = store.ops
            with pytest.raises(dist.DistBackendError) as again:
                dist.all_reduce(t)
            out = {"first": str(first.value), "again": str(again.value),
                   "store ops": store.ops - ops}
            side.set("tried", b"1")
        else:
            side.wait(["tried"], datetime.timedelta(seconds=120))
        _cpu_collectives(ctx, "after a CUDA engine that never met")
        out["engines"] = [e.device.type for e in dist.group.WORLD._get_backend(
            torch.device("cpu")).engines]
        return out
    finally:
        dist.destroy_process_group()


def test_torch_backend_cuda_engine_that_never_met_is_refused_at_once_after(ranks):
    got = ranks.run(_cuda_call_that_peers_never_join)
    # Bootstrap's timeout, naming who waited and who did not come.
    assert "did not" in got[0]["first"], got[0]["first"]
    assert "(rank 0 waited for store key" in got[0]["first"], got[0]["first"]
    assert got[0]["again"] == got[0]["first"]
    assert got[0]["store ops"] == 0, "the second CUDA call met its peers again"
    assert all(r["engines"] == ["cpu"] for r in got), got


# --- DistributedDataParallel ---------------------------------------------------------


def _ddp_train(ctx: RankContext, backend: str) -> dict:
    device = _device(ctx, backend)
    with _default_group(ctx, backend):
        model = _model().to(device)
        # Every rank starts elsewhere: DDP must take rank 0's parameters.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(ctx.rank)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        losses = _train_steps(ctx, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9),
                              device, steps=3)
        out = {"losses": losses, "params": [_numpy(p) for p in model.parameters()]}
        if backend == "pyddp":
            out["transport"] = _cuda_transport(dist.group.WORLD, device)
    return out


def test_torch_ddp_on_cuda_tensors_trains_as_the_reference(ranks):
    on_pyddp, on_ref = _run_both(ranks, _ddp_train)
    for rank in range(WORLD):
        assert on_pyddp[rank]["transport"] in ("cuda_ipc", "nccl"), on_pyddp[rank]
        _assert_close(on_pyddp[rank]["losses"], on_ref[rank]["losses"], f"rank {rank}: losses")
        _assert_close(on_pyddp[rank]["params"], on_ref[rank]["params"], f"rank {rank}: params")
        for a, b in zip(on_pyddp[rank]["params"], on_pyddp[0]["params"]):
            assert np.array_equal(a, b), f"rank {rank}'s parameters differ from rank 0's"
    initial = [_numpy(p) for p in _model().parameters()]
    assert not any(np.allclose(a, b) for a, b in zip(on_ref[0]["params"], initial)), \
        "training did not move the parameters"


# --- FSDP2 -----------------------------------------------------------------------------


def _fsdp_train(ctx: RankContext, backend: str, mesh_shape) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = _device(ctx, backend)
    with _default_group(ctx, backend):
        # 2-D is HSDP: all-reduce across "replicate", reduce-scatter within "shard".
        names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh(device.type, tuple(mesh_shape), mesh_dim_names=names)
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # gloo has no ReduceOp.AVG, FSDP2's default for float32: it sums, then divides.
        model.set_force_sum_reduction_for_comms(backend == "gloo")
        losses = _train_steps(ctx, model, torch.optim.Adam(model.parameters(), lr=0.01), device,
                              steps=4)
        params = [_numpy(p.full_tensor()) for p in model.parameters()]
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["fsdp", "hsdp"])
def test_torch_fsdp2_on_cuda_tensors_trains_as_the_reference(ranks, mesh_shape):
    on_pyddp, on_ref = _run_both(ranks, _fsdp_train, mesh_shape)
    for rank in range(WORLD):
        _assert_close(on_pyddp[rank]["losses"], on_ref[rank]["losses"], f"rank {rank}: losses")
        _assert_close(on_pyddp[rank]["params"], on_ref[rank]["params"], f"rank {rank}: params")
        for a, b in zip(on_pyddp[rank]["params"], on_pyddp[0]["params"]):
            assert np.array_equal(a, b), f"rank {rank}'s parameters differ from rank 0's"


# --- DTensor on a 2-D mesh ---------------------------------------------------------------


def _shard_to_shard(src, dst) -> bool:
    """Whether redistributing src -> dst moves a mesh dim from one Shard to another, which
    DTensor does with an all-to-all on a GPU mesh."""
    from torch.distributed.tensor import Shard

    return any(isinstance(a, Shard) and isinstance(b, Shard) and a.dim != b.dim
               for a, b in zip(src, dst))


def _dtensor(ctx: RankContext, backend: str) -> dict:
    """test_torch_stack's DTensor cases (distribute, redistribute between every pair of
    placements, Partial reductions) on the device under test."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    device = _device(ctx, backend)
    out = {}

    def redistribute(d, mesh, dst, what, expected):
        r = d.redistribute(mesh, dst).to_local()
        out[what] = _bits(r.cpu())
        assert torch.equal(r.cpu(), expected.cpu()), what

    with _default_group(ctx, backend):
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("a", "b"))
        transports = ({_cuda_transport(mesh.get_group(dim), device) for dim in ("a", "b")}
                      if backend == "pyddp" else set())
        coord = tuple(mesh.get_coordinate())
        for si, shape in enumerate(SHAPES):
            full = _ints(shape, si).to(device)
            # Only rank 0's data counts (src_data_rank=0).
            mine = full + 100 * ctx.rank
            for src in _placements():
                d = distribute_tensor(mine, mesh, src)
                out[f"{shape} distribute {_name(src)}"] = _bits(d.to_local().cpu())
                assert torch.equal(d.full_tensor().cpu(), full.cpu()), f"{shape} {_name(src)}"
                for dst in _placements():
                    redistribute(d, mesh, dst, f"{shape} {_name(src)} -> {_name(dst)}",
                                 distribute_tensor(full, mesh, dst).to_local())
        for ci, src in enumerate(_partial_cases()):
            local, whole = _partial_local(src, (8, 12), coord, ci)
            d = DTensor.from_local(local.to(device), mesh, src, run_check=False)
            assert torch.equal(d.full_tensor().cpu(), whole), f"{_name(src)} full_tensor"
            for dst in _placements():
                redistribute(d, mesh, dst, f"{_name(src)} -> {_name(dst)}",
                             distribute_tensor(whole.to(device), mesh, dst).to_local())
    return {"results": out, "transports": transports}


def test_torch_dtensor_on_a_2d_cuda_mesh_as_the_reference(ranks):
    on_pyddp, on_ref = _run_both(ranks, _dtensor)
    shard_to_shard = {f"{shape} {_name(s)} -> {_name(d)}"
                      for shape in SHAPES for s, d in itertools.product(_placements(), repeat=2)
                      if _shard_to_shard(s, d)}
    shard_to_shard |= {f"{_name(s)} -> {_name(d)}"
                       for s, d in itertools.product(_partial_cases(), _placements())
                       if _shard_to_shard(s, d)}
    for rank in range(WORLD):
        mine, ref = on_pyddp[rank], on_ref[rank]
        assert mine["transports"] <= {"cuda_ipc", "nccl"}, mine["transports"]
        # every redistribution ran, shard to shard (an all-to-all on a GPU mesh) too
        missing = shard_to_shard - set(mine["results"])
        assert not missing, sorted(missing)
        assert set(ref["results"]) == set(mine["results"]), f"rank {rank}"
        bad = [k for k in mine["results"] if mine["results"][k] != ref["results"][k]]
        assert not bad, f"rank {rank}: {len(bad)} results differ from the reference's: {bad[:3]}"


# --- pipelining ------------------------------------------------------------------------


def _pipeline_train(ctx: RankContext, backend: str, schedule: str) -> dict:
    """test_torch_stack's pipeline (two pipelines of two stages, data parallel across them)
    on the device under test."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    device = _device(ctx, backend)
    with _default_group(ctx, backend):
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "pp"))
        stage_index, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        transport = _cuda_transport(mesh.get_group("pp"), device) if backend == "pyddp" else ""
        torch.manual_seed(0)
        full = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3)).to(device)
        part = full[:4] if stage_index == 0 else full[4:]
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(2, 16, 8, generator=gen)
        ys = torch.randint(0, 3, (2, 16), generator=gen)
        x, y = xs[replica].to(device), ys[replica].to(device)
        losses, grads = [], []
        stage = PipelineStage(part, stage_index, 2, device, group=mesh.get_group("pp"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = kind(stage, n_microbatches=4, loss_fn=torch.nn.functional.cross_entropy)
        opt = torch.optim.SGD(part.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            if stage_index == 0:
                sched.step(x)
            else:
                step_losses = []
                sched.step(target=y, losses=step_losses)
                losses.append(_numpy(torch.stack(step_losses)))
            for p in part.parameters():
                dist.all_reduce(p.grad, group=mesh.get_group("dp"))
                p.grad.div_(2)
            grads.append([_numpy(p.grad) for p in part.parameters()])
            opt.step()
        params = [_numpy(p) for p in part.parameters()]
    return {"transport": transport, "losses": losses, "grads": grads, "params": params}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_on_cuda_tensors_as_the_reference(ranks, schedule):
    on_pyddp, on_ref = _run_both(ranks, _pipeline_train, schedule)
    for rank in range(WORLD):
        mine = on_pyddp[rank]
        assert mine["transport"] in ("cuda_ipc", "nccl"), mine["transport"]
        for key in ("losses", "grads", "params"):
            _assert_close(mine[key], on_ref[rank][key], f"rank {rank}: {key}")
    last = [r for r in range(WORLD) if on_ref[r]["losses"]]
    assert last == [1, 3], "each pipeline's last stage reports its losses"
