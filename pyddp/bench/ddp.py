"""DDP benchmark: training steps of a ~25M-parameter MLP on spawned ranks, CPU or GPU.

    python -m pyddp.bench.ddp [--world-size 2] [--rounds 3] [--steps 8]
    python -m pyddp.bench ddp --device cuda     # the same on GPUs

Times, in one run and on the same ranks, three ways of taking a training step
(forward, backward, SGD step) with the same per-rank work:

- ``no communication``: the bare model, the baseline;
- ``pyddp DDP (shm)``: ``pyddp.DistributedDataParallel`` over a pyddp group;
- ``torch DDP (gloo)``: ``torch.nn.parallel.DistributedDataParallel`` over gloo.

With ``--device cuda`` rank r computes on GPU ``r % torch.cuda.device_count()``
(ranks share GPUs round-robin when there are fewer GPUs than ranks) and the
variants are ``no communication (cuda)``, ``pyddp DDP (auto, cuda)`` (a pyddp
group of backend "auto": cuda_ipc or NCCL, which the report names) and
``torch DDP (nccl, cuda)``, or ``torch DDP (gloo, cuda)`` where NCCL cannot run
these ranks (several ranks on one GPU need NCCL 2.30; the report says why).
Timed regions begin and end with ``torch.cuda.synchronize``.

The communication overhead of a DDP is its step time minus the baseline's.
Every round times each variant once, in an order that rotates between rounds,
so that drifts of a shared machine hit them alike. A round's step time is the
slowest rank's mean; an overhead is taken within a round (variant minus
baseline, measured seconds apart) and the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from pyddp import _launch, devices
from pyddp.bench.over_ranks import max_over_ranks

VARIANTS = ("no communication", "pyddp DDP (shm)", "torch DDP (gloo)")
"""The variants on the CPU; ``Setup.variants`` names them on CUDA."""

NAME_WIDTH = 20
"""Width of the table's first column: the CPU variants' longest name."""

OVERHEAD_TARGET = 0.25
"""pyddp DDP's overhead, as a share of torch DDP + gloo's, that the report says is met."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, for ``python -m pyddp.bench ddp`` or this module's own CLI."""
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default: 2)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="rounds of every variant; figures are medians (default: 7)")
    parser.add_argument("--steps", type=int, default=4,
                        help="timed training steps per variant and round (default: 4)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per variant before the first round (default: 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank (default: 32)")
    parser.add_argument("--width", type=int, default=2048,
                        help="hidden width of the MLP (default: 2048, about 25M parameters)")
    parser.add_argument("--layers", type=int, default=5,
                        help="hidden width x width layers (default: 5)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="bucket cap for both DDPs (default: torch's, 25 MiB)")
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="gradient_as_bucket_view=True for both DDPs")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may take, and the run may go without "
                             "progress, before it is stopped (default: 300)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the ranks compute: cpu (default) or cuda (rank r on GPU "
                             "r %% device count; torch DDP over NCCL where it can run "
                             "these ranks, else gloo)")


@dataclass(frozen=True)
class Setup:
    """Where the ranks compute and what torch DDP runs over, decided before they start."""

    device: str
    """"cpu" or "cuda"."""
    torch_backend: str
    """torch DDP's backend: "gloo" or "nccl"."""
    why_not_nccl: Optional[str] = None
    """On CUDA, why torch DDP runs over gloo rather than NCCL."""

    @property
    def variants(self) -> Tuple[str, str, str]:
        """The names of the baseline, pyddp DDP and torch DDP, with backend and device."""
        if self.device == "cpu":
            return VARIANTS
        return (f"no communication ({self.device})",
                f"pyddp DDP ({devices.GROUP_BACKEND[self.device]}, {self.device})",
                f"torch DDP ({self.torch_backend}, {self.device})")


def make_setup(device: str, world_size: int) -> Setup:
    """The setup of ``world_size`` ranks, all on this host, computing on ``device``."""
    if device == "cpu":
        return Setup("cpu", "gloo")
    if not dist.is_nccl_available():
        return Setup(device, "gloo", "this torch build has no NCCL")
    refusal = devices.nccl_refusal(world_size, torch.cuda.device_count(),
                                   torch.cuda.nccl.version())
    return Setup(device, "gloo" if refusal else "nccl", refusal)


