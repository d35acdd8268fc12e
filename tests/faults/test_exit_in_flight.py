"""Interpreter exit with threads inside collectives, point-to-point waits and Work.wait():
the process ends with the script's exit status, its peers are told at once, nothing is
left in /dev/shm and nothing aborts. Rank 0's daemon threads wait on peers that never
come while its main thread returns; rank 1 then finds every group failed, naming rank 0.
Run on one host (the shm engine) and with the ranks on two simulated hosts through
PYDDP_HOSTID (the engine across hosts, over gloo).
"""

from __future__ import annotations

import textwrap

import pytest

from harness import pyddp_segments
from script_ranks import script_ranks

pytestmark = pytest.mark.multiprocess

# Each group is used by one thread, as torch.distributed requires; every kind of wait
# that a thread can be in when the interpreter exits has its group.
EXIT_SCRIPT = textwrap.dedent("""
    import datetime, sys, threading, time
    import torch, torch.distributed as dist
    import pyddp

    rank, path = int(sys.argv[1]), sys.argv[2]
    timeout = datetime.timedelta(seconds=60)
    store = dist.FileStore(path, 2)
    dist.init_process_group("pyddp", store=dist.PrefixStore("torch", store), rank=rank,
                            world_size=2, timeout=timeout)
    groups = {name: pyddp.new_group("auto", store=dist.PrefixStore(name, store), rank=rank,
                                    world_size=2, timeout=timeout)
              for name in ("small", "large", "async", "recv")}
    print("layout", groups["small"].layout(), flush=True)

    def small():
        groups["small"].all_reduce(torch.ones(16))

    def large():
        groups["large"].all_reduce(torch.ones(65536))

    def waited():
        groups["async"].all_reduce(torch.ones(1000), async_op=True).wait()

    def received():
        groups["recv"].recv(torch.zeros(8), 1)

    def through_torch():
        dist.all_reduce(torch.ones(16))

    if rank == 0:
        for fn in (small, large, waited, received, through_torch):
            threading.Thread(target=fn, daemon=True).start()
        time.sleep(1.0)  # every thread is waiting on rank 1 by then
        print("exiting", flush=True)
        sys.exit(7)
    # Rank 1 never joins those calls; once rank 0 is gone, each group fails (naming
    # rank 0 where the engine can tell: gloo, between hosts, says only that a
    # connection closed).
    print("ready", flush=True)
    sys.stdin.readline()
    told = []
    for name, call in [*((n, g.barrier) for n, g in groups.items()), ("torch", dist.barrier)]:
        try:
            call()
        except dist.DistBackendError as error:
            told.append(name + ("(rank 0)" if "rank 0" in str(error) else ""))
    print("told", " ".join(told), flush=True)
""")

RUNS = 4  # the abort it guards against struck in about half the exits


@pytest.mark.parametrize("hosts", [1, 2], ids=["one-host", "two-hosts"])
def test_exit_with_threads_inside_calls_is_clean(hosts):
    before = set(pyddp_segments())
    # Two hosts: PYDDP_HOSTID gives each rank a host of its own.
    host = (lambda r: {"PYDDP_HOSTID": f"host{r}"}) if hosts == 2 else None
    for run in range(RUNS):
        with script_ranks(EXIT_SCRIPT, 2, env=host) as procs:
            out0, err0 = procs[0].communicate(timeout=120)
            assert procs[0].returncode == 7, (run, procs[0].returncode, err0)
            assert "exiting" in out0, (run, out0, err0)
            for bad in ("terminate called", "Fatal Python error", "Exception ignored",
                        "Exception in thread"):
                assert bad not in err0, (run, err0)
            out1, err1 = procs[1].communicate("go\n", timeout=120)
            assert procs[1].returncode == 0, (run, procs[1].returncode, err1)
            named = "(rank 0)" if hosts == 1 else ""
            told = " ".join(f"{name}{named}" for name in ("small", "large", "async", "recv",
                                                           "torch"))
            assert f"told {told}\n" in out1, (run, out1, err1)
            assert ("hierarchical" in out0 or "gloo" in out0) == (hosts == 2), out0
        assert set(pyddp_segments()) <= before, (run, set(pyddp_segments()) - before)
