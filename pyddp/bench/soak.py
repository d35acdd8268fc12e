"""Soak: minutes of mixed collectives, DDP steps and group create/destroy cycles on
spawned CPU ranks, every rank's resources sampled, failing if any grows after warm-up.

    python -m pyddp.bench soak [--minutes 20] [--world-size 2] [--sample-seconds 60]

Every cycle, on every rank and in the same order: all_reduce, all_gather,
broadcast (the root turns), reduce_scatter, all_to_all, a ring of
point-to-point exchanges (batch_isend_irecv), an asynchronous barrier and a
monitored barrier on the default group, then two tagged messages to the next rank received in the
opposite order, each checked against the value it must have; one training step
of pyddp's DistributedDataParallel; a new group of every rank created, used for
an all_reduce and destroyed; and a subgroup of every rank but one (the one left
out turns), likewise. The message sizes turn between 4 bytes, 4 KB
and 1 MiB.

The store is a TCPStore hosted by this process, as torchrun's agent hosts it
for its ranks: the bootstrap keys of every group made stay there, as those of
torch's own backends do, and the ranks hold no store state that grows. (Over
a FileStore every rank would: its client keeps every key it has read, and
with those small allocations interleaved between the cycle's megabyte
tensors glibc's heap grows by a few hundred KB per group made, free memory
that malloc_trim(0) gives back.)

At the end of a cycle (nothing in flight, the cycle's group destroyed) each
rank samples its resident memory, open file descriptors, threads, bytes of
pyddp's shared memory it maps, and the pyddp entries in /dev/shm (those of
every pyddp job on the host: run the soak alone), and prints them. The samples taken during warm-up are shown but not judged (allocators,
torch's and pyddp's lazily made buffers and threads settle then); every later
sample must not exceed the first one after warm-up: by nothing for the counts
and mapped bytes, by ``RSS_TOLERANCE_BYTES`` for resident memory. Exits 1 when
anything grew or a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing as mp
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from pyddp import _launch

SHM_PREFIX = "pyddp-"
"""The names pyddp gives its shared-memory segments in /dev/shm."""

RSS_TOLERANCE_BYTES = 16 << 20
"""Resident memory a rank may gain after warm-up without being called a leak. On
2 ranks the resident memory after warm-up moves within about 10 MiB up and down
(the allocator's free lists, not pyddp's objects); a leak of one group's or one
message's memory per cycle (about 100 cycles a second) passes this within
seconds."""

SIZES = (1, 1024, 256 * 1024)
"""float32 elements of the cycle's messages, in turn: 4 B, 4 KiB, 1 MiB."""

MONITORED_TIMEOUT = datetime.timedelta(seconds=60)
"""The cycle's monitored barrier's: every rank comes within the cycle, so only a stuck rank
reaches it."""


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one rank holds at one moment."""
    rss_bytes: int
    fds: int
    threads: int
    shm_mapped_bytes: int
    shm_entries: int

    LIMITS = {"rss_bytes": RSS_TOLERANCE_BYTES}
    """Growth allowed after warm-up, by field (0 for those not named)."""


def read_resources(shm_dir: str = "/dev/shm") -> Resources:
    """This process's resources, read from /proc/self and ``shm_dir``."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    mapped = 0
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5]).startswith(SHM_PREFIX):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mapped += end - start
    return Resources(
        rss_bytes=int(status["VmRSS"][0]) * 1024,
        fds=len(os.listdir("/proc/self/fd")),
        threads=int(status["Threads"][0]),
        shm_mapped_bytes=mapped,
        shm_entries=sum(name.startswith(SHM_PREFIX) for name in os.listdir(shm_dir)))


