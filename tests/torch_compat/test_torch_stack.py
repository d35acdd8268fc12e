"""torch's parallelism stack on the "pyddp" backend, against gloo.

DTensor on a 2-D device mesh, FSDP2, pipelining, and torch.distributed's
point-to-point and all-to-all calls run on 4 ranks, each case twice: once
with "pyddp" as the default group's backend, once with "gloo". The default
group (not a side group) is switched because device meshes, FSDP2 and the
pipeline schedules build their subgroups with the default group's backend:
only then does every collective and message of a case go through the
backend under test. Results must match gloo's: bitwise where the inputs are
small integers, closely where floating-point sums run in a backend's own
order (FSDP2 over 4 ranks).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pyddp  # noqa: F401  (registers the "pyddp" backend)
from collective_cases import check_equal, make_input
from harness import RankContext, Ranks

pytestmark = pytest.mark.multiprocess

WORLD = 4
BACKENDS = ("pyddp", "gloo")


def _setup(ctx: RankContext) -> None:
    # The spawned ranks must register "pyddp" before any group is made.
    import pyddp  # noqa: F401


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks(WORLD, setup=_setup)
    yield pool
    pool.close()


@contextlib.contextmanager
def _default_group(ctx: RankContext, backend: str):
    """The default group on `backend` for one case, destroyed afterwards."""
    # Every rank runs the same cases in the same order, so the counter names
    # the same fresh store on every rank.
    n = ctx.state["cases"] = ctx.state.get("cases", 0) + 1
    store = dist.FileStore(ctx.store_path(f"case{n}-{backend}"), ctx.world_size)
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        assert dist.get_backend() == backend
        yield
    finally:
        dist.destroy_process_group()


def _bits(t: torch.Tensor):
    """A tensor as comparable bytes: equal exactly when bitwise equal."""
    t = t.detach().contiguous()
    return str(t.dtype), tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes()


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued float32: every sum below is exact in any order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=gen).to(torch.float32)


def _run_both(ranks: Ranks, fn, *args):
    """fn on pyddp then on gloo: per-rank results of each."""
    return [ranks.run(fn, backend, *args) for backend in BACKENDS]


def _assert_same_bits(on_pyddp, on_gloo, what: str, pyddp_only=lambda key: False) -> None:
    for rank, (mine, ref) in enumerate(zip(on_pyddp, on_gloo)):
        assert set(ref) == {k for k in mine if not pyddp_only(k)}, \
            f"{what}: rank {rank} ran other cases"
        bad = [k for k in ref if mine[k] != ref[k]]
        assert not bad, (f"{what}: rank {rank}: {len(bad)} of {len(ref)} results differ from "
                         f"gloo's, e.g. {bad[:3]}")


def _flatten(x):
    if isinstance(x, list):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


# --- DTensor on a 2-D mesh ---------------------------------------------------

SHAPES = [(8, 12), (7, 5)]  # even, and uneven along both dims (padded collectives)


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    one = [Shard(0), Shard(1), Replicate()]
    return [tuple(p) for p in itertools.product(one, repeat=2)]


def _name(placements) -> str:
    return ",".join(str(p) for p in placements)


def _comms(mode) -> dict:
    return {str(op): n for op, n in mode.get_comm_counts().items()}


def _dtensor_redistribute(ctx: RankContext, backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    with _default_group(ctx, backend), CommDebugMode() as comms:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        for si, shape in enumerate(SHAPES):
            full = _ints(shape, si)
            # Only rank 0's data counts (src_data_rank=0): distribute_tensor
            # must scatter and broadcast it, not keep each rank's own.
            mine = full + 100 * ctx.rank
            for src in _placements():
                d = distribute_tensor(mine, mesh, src)
                out[f"{shape} distribute {_name(src)}"] = _bits(d.to_local())
                check_equal(d.full_tensor(), full, f"{shape} {_name(src)} full_tensor")
                for dst in _placements():
                    r = d.redistribute(mesh, dst)
                    what = f"{shape} {_name(src)} -> {_name(dst)}"
                    out[what] = _bits(r.to_local())
                    check_equal(r.full_tensor(), full, f"{what} full_tensor")
                    # Redistributing is exact: the same shard as distributing directly.
                    check_equal(r.to_local(), distribute_tensor(full, mesh, dst).to_local(),
                                f"{what} against a direct distribute_tensor")
    out["comms"] = _comms(comms)
    return out


def _partial_cases():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [(Partial(), Partial()), (Partial(), Shard(0)), (Shard(1), Partial()),
            (Partial(), Replicate()), (Replicate(), Partial("max"))]


def _partial_local(placements, shape, coord, seed):
    """This rank's local tensor for a DTensor with `placements` on the 2x2 mesh
    at `coord`, and the global tensor it stands for (computed without it)."""
    from torch.distributed.tensor import Partial, Shard

    def contribution(c):
        # A partial mesh dim contributes a different addend per coordinate;
        # a replicated or sharded one the same.
        key = tuple(c[i] if isinstance(p, Partial) else 0 for i, p in enumerate(placements))
        return _ints(shape, seed * 10 + key[0] * 2 + key[1])

    coords = [(i, j) for i in range(2) for j in range(2)]
    # Addends of the whole: one per distinct key over the partial dims.
    seen = {}
    for c in coords:
        key = tuple(c[i] if isinstance(p, Partial) else 0 for i, p in enumerate(placements))
        seen[key] = contribution(c)
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    stack = torch.stack(list(seen.values()))
    whole = stack.amax(0) if ops == {"max"} else stack.sum(0)
    local = contribution(coord)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            local = local.chunk(2, dim=p.dim)[coord[i]]
    return local.contiguous(), whole


def _dtensor_partial(ctx: RankContext, backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    with _default_group(ctx, backend), CommDebugMode() as comms:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        coord = tuple(mesh.get_coordinate())
        shape = (8, 12)
        for ci, src in enumerate(_partial_cases()):
            local, whole = _partial_local(src, shape, coord, ci)
            d = DTensor.from_local(local, mesh, src, run_check=False)
            check_equal(d.full_tensor(), whole, f"{_name(src)} full_tensor")
            for dst in _placements():
                r = d.redistribute(mesh, dst)
                what = f"{_name(src)} -> {_name(dst)}"
                out[what] = _bits(r.to_local())
                check_equal(r.to_local(), distribute_tensor(whole, mesh, dst).to_local(), what)
        # A partial sum as tensor parallelism makes one: x columns and w rows
        # sharded on "b" multiply into partial sums of x @ w.
        x, w = _ints((6, 8), 50), _ints((8, 4), 51)
        dx = distribute_tensor(x, mesh, (Replicate(), Shard(1)))
        dw = distribute_tensor(w, mesh, (Replicate(), Shard(0)))
        y = dx @ dw
        assert str(y.placements[1]).startswith("P"), y.placements
        out["matmul partial"] = _bits(y.to_local())
        for dst in [(Replicate(), Replicate()), (Replicate(), Shard(0)), (Shard(1), Shard(0))]:
            r = y.redistribute(mesh, dst)
            out[f"matmul -> {_name(dst)}"] = _bits(r.to_local())
            check_equal(r.full_tensor(), x @ w, f"matmul -> {_name(dst)}")
    out["comms"] = _comms(comms)
    return out


def _dtensor_all_to_all(ctx: RankContext, backend: str) -> dict:
    """Shard(i) -> Shard(j) as DTensor does it on GPUs: one all-to-all per mesh dim.

    On a CPU mesh torch 2.13 replaces this all-to-all with all-gather + chunk
    (``shard_dim_alltoall`` in torch/distributed/tensor/_collective_utils.py,
    because gloo once lacked all-to-all), so ``redistribute`` alone would
    never reach the backend's all-to-all: the op it would run is called here.
    """
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    with _default_group(ctx, backend), torch.profiler.profile() as prof:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        # The other mesh dim shards tensor dim 2, out of the all-to-all's way.
        for si, shape in enumerate([(8, 12, 2), (4, 6, 4)]):
            full = _ints(shape, 20 + si)
            for mesh_dim, (gather_dim, shard_dim) in itertools.product(
                    (0, 1), ((0, 1), (1, 0))):
                src = [Shard(2), Shard(2)]
                src[mesh_dim] = Shard(gather_dim)
                dst = list(src)
                dst[mesh_dim] = Shard(shard_dim)
                d = distribute_tensor(full, mesh, src)
                group = mesh.get_group(mesh_dim)
                got = torch.ops._dtensor.shard_dim_alltoall(
                    d.to_local(), gather_dim, shard_dim,
                    funcol._group_or_group_name(group))
                got = funcol.wait_tensor(got)
                what = f"{shape} mesh dim {mesh_dim}: {_name(src)} -> {_name(dst)}"
                out[what] = _bits(got)
                check_equal(got, distribute_tensor(full, mesh, dst).to_local(), what)
    out["ops"] = sorted({e.name for e in prof.events() if e.name.startswith("c10d::")})
    return out


# --- FSDP2 ---------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 5 output rows do not divide by 4 ranks: FSDP2 pads that shard.
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 5))


def _fsdp_train(ctx: RankContext, backend: str, mesh_shape, force_sum: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with _default_group(ctx, backend):
        # 2-D is HSDP: all-reduce across "replicate", reduce-scatter within "shard".
        names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # gloo has no ReduceOp.AVG, which FSDP2 uses for float32 by default;
        # summing then dividing is the path gloo can run.
        model.set_force_sum_reduction_for_comms(force_sum)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4 * ctx.world_size, 12, generator=gen)
        y = torch.randint(0, 5, (4 * ctx.world_size,), generator=gen)
        shard = slice(4 * ctx.rank, 4 * (ctx.rank + 1))
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[shard]), y[shard])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        params = [p.full_tensor().detach().numpy().copy() for p in model.parameters()]
    return {"losses": np.array(losses), "params": params}


# --- pipelining ------------------------------------------------------------------


def _pipeline_train(ctx: RankContext, backend: str, schedule: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    with _default_group(ctx, backend):
        # Two pipelines ("pp" rows {0,1} and {2,3}) of two stages, data
        # parallel across them ("dp" columns).
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        stage_index, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        torch.manual_seed(0)
        full = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3))
        part = full[:4] if stage_index == 0 else full[4:]
        stage = PipelineStage(part, stage_index, 2, torch.device("cpu"),
                              group=mesh.get_group("pp"))
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = kind(stage, n_microbatches=4, loss_fn=torch.nn.functional.cross_entropy)
        opt = torch.optim.SGD(part.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(7)
        xs = torch.randn(2, 16, 8, generator=gen)
        ys = torch.randint(0, 3, (2, 16), generator=gen)
        x, y = xs[replica], ys[replica]
        losses, grads = [], []
        for step in range(2):
            opt.zero_grad()
            if stage_index == 0:
                sched.step(x)
            else:
                step_losses = []
                out = sched.step(target=y, losses=step_losses)
                losses.append(torch.stack(step_losses).detach().numpy().copy())
                if step == 0:
                    # The merged output of the microbatches is the whole
                    # model's (whose first half only rank 0 updates later).
                    with torch.no_grad():
                        torch.testing.assert_close(out, full(x), rtol=1e-6, atol=1e-6)
            for p in part.parameters():
                dist.all_reduce(p.grad, group=mesh.get_group("dp"))
                p.grad.div_(2)
            grads.append([p.grad.detach().numpy().copy() for p in part.parameters()])
            opt.step()
        params = [p.detach().numpy().copy() for p in part.parameters()]
    return {"losses": losses, "grads": grads, "params": params}


# --- point-to-point and all-to-all -------------------------------------------------

P2P_DTYPES = [torch.float32, torch.int64, torch.bfloat16]
P2P_COUNTS = [0, 1, 1001, 70000]  # 70000 floats move in many pieces


def _payload(src: int, dst: int, count: int, dtype, salt: int = 0) -> torch.Tensor:
    return make_input(src, count, dtype, salt=1000 * salt + 10 * dst + 1)


def _send_recv(ctx: RankContext, backend: str) -> dict:
    rank, out = ctx.rank, {}
    with _default_group(ctx, backend):
        # Three pairings cover all six pairs of ranks.
        for mask in (1, 2, 3):
            peer = rank ^ mask
            for lower_sends_first in (True, False):
                for dtype, count in itertools.product(P2P_DTYPES, P2P_COUNTS):
                    got = torch.full((count,), 3, dtype=dtype)
                    mine = _payload(rank, peer, count, dtype)
                    if (rank < peer) == lower_sends_first:
                        dist.send(mine, peer)
                        dist.recv(got, peer)
                    else:
                        dist.recv(got, peer)
                        dist.send(mine, peer)
                    what = (f"pair {rank}<->{peer} lower_sends_first={lower_sends_first} "
                            f"{dtype} n={count}")
                    check_equal(got, _payload(peer, rank, count, dtype), what)
                    out[what] = _bits(got)
    return out


def _tagged(ctx: RankContext, backend: str) -> dict:
    rank, out = ctx.rank, {}
    # Same-size messages under different tags: a mismatch shows in the values.
    tags = [(0, 1001), (3, 1001), (7, 70000), (11, 0), (12, 1001)]
    with _default_group(ctx, backend):
        for mask, recv_first in itertools.product((1, 2), (False, True)):
            peer = rank ^ mask
            sends, recvs = [], []

            def post_sends():
                for tag, count in tags:
                    sends.append(dist.isend(_payload(rank, peer, count, torch.float32, tag),
                                            peer, tag=tag))
                # Two messages with one tag arrive in the order they were sent.
                for k in range(2):
                    sends.append(dist.isend(_payload(rank, peer, 5, torch.int64, 100 + k),
                                            peer, tag=99))

            def post_recvs():
                for tag, count in reversed(tags):
                    buf = torch.full((count,), 3.0)
                    recvs.append((f"tag {tag}", buf, _payload(peer, rank, count, torch.float32,
                                                              tag), dist.irecv(buf, peer, tag=tag)))
                for k in range(2):
                    buf = torch.zeros(5, dtype=torch.int64)
                    recvs.append((f"tag 99 #{k}", buf,
                                  _payload(peer, rank, 5, torch.int64, 100 + k),
                                  dist.irecv(buf, peer, tag=99)))

            if recv_first:
                post_recvs()
                post_sends()
            else:
                post_sends()
                post_recvs()
            # Out of order: the last-posted receive is waited for first.
            for what, buf, expected, work in reversed(recvs):
                assert work.wait()
                what = f"peer {peer} recv_first={recv_first} {what}"
                check_equal(buf, expected, what)
                out[what] = _bits(buf)
            for work in sends:
                assert work.wait()
    return out


def _batched_rings(ctx: RankContext, backend: str) -> dict:
    rank, n, out = ctx.rank, ctx.world_size, {}
    right, left = (rank + 1) % n, (rank - 1) % n
    with _default_group(ctx, backend):
        for count, recv_first in itertools.product((0, 7, 70000), (False, True)):
            send = dist.P2POp(dist.isend, _payload(rank, right, count, torch.float32), right)
            got = torch.full((count,), 3.0)
            recv = dist.P2POp(dist.irecv, got, left)
            for work in dist.batch_isend_irecv([recv, send] if recv_first else [send, recv]):
                work.wait()
            what = f"ring n={count} recv_first={recv_first}"
            check_equal(got, _payload(left, rank, count, torch.float32), what)
            out[what] = _bits(got)
            # Both directions at once, two messages per direction: messages
            # between one pair in one direction match in list order.
            ops, expected = [], []
            for peer in (right, left):
                for k in range(2):
                    ops.append(dist.P2POp(dist.isend,
                                          _payload(rank, peer, count + k, torch.int64, k), peer))
            for peer in (left, right):
                for k in range(2):
                    buf = torch.zeros(count + k, dtype=torch.int64)
                    ops.append(dist.P2POp(dist.irecv, buf, peer))
                    expected.append((f"from {peer} #{k}", buf,
                                     _payload(peer, rank, count + k, torch.int64, k)))
            if recv_first:
                ops = ops[4:] + ops[:4]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for what, buf, ref in expected:
                what = f"both ways n={count} recv_first={recv_first} {what}"
                check_equal(buf, ref, what)
                out[what] = _bits(buf)
    return out


def _rows(src: int, dst: int, rows: int, dtype) -> torch.Tensor:
    return _payload(src, dst, rows * 3, dtype, salt=7).reshape(rows, 3)


def _all_to_all(ctx: RankContext, backend: str) -> dict:
    rank, n, out = ctx.rank, ctx.world_size, {}
    splits = {
        "even": lambda s, d: 5,
        "uneven": lambda s, d: s + 2 * d + 1,
        # Zeros scattered over the pairs, and rank 1 sends nothing at all.
        "zeros": lambda s, d: 0 if s == 1 or (s + d) % 3 == 0 else s + d,
        "empty": lambda s, d: 0,
        "large": lambda s, d: 20000 + 1000 * s - 500 * d,
    }
    with _default_group(ctx, backend):
        for (name, split), dtype, async_op in itertools.product(
                splits.items(), (torch.float32, torch.int64), (False, True)):
            inp = torch.cat([_rows(rank, d, split(rank, d), dtype) for d in range(n)])
            expected = torch.cat([_rows(s, rank, split(s, rank), dtype) for s in range(n)])
            got = torch.full_like(expected, 3)
            in_splits = None if name == "even" else [split(rank, d) for d in range(n)]
            out_splits = None if name == "even" else [split(s, rank) for s in range(n)]
            work = dist.all_to_all_single(got, inp, out_splits, in_splits, async_op=async_op)
            if async_op:
                work.wait()
            what = f"all_to_all_single {name} {dtype} async={async_op}"
            check_equal(got, expected, what)
            out[what] = _bits(got)
            if backend == "gloo" and name != "even":
                # gloo's list all_to_all wants one shape for every tensor;
                # pyddp's takes any, checked above against the reference.
                continue
            # The list form: a tensor per peer, sizes differing per pair.
            outs = [torch.full((split(s, rank), 3), 3, dtype=dtype) for s in range(n)]
            work = dist.all_to_all(outs, [_rows(rank, d, split(rank, d), dtype) for d in range(n)],
                                   async_op=async_op)
            if async_op:
                work.wait()
            for s in range(n):
                what = f"all_to_all {name} {dtype} async={async_op} from {s}"
                check_equal(outs[s], _rows(s, rank, split(s, rank), dtype), what)
                out[what] = _bits(outs[s])
    return out


# --- tests -------------------------------------------------------------------


def test_dtensor_distribute_and_redistribute_on_2d_mesh(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _dtensor_redistribute)
    _assert_same_bits(on_pyddp, on_gloo, "DTensor redistribute")
    # The cases reached every collective that DTensor's Shard and Replicate
    # placements use on a CPU mesh.
    comms = on_pyddp[0]["comms"]
    for op in ("c10d.scatter_", "c10d.broadcast_", "c10d_functional.all_gather_into_tensor"):
        assert comms.get(op, 0) > 0, comms


def test_dtensor_partial_reductions(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _dtensor_partial)
    _assert_same_bits(on_pyddp, on_gloo, "DTensor Partial")
    comms = on_pyddp[0]["comms"]
    for op in ("c10d_functional.all_reduce", "c10d_functional.reduce_scatter_tensor"):
        assert comms.get(op, 0) > 0, comms


def test_dtensor_shard_to_shard_all_to_all(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _dtensor_all_to_all)
    _assert_same_bits(on_pyddp, on_gloo, "DTensor shard_dim_alltoall")
    # The backend's own all-to-all ran, not a fallback.
    assert "c10d::alltoall_base_" in on_pyddp[0]["ops"], on_pyddp[0]["ops"]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["fsdp", "hsdp"])
def test_fsdp2_trains_as_on_gloo(ranks, mesh_shape):
    reference = ranks.run(_fsdp_train, "gloo", mesh_shape, True)
    for force_sum in (True, False):
        got = ranks.run(_fsdp_train, "pyddp", mesh_shape, force_sum)
        for rank in range(WORLD):
            # Four ranks' gradients are summed in each backend's own order:
            # a few ulps apart at most.
            np.testing.assert_allclose(got[rank]["losses"], reference[rank]["losses"],
                                       rtol=1e-6, atol=1e-7)
            for a, b in zip(got[rank]["params"], reference[rank]["params"]):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            for a, b in zip(got[rank]["params"], got[0]["params"]):
                assert np.array_equal(a, b), f"rank {rank}'s parameters differ from rank 0's"
    initial = [p.detach().numpy() for p in _model().parameters()]
    assert not any(np.allclose(a, b) for a, b in zip(reference[0]["params"], initial)), \
        "training did not move the parameters"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelining_trains_as_on_gloo(ranks, schedule):
    on_pyddp, on_gloo = _run_both(ranks, _pipeline_train, schedule)
    for rank in range(WORLD):
        # Only 2 ranks meet in each sum (a + b == b + a): exact.
        for key in ("losses", "grads", "params"):
            mine, ref = list(_flatten(on_pyddp[rank][key])), list(_flatten(on_gloo[rank][key]))
            assert len(mine) == len(ref), f"rank {rank}: {key}"
            for a, b in zip(mine, ref):
                assert np.array_equal(a, b), f"rank {rank}: {key} differ from gloo's"
    last = [r for r in range(WORLD) if on_pyddp[r]["losses"]]
    assert last == [1, 3], "each pipeline's last stage reports its losses"


def test_send_recv_in_both_orders(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _send_recv)
    _assert_same_bits(on_pyddp, on_gloo, "send/recv")


def test_isend_irecv_tags_out_of_order(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _tagged)
    _assert_same_bits(on_pyddp, on_gloo, "isend/irecv")


def test_batch_isend_irecv_rings(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _batched_rings)
    _assert_same_bits(on_pyddp, on_gloo, "batch_isend_irecv")


def test_all_to_all(ranks):
    on_pyddp, on_gloo = _run_both(ranks, _all_to_all)
    _assert_same_bits(on_pyddp, on_gloo, "all_to_all",
                      pyddp_only=lambda k: k.startswith("all_to_all ") and " even " not in k)
