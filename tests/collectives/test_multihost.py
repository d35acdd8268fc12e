"""CPU groups that span hosts: shared memory inside each host, gloo between hosts.

Hosts are simulated honestly (tests/support/hosts.py): each is its own UTS and mount
namespace with its own hostname and a private /dev/shm, so no shared memory
passes between them while loopback TCP connects them. Placements: 2 hosts x 2
ranks (even: the hierarchical layout), the same interleaved (ranks 0, 2 on one
host), 3 + 1 (uneven: through host leaders), 3 hosts of one rank (gloo alone);
and PYDDP_HOSTID splitting one real host into two. Every collective, dtype and
op (the bitwise ops included) against the references of the one-host tests,
sparse all-reduce against a one-process sum, receives from any
rank (gloo's recvAnysource), DDP against one process and
torch's DDP over the "pyddp" backend against gloo, a rank killed on the other
host named by the survivors, and nothing left in /dev/shm on any host.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import collective_suite as one_host
import pyddp
import test_p2p as p2p
import test_sparse as sparse
from collective_cases import check_equal
from ddp_cases import (Case, assert_close_records, assert_identical_records, make_model, pack,
                      reference, train, unpack)
from harness import RankContext, Ranks
from hosts import HostRanks
from pyddp import _launch

SKIP = _launch.simulated_hosts_unavailable()
pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(SKIP is not None, reason=f"simulated hosts: {SKIP}")]

TIMEOUT = datetime.timedelta(seconds=60)
GROUP = "multihost"


def _setup(ctx: RankContext) -> None:
    n = ctx.world_size
    pg = pyddp.init_process_group("auto", store=dist.FileStore(ctx.store_path("pyddp"), n),
                                  rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    # The one-host case functions find their group under these names.
    for name in (GROUP, "default", "small"):
        ctx.groups[name] = pg


PLACEMENTS = {
    "2x2": ["a", "a", "b", "b"],
    "2x2-interleaved": ["a", "b", "a", "b"],
    "3+1": ["a", "a", "a", "b"],
    "3x1": ["a", "b", "c"],
}


@pytest.fixture(scope="module", params=list(PLACEMENTS), ids=list(PLACEMENTS))
def hosts(request):
    pool = HostRanks(PLACEMENTS[request.param], setup=_setup)
    pool.name = request.param
    yield pool
    pool.close()


def _layout(ctx: RankContext) -> tuple:
    pg = ctx.groups[GROUP]
    return pg.transports()["cpu"], pg.layout()


def test_the_layout_follows_the_hosts(hosts):
    expected = {"2x2": "hierarchical (shm inside each host", "2x2-interleaved":
                "hierarchical (shm inside each host", "3+1": "through host leaders",
                "3x1": "gloo (one rank per host)"}[hosts.name]
    for transport, layout in hosts.run(_layout):
        assert transport == "shm+gloo", transport
        assert expected in layout, layout
        assert f"{len(set(hosts.placement))} hosts" in layout, layout


def test_every_collective_dtype_and_op(hosts):
    hosts.run(one_host._all_reduce_cases, GROUP)
    hosts.run(one_host._reduce_scatter_cases, GROUP)
    hosts.run(one_host._all_gather_cases, GROUP)
    hosts.run(one_host._broadcast_cases, GROUP)


def test_bitwise_ops_across_hosts(hosts):
    # gloo reduces between hosts with c10d's BAND, BOR and BXOR.
    hosts.run(one_host._bitwise_cases, GROUP)


def test_rooted_all_to_all_coalesced_and_point_to_point(hosts):
    hosts.run(p2p._rooted, GROUP)
    hosts.run(p2p._all_to_all, GROUP)
    hosts.run(p2p._coalesced, GROUP)
    hosts.run(p2p._ring_exchanges, GROUP)


def test_sparse_all_reduce_and_receive_from_any_source(hosts):
    hosts.run(sparse._sparse_cases, GROUP)
    hosts.run(p2p._any_source, GROUP, False)


def _monitored_barrier(ctx: RankContext) -> object:
    """gloo's monitored_barrier, which pyddp hands over across hosts: it passes on the group;
    on a fresh group that rank 1 skips, what each other rank raised."""
    pg, n = ctx.groups[GROUP], ctx.world_size
    pyddp.monitored_barrier(pg, timeout=datetime.timedelta(seconds=30))
    pyddp.monitored_barrier(pg, wait_all_ranks=True)
    pg.barrier()  # the group goes on
    # gloo's ranks that arrived hear of rank 0's failure at their group's timeout.
    fresh = pyddp.create_group("auto", store=dist.FileStore(ctx.store_path("monitored"), n),
                               rank=ctx.rank, world_size=n, timeout=datetime.timedelta(seconds=5))
    try:
        message = None
        if ctx.rank != 1:
            with pytest.raises(RuntimeError) as error:
                pyddp.monitored_barrier(fresh, timeout=datetime.timedelta(seconds=1))
            message = str(error.value)
        # Rank 1 leaves the fresh group once every rank is done with it: its gloo
        # connections closing would otherwise be what rank 0 hears.
        pg.barrier()
        return message
    finally:
        fresh.shutdown()


def test_monitored_barrier_across_hosts_is_gloos(hosts):
    messages = hosts.run(_monitored_barrier)
    assert messages[1] is None
    assert "Rank 1 failed to pass monitoredBarrier in 1000 ms" in messages[0], messages
    for rank in range(2, hosts.world_size):
        assert (f"Rank {rank} successfully reached monitoredBarrier, but received errors while "
                "waiting for send/recv from rank 0") in messages[rank], messages


def _mismatch(ctx: RankContext) -> str:
    """The last rank calls a longer all_reduce: every rank fails, on every host."""
    n = ctx.world_size
    pg = pyddp.create_group("auto", store=dist.FileStore(ctx.store_path("mismatch"), n),
                            rank=ctx.rank, world_size=n, timeout=datetime.timedelta(seconds=20))
    try:
        with pytest.raises(dist.DistBackendError) as error:
            pg.all_reduce(torch.ones(4 + (ctx.rank == n - 1)))
        return str(error.value)
    finally:
        pg.shutdown()


def test_a_mismatch_fails_every_rank(hosts):
    for message in hosts.run(_mismatch):
        assert "differs between ranks" in message and "count from 4 to 5" in message, message


def _ddp(ctx: RankContext) -> bytes:
    case = Case(steps=3)
    model = make_model(case, ctx.rank)
    ddp = pyddp.DistributedDataParallel(model, process_group=ctx.groups[GROUP])
    return pack(train(case, model, ddp, ctx.rank, ddp.no_sync))


def test_ddp_across_hosts_trains_as_one_process(hosts):
    records = [unpack(b) for b in hosts.run(_ddp)]
    assert_identical_records(records, "pyddp DDP across hosts")
    assert_close_records(records[0], reference(Case(steps=3), hosts.world_size),
                         "pyddp DDP across hosts vs one process")


def _torch_ddp(ctx: RankContext) -> bytes:
    """torch's DDP over the "pyddp" backend and over gloo, in the same processes."""
    n = ctx.world_size
    dist.init_process_group("pyddp", store=dist.FileStore(ctx.store_path("torch"), n),
                            rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    try:
        gloo = dist.new_group(backend="gloo")
        out = {}
        for name, group in (("pyddp", None), ("gloo", gloo)):
            torch.manual_seed(ctx.rank)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 2))
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(ctx.rank)
            for _ in range(3):
                opt.zero_grad()
                ddp(torch.randn(4, 8, generator=gen)).square().sum().backward()
                opt.step()
            out[name] = [p.detach().clone() for p in model.parameters()]
        return pack(out)
    finally:
        dist.destroy_process_group()


