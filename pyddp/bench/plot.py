"""``--plot``: busbw and latency against message size, one line per peer (matplotlib)."""

import importlib.util
from collections.abc import Sequence
from typing import Optional

from pyddp.bench.metrics import Result
from pyddp.bench.ops import SIZELESS_OPS
from pyddp.bench.sizes import format_size


def unavailable() -> Optional[str]:
    """Why ``--plot`` cannot work here; None if it can."""
    if importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib (pip install matplotlib)"
    return None


def write_plot(path: str, results: Sequence[Result], ops: Sequence[str],
               peers: Sequence[str], title: str) -> None:
    """Draws, for each op with results, busbw (left) and time per call (right) against size
    (a barrier, which has no size, is in the tables only).

    Both axes are logarithmic; the format follows ``path``'s extension (png,
    svg, pdf). Uses matplotlib's object API with the Agg canvas, so no display
    or global pyplot state is involved.
    """
    from matplotlib.figure import Figure

    measured = [op for op in ops
                if op not in SIZELESS_OPS and any(r.op == op for r in results)]
    if not measured:
        raise ValueError("no results to plot")
    figure = Figure(figsize=(12, 4.2 * len(measured)), layout="constrained")
    axes = figure.subplots(len(measured), 2, squeeze=False)
    for (bw_ax, time_ax), op in zip(axes, measured):
        for name in peers:
            rows = sorted((r for r in results if r.op == op and r.peer == name),
                          key=lambda r: r.size)
            if not rows:
                continue
            sizes = [r.size for r in rows]
            bw_ax.plot(sizes, [r.busbw_gbps for r in rows], marker="o", label=name)
            time_ax.plot(sizes, [r.time_us for r in rows], marker="o", label=name)
        for ax, label in ((bw_ax, "busbw (GB/s)"), (time_ax, "time per call (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size")
            ax.set_ylabel(label)
            ax.set_title(f"{op}: {label.split(' (')[0]}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            ticks = sorted({r.size for r in results if r.op == op})
            ax.set_xticks(ticks, [format_size(t) for t in ticks])
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
