"""Rendering results: nccl-tests-shaped tables, the comparison summary and JSON."""

import dataclasses
import json
from collections.abc import Iterable

from pyddp.bench.metrics import Result

_ROW = "{:>12}  {:>12}  {:>8}  {:>11}  {:>12}  {:>12}  {:>8}"


def table(results: list[Result]) -> str:
    """One table for the results of a single (op, backend), in size order."""
    first = results[0]
    lines = [
        f"# op: {first.op}  backend: {first.backend}  ranks: {first.world_size}  "
        f"dtype: {first.dtype}",
        "#" + _ROW.format("size (B)", "count", "type", "time (us)", "algbw (GB/s)",
                          "busbw (GB/s)", "#wrong")[1:],
    ]
    for r in results:
        lines.append(_ROW.format(r.size, r.count, r.dtype, f"{r.time_us:.1f}",
                                 f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}", r.wrong))
    return "\n".join(lines)


def summary(candidate: list[Result], baseline: list[Result]) -> str:
    """Per size, ``candidate``'s speed-up over ``baseline`` (same op, same sizes).

    The speed-up is baseline time / candidate time, which is also candidate
    busbw / baseline busbw (same size, same factor); both busbw are shown.
    """
    c0, b0 = candidate[0], baseline[0]
    row = "{:>12}  {:>12}  {:>12}  {:>9}  {:>12}  {:>12}"
    lines = [
        f"# summary: {c0.op}, {c0.backend} vs {b0.backend} "
        f"(speed-up = {b0.backend} time / {c0.backend} time = busbw ratio)",
        "#" + row.format("size (B)", f"{c0.backend} (us)", f"{b0.backend} (us)", "speed-up",
                         f"{c0.backend} busbw", f"{b0.backend} busbw")[1:],
    ]
    by_size = {r.size: r for r in baseline}
    for c in candidate:
        b = by_size[c.size]
        lines.append(row.format(c.size, f"{c.time_us:.1f}", f"{b.time_us:.1f}",
                                f"{b.time_us / c.time_us:.2f}x", f"{c.busbw_gbps:.3f}",
                                f"{b.busbw_gbps:.3f}"))
    return "\n".join(lines)


def render(results: list[Result], ops: Iterable[str], backends: list[str], baseline: str) -> str:
    """All tables (per op, per backend), then each backend's summary against ``baseline``.

    The summary is left out when ``baseline`` was not run.
    """
    blocks: list[str] = []
    for op in ops:
        runs = {name: [r for r in results if r.op == op and r.backend == name]
                for name in backends}
        blocks.extend(table(runs[name]) for name in backends if runs[name])
        if runs.get(baseline):
            blocks.extend(summary(runs[name], runs[baseline])
                          for name in backends if name != baseline and runs[name])
    wrong = sum(r.wrong for r in results)
    blocks.append(f"# wrong elements: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return "\n\n".join(blocks)


def write_json(results: list[Result], path: str) -> None:
    """Writes ``results`` to ``path`` as a JSON list of dicts, one per (op, backend, size)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump([dataclasses.asdict(r) for r in results], f, indent=2)
        f.write("\n")