def test_torch_ddp_over_pyddp_across_hosts_matches_gloo(hosts):
    results = [unpack(b) for b in hosts.run(_torch_ddp)]
    for r, result in enumerate(results):
        for mine, theirs in zip(result["pyddp"], result["gloo"]):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        for mine, first in zip(result["pyddp"], results[0]["pyddp"]):
            assert torch.equal(mine, first), f"rank {r}'s parameters differ from rank 0's"


def _pyddp_segments(ctx: RankContext) -> list:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("pyddp-"))


def _refuse_shm(ctx: RankContext) -> str:
    n = ctx.world_size
    with pytest.raises(ValueError) as error:
        pyddp.create_group("shm", store=dist.FileStore(ctx.store_path("shm-only"), n),
                           rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    return str(error.value)


def test_shm_refuses_a_group_across_hosts_and_names_auto(hosts):
    for message in hosts.run(_refuse_shm):
        assert "the ranks span" in message and "shared memory serves one host" in message, message
        assert "use the backend 'auto'" in message, message
        assert "ranks 0" in message or "rank 0" in message, message


def _strided(ctx: RankContext) -> None:
    """Non-contiguous tensors across hosts, as on one host; the group goes on after them."""
    pg, n, r = ctx.groups[GROUP], ctx.world_size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.zeros(6, 2)
    works = [pg.isend((torch.arange(12.0) + r).reshape(6, 2)[:, 0], right),
             pg.irecv(got[:, 1], left)]
    for work in works:
        work.wait()
    check_equal(got[:, 1], torch.arange(6.0) * 2 + left, "irecv into a column")
    check_equal(got[:, 0], torch.zeros(6), "the column beside it")
    row = torch.zeros(3, 2)
    if r % 2:
        pg.recv(row[:, 0], left, 1)
        pg.send(torch.full((3, 2), float(r))[:, 1], right, 1)
    else:
        pg.send(torch.full((3, 2), float(r))[:, 1], right, 1)
        pg.recv(row[:, 0], left, 1)
    check_equal(row[:, 0], torch.full((3,), float(left)), "recv into a column")
    gathered = [torch.zeros(4, 2)[:, 1] for _ in range(n)] if r == 0 else None
    pg.gather(torch.full((4, 2), float(r))[:, 0], gathered, 0)
    if r == 0:
        for k in range(n):
            check_equal(gathered[k], torch.full((4,), float(k)), f"gather from {k}")
    out = torch.zeros(3, 2)
    pg.scatter(out[:, 0], [torch.full((3, 2), float(k))[:, 1] for k in range(n)]
               if r == 0 else None, 0)
    check_equal(out[:, 0], torch.full((3,), float(r)), "scatter into a column")
    flat = torch.arange(2.0 * n) + 100 * r
    both = torch.zeros(2 * n, 2)
    pg.all_to_all_single(both[:, 1], torch.stack([flat, flat], 1)[:, 0])
    expected = torch.cat([torch.tensor([2.0 * r, 2.0 * r + 1]) + 100 * s for s in range(n)])
    check_equal(both[:, 1], expected, "all_to_all_single into a column")
    t = torch.ones(3)
    pg.all_reduce(t)
    check_equal(t, torch.full((3,), float(n)), "all_reduce after them")


def test_non_contiguous_tensors_across_hosts(hosts):
    hosts.run(_strided)


def _p2p_with_the_dead(ctx: RankContext) -> str:
    pg = pyddp.create_group("auto", store=dist.FileStore(ctx.store_path("p2p-kill"),
                                                         ctx.world_size),
                            rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=20))
    pg.barrier()
    if ctx.rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if ctx.rank != 0:
        return ""
    with pytest.raises(dist.DistBackendError) as error:
        pg.recv(torch.zeros(4), 3, 2)
    return str(error.value)


