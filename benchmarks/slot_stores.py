"""Cached, streaming and auto slot stores side by side, round after round.

Two spawned ranks make three pyddp groups, identical but for
``RingOptions.slot_stores`` (CACHED, STREAMING, AUTO), and time a loop of one
collective on each in turn, round after round, so that all three see the
same placement of the two ranks' cores even when the host moves them
(benchmarks/README.md, "Where the host puts the two vCPUs"). Prints each
round's time per call for the three, and auto's time over the faster of the
other two (1: auto picked right). Each group's first call is checked against
the expected result.

    python benchmarks/slot_stores.py [all_gather|broadcast|all_reduce] [bytes per rank] [rounds]

Run benchmarks/core_distance.cpp before and after to know which case a run saw.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import sys
import tempfile
import time

import torch

import pyddp

KINDS = (("cached", pyddp.SlotStores.CACHED), ("streaming", pyddp.SlotStores.STREAMING),
         ("auto", pyddp.SlotStores.AUTO))
ROUND_SECONDS = 0.02
"""How long one group's loop of a round copies, at the 2 GB/s it reaches at the least."""
TIMEOUT = datetime.timedelta(seconds=60)
"""Of every collective: a rank that dies fails its peer's next call at once or within this."""
RESULTS_SECONDS = 600
"""How long the parent waits for all rounds."""


def _rank(rank: int, rendezvous: str, op: str, nbytes: int, rounds: int, results) -> None:
    torch.set_num_threads(1)
    groups = {}
    for name, kind in KINDS:
        options = pyddp.RingOptions()
        options.slot_stores = kind
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
    for _ in range(rounds):
        row = []
        for pg in groups.values():
            call(pg)
            pg.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call(pg)
            row.append((time.perf_counter() - start) / iters)
        if rank == 0:
            results.put(row)
    for pg in groups.values():
        pyddp.destroy_process_group(pg)


def main() -> None:
    op = sys.argv[1] if len(sys.argv) > 1 else "all_gather"
    nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    if op not in ("all_gather", "broadcast", "all_reduce"):
        raise SystemExit(f"unknown op {op!r}")
    if nbytes < 4 or rounds < 1:
        raise SystemExit("bytes per rank must be at least 4 (one float32), rounds at least 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = tempfile.mktemp(prefix="pyddp-slot-stores-")
    procs = [ctx.Process(target=_rank, args=(r, rendezvous, op, nbytes, rounds, results))
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
    print(f"# {op}, {nbytes} bytes per rank, 2 ranks: us per call")
    print(f"{'cached':>10} {'streaming':>10} {'auto':>10} {'auto/best':>10}")
    for row in rows:
        cached, streaming, auto = (seconds * 1e6 for seconds in row)
        print(f"{cached:>10.1f} {streaming:>10.1f} {auto:>10.1f} "
              f"{auto / min(cached, streaming):>10.2f}")


if __name__ == "__main__":
    main()
