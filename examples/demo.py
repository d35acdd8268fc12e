"""A tour of pyddp's collectives on CPU processes, then the benchmark table.

    python examples/demo.py [--world-size N] [--quick]

Spawns N processes (default 2) that rendezvous through a file:// store, runs
each collective once with values you can check by eye, then times all_reduce
for pyddp beside torch.distributed's gloo (python -m pyddp.bench).
"""

from __future__ import annotations

import argparse

import torch

from pyddp._launch import LaunchError, Rendezvous, spawn

TIMEOUT_S = 120
"""Bound on the tour's ranks, which take a few seconds."""


def _rank(rank: int, world: int, init_method: str) -> None:
    import pyddp

    torch.set_num_threads(1)
    pyddp.init_process_group("shm", init_method=init_method, rank=rank, world_size=world)

    def show(text: str) -> None:
        # Ranks print in turn, so lines do not interleave.
        for r in range(world):
            pyddp.barrier()
            if r == rank:
                print(f"[rank {rank}] {text}", flush=True)

    t = torch.arange(4, dtype=torch.float32) + rank
    pyddp.all_reduce(t)
    show(f"all_reduce(arange(4) + rank)          -> {t.tolist()}")

    out = torch.empty(2 * world, dtype=torch.int64)
    pyddp.all_gather_single(out, torch.full((2,), rank))
    show(f"all_gather_single(full(2, rank))      -> {out.tolist()}")

    b = torch.tensor([float(rank)] * 3)
    pyddp.broadcast(b, src=world - 1)
    show(f"broadcast(rank, src={world - 1})              -> {b.tolist()}")

    rs = torch.empty(2)
    pyddp.reduce_scatter_single(rs, torch.arange(2 * world, dtype=torch.float32),
                                op=pyddp.ReduceOp.MAX)
    show(f"reduce_scatter_single(arange, MAX)    -> {rs.tolist()}")

    work = pyddp.all_reduce(torch.ones(1_000_000), op=pyddp.ReduceOp.AVG, async_op=True)
    work.wait()
    show(f"async all_reduce(ones(1e6), AVG)      -> completed={work.is_completed()}, "
         f"value={work.get_future().value()[0][0].item()}")
    pyddp.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="benchmark 4K..1M only")
    args = parser.parse_args()

    with Rendezvous(prefix="pyddp-demo-") as rendezvous:
        job = spawn(_rank, args.world_size, (args.world_size, rendezvous.init_method()))
        try:
            with job:
                job.wait(TIMEOUT_S)
        except LaunchError as error:
            raise SystemExit(f"demo ranks failed with exit codes {job.exitcodes()}: {error}")

    from pyddp.bench.cli import main as bench

    print("\npyddp beside torch.distributed gloo, all_reduce float32 "
          f"({args.world_size} ranks on this machine):", flush=True)
    bench_args = ["--world-size", str(args.world_size)]
    if args.quick:
        bench_args += ["-e", "1M"]
    raise SystemExit(bench(bench_args))


if __name__ == "__main__":
    main()