class MLP(nn.Module):
    """width/2 inputs -> ``layers`` hidden layers of ``width`` -> width/2 outputs."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        dims = [width // 2] + [width] * (layers + 1) + [width // 2]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark and prints its table; 1 if a rank failed, 2 if the device asked
    for cannot serve the ranks (then none is started)."""
    try:
        device = devices.resolve(args.device, pyddp_groups=True)
    except devices.DeviceUnavailable as error:
        print(f"pyddp.bench ddp: {error}", file=sys.stderr)
        return 2
    setup = make_setup(device, args.world_size)
    n_params = sum(p.numel() for p in MLP(args.width, args.layers).parameters())
    print(f"# pyddp.bench ddp: MLP of {n_params / 1e6:.1f}M parameters "
          f"({n_params * 4 / 2**20:.0f} MiB of float32 gradients), {args.world_size} ranks, "
          f"batch {args.batch_size} per rank, {args.rounds} rounds x {args.steps} steps, "
          f"bucket_cap_mb={args.bucket_cap_mb or 'default'}, "
          f"gradient_as_bucket_view={args.gradient_as_bucket_view}", flush=True)
    if setup.device == "cuda":
        count = torch.cuda.device_count()
        print(f"# on cuda: {args.world_size} ranks on {count} GPU(s), rank r on GPU "
              f"r % {count}; torch DDP over {setup.torch_backend}", flush=True)
        note = devices.sharing_note(args.world_size, count)
        if note:
            print(f"# {note}", flush=True)
    try:
        report = _run(args, setup)
    except RuntimeError as error:
        print(f"pyddp.bench ddp: {error}", file=sys.stderr)
        return 1
    print(_render(report, setup))
    return 0


def _render(report: Dict[str, object], setup: Setup) -> str:
    variants = setup.variants
    width = max(NAME_WIDTH, *map(len, variants))
    steps: Dict[str, List[float]] = report["step_s"]  # type: ignore[assignment]
    base = steps[variants[0]]
    overhead = {name: statistics.median(v - b for v, b in zip(steps[name], base))
                for name in variants[1:]}
    lines = [f"{'variant':<{width}} {'step (ms)':>10} {'overhead (ms)':>14} "
             f"{'overhead / torch':>17}"]
    for name in variants:
        row = f"{name:<{width}} {1e3 * statistics.median(steps[name]):>10.1f} "
        if name == variants[0]:
            row += f"{'-':>14} {'-':>17}"
        else:
            torch_overhead = overhead[variants[2]]
            # On a noisy machine torch's overhead can come out <= 0: no ratio then.
            ratio = (f"{overhead[name] / torch_overhead:>16.2f}x" if torch_overhead > 0
                     else f"{'n/a':>17}")
            row += f"{1e3 * overhead[name]:>14.1f} {ratio}"
        lines.append(row)
    pyddp_step = statistics.median(steps[variants[1]])
    wait = report["pyddp_wait_s"]
    lines.append(f"pyddp: {1e3 * wait:.1f} ms per step waiting for all-reduces at the end of "
                 f"backward ({100 * wait / pyddp_step:.0f}% of its step)")
    lines.append(f"pyddp parameters bitwise identical on every rank: "
                 f"{'yes' if report['identical'] else 'NO'}")
    ours, theirs = overhead[variants[1]], overhead[variants[2]]
    if setup.device == "cpu":
        # The target is pyddp's on the CPU; on GPUs the table's ratios are the result.
        lines.append(f"target, pyddp overhead <= {OVERHEAD_TARGET} x torch DDP + gloo's: "
                     f"{'met' if ours <= OVERHEAD_TARGET * theirs else 'not met'} "
                     f"({1e3 * ours:.1f} ms vs {1e3 * theirs:.1f} ms)")
    else:
        transports: Dict[str, str] = report["pyddp_transports"]  # type: ignore[assignment]
        lines.append(f"device: {setup.device}; rank 0 on {report['device_name']}")
        lines.append(f"pyddp DDP: group of backend {devices.GROUP_BACKEND[setup.device]!r}, "
                     f"{setup.device} tensors over {transports.get(setup.device, 'none')}")
        lines.append(f"torch DDP: over {setup.torch_backend}"
                     + (f", not NCCL: {setup.why_not_nccl}" if setup.why_not_nccl else ""))
    return "\n".join(lines)


