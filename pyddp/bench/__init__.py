"""Microbenchmarks for pyddp: ``python -m pyddp.bench``.

Times collectives of pyddp and of its peers (torch.distributed gloo) in one
run on the same machine and prints nccl-tests-shaped tables: size, count,
type, time, algbw, busbw and the number of wrong elements, then pyddp's
speed-up over the baseline peer.

Layout:
  sizes.py     parsing of 4K/64M-style sizes and the size sweep
  metrics.py   busbw factors and the Result row (pure functions)
  backends.py  Backend protocol and the table of libraries under test
  ops.py       Case protocol and the table of benchmarked collectives
  worker.py    what each spawned rank runs: the one timing loop
  launch.py    spawning, supervising and reaping the ranks
  report.py    tables, summary and JSON
  cli.py       argument parsing and ``main``
"""
