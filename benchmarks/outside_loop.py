"""pyddp beside Open MPI, timed by a plain loop over each library's public Python API.

A check of `python -m pyddp.bench` by other means: no timing loop of the bench,
no calibration, only ``pyddp.ProcessGroup`` calls and mpi4py calls on the same
CPU tensors (numpy views for MPI), in rounds that alternate between the two
libraries so that both see the same load. Every rank checks the result of
each call once before timing it. Prints, per op and size, each library's
median time per call over the rounds and the median over rounds of pyddp's
time / MPI's time measured back to back (below 1: pyddp is faster).

    mpirun --allow-run-as-root -np 2 --bind-to none \\
        python -m mpi4py benchmarks/outside_loop.py [--sizes 4K,1M] [--rounds 8]

(``-m mpi4py``: a rank that fails aborts the others instead of leaving them in
a barrier.)

Sizes are bytes per rank (all_gather's output and reduce_scatter's input are
world_size times that).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Optional

import torch
from mpi4py import MPI

import pyddp

OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")
WARMUP_CALLS = 200
"""Calls before a library's first timed loop, and in the loop that sizes the timed ones:
enough to fault in every buffer and settle each library's first-call work."""
TARGET_SECONDS = 0.05
"""How long one library's loop of one round runs: long enough that a clock read is
nothing beside it, short enough that the rounds alternate every few tenths of a second."""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


Call = Callable[[], None]


def _checked(ours: Call, theirs: Call, outputs: tuple[torch.Tensor, torch.Tensor],
             expected: torch.Tensor, reset: Call = lambda: None
             ) -> tuple[Call, Call, Callable[[], Optional[str]]]:
    """``(ours, theirs, check)``: check runs both once (after ``reset``) and compares
    both outputs with ``expected``."""
    def check() -> Optional[str]:
        reset()
        ours()
        theirs()
        return None if all(torch.equal(o, expected) for o in outputs) else "wrong result"
    return ours, theirs, check


def calls(op: str, nbytes: int, pg: pyddp.ProcessGroup, comm: MPI.Comm
          ) -> tuple[Call, Call, Callable[[], Optional[str]]]:
    """(pyddp's call, MPI's call, a check of both results) for ``op`` on ``nbytes`` per rank."""
    n, world, rank = nbytes // 4, comm.Get_size(), comm.Get_rank()
    base = torch.arange(n, dtype=torch.float32) % 97
    mine = base + rank
    if op == "barrier":
        return pg.barrier, comm.Barrier, lambda: None
    if op in ("all_reduce", "broadcast"):
        t, m = mine.clone(), mine.clone()
        mn = m.numpy()  # once, as the other ops' views: a view per call is MPI's time too

        def reset() -> None:
            t.copy_(mine)
            m.copy_(mine)
        if op == "all_reduce":
            return _checked(lambda: pg.all_reduce(t),
                            lambda: comm.Allreduce(MPI.IN_PLACE, mn), (t, m),
                            sum(base + r for r in range(world)), reset)
        return _checked(lambda: pg.broadcast(t, 0), lambda: comm.Bcast(mn, 0), (t, m),
                        base, reset)
    if op == "all_gather":
        out, mout = torch.empty(world * n), torch.empty(world * n)
        a, mo = mine.numpy(), mout.numpy()
        return _checked(lambda: pg.all_gather_single(out, mine), lambda: comm.Allgather(a, mo),
                        (out, mout), torch.cat([base + r for r in range(world)]))
    if op == "reduce_scatter":
        inp = torch.cat([mine + 1000 * k for k in range(world)])
        out, mout = torch.empty(n), torch.empty(n)
        a, mo = inp.numpy(), mout.numpy()
        return _checked(lambda: pg.reduce_scatter_single(out, inp),
                        lambda: comm.Reduce_scatter_block(a, mo), (out, mout),
                        sum(base + r + 1000 * rank for r in range(world)))
    raise ValueError(f"unknown op {op}")


def loop(f: Call, iters: int, comm: MPI.Comm) -> float:
    """Seconds per call of ``iters`` calls of ``f``, started together on every rank."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K", help="comma list of bytes per rank (K/M/G)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    rendezvous = comm.bcast(tempfile.mktemp(prefix="pyddp-outside-loop-") if rank == 0 else None)
    pg = pyddp.init_process_group("shm", init_method=f"file://{rendezvous}", rank=rank,
                                  world_size=world)
    try:
        if rank == 0:
            print(f"# {world} ranks; per call: median over {args.rounds} rounds; "
                  "ratio: median of pyddp/MPI per round")
            print(f"# {'op':>15} {'bytes':>10} {'pyddp (us)':>11} {'MPI (us)':>9} {'ratio':>6}")
        for op in args.ops.split(","):
            for nbytes in ([0] if op == "barrier" else
                           [parse_size(s) for s in args.sizes.split(",")]):
                ours, theirs, check = calls(op, nbytes, pg, comm)
                problem = check()
                if comm.allreduce(problem is not None, op=MPI.LOR):
                    raise SystemExit(f"rank {rank}: {op} {nbytes} B: {problem}")
                for f in (ours, theirs):
                    for _ in range(WARMUP_CALLS):
                        f()
                # As many calls as TARGET_SECONDS of the slower library, agreed by every rank.
                probe = max(loop(ours, WARMUP_CALLS, comm), loop(theirs, WARMUP_CALLS, comm))
                iters = comm.allreduce(max(10, int(TARGET_SECONDS / probe)), op=MPI.MIN)
                times: dict[str, list[float]] = {"pyddp": [], "mpi": []}
                for round_ in range(args.rounds):
                    # Each library goes first in half the rounds.
                    order = [("pyddp", ours), ("mpi", theirs)]
                    for name, f in order if round_ % 2 == 0 else order[::-1]:
                        times[name].append(loop(f, iters, comm))
                if rank == 0:
                    ratio = statistics.median(p / m for p, m in zip(times["pyddp"], times["mpi"]))
                    print(f"  {op:>15} {nbytes:>10} {statistics.median(times['pyddp']) * 1e6:>11.2f} "
                          f"{statistics.median(times['mpi']) * 1e6:>9.2f} {ratio:>6.2f}", flush=True)
    finally:
        pyddp.destroy_process_group()


if __name__ == "__main__":
    main()
