"""Command line of ``python -m pyddp.bench``: the microbenchmark, ``ddp`` and ``soak``.

``python -m pyddp.bench [options]`` times collectives; ``python -m pyddp.bench
ddp [options]`` hands over to the DDP benchmark in ``pyddp.bench.ddp`` and
``python -m pyddp.bench soak [options]`` to the soak in ``pyddp.bench.soak``
(each imported only then). The microbenchmark spawns its ranks, or, started by
torchrun (RANK and WORLD_SIZE set), is itself one of the ranks.
"""

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Optional

from pyddp.bench import across_hosts, launch, plot, report
from pyddp.bench.peers import BASELINES, HOST_PEERS, PEERS
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.ops import OPS, REDOPS, REDUCING_OPS, exact_limit, largest_value
from pyddp.bench.sizes import format_size, parse_size, size_sweep
from pyddp.bench.worker import DTYPES, Event, Launch, Plan, launched_rank

SUBCOMMANDS = {
    "ddp": ("pyddp.bench.ddp", "the DDP benchmark"),
    "soak": ("pyddp.bench.soak", "the soak (resources over minutes of mixed work)"),
    "recovery": ("pyddp.bench.recovery", "what a lost rank costs a DDP job that survives it"),
}
"""``python -m pyddp.bench NAME``: the module that runs NAME (imported only then), and what
it is."""


def _size(text: str) -> int:
    """argparse type for a byte size (``4K``, ``64M``)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for an integer of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    """argparse type for a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _names(known: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type for ``all`` or a comma list of names from ``known`` (duplicates dropped)."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if names == ["all"]:
            return list(known)
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose 'all' or a comma list from {', '.join(known)}")
        return list(dict.fromkeys(names))
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the microbenchmark, ``python -m pyddp.bench [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m pyddp.bench",
        description="Time collectives of pyddp and its peers (torch.distributed gloo and NCCL, "
                    "MPI, DeepSpeed's shm all-reduce, torch's symm_mem all-reduce kernels) "
                    "side by side on this machine, in nccl-tests-shaped tables. Sizes take "
                    "K/M/G suffixes.",
        epilog="'python -m pyddp.bench ddp --help' and 'python -m pyddp.bench soak --help' "
               "describe the DDP benchmark and the soak. "
               "Under torchrun (RANK and WORLD_SIZE set) this process is one of the ranks and "
               "spawns none.")
    parser.add_argument("--world-size", type=_int_at_least(1), default=None,
                        help="ranks to spawn (default: 2; under torchrun: its WORLD_SIZE)")
    parser.add_argument("-b", "--min-bytes", type=_size, default=parse_size("4K"),
                        help="smallest message size (default: 4K)")
    parser.add_argument("-e", "--max-bytes", type=_size, default=parse_size("64M"),
                        help="largest message size (default: 64M)")
    parser.add_argument("-f", "--step-factor", type=_int_at_least(2), default=4,
                        help="size multiplier between steps, at least 2 (default: 4)")
    parser.add_argument("--ops", type=_names(OPS), default=["all_reduce"],
                        help=f"'all' or a comma list from {', '.join(OPS)} (default: all_reduce)")
    parser.add_argument("--peers", "--backends", type=_names(PEERS), default=None,
                        help=f"'all' or a comma list from {', '.join(PEERS)} (default: all; "
                             f"with --hosts: {','.join(HOST_PEERS)}; those that cannot run "
                             "here are listed as skipped, with why)")
    parser.add_argument("--hosts", type=_int_at_least(1), default=1,
                        help="spread the ranks evenly over this many hosts simulated on this "
                             "machine (each rank in namespaces of its own, with its host's "
                             "hostname and private /dev/shm; loopback TCP between hosts; "
                             "needs root), to time pyddp's backend 'auto' against gloo across "
                             "hosts; the world size must be a multiple (default: 1, this "
                             "machine as it is)")
    parser.add_argument("-d", "--dtype", choices=list(DTYPES), default="float32",
                        help="element type (default: float32)")
    parser.add_argument("-o", "--redop", choices=REDOPS, default="sum",
                        help="reduction of all_reduce and reduce_scatter (default: sum)")
    parser.add_argument("-r", "--root", type=_int_at_least(0), default=0,
                        help="root rank of broadcast (default: 0)")
    parser.add_argument("-n", "--iters", type=_int_at_least(1), default=None,
                        help="timed iterations per block (default: adaptive, so that the "
                             "blocks of a point take about --target-time seconds in all)")
    parser.add_argument("--trials", type=_int_at_least(1), default=5,
                        help="timed blocks per point; peers take turns block by block and "
                             "the median block is reported (default: 5)")
    parser.add_argument("--target-time", type=_positive_float, default=0.25,
                        help="seconds per point, all blocks together, when --iters is "
                             "adaptive (default: 0.25)")
    parser.add_argument("-w", "--warmup", type=_int_at_least(0), default=3,
                        help="untimed iterations before each point (default: 3)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="after timing, run each point once more from fresh inputs and "
                             "count wrong elements against a reference computed locally "
                             "(default: on)")
    parser.add_argument("--threads", type=_int_at_least(1), default=1,
                        help="intra-op (OpenMP) threads per rank (default: 1)")
    parser.add_argument("--baseline", choices=list(PEERS), default=None,
                        help="peer the summary's speed-ups are relative to (default: "
                             + ", ".join(f"{b} for {d} peers" for d, b in BASELINES.items())
                             + ")")
    parser.add_argument("--timeout", type=_positive_float, default=300.0,
                        help="seconds a collective may take, and the run may go without "
                             "progress, before it is stopped (default: 300)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the plan, results and skips to PATH as JSON")
    parser.add_argument("--csv", metavar="PATH", default=None,
                        help="also write the results to PATH as CSV, one row per point")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="also draw busbw and latency against size for every peer to "
                             "PATH (png, svg or pdf; needs matplotlib)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (it is drawn on stderr only when that is a "
                             "terminal and tqdm is installed)")
    return parser


