"""pyddp groups that differ in one setting, side by side, round after round.

Two spawned ranks make one pyddp group per variant of a comparison, identical
but for the options it names, and time a loop of one collective on each in
turn, round after round, so that all see the same placement of the two
ranks' cores even when the host moves them
(benchmarks/studies/where-the-host-puts-the-two-vcpus.md). Prints each
round's time per call for each
variant, and the last variant's time over the fastest of the others. Each
group's first call is checked against the expected result. Comparisons:

- ``slot_stores``: ``GroupOptions.slot_stores`` CACHED, STREAMING and AUTO
  (last/best 1: auto picked right);
- ``cma``: all_gather and broadcast through the ring's slots (``cma``
  NEVER), through a single copy by the kernel (ALWAYS: cross-memory attach)
  and as rank 0 picks from its times (AUTO; last/best 1: it picked right);
- ``loop_isa``: the reduction kernels' loops compiled for each instruction
  set this CPU runs (x86-64's baseline, AVX2), switched in both ranks before
  each group's loop (last/best 1: the default is the fastest);
- ``switches``: what the first calls after a switch between those two paths
  cost (rank 1's time of each; the chooser of AUTO does not time the first).
  A round runs SWITCH_BEFORE calls on one path, then SWITCH_AFTER timed
  calls on the other, SWITCH_REPEATS times, and prints the median of each of
  those calls beside the median call of a run of that path alone.

    python benchmarks/side_by_side.py [slot_stores|cma|switches] \
        [all_gather|broadcast|all_reduce] [bytes per rank] [rounds]
    python benchmarks/side_by_side.py loop_isa all_reduce [bytes per rank] [rounds]

Run benchmarks/core_distance.cpp before and after to know which case a run saw.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import pyddp
from pyddp._C import _testing

COMPARISONS = {
    "slot_stores": (("cached", {"slot_stores": pyddp.SlotStores.CACHED}),
                    ("streaming", {"slot_stores": pyddp.SlotStores.STREAMING}),
                    ("auto", {"slot_stores": pyddp.SlotStores.AUTO})),
    "cma": (("slots", {"cma": pyddp.CmaReads.NEVER}),
            ("kernel", {"cma": pyddp.CmaReads.ALWAYS, "cma_min_bytes": 0}),
            ("auto", {"cma": pyddp.CmaReads.AUTO})),
    "switches": (("slots", {"cma": pyddp.CmaReads.NEVER}),
                 ("kernel", {"cma": pyddp.CmaReads.ALWAYS, "cma_min_bytes": 0})),
    "loop_isa": tuple((isa.name.lower(), {}) for isa in _testing.supported_loop_isas()),
}
SWITCH_BEFORE, SWITCH_AFTER, SWITCH_REPEATS = 28, 4, 30
ROUND_SECONDS = 0.02
"""How long one group's loop of a round copies, at the 2 GB/s it reaches at the least."""
TIMEOUT = datetime.timedelta(seconds=60)
"""Of every collective: a rank that dies fails its peer's next call at once or within this."""
RESULTS_SECONDS = 600
"""How long the parent waits for all rounds."""


def _rank(rank: int, rendezvous: str, comparison: str, op: str, nbytes: int, rounds: int,
          results) -> None:
    torch.set_num_threads(1)
    groups = {}
    for name, settings in COMPARISONS[comparison]:
        options = pyddp.GroupOptions()
        for key, value in settings.items():
            setattr(options, key, value)
        groups[name] = pyddp.new_group("shm", init_method=f"file://{rendezvous}.{name}",
                                       rank=rank, world_size=2, timeout=TIMEOUT,
                                       options=options)
    n = nbytes // 4
    mine = torch.arange(n, dtype=torch.float32) + rank
    tensor, out = mine.clone(), torch.empty(2 * n)

    def call(pg: pyddp.ProcessGroup) -> None:
        if op == "all_gather":
            pg.all_gather_single(out, mine)
        elif op == "broadcast":
            pg.broadcast(tensor, 0)
        else:
            pg.all_reduce(tensor)

    for pg in groups.values():
        tensor.copy_(mine)
        call(pg)
        expected = {"all_gather": (out, torch.cat([mine - rank, mine - rank + 1])),
                    "broadcast": (tensor, mine - rank),
                    "all_reduce": (tensor, 2 * (mine - rank) + 1)}[op]
        assert torch.equal(*expected), f"rank {rank}: wrong {op} result"
    iters = max(5, int(ROUND_SECONDS / (nbytes / 2e9)))
    # Rank 1's times in a switch: a broadcast's root returns before the slots are read.
    reporter = 1 if comparison == "switches" else 0
    for _ in range(rounds):
        row = (_switch_round(groups, call) if comparison == "switches"
               else _loop_round(groups, call, iters, comparison))
        if rank == reporter:
            results.put(row)
    for pg in groups.values():
        pyddp.destroy_process_group(pg)