def test_a_receive_from_a_rank_killed_on_another_host_names_it():
    pool = HostRanks(PLACEMENTS["2x2"])
    try:
        message = pool.run_each([_p2p_with_the_dead] * 4, timeout=120, allow_dead=True)[0]
    finally:
        pool.close()
    assert message.startswith("pyddp: rank 0: recv from rank 3 (tag 2) across hosts failed: "), \
        message
    assert "pyddp: pyddp:" not in message, message


# --- a rank killed on another host ------------------------------------------------


def _loop_until_failure(ctx: RankContext) -> tuple:
    pg = pyddp.create_group("auto", store=dist.FileStore(ctx.store_path("kill"), ctx.world_size),
                            rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(seconds=20))
    start = None
    try:
        t = torch.ones(1000)
        for i in range(100_000):
            if i == 5:
                open(os.path.join(ctx.tmpdir, f"looping{ctx.rank}"), "w").close()
                start = time.monotonic()
            pg.all_reduce(t)
        return "", 0.0
    except dist.DistBackendError as error:
        return str(error), time.monotonic() - (start or time.monotonic())
    finally:
        pg.shutdown()


def test_a_rank_killed_on_another_host_is_named_and_nothing_stays_in_shm():
    pool = HostRanks(PLACEMENTS["2x2"])
    try:
        victim = 3
        results = {}
        runner = threading.Thread(target=lambda: results.update(
            out=pool.run_each([_loop_until_failure] * 4, timeout=120, allow_dead=True)))
        runner.start()
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(pool.tmpdir, f"looping{r}")) for r in range(4)):
            assert time.monotonic() < deadline, "the survivors never started"
            time.sleep(0.05)
        pool.kill(victim)
        runner.join(150)
        assert not runner.is_alive(), "the survivors did not finish"
        for r, result in enumerate(results["out"]):
            if r == victim:
                continue
            message, elapsed = result
            assert "rank 3" in message, (r, message)
            assert "pyddp: pyddp:" not in message, (r, message)
            assert elapsed < 20 + 10, (r, elapsed)  # within the group's timeout
        for r, left in enumerate(pool.run_each([_pyddp_segments] * 4, allow_dead=True)):
            assert r == victim or left == [], (r, left)
    finally:
        pool.close()


# --- PYDDP_HOSTID: one machine as two hosts -------------------------------------------


def _split_by_hostid(ctx: RankContext) -> tuple:
    n = ctx.world_size
    os.environ["PYDDP_HOSTID"] = "left" if ctx.rank < n // 2 else "right"
    pg = pyddp.create_group("auto", store=dist.FileStore(ctx.store_path("hostid"), n),
                            rank=ctx.rank, world_size=n, timeout=TIMEOUT)
    try:
        ctx.groups["split"] = pg
        one_host._all_reduce_cases(ctx, "split")
        return pg.transports()["cpu"], pg.layout()
    finally:
        ctx.groups.pop("split")
        pg.shutdown()
        del os.environ["PYDDP_HOSTID"]


def test_pyddp_hostid_makes_one_machine_two_hosts():
    pool = Ranks(4)
    try:
        for transport, layout in pool.run(_split_by_hostid):
            assert transport == "shm+gloo", transport
            assert "2 hosts: ranks 0,1 on left; ranks 2,3 on right" in layout, layout
    finally:
        pool.close()