def growth(samples: List[Resources]) -> List[str]:
    """What grew: every field of a sample after the first that exceeds the first
    sample's by more than ``Resources.LIMITS`` allows, worst sample per field."""
    if not samples:
        return []
    base, found = samples[0], []
    for field in dataclasses.fields(Resources):
        limit = Resources.LIMITS.get(field.name, 0)
        worst = max(getattr(s, field.name) for s in samples)
        if worst - getattr(base, field.name) > limit:
            found.append(f"{field.name} grew from {getattr(base, field.name)} to {worst} "
                         f"(allowed: +{limit})")
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's options, for ``python -m pyddp.bench soak``."""
    parser.add_argument("--minutes", type=float, default=20.0,
                        help="how long to run (default: 20)")
    parser.add_argument("--world-size", type=int, default=2, choices=(2, 3, 4),
                        help="ranks to spawn (default: 2)")
    parser.add_argument("--sample-seconds", type=float, default=60.0,
                        help="seconds between samples (default: 60)")
    parser.add_argument("--warmup-seconds", type=float, default=60.0,
                        help="samples before this are not judged (default: 60)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may take, and the run may go without a "
                             "sample beyond its interval, before it is stopped (default: 120)")


def main(args: argparse.Namespace) -> int:
    """Runs the soak; prints the samples and the verdict. 0 if nothing grew."""
    if args.warmup_seconds >= 60 * args.minutes:
        print("pyddp.bench soak: the warm-up must end before the run does "
              f"(--warmup-seconds {args.warmup_seconds:g}, --minutes {args.minutes:g})",
              file=sys.stderr)
        return 2
    print(f"# soak: {args.world_size} ranks, {args.minutes:g} min, a sample every "
          f"{args.sample_seconds:g} s, warm-up {args.warmup_seconds:g} s")
    print(f"{'t (s)':>7} {'rank':>4} {'rss (MiB)':>10} {'fds':>5} {'threads':>7} "
          f"{'shm mapped (MiB)':>16} {'/dev/shm':>8}  cycles")
    lines = mp.get_context("spawn").Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    try:
        with _launch.spawn(_rank, args.world_size, (args, store.port, lines)) as job:
            kept = job.follow(lines, args.sample_seconds + args.timeout,
                              lambda line: print(line, flush=True))
    finally:
        lines.close()
    judged: Dict[int, List[Resources]] = dict(enumerate(kept))
    failures = [f"rank {rank}: {what}" for rank, kept in judged.items() for what in growth(kept)]
    for line in failures:
        print(f"GREW {line}")
    verdict = "nothing grew after warm-up" if not failures else f"{len(failures)} grew"
    print(f"# soak: {verdict} ({len(judged[0])} judged samples per rank)")
    return 1 if failures else 0


