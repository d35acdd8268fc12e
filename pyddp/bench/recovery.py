"""Recovery: what a lost rank costs a job that trains with
``pyddp.DistributedDataParallel(on_rank_failure="shrink")``.

    python -m pyddp.bench recovery [--world-size 3] [--steps 40] [--repeat 3]

Spawned CPU ranks train a small MLP; after ``--steps`` steps the last rank writes the
time to the store and kills itself (SIGKILL), and its peers start their next step,
whose gradient all-reduce waits for it. Each survivor reports, from that time on its
clock (one host: one clock):

- detection: until its backward returned with the failure noted (the step's forward and
  backward, and the dead peer found: its pid gone, or a peer's failure word read);
- recovery: until its next applied step ended (the failed step's agreement, the shrink,
  and one step on the new group);

and its steps per second over ``--steps`` steps on the shrunk group (after as many
untimed ones), beside a job started with the survivors' count in the same run, timed
after as many steps (the throughput a shrunk job should keep). The store is a TCPStore hosted by this process, which outlives every rank as
torchrun's agent store does.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyddp import _launch

TIMEOUT = datetime.timedelta(seconds=60)
BATCH = 64
WIDTH = 512  # an MLP of about 0.8 M parameters: steps of a few milliseconds here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The recovery benchmark's options, for ``python -m pyddp.bench recovery``."""
    parser.add_argument("--world-size", type=int, default=3, choices=(2, 3, 4),
                        help="ranks to spawn; the last one is killed (default: 3)")
    parser.add_argument("--steps", type=int, default=40,
                        help="steps before the kill, and steps timed after it (default: 40)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="jobs to run, each losing a rank (default: 3)")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def _rank(rank: int, world_size: int, port: int, name: str, steps: int,
          victim: Optional[int]) -> Dict[str, float]:
    import pyddp

    # The survivors' warning of the lost rank is what the benchmark causes; its rows
    # say the rest.
    logging.getLogger("pyddp").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    store = dist.PrefixStore(name, dist.TCPStore("127.0.0.1", port, is_master=False,
                                                 timeout=TIMEOUT))
    group = pyddp.new_group("shm", store=store, rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = pyddp.DistributedDataParallel(model, process_group=group,
                                        on_rank_failure="shrink", optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 10, (BATCH,),
                                                                    generator=gen)

    def step() -> bool:
        F.cross_entropy(ddp(x), y).backward()
        applied = ddp.should_commit()
        if applied:
            opt.step()
        opt.zero_grad()
        return applied

    for _ in range(steps):
        step()
    out: Dict[str, float] = {}
    if victim is not None:
        if rank == victim:
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        store.wait(["killed_at"], TIMEOUT)
        F.cross_entropy(ddp(x), y).backward()
        detected = time.time()
        applied = ddp.should_commit()
        opt.zero_grad()
        while not applied:
            applied = step()
        killed = float(store.get("killed_at"))
        out.update(detection=detected - killed, recovery=time.time() - killed)
        # As many steps on the new group as the job it is compared with took before its
        # timed ones (first touches of its memory, the choosers' first samples).
        for _ in range(steps):
            step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    out["steps_per_second"] = steps / (time.perf_counter() - start)
    pyddp.destroy_process_group(ddp.process_group)
    return out


def _run(world_size: int, port: int, name: str, steps: int,
         victim: Optional[int]) -> List[Dict[str, float]]:
    """The survivors' reports of one job."""
    lost = {victim} if victim is not None else set()
    with _launch.spawn(_rank, world_size, (world_size, port, name, steps, victim)) as job:
        deadline = time.monotonic() + 2 * TIMEOUT.total_seconds()
        while True:
            try:
                if job.poll(lost):
                    break
            except _launch.RankFailed as error:
                if error.rank not in lost or error.exitcode != -signal.SIGKILL:
                    raise
            if time.monotonic() > deadline:
                raise _launch.RanksTimedOut(f"the job {name} still runs")
            time.sleep(0.05)
        return [r for rank, r in enumerate(job.results) if rank not in lost]


def main(args: argparse.Namespace) -> int:
    """Runs the jobs; prints one row per survivor and job, then the medians."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT)
    w = args.world_size
    print(f"# recovery: {w} ranks lose rank {w - 1} after {args.steps} steps; a job of "
          f"{w - 1} ranks for comparison; {args.repeat} job(s) each")
    print(f"{'job':>4} {'rank':>4} {'detection (ms)':>15} {'recovery (ms)':>14} "
          f"{'steps/s after':>14} {'steps/s of a {}-rank job'.format(w - 1):>24}")
    detection, recovery, ratios = [], [], []
    for n in range(args.repeat):
        survivors = _run(w, store.port, f"lose{n}", args.steps, w - 1)
        fresh = _run(w - 1, store.port, f"fresh{n}", args.steps, None)
        base = statistics.median(r["steps_per_second"] for r in fresh)
        for rank, r in enumerate(survivors):
            print(f"{n:>4} {rank:>4} {1000 * r['detection']:>15.1f} "
                  f"{1000 * r['recovery']:>14.1f} {r['steps_per_second']:>14.1f} "
                  f"{base:>24.1f}", flush=True)
            detection.append(r["detection"])
            recovery.append(r["recovery"])
            ratios.append(r["steps_per_second"] / base)
    print(f"# median: detection {1000 * statistics.median(detection):.1f} ms, recovery "
          f"{1000 * statistics.median(recovery):.1f} ms, throughput after the shrink "
          f"{statistics.median(ratios):.2f}x that of a {w - 1}-rank job")
    return 0
