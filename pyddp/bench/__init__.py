"""Benchmarks for pyddp: ``python -m pyddp.bench`` and ``python -m pyddp.bench ddp``.

The microbenchmark times collectives of pyddp and of its peers (torch.distributed
gloo and NCCL, MPI through mpi4py, DeepSpeed's shared-memory all-reduce) in one
run on the same machine, and prints nccl-tests-shaped tables: size, count,
type, time, algbw, busbw and the number of wrong elements, then each peer's
speed-up over the baseline peer (gloo on CPU, NCCL on GPU). Peers that
cannot run here are listed as skipped, with the reason. ``--hosts H`` spreads
the ranks over H hosts simulated on this machine, to time pyddp's backend
"auto" against gloo across hosts.

Layout:
  sizes.py       parsing of 4K/64M-style sizes and the size sweep
  metrics.py     busbw factors, the Result row and Skipped (pure)
  across_hosts.py
                 --hosts: the ranks' placement and the bytes an all_reduce sends
                 between hosts (pure)
  peers.py       Peer protocol and the table of libraries under test (pyddp among them)
  ops.py         Case protocol, exact inputs and local references of the collectives
  worker.py      what each rank runs: the one timing loop, and the rank entry point
  over_ranks.py  max and sum over ranks, the bookkeeping of both benchmarks
  launch.py      a run's ranks (started by pyddp._launch, directly, through mpirun or
                 on simulated hosts) and the event files they report through
  report.py      tables, summary, skips, what a run on simulated hosts means, JSON, CSV
  plot.py        busbw and latency against size (matplotlib)
  cli.py         argument parsing, torchrun mode, the ``ddp`` subcommand and ``main``
  ddp.py         the DDP benchmark (``python -m pyddp.bench ddp``)
"""
