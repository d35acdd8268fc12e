"""pyddp.DistributedDataParallel on 2 and 3 spawned CPU ranks.

References: a single process holding every rank's batches (ddp_cases.reference)
and torch's own DistributedDataParallel on a gloo group in the same ranks,
given the same model, data and seed. Every rank starts from a different
random model, so construction must copy rank 0's. After every step the
parameters must be bitwise identical on every rank.
"""

from __future__ import annotations

import datetime
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pyddp
import pyddp.reducer
from ddp_cases import (HIDDEN, OUT, Case, Net, assert_close_records,
                       assert_identical_records, batch, make_model, pack, reference, train,
                       unpack)
from harness import RankContext, Ranks
from pyddp.ddp import (DistributedDataParallel, GradBucket, allreduce_hook, bf16_compress_hook,
                       fp16_compress_hook)

TorchDDP = torch.nn.parallel.DistributedDataParallel
FAIL_TIMEOUT = datetime.timedelta(seconds=3)


def _setup(ctx: RankContext) -> None:
    n = ctx.world_size
    ctx.groups["default"] = pyddp.init_process_group(
        "shm", store=dist.FileStore(ctx.store_path("pyddp"), n), rank=ctx.rank, world_size=n,
        timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.FileStore(ctx.store_path("gloo"), n),
                            rank=ctx.rank, world_size=n)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ranks(request):
    pool = Ranks(request.param, setup=_setup)
    yield pool
    pool.close()


# --- functions run on every rank ---------------------------------------------------


def _train_both(ctx: RankContext, case: Case) -> bytes:
    """``case`` trained with pyddp's DDP and with torch's DDP (gloo)."""
    model = make_model(case, ctx.rank)
    default = pyddp.reducer.IN_PLACE_MIN_BYTES
    if case.in_place_min_bytes is not None:
        pyddp.reducer.IN_PLACE_MIN_BYTES = case.in_place_min_bytes
    try:
        ddp = DistributedDataParallel(model, **case.ddp)
    finally:
        pyddp.reducer.IN_PLACE_MIN_BYTES = default
    ours = train(case, model, ddp, ctx.rank, ddp.no_sync)
    torch_model = make_model(case, ctx.rank)
    torch_ddp = TorchDDP(torch_model, **case.ddp)
    theirs = train(case, torch_model, torch_ddp, ctx.rank, torch_ddp.no_sync)
    return pack((ours, theirs))


def _no_sync_keeps_gradients_local(ctx: RankContext, as_view: bool) -> bytes:
    model = make_model(Case(), ctx.rank)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    x, y = batch(Case(), 0, 0, ctx.rank)
    with ddp.no_sync():
        F.cross_entropy(ddp(x), y).backward()
    return pack({n: p.grad.clone() for n, p in model.named_parameters()})


def _buffers(ctx: RankContext, broadcast: bool) -> bytes:
    """Buffers after construction, after 3 training steps, and after one more eval forward."""
    case = Case(model={"batchnorm": True})
    out = []
    for wrap in (DistributedDataParallel, TorchDDP):
        model = make_model(case, ctx.rank)
        with torch.no_grad():
            model.bn.running_mean.fill_(ctx.rank)
            model.bn.running_var.fill_(1 + ctx.rank)
            model.bn.num_batches_tracked.fill_(10 * ctx.rank)
        with warnings.catch_warnings():  # torch 2.13 renames it forward_sync_buffers
            warnings.simplefilter("ignore", FutureWarning)
            ddp = wrap(model, broadcast_buffers=broadcast)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        snaps = [{n: b.clone() for n, b in model.named_buffers()}]
        for step in range(3):
            x, y = batch(case, step, 0, ctx.rank)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        snaps.append({n: b.clone() for n, b in model.named_buffers()})
        ddp.eval()
        with torch.no_grad():
            ddp(batch(case, 9, 0, ctx.rank)[0])
        snaps.append({n: b.clone() for n, b in model.named_buffers()})
        out.append(snaps)
    return pack(out)