def _loop_round(groups: dict, call: Callable[[pyddp.ProcessGroup], None], iters: int,
                comparison: str) -> list:
    """Per group: seconds per call of a loop of `iters` calls."""
    row = []
    for name, pg in groups.items():
        if comparison == "loop_isa":
            _testing.use_loop_isa(_testing.LoopIsa.__members__[name.upper()])
        call(pg)
        pg.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call(pg)
        row.append((time.perf_counter() - start) / iters)
    return row


def _timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _switch_round(groups: dict, call: Callable[[pyddp.ProcessGroup], None]) -> list:
    """Per path: the median time of each of the first SWITCH_AFTER calls
    after SWITCH_BEFORE on the other path, then that of a run of its own."""
    row = []
    for name, pg in groups.items():
        other = next(g for n, g in groups.items() if n != name)
        after: list[list[float]] = [[] for _ in range(SWITCH_AFTER)]
        for _ in range(SWITCH_REPEATS):
            for _ in range(SWITCH_BEFORE):
                call(other)
            for times in after:
                times.append(_timed(lambda: call(pg)))
        run = [_timed(lambda: call(pg)) for _ in range(SWITCH_BEFORE * SWITCH_REPEATS // 4)]
        row.append([statistics.median(t) for t in after] + [statistics.median(run)])
    return row


def main() -> None:
    comparison = sys.argv[1] if len(sys.argv) > 1 else "slot_stores"
    op = sys.argv[2] if len(sys.argv) > 2 else "all_gather"
    nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    if comparison not in COMPARISONS:
        raise SystemExit(f"unknown comparison {comparison!r}: one of {', '.join(COMPARISONS)}")
    if op not in ("all_gather", "broadcast", "all_reduce"):
        raise SystemExit(f"unknown op {op!r}")
    if nbytes < 4 or rounds < 1:
        raise SystemExit("bytes per rank must be at least 4 (one float32), rounds at least 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tempfile.mktemp(prefix="pyddp-side-by-side-")
    procs = [ctx.Process(target=_rank,
                         args=(r, rendezvous, comparison, op, nbytes, rounds, results))
             for r in range(2)]
    for p in procs:
        p.start()
    # Rows are read before the ranks are joined: a rank exits only once the
    # queue has taken what it put.
    rows, deadline = [], time.monotonic() + RESULTS_SECONDS
    try:
        while len(rows) < rounds:
            rows.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
    except queue.Empty:
        pass
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    if len(rows) < rounds or any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: {len(rows)} of {rounds} rounds, exit codes "
                         f"{[p.exitcode for p in procs]}")
    names = [name for name, _ in COMPARISONS[comparison]]
    if comparison == "switches":
        print(f"# {op}, {nbytes} bytes per rank, 2 ranks: rank 1's median us of the first "
              f"{SWITCH_AFTER} calls after a switch, and of a run of the same path")
        for row in rows:
            print("  ".join(f"{name}: " + " ".join(f"{t * 1e6:.1f}" for t in times[:-1])
                            + f" | {times[-1] * 1e6:.1f}" for name, times in zip(names, row)))
        return
    print(f"# {op}, {nbytes} bytes per rank, 2 ranks: us per call")
    print("".join(f"{name:>10} " for name in names) + f"{names[-1] + '/best':>12}")
    for row in rows:
        times = [seconds * 1e6 for seconds in row]
        print("".join(f"{t:>10.1f} " for t in times) + f"{times[-1] / min(times[:-1]):>12.2f}")


if __name__ == "__main__":
    main()