def _line(t: float, rank: int, r: Resources, cycles: int, warm: bool) -> str:
    """One row of the table of samples."""
    return (f"{t:>7.0f} {rank:>4} {r.rss_bytes / 2**20:>10.1f} {r.fds:>5} {r.threads:>7} "
            f"{r.shm_mapped_bytes / 2**20:>16.2f} {r.shm_entries:>8}  {cycles}"
            f"{'  (warm-up)' if warm else ''}")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _check(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.equal(got, expected):
        raise AssertionError(f"soak: {what} gave a wrong result")


def _cycle(pg, cycle: int) -> None:
    """One cycle's collectives and point-to-point on ``pg``, each checked."""
    import pyddp

    n, r, s = pg.size(), pg.rank(), SIZES[cycle % len(SIZES)]
    every = torch.arange(1, n + 1, dtype=torch.float32)
    total = float(n * (n + 1) // 2)

    x = torch.full((s,), float(r + 1))
    pg.all_reduce(x)
    _check("all_reduce", x, torch.full((s,), total))

    out = torch.empty(n * s)
    pg.all_gather_single(out, torch.full((s,), float(r + 1)))
    _check("all_gather", out, every.repeat_interleave(s))

    root = cycle % n
    x = torch.full((s,), float(r + 1))
    pg.broadcast(x, root)
    _check("broadcast", x, torch.full((s,), float(root + 1)))

    x = torch.empty(s)
    pg.reduce_scatter_single(x, torch.full((n * s,), float(r + 1)))
    _check("reduce_scatter", x, torch.full((s,), total))

    x = torch.empty(n * s)
    pg.all_to_all_single(x, (r * n + torch.arange(n, dtype=torch.float32)).repeat_interleave(s))
    _check("all_to_all", x, (torch.arange(n, dtype=torch.float32) * n + r).repeat_interleave(s))

    got = torch.empty(s)
    for work in pyddp.batch_isend_irecv([
            pyddp.P2POp(pyddp.isend, torch.full((s,), float(r + 1)), (r + 1) % n, pg),
            pyddp.P2POp(pyddp.irecv, got, (r - 1) % n, pg)]):
        work.wait()
    _check("send/recv", got, torch.full((s,), float((r - 1) % n + 1)))

    # Two tags received in the order opposite to the sends': the first message waits
    # unexpected while the second is taken.
    sends = [pg.isend(torch.full((s,), float(r + tag)), (r + 1) % n, tag) for tag in (1, 2)]
    for tag in (2, 1):
        got = torch.empty(s)
        pg.irecv(got, (r - 1) % n, tag).wait()
        _check(f"recv of tag {tag}", got, torch.full((s,), float((r - 1) % n + tag)))
    for work in sends:
        work.wait()

    pg.barrier(async_op=True).wait()
    # Each call takes two tags of its own: nothing may grow with them.
    pg.monitored_barrier(MONITORED_TIMEOUT)


def _group_cycle(members: List[int], rank: int, size: int) -> None:
    """A new group of ``members`` of the default group, used for an all_reduce and destroyed.
    Its object goes at return, and with it the shared memory its engines map, so that
    every sample sees the same groups alive whichever ranks were members."""
    import pyddp

    group = pyddp.new_group(members)
    if rank not in members:
        return
    x = torch.full((size,), float(rank))
    group.all_reduce(x)
    _check(f"all_reduce on a new group of ranks {members}", x,
           torch.full_like(x, float(sum(members))))
    pyddp.destroy_process_group(group)


def _rank(rank: int, args: argparse.Namespace, store_port: int, lines) -> List[Resources]:
    """One rank: cycles until rank 0 calls the end; its samples after warm-up."""
    import pyddp
    from pyddp.ddp import DistributedDataParallel

    torch.set_num_threads(1)  # one core per rank
    n = args.world_size
    timeout = datetime.timedelta(seconds=args.timeout)
    pg = pyddp.init_process_group(
        "shm", store=dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout),
        rank=rank, world_size=n, timeout=timeout)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(_Model())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        inputs, targets = torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)
        start = time.monotonic()
        next_sample = start
        kept: List[Resources] = []
        cycle = 0
        while True:
            _cycle(pg, cycle)
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            size = SIZES[cycle % len(SIZES)]
            _group_cycle(list(range(n)), rank, size)
            # Every rank but one (the one left out turns): it goes on meanwhile.
            _group_cycle([m for m in range(n) if m != cycle % n], rank, size)
            cycle += 1
            # Rank 0's clock decides for all, so that every rank runs the same cycles.
            elapsed = time.monotonic() - start
            calls = torch.tensor([float(elapsed >= next_sample - start),
                                  float(elapsed >= 60 * args.minutes)] if rank == 0 else [0., 0.])
            pg.all_reduce(calls, op=pyddp.ReduceOp.MAX)
            sample, stop = bool(calls[0]), bool(calls[1])
            if sample or stop:
                resources = read_resources()
                warm = elapsed < args.warmup_seconds
                if not warm:
                    kept.append(resources)
                lines.put(_line(elapsed, rank, resources, cycle, warm))
                next_sample += args.sample_seconds
            if stop:
                return kept
    finally:
        pyddp.destroy_process_group(pg)
