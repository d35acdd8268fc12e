"""Command line of ``python -m pyddp.bench``."""

import argparse
import sys
from collections.abc import Callable, Collection
from typing import Optional

from pyddp.bench import launch, report
from pyddp.bench.backends import BACKENDS
from pyddp.bench.ops import OPS
from pyddp.bench.sizes import format_size, parse_size, size_sweep
from pyddp.bench.worker import DTYPES, Plan


def _size(text: str) -> int:
    """argparse type for a byte size (``4K``, ``64M``)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    """argparse type for an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _names(known: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type for a comma list of names from ``known``, duplicates dropped."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose a comma list from {', '.join(known)}")
        return list(dict.fromkeys(names))
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m pyddp.bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m pyddp.bench",
        description="Time pyddp's collectives against torch.distributed peers on this machine "
                    "(nccl-tests-shaped output; sizes take K/M/G suffixes).")
    parser.add_argument("--world-size", type=_positive_int, default=2,
                        help="ranks to spawn (default: 2)")
    parser.add_argument("-b", "--min-bytes", type=_size, default=parse_size("4K"),
                        help="smallest message size (default: 4K)")
    parser.add_argument("-e", "--max-bytes", type=_size, default=parse_size("64M"),
                        help="largest message size (default: 64M)")
    parser.add_argument("-f", "--step-factor", type=int, default=4,
                        help="size multiplier between steps, at least 2 (default: 4)")
    parser.add_argument("--iters", type=_positive_int, default=None,
                        help="timed iterations per point (default: adaptive, about "
                             "--target-time seconds and at least 5)")
    parser.add_argument("--target-time", type=float, default=0.2,
                        help="seconds per point when --iters is adaptive (default: 0.2)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed iterations before each point (default: 3)")
    parser.add_argument("--ops", type=_names(OPS), default=["all_reduce"],
                        help=f"comma list of collectives from {', '.join(OPS)} "
                             "(default: all_reduce)")
    parser.add_argument("--backends", type=_names(BACKENDS), default=["pyddp", "gloo"],
                        help=f"comma list from {', '.join(BACKENDS)} (default: pyddp,gloo)")
    parser.add_argument("--baseline", choices=list(BACKENDS), default="gloo",
                        help="backend the others' speed-ups are relative to (default: gloo)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="element type (default: float32)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may take, and the run may go without "
                             "progress, before it is stopped (default: 300)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results to PATH as a JSON list")
    return parser


def parse_plan(argv: Optional[list[str]] = None) -> tuple[Plan, Optional[str], str]:
    """The run's Plan, the JSON path (or None) and the baseline backend from ``argv``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    itemsize = DTYPES[args.dtype].itemsize
    if args.min_bytes < itemsize:
        parser.error(f"--min-bytes {args.min_bytes} is less than one {args.dtype} "
                     f"({itemsize} bytes)")
    if args.warmup < 0 or args.target_time <= 0 or args.timeout <= 0:
        parser.error("--warmup must be >= 0; --target-time and --timeout must be positive")
    try:
        sizes = size_sweep(args.min_bytes, args.max_bytes, args.step_factor)
    except ValueError as error:
        parser.error(str(error))
    plan = Plan(world_size=args.world_size, sizes=sizes, ops=args.ops, backends=args.backends,
                dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                target_seconds=args.target_time, timeout_seconds=args.timeout)
    return plan, args.json, args.baseline


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the benchmark; exit status 1 if a rank failed or any element was wrong."""
    plan, json_path, baseline = parse_plan(argv)
    print(f"# pyddp.bench: world size {plan.world_size}, {', '.join(plan.ops)}, "
          f"{format_size(plan.sizes[0])} to {format_size(plan.sizes[-1])}, "
          f"backends {', '.join(plan.backends)}", flush=True)
    try:
        results = launch.run(plan)
    except launch.BenchError as error:
        print(f"pyddp.bench: {error}", file=sys.stderr)
        return 1
    print(report.render(results, plan.ops, plan.backends, baseline))
    if json_path is not None:
        report.write_json(results, json_path)
    return 0 if all(r.wrong == 0 for r in results) else 1
