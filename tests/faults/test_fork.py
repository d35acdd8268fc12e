"""A process that inherits groups through fork() owns none of them: whatever the child
does (exit normally, drop the group and collect it, destroy it, or do so in a
multiprocessing fork child) leaves its parent's groups working for the parent and its
peers, and a collective on an inherited group raises, naming the process that made it
and the fix. For pyddp's own groups and torch.distributed's "pyddp" groups, on 2 and 3
ranks.
"""

from __future__ import annotations

import textwrap

import pytest

from harness import pyddp_segments
from script_ranks import script_ranks

pytestmark = pytest.mark.multiprocess

# Every rank runs the scenarios in order; after each one, rank 0 (the only one that
# forks) checks its child's exit code, and every rank runs an all_reduce on the group
# the child inherited and checks the sum. Nothing in the script catches SystemExit
# or runs a finally: a child's sys.exit ends it as a script's exit would.
FORK_SCRIPT = textwrap.dedent("""
    import datetime, gc, multiprocessing, os, sys, time
    import torch, torch.distributed as dist
    import pyddp

    rank, path, world, kind = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    timeout = datetime.timedelta(seconds=60)
    store = dist.FileStore(path, world)
    groups = {}
    if kind == "pyddp":
        groups["pg"] = pyddp.new_group("shm", store=store, rank=rank, world_size=world,
                                       timeout=timeout)
        all_reduce = lambda t: groups["pg"].all_reduce(t)
        def drop():
            groups.clear()
            gc.collect()
        destroy = lambda: pyddp.destroy_process_group(groups["pg"])
    else:
        dist.init_process_group("pyddp", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        all_reduce = dist.all_reduce
        drop = destroy = dist.destroy_process_group

    def use():
        try:
            all_reduce(torch.ones(4))
        except RuntimeError as error:
            text = str(error)
            ok = f"made by process {os.getppid()}" in text and "fork" in text
            print("refused" if ok else "wrong message: " + text, flush=True)
            sys.exit(0 if ok else 3)
        sys.exit(4)

    def in_multiprocessing_child():
        child = multiprocessing.get_context("fork").Process(target=drop)
        child.start()
        child.join(60)
        if child.exitcode is None:
            child.kill()
        sys.exit(child.exitcode)

    scenarios = {"exit": lambda: sys.exit(0), "drop": lambda: (drop(), sys.exit(0)),
                 "destroy": lambda: (destroy(), sys.exit(0)),
                 "multiprocessing": in_multiprocessing_child, "use": use}
    for step, (name, action) in enumerate(scenarios.items()):
        if rank == 0:
            pid = os.fork()
            if pid == 0:
                action()
            code = None
            deadline = time.monotonic() + 60
            while code is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    code = os.waitstatus_to_exitcode(status)
                elif time.monotonic() > deadline:
                    from stacks import stacks_of
                    code = "hung; " + stacks_of(pid)
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                else:
                    time.sleep(0.02)
            assert code == 0, f"the child of {name} exited with {code}"
        t = torch.full((8,), float(rank + step))
        all_reduce(t)
        expected = sum(r + step for r in range(world))
        assert torch.equal(t, torch.full((8,), float(expected))), (name, t)
        print("after", name, "ok", flush=True)
""")


@pytest.mark.parametrize("world", [2, 3], ids=lambda n: f"world{n}")
@pytest.mark.parametrize("kind", ["pyddp", "torch"])
def test_a_forked_child_never_touches_its_parents_groups(kind, world):
    before = set(pyddp_segments())
    with script_ranks(FORK_SCRIPT, world, str(world), kind) as procs:
        results = [p.communicate(timeout=240) + (p.returncode,) for p in procs]
    for rank, (out, err, code) in enumerate(results):
        # A string, which pytest shows whole: a hung child's report is long.
        assert code == 0, f"rank {rank} exited with {code}\nstdout:\n{out}\nstderr:\n{err}"
        for name in ("exit", "drop", "destroy", "multiprocessing", "use"):
            assert f"after {name} ok" in out, (rank, name, out, err)
        for bad in ("terminate called", "Fatal Python error", "wrong message"):
            assert bad not in out + err, (rank, out, err)
    assert "refused" in results[0][0], results[0]
    assert set(pyddp_segments()) <= before, set(pyddp_segments()) - before