@dataclass(frozen=True)
class Options:
    """A parsed microbenchmark command line."""

    plan: Plan
    baselines: dict[str, str]
    json_path: Optional[str]
    csv_path: Optional[str]
    plot_path: Optional[str]
    quiet: bool


def parse_options(argv: Optional[Sequence[str]] = None,
                  launch_env: Optional[Launch] = None) -> Options:
    """Options from ``argv``; ``launch_env`` is where torchrun placed this process, if it did.

    Exits with status 2 and a message naming the option on a bad command line.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = args.world_size if args.world_size is not None else 2
    if launch_env is not None:
        if args.world_size is not None and args.world_size != launch_env.world_size:
            parser.error(f"--world-size {args.world_size} differs from torchrun's WORLD_SIZE "
                         f"{launch_env.world_size}")
        world_size = launch_env.world_size
    dtype = DTYPES[args.dtype]
    if args.min_bytes < dtype.itemsize:
        parser.error(f"--min-bytes {args.min_bytes} is less than one {args.dtype} "
                     f"({dtype.itemsize} bytes)")
    try:
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
    except ValueError as error:
        parser.error(f"-b/-e/-f: {error}")
    peers = args.peers if args.peers is not None else list(PEERS)
    if args.hosts > 1:
        if launch_env is not None:
            parser.error("--hosts: the tool simulates the hosts of the ranks it starts; under "
                         "torchrun it starts none")
        try:
            across_hosts.placement(world_size, args.hosts)
        except ValueError as error:
            parser.error(f"--hosts {args.hosts}: {error}")
        if args.peers is None:
            peers = list(HOST_PEERS)
        elif set(peers) - set(HOST_PEERS):
            parser.error(f"--hosts: only {' and '.join(HOST_PEERS)} run across simulated "
                         f"hosts, not {', '.join(p for p in peers if p not in HOST_PEERS)}")
    if "sendrecv" in args.ops and world_size < 2:
        parser.error("--ops sendrecv needs at least 2 ranks: every rank sends to the next")
    if "broadcast" in args.ops and args.root >= world_size:
        parser.error(f"--root {args.root} is not a rank of a world of {world_size}")
    reducing = [op for op in args.ops if op in REDUCING_OPS]
    if args.redop == "avg" and reducing and not dtype.is_floating_point:
        parser.error(f"--redop avg needs a floating-point --dtype, got {args.dtype}")
    if args.check:
        for op in args.ops:
            largest = largest_value(op, args.redop, world_size)
            if largest > exact_limit(dtype):
                parser.error(
                    f"--check: {op} on {world_size} ranks reaches {largest}, which {args.dtype} "
                    "does not hold exactly; use a wider --dtype, fewer ranks or --no-check")
    if args.plot is not None and plot.unavailable() is not None:
        parser.error(plot.unavailable())
    plan = Plan(world_size=world_size, sizes=sizes, ops=args.ops, peers=peers,
                dtype=args.dtype, redop=args.redop, root=args.root, iters=args.iters,
                warmup=args.warmup, target_seconds=args.target_time,
                timeout_seconds=args.timeout, check=args.check, threads=args.threads,
                trials=args.trials, hosts=args.hosts)
    baselines = ({device: args.baseline for device in BASELINES} if args.baseline
                 else dict(BASELINES))
    return Options(plan, baselines, args.json, args.csv, args.plot, args.quiet)


class _Progress:
    """A tqdm bar over the run's points on stderr, when stderr is a terminal and tqdm exists.

    Skips shrink the total, as their points will never come.
    """

    def __init__(self, plan: Plan, quiet: bool) -> None:
        self._bar = None
        self._points_per_op = len(plan.sizes)
        self._ops = len(plan.ops)
        if quiet or not sys.stderr.isatty() or importlib.util.find_spec("tqdm") is None:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=len(plan.sizes) * len(plan.ops) * len(plan.peers),
                         unit="point", file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, event: Event) -> None:
        if self._bar is None:
            return
        if isinstance(event, Skipped):
            ops = self._ops if event.op is None else 1
            self._bar.total -= ops * self._points_per_op
            self._bar.refresh()
        else:
            self._bar.set_postfix_str(f"{event.op} {event.peer} {format_size(event.size)}",
                                      refresh=False)
            self._bar.update()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _run_here(plan: Plan, launch_env: Launch, on_event: Callable[[Event], None]) -> list[Event]:
    """The sweep in this process, one rank of a torchrun job; every rank returns the events."""
    import torch

    from pyddp.bench.worker import sweep
    from pyddp.rendezvous import rendezvous

    torch.set_num_threads(plan.threads)
    store, _, _ = rendezvous("env://", launch_env.rank, launch_env.world_size,
                             datetime.timedelta(seconds=plan.timeout_seconds))
    events = []
    for event in sweep(plan, launch_env, store):
        events.append(event)
        on_event(event)
    return events


def microbenchmark(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the collectives benchmark; exit status 1 if a rank failed or an element was wrong."""
    launch_env = launched_rank()
    if launch_env is not None and launch_env.by_mpirun:
        print("pyddp.bench: do not start the tool under mpirun; it starts mpirun itself when "
              "the mpi peer is wanted", file=sys.stderr)
        return 2
    options = parse_options(argv, launch_env)
    plan = options.plan
    speaker = launch_env is None or launch_env.rank == 0
    if speaker:
        on_hosts = f" on {plan.hosts} simulated hosts" if plan.hosts > 1 else ""
        print(f"# pyddp.bench: {plan.world_size} ranks{on_hosts}, {', '.join(plan.ops)}, "
              f"{plan.dtype}, "
              f"{format_size(plan.sizes[0])} to {format_size(plan.sizes[-1])}, "
              f"peers {', '.join(plan.peers)}", flush=True)
    progress = _Progress(plan, options.quiet or not speaker)
    try:
        if launch_env is None:
            events = launch.run(plan, progress)
        else:
            events = _run_here(plan, launch_env, progress)
    except launch.BenchError as error:
        print(f"pyddp.bench: {error}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    results = [e for e in events if isinstance(e, Result)]
    skipped = [e for e in events if isinstance(e, Skipped)]
    if speaker:
        print(report.render(results, skipped, plan.ops, plan.peers, options.baselines,
                            plan.check), flush=True)
        if plan.hosts > 1:
            print("\n" + report.simulated_hosts(
                across_hosts.placement(plan.world_size, plan.hosts), results), flush=True)
        if options.json_path is not None:
            report.write_json(options.json_path, dataclasses.asdict(plan), results, skipped)
        if options.csv_path is not None:
            report.write_csv(options.csv_path, results)
        if options.plot_path is not None:
            if results:
                plot.write_plot(options.plot_path, results, plan.ops, plan.peers,
                                f"pyddp.bench: {plan.world_size} ranks, {plan.dtype}, "
                                f"{os.uname().nodename}")
            else:
                print(f"pyddp.bench: no results, so no plot at {options.plot_path}",
                      file=sys.stderr)
    return 0 if all(not r.wrong for r in results) else 1


def subcommand(name: str, argv: Sequence[str]) -> int:
    """``python -m pyddp.bench NAME [options]``: hands ``argv`` to NAME's module."""
    module_name, what = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(f"pyddp.bench {name}: {what} ({module_name}) is not part of this installation of "
              "pyddp", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"python -m pyddp.bench {name}",
                                     description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return module.main(parser.parse_args(argv))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m pyddp.bench [ddp|soak] [options]``; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        return subcommand(args[0], args[1:])
    return microbenchmark(args)
