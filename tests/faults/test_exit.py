"""A process that exits cleanly with its groups: after destroying them inside a future
callback, or without destroying them at all, leaving its unreceived messages behind;
nothing aborts and nothing is left in /dev/shm.
"""

from __future__ import annotations

import textwrap

import pytest

from harness import pyddp_segments
from script_ranks import next_line, script_ranks

pytestmark = pytest.mark.multiprocess


CALLBACK_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    import pyddp

    rank, path = int(sys.argv[1]), sys.argv[2]
    pyddp.init_process_group("shm", store=dist.FileStore(path, 2), rank=rank, world_size=2)

    class SlowToDrop:
        def __del__(self):
            time.sleep(0.5)  # GIL released: the main thread reaches exit meanwhile

    def make_callback():
        keep = SlowToDrop()

        def callback(fut):
            assert keep is not None
            pyddp.destroy_process_group()
            return fut.value()
        return callback

    # The worker drops the callback (and SlowToDrop) after completing the
    # future that the main thread waits for.
    fut = pyddp.all_reduce(torch.ones(4), async_op=True).get_future().then(make_callback())
    print("sum", fut.wait()[0][0].item(), flush=True)
""")


def _run_ranks(script: str, world: int, timeout: float) -> list:
    with script_ranks(script, world) as procs:
        return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]


def test_destroy_inside_a_future_callback_then_exit_is_clean():
    for out, err, code in _run_ranks(CALLBACK_SCRIPT, 2, 120):
        assert code == 0 and "sum 2.0" in out, (code, out, err)
        assert "terminate called" not in err and "Fatal Python error" not in err, err


# Rank 0 leaves a message rank 1 never receives on a torch.distributed "pyddp" group
# and on one of pyddp's own, then exits without destroying either; rank 1 waits for
# its word (stdin) to exit the same way. A reference nothing drops keeps both groups
# alive to the end of each process, as torch does with its groups under torch 2.14.
EXIT_SCRIPT = textwrap.dedent("""
    import ctypes, datetime, sys
    import torch, torch.distributed as dist
    import pyddp

    rank, path, own_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=timeout)
    torchs = dist.new_group(backend="pyddp")
    own = pyddp.new_group("shm", store=dist.FileStore(own_path, 2), rank=rank,
                          world_size=2, timeout=timeout)
    for group in (torchs, own):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    if rank == 0:
        torchs.send([torch.ones(3)], 1, 0)
        pyddp.isend(torch.ones(3), 1, group=own)
    print("sent" if rank == 0 else "waiting", flush=True)
    if rank == 1:
        sys.stdin.readline()
""")


def test_a_rank_that_exits_without_destroying_its_groups_leaves_no_segment(tmp_path):
    before = set(pyddp_segments())
    with script_ranks(EXIT_SCRIPT, 2, str(tmp_path / "own")) as procs:
        assert next_line(procs[1], 60) == "waiting\n"
        out, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 0 and "sent" in out, (procs[0].returncode, out, err)
        # Rank 1 is still alive, so it has reclaimed nothing: rank 0's exit took its
        # channels (its sends' messages unreceived) out of /dev/shm.
        assert set(pyddp_segments()) == before
        out, err = procs[1].communicate("exit\n", timeout=60)
        assert procs[1].returncode == 0, (out, err)
    assert set(pyddp_segments()) == before