def _run(args: argparse.Namespace, setup: Setup) -> Dict[str, object]:
    """Spawns the ranks, shows rank 0's progress and returns its report."""
    progress = mp.get_context("spawn").Queue()
    try:
        with _launch.Rendezvous(prefix="pyddp-bench-ddp-") as rendezvous:
            with _launch.spawn(_measure, args.world_size,
                               (args, setup, rendezvous.directory, progress)) as job:
                return job.follow(progress, args.timeout,
                                  lambda line: print(f"# {line}", flush=True))[0]
    finally:
        progress.close()


def _measure(rank: int, args: argparse.Namespace, setup: Setup, store_dir: str, progress
             ) -> Dict[str, object]:
    """One rank: times every variant; the report (the same on every rank)."""
    import pyddp
    from pyddp.ddp import DistributedDataParallel

    torch.set_num_threads(1)  # one core per rank
    n = args.world_size
    variants = setup.variants
    # All ranks on this host: the rank is the local rank.
    device = devices.use_gpu(rank, n) if setup.device == "cuda" else torch.device("cpu")
    timeout = datetime.timedelta(seconds=args.timeout)
    # The default group (gloo, CPU tensors) does the bookkeeping: barriers, maxima, checks.
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "gloo"), n),
                            rank=rank, world_size=n, timeout=timeout)
    group = pyddp.init_process_group(
        devices.GROUP_BACKEND[setup.device],
        store=dist.FileStore(os.path.join(store_dir, "pyddp"), n), rank=rank,
        world_size=n, timeout=timeout)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        # torch DDP's own group on NCCL; over gloo it takes the default group.
        torch_group = (dist.new_group(backend="nccl", timeout=timeout)
                       if setup.torch_backend == "nccl" else None)
        ddp_options = dict(bucket_cap_mb=args.bucket_cap_mb,
                           gradient_as_bucket_view=args.gradient_as_bucket_view)
        torch.manual_seed(0)
        models = {
            variants[0]: MLP(args.width, args.layers).to(device),
            variants[1]: DistributedDataParallel(MLP(args.width, args.layers).to(device),
                                                 **ddp_options),
            variants[2]: torch.nn.parallel.DistributedDataParallel(
                MLP(args.width, args.layers).to(device),
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=torch_group, **ddp_options),
        }
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch_size, args.width // 2, generator=gen).to(device)
        y = torch.randn(args.batch_size, args.width // 2, generator=gen).to(device)
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-4)
                      for name, m in models.items()}

        def step(name: str) -> None:
            loss = nn.functional.mse_loss(models[name](x), y)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()

        for name in variants:
            for _ in range(args.warmup):
                step(name)
        samples: Dict[str, List[float]] = {name: [] for name in variants}
        waits: List[float] = []
        for round_ in range(args.rounds):
            for k in range(len(variants)):
                name = variants[(round_ + k) % len(variants)]
                # Nothing of the last variant left running on the GPU, every rank at the start.
                synchronize()
                dist.barrier()
                wait = 0.0
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(name)
                    if name == variants[1]:
                        wait += models[name].last_comm_wait_seconds
                synchronize()
                seconds = max_over_ranks((time.perf_counter() - start) / args.steps)
                samples[name].append(seconds)
                if name == variants[1]:
                    waits.append(max_over_ranks(wait / args.steps))
            if rank == 0:
                times = ", ".join(f"{name} {1e3 * samples[name][-1]:.1f}" for name in variants)
                progress.put(f"round {round_ + 1}/{args.rounds} (ms/step): {times}")
        identical = _identical_across_ranks(models[variants[1]].module, n)
        return {"step_s": samples, "pyddp_wait_s": statistics.median(waits),
                "identical": identical, "pyddp_transports": group.transports(),
                "device_name": (f"{device} ({torch.cuda.get_device_name(device)})"
                                if device.type == "cuda" else str(device))}
    finally:
        pyddp.destroy_process_group(group)
        dist.destroy_process_group()


def _identical_across_ranks(model: nn.Module, world_size: int) -> bool:
    """Whether every rank holds bitwise the same parameters (their bytes compared via gloo,
    on the CPU)."""
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]
                     ).view(torch.int32)
    lowest, highest = flat.clone(), flat.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lowest, highest))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m pyddp.bench.ddp",
                                      description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