def _grads_with_hook(ctx: RankContext, hook_name: str) -> bytes:
    model = make_model(Case(), ctx.rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    hook = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook,
            "avg": allreduce_hook}[hook_name]
    ddp.register_comm_hook(None, hook)
    x, y = batch(Case(), 0, 0, ctx.rank)
    F.cross_entropy(ddp(x), y).backward()
    return pack({n: p.grad.clone() for n, p in model.named_parameters()})


def _custom_hook(ctx: RankContext) -> bytes:
    """A user hook with torch's signature: SUM all-reduce, then divide in a future callback.

    The 419-byte cap makes three buckets: head, fc2, fc1.
    """
    model = make_model(Case(), ctx.rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0004)
    seen = []

    def hook(group: pyddp.ProcessGroup, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        views_ok = all(g.data_ptr() >= buffer.data_ptr() and
                       g.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size()
                       for g in bucket.gradients())
        names = [n for p in bucket.parameters() for n, q in model.named_parameters() if p is q]
        # fc1's gradient is the last one backward computes: a bucket started
        # before it exists overlaps with the rest of backward.
        during_backward = model.fc1.weight.grad is None
        seen.append((bucket.index(), bucket.is_last(), names, views_ok, during_backward))
        fut = group.all_reduce(buffer, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / group.size())

    ddp.register_comm_hook(pyddp.get_default_group(), hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook(None, hook)
    x, y = batch(Case(), 0, 0, ctx.rank)
    F.cross_entropy(ddp(x), y).backward()
    return pack((seen, {n: p.grad.clone() for n, p in model.named_parameters()}))


def _bucket_view_storage(ctx: RankContext) -> None:
    for as_view in (True, False):
        model = make_model(Case(), ctx.rank)
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_view)
        pointers = []
        for step in range(2):
            x, y = batch(Case(), step, 0, ctx.rank)
            F.cross_entropy(ddp(x), y).backward()
            pointers.append([p.grad.data_ptr() for p in model.parameters()])
            storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            # The whole model fits the first bucket: one storage for every gradient.
            assert (len(storages) == 1) == as_view, (as_view, storages)
            model.zero_grad(set_to_none=False)
        assert pointers[0] == pointers[1]


def _unused_without_flag(ctx: RankContext) -> list:
    model = make_model(Case(model={"extra": True}), ctx.rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    messages = []
    for step in range(2):  # the error leaves the group and the wrapper usable
        x, y = batch(Case(), step, 0, ctx.rank)
        loss = F.cross_entropy(ddp(x), y)
        with pytest.raises(RuntimeError) as error:
            loss.backward()
        messages.append(str(error.value))
    t = torch.ones(3)
    pyddp.all_reduce(t)
    assert t.tolist() == [ctx.world_size] * 3
    return messages


def _unused_keeps_its_own_gradient(ctx: RankContext) -> None:
    """A parameter no rank uses keeps whatever grad it had, even one that differs per rank."""
    default = pyddp.reducer.IN_PLACE_MIN_BYTES
    for in_place_min_bytes in (1, None):  # everything in place; everything packed
        model = make_model(Case(model={"extra": True}), ctx.rank)
        if in_place_min_bytes is not None:
            pyddp.reducer.IN_PLACE_MIN_BYTES = in_place_min_bytes
        try:
            ddp = DistributedDataParallel(model, find_unused_parameters=True)
        finally:
            pyddp.reducer.IN_PLACE_MIN_BYTES = default
        stale = torch.full_like(model.unused.weight, float(ctx.rank + 1))
        model.unused.weight.grad = stale.clone()
        x, y = batch(Case(), 0, 0, ctx.rank)
        F.cross_entropy(ddp(x), y).backward()
        assert torch.equal(model.unused.weight.grad, stale), in_place_min_bytes
        assert model.unused.bias.grad is None and model.sometimes.weight.grad is None


def _mismatched_models(ctx: RankContext) -> list:
    messages = []
    model = make_model(Case(), ctx.rank)
    if ctx.rank == 1:
        model.head = nn.Linear(HIDDEN, OUT + 1)
    with pytest.raises(ValueError) as error:
        DistributedDataParallel(model)
    messages.append(str(error.value))
    model = make_model(Case(model={"extra": ctx.rank == ctx.world_size - 1}), ctx.rank)
    with pytest.raises(ValueError) as error:
        DistributedDataParallel(model)
    messages.append(str(error.value))
    model = make_model(Case(), ctx.rank)
    if ctx.rank == 0:
        model.fc2.double()
    with pytest.raises(ValueError) as error:
        DistributedDataParallel(model)
    messages.append(str(error.value))
    # Every rank raised after the same collectives: the group is still in step.
    t = torch.ones(3)
    pyddp.all_reduce(t)
    assert t.tolist() == [ctx.world_size] * 3
    return messages


def _state_dict_round_trip(ctx: RankContext) -> None:
    ours = DistributedDataParallel(make_model(Case(model={"batchnorm": True}), ctx.rank))
    theirs = TorchDDP(make_model(Case(model={"batchnorm": True}), ctx.rank + 7))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(k.startswith("module.") for k in ours.state_dict())
    with torch.no_grad():
        for p in theirs.parameters():
            p.mul_(3)
    checkpoint = pack(theirs.state_dict())  # as torch.save writes a torch DDP checkpoint
    ours.load_state_dict(unpack(checkpoint))
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), k
    fresh = TorchDDP(make_model(Case(model={"batchnorm": True}), ctx.rank + 11))
    fresh.load_state_dict(ours.state_dict())
    for (k, a), b in zip(ours.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k


class _FailOnRank(torch.autograd.Function):
    """Identity whose backward raises on ``rank``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, fail_rank: int) -> torch.Tensor:
        ctx.fail = rank == fail_rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.fail:
            raise RuntimeError("this rank's backward failed on purpose")
        return grad, None, None


class _FailingNet(Net):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = _FailOnRank.apply(torch.relu(self.fc1(x)), self.rank, 1)
        return self.head(torch.relu(self.fc2(h)))


def _fail_mid_backward(ctx: RankContext) -> tuple:
    group = pyddp.new_group("shm", store=dist.FileStore(ctx.store_path("fail"), ctx.world_size),
                            rank=ctx.rank, world_size=ctx.world_size, timeout=FAIL_TIMEOUT)
    ctx.groups["fail"] = group
    torch.manual_seed(0)
    # Small buckets: head's and fc2's all-reduces start before fc1's backward fails.
    ddp = DistributedDataParallel(_FailingNet(ctx.rank), process_group=group,
                                  bucket_cap_mb=0.001)
    x, y = batch(Case(), 0, 0, ctx.rank)
    loss = F.cross_entropy(ddp(x), y)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        loss.backward()
    elapsed = time.monotonic() - start
    later = None
    if ctx.rank == 1:
        with pytest.raises(RuntimeError) as again:
            ddp(x)
        later = str(again.value)
    return str(error.value), elapsed, later


# --- tests ------------------------------------------------------------------------------

CASES = {
    "sgd": Case(),
    "sgd-all-packed": Case(in_place_min_bytes=None, seed=13),
    "adam": Case(optimizer="adam", seed=1),
    "cap-below-a-parameter": Case(ddp={"bucket_cap_mb": 0.0001}, seed=2),  # 104 bytes
    "cap-below-a-parameter-all-packed": Case(ddp={"bucket_cap_mb": 0.0001}, seed=14,
                                             in_place_min_bytes=None),
    "small-caps-adam": Case(ddp={"bucket_cap_mb": 0.001}, optimizer="adam", seed=3),
    "mixed-dtypes": Case(model={"mixed": True}, ddp={"bucket_cap_mb": 0.001}, seed=4),
    "bucket-view": Case(ddp={"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
                        set_to_none=False, seed=5),
    "bucket-view-set-to-none": Case(ddp={"gradient_as_bucket_view": True}, optimizer="adam",
                                    seed=6),
    "no-sync": Case(accumulate=2, seed=7),
    "no-sync-bucket-view": Case(accumulate=2, ddp={"gradient_as_bucket_view": True},
                                set_to_none=False, optimizer="adam", seed=8),
    "unused": Case(model={"extra": True}, extra_ranks=(0,), optimizer="adam", seed=9,
                   ddp={"find_unused_parameters": True, "bucket_cap_mb": 0.001}),
    "unused-bucket-view": Case(model={"extra": True}, extra_ranks=(1,), seed=10,
                               ddp={"find_unused_parameters": True,
                                    "gradient_as_bucket_view": True}),
    "unused-no-sync": Case(model={"extra": True}, extra_ranks=(0,), accumulate=1, seed=11,
                           ddp={"find_unused_parameters": True}),
    # Used in a no_sync backward only: reduced (torch's local_used_map), not left alone.
    "used-only-under-no-sync": Case(model={"extra": True}, extra_ranks=(0,), accumulate=1,
                                    extra_in_sync=False, seed=15,
                                    ddp={"find_unused_parameters": True}),
    "used-only-under-no-sync-all-packed": Case(model={"extra": True}, extra_ranks=(0,),
                                               accumulate=1, extra_in_sync=False, seed=16,
                                               in_place_min_bytes=None,
                                               ddp={"find_unused_parameters": True}),
    "batchnorm": Case(model={"batchnorm": True}, optimizer="adam", seed=12),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_single_process_and_torch_ddp(ranks, name):
    case = CASES[name]
    expected = reference(case, ranks.world_size)
    results = [unpack(r) for r in ranks.run(_train_both, case)]
    ours = [r[0] for r in results]
    theirs = [r[1] for r in results]
    assert_identical_records(ours, f"{name} pyddp")
    for rank in range(ranks.world_size):
        assert_close_records(ours[rank], expected, f"{name} rank {rank} vs single process")
        assert_close_records(ours[rank], theirs[rank], f"{name} rank {rank} vs torch DDP")
    if case.model.get("extra"):
        # Unused on every rank: grad stays None and the parameter never moves.
        for record in ours[0][1:]:
            assert record["grads"]["unused.weight"] is None
        assert torch.equal(ours[0][-1]["params"]["unused.weight"],
                           ours[0][0]["params"]["unused.weight"])


def _train_registered(ctx: RankContext, name: str, hook: bool, mappable: bool = True) -> bytes:
    """``CASES[name]`` trained with pyddp's DDP over the fused collectives on the emulated
    grid (two-shot forced, so that every bucket reads in place), and with torch's DDP.
    ``mappable=False``: the buckets lie in plain memory, which peers cannot map."""
    case = CASES[name]
    if not mappable:
        pyddp.reducer.registered.empty = lambda count, dtype: torch.zeros(count, dtype=dtype)
    options = pyddp.GroupOptions()
    options.algo = pyddp.Algo.TWO_SHOT
    group = pyddp.create_group(
        "emulated", store=dist.FileStore(ctx.store_path(f"emulated-{name}-{hook}"),
                                         ctx.world_size),
        rank=ctx.rank, world_size=ctx.world_size, timeout=datetime.timedelta(seconds=60),
        options=options)
    assert group.can_register("cpu")
    model = make_model(case, ctx.rank)
    default = pyddp.reducer.IN_PLACE_MIN_BYTES
    if case.in_place_min_bytes is not None:
        pyddp.reducer.IN_PLACE_MIN_BYTES = case.in_place_min_bytes
    try:
        ddp = DistributedDataParallel(model, process_group=group, **case.ddp)
    finally:
        pyddp.reducer.IN_PLACE_MIN_BYTES = default
    if hook:
        # the buckets are made again, every gradient packed, and registered again
        ddp.register_comm_hook(group, allreduce_hook)
    engine = group._engines["cpu"]
    start = engine.registered_launches
    ours = train(case, model, ddp, ctx.rank, ddp.no_sync)
    launches = engine.registered_launches - start
    buffers = sum(1 for bucket in ddp.reducer._buckets if bucket.buffer.numel())
    group.shutdown()
    if not mappable:
        pyddp.reducer.registered.empty = pyddp.registered.empty
    torch_model = make_model(case, ctx.rank)
    torch_ddp = TorchDDP(torch_model, **case.ddp)
    theirs = train(case, torch_model, torch_ddp, ctx.rank, torch_ddp.no_sync)
    return pack((ours, theirs, launches, buffers))


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook", [False, True], ids=["no-hook", "allreduce-hook"])
@pytest.mark.parametrize("name", ["small-caps-adam", "bucket-view", "no-sync"])
def test_buckets_registered_with_fused_collectives_are_read_in_place(ranks, name, hook):
    case = CASES[name]
    expected = reference(case, ranks.world_size)
    results = [unpack(r) for r in ranks.run(_train_registered, name, hook)]
    ours = [r[0] for r in results]
    assert_identical_records(ours, f"{name} pyddp over registered buckets")
    for rank, (mine, theirs, launches, buffers) in enumerate(results):
        assert_close_records(mine, expected, f"{name} rank {rank} vs single process")
        assert_close_records(mine, theirs, f"{name} rank {rank} vs torch DDP")
        # every bucket's buffer, once per synchronised backward; nothing else
        assert buffers > 0 and launches == case.steps * buffers, (rank, launches, buffers)


@pytest.mark.multiprocess
def test_buckets_the_group_cannot_register_stage_and_train_alike(ranks):
    # every rank's registration fails alike (plain memory): a warning, and the
    # buckets stage
    case = CASES["small-caps-adam"]
    expected = reference(case, ranks.world_size)
    results = [unpack(r) for r in ranks.run(_train_registered, "small-caps-adam", False, False)]
    for rank, (mine, theirs, launches, buffers) in enumerate(results):
        assert_close_records(mine, expected, f"rank {rank} vs single process")
        assert_close_records(mine, theirs, f"rank {rank} vs torch DDP")
        assert buffers > 0 and launches == 0, (rank, launches, buffers)


@pytest.mark.multiprocess
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "view"])
def test_no_sync_backward_does_not_communicate(ranks, as_view):
    got = [unpack(r) for r in ranks.run(_no_sync_keeps_gradients_local, as_view)]
    model = make_model(Case(), 0)
    for rank, grads in enumerate(got):
        model.zero_grad()
        x, y = batch(Case(), 0, 0, rank)
        F.cross_entropy(model(x), y).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.multiprocess
def test_buffers_are_broadcast_before_each_forward_as_torch_does(ranks):
    n = ranks.world_size
    for broadcast in (True, False):
        got = [unpack(r) for r in ranks.run(_buffers, broadcast)]
        for rank in range(n):
            ours, theirs = got[rank]
            for when in range(3):
                for name in ours[when]:
                    torch.testing.assert_close(ours[when][name], theirs[when][name],
                                               msg=lambda m: f"{broadcast} {when} {name}: {m}")
        for when in (0, 2):  # after construction and after a forward that followed a synced one
            for rank in range(1, n):
                for name, buf in got[0][0][when].items():
                    assert torch.equal(got[rank][0][when][name], buf) == broadcast, (
                        broadcast, when, rank, name)
        # Each rank updated its running stats with its own batch in the last forward.
        assert not torch.equal(got[0][0][1]["bn.running_mean"], got[1][0][1]["bn.running_mean"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("hook_name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_compression_hooks_average_in_half_precision(ranks, hook_name, dtype):
    n = ranks.world_size
    got = [unpack(r) for r in ranks.run(_grads_with_hook, hook_name)]
    model = make_model(Case(), 0)
    local = []
    for rank in range(n):
        model.zero_grad()
        x, y = batch(Case(), 0, 0, rank)
        F.cross_entropy(model(x), y).backward()
        local.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name in local[0]:
        exact = sum(g[name] for g in local) / n
        compressed = (sum(g[name].to(dtype).float() for g in local) / n).to(dtype).float()
        for rank in range(n):
            grad = got[rank][name]
            assert torch.equal(grad, got[0][name]), (rank, name)
            assert torch.equal(grad.to(dtype).float(), grad), f"{name} is not {dtype}-valued"
            ulp = 2 ** -10 if dtype == torch.float16 else 2 ** -7
            torch.testing.assert_close(grad, compressed, rtol=ulp, atol=1e-6)
            torch.testing.assert_close(grad, exact, rtol=4 * ulp, atol=1e-4)


@pytest.mark.multiprocess
def test_allreduce_hook_averages_like_no_hook(ranks):
    expected = reference(Case(steps=1), ranks.world_size)[1]["grads"]
    for grads in (unpack(r) for r in ranks.run(_grads_with_hook, "avg")):
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7)


@pytest.mark.multiprocess
def test_custom_comm_hook_gets_torchs_bucket_api(ranks):
    n = ranks.world_size
    got = [unpack(r) for r in ranks.run(_custom_hook)]
    expected = reference(Case(steps=1), n)[1]["grads"]
    names = [name for name, _ in make_model(Case(), 0).named_parameters()]
    for seen, grads in got:
        assert [s[0] for s in seen] == list(range(len(seen))) and len(seen) > 2, seen
        assert [s[1] for s in seen] == [False] * (len(seen) - 1) + [True]
        assert all(s[3] for s in seen), "gradients() are not views into buffer()"
        assert [s[4] for s in seen] == [True] * (len(seen) - 1) + [False], seen
        in_buckets = [name for s in seen for name in s[2]]
        assert in_buckets == list(reversed(names)), in_buckets
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-5, atol=1e-7)
    assert got[0][0] == got[-1][0]


@pytest.mark.multiprocess
def test_gradients_are_bucket_views_only_when_asked(ranks):
    ranks.run(_bucket_view_storage)


@pytest.mark.multiprocess
def test_unused_parameters_without_the_flag_are_named_in_the_same_backward(ranks):
    for messages in ranks.run(_unused_without_flag):
        for m in messages:
            assert "received no gradient in this backward" in m, m
            assert "unused.weight, unused.bias, sometimes.weight, sometimes.bias" in m, m
            assert "find_unused_parameters=True" in m, m


@pytest.mark.multiprocess
def test_gradient_of_a_parameter_no_rank_used_is_left_alone(ranks):
    ranks.run(_unused_keeps_its_own_gradient)


@pytest.mark.multiprocess
def test_mismatched_models_fail_on_every_rank_naming_parameter_and_ranks(ranks):
    n = ranks.world_size
    others = ", ".join(str(r) for r in range(n) if r != 1)
    last = n - 1
    for rank, (shape, count, dtype) in enumerate(ranks.run(_mismatched_models)):
        assert f"rank {rank}: the ranks' models differ at parameter/buffer #4" in shape, shape
        assert f"{others}: parameter 'head.weight': shape [{OUT}, {HIDDEN}], float32" in shape
        assert f"rank 1: parameter 'head.weight': shape [{OUT + 1}, {HIDDEN}], float32" in shape
        assert "#6" in count and f"rank {last}: parameter 'unused.weight'" in count, count
        assert "nothing (fewer parameters and buffers)" in count, count
        assert "rank 0: parameter 'fc2.weight': shape [20, 20], float64" in dtype, dtype


@pytest.mark.multiprocess
def test_state_dict_round_trips_with_torch_ddp(ranks):
    ranks.run(_state_dict_round_trip)


@pytest.mark.multiprocess
def test_a_rank_failing_mid_backward_is_named_by_the_others(ranks):
    results = ranks.run(_fail_mid_backward, timeout=60)
    for rank, (message, elapsed, later) in enumerate(results):
        if rank == 1:
            assert "failed on purpose" in message, message
            assert "previous synchronised backward did not finish" in later, later
            continue
        assert f"rank {rank}: the gradient all-reduce of bucket" in message, message
        assert "rank 1 did not arrive" in message, message
        assert elapsed < FAIL_TIMEOUT.total_seconds() + 10, elapsed


def test_constructor_arguments_are_checked():
    group = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"rank 0: device_ids=\[0\] .* must be None for a CPU"):
            DistributedDataParallel(Net(), device_ids=[0], process_group=group)
        with pytest.raises(ValueError, match="no parameter that requires a gradient"):
            DistributedDataParallel(nn.ReLU(), process_group=group)
        with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
            DistributedDataParallel(Net(), process_group=group, bucket_cap_mb=0)
        with pytest.raises(RuntimeError, match="no process group: call pyddp.init_process_group"):
            DistributedDataParallel(Net())
    finally:
        group.shutdown()


def test_single_rank_group_trains_like_one_process():
    group = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        case = Case(steps=2)
        model = make_model(case, 0)
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
        assert_close_records(train(case, model, ddp, 0, ddp.no_sync), reference(case, 1),
                             "world 1", rtol=0, atol=0)
    finally:
        group.shutdown()
