"""Rendering results: nccl-tests-shaped tables, the ratio summary, skips, JSON and CSV."""

import csv
import dataclasses
import json
import os
import platform
from collections.abc import Sequence
from typing import Any, Optional

import torch

from pyddp.bench.across_hosts import flat_ring_inter_host_bytes, hierarchical_inter_host_bytes
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.peers import CEILINGS, FLOORS, RIVALS

_ROW = "{:>12}  {:>12}  {:>8}  {:>6}  {:>4}  {:>11}  {:>12}  {:>12}  {:>7}"


def table(results: Sequence[Result]) -> str:
    """One table for the results of a single (op, peer), in size order."""
    first = results[0]
    lines = [
        f"# {first.op}  peer: {first.peer} ({first.detail})  ranks: {first.world_size}  "
        f"device: {first.device}",
        "#" + _ROW.format("size (B)", "count", "type", "redop", "root", "time (us)",
                          "algbw (GB/s)", "busbw (GB/s)", "#wrong")[1:],
    ]
    for r in results:
        lines.append(_ROW.format(r.size, r.count, r.dtype, r.redop, r.root, f"{r.time_us:.1f}",
                                 f"{r.algbw_gbps:.3f}", f"{r.busbw_gbps:.3f}",
                                 "N/A" if r.wrong is None else r.wrong))
    return "\n".join(lines)


def summary(results: Sequence[Result], peers: Sequence[str], baseline: str) -> Optional[str]:
    """Per size, each peer's speed-up over ``baseline``: baseline time / peer time.

    ``results`` are of one op and one device. That ratio is also the busbw
    ratio (same size, same factor); above 1 the peer is faster. A peer
    without a point at some size shows "-". None when ``baseline`` has no
    results here or no other peer has.
    """
    base = {r.size: r for r in results if r.peer == baseline}
    others = [name for name in peers
              if name != baseline and any(r.peer == name for r in results)]
    if not base or not others:
        return None
    first = next(iter(base.values()))
    times = {(r.peer, r.size): r.time_us for r in results}
    # Columns of 12, wider where a name is longer.
    row = "{:>12}" + "".join(f"  {{:>{max(12, len(name))}}}"
                             for name in (f"{baseline} (us)", *others))
    lines = [
        f"# summary: {first.op} on {first.device}, speed-up over {baseline} "
        f"({baseline} time / peer time = busbw ratio; above 1 is faster)",
        "#" + row.format("size (B)", f"{baseline} (us)", *others)[1:],
    ]
    for size in sorted(base):
        cells = [f"{base[size].time_us / times[name, size]:.2f}x" if (name, size) in times
                 else "-" for name in others]
        lines.append(row.format(size, f"{base[size].time_us:.1f}", *cells))
    return "\n".join(lines)


def skipped_lines(skipped: Sequence[Skipped]) -> str:
    """One ``# skipped:`` line per peer or (peer, op) that did not run, with why."""
    return "\n".join(
        f"# skipped: {s.peer}{'' if s.op is None else ' ' + s.op}: {s.reason}"
        for s in skipped)


def render(results: Sequence[Result], skipped: Sequence[Skipped], ops: Sequence[str],
           peers: Sequence[str], baselines: dict[str, str], checked: bool) -> str:
    """All tables (per op, per peer), each op's summaries, the skips and the wrong count.

    ``baselines`` maps a device ("cpu", "cuda") to the peer its summary
    compares with; every op also gets a summary over each device's rival,
    floor and ceiling peer (peers.RIVALS, FLOORS, CEILINGS) where it ran.
    """
    blocks: list[str] = []
    for op in ops:
        of_op = [r for r in results if r.op == op]
        for name in peers:
            rows = [r for r in of_op if r.peer == name]
            if rows:
                blocks.append(table(rows))
        # Against the baseline, the rival library when it ran (MPI time / peer time), the
        # floor (on GPUs gloo, staged through the host), then the ceiling (below 1: the
        # share of the machine's memory speed a peer reaches); each pair once.
        references = dict.fromkeys(
            [*baselines.items(), *RIVALS.items(), *FLOORS.items(), *CEILINGS.items()])
        for device, reference in references:
            text = summary([r for r in of_op if r.device == device], peers, reference)
            if text is not None:
                blocks.append(text)
    if skipped:
        blocks.append(skipped_lines(skipped))
    if checked:
        wrong = sum(r.wrong or 0 for r in results)
        blocks.append(f"# wrong elements: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    else:
        blocks.append("# wrong elements: not checked (--no-check)")
    return "\n\n".join(blocks)


def _ranks_on_hosts(hosts_of: Sequence[str]) -> str:
    """"ranks 0,1 on host0; ranks 2,3 on host1"."""
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts_of):
        ranks.setdefault(host, []).append(rank)
    return "; ".join(f"ranks {','.join(map(str, rs))} on {host}" for host, rs in ranks.items())


_HOSTS_ROW = "{:>12}  {:>14}  {:>14}  {:>10}  {:>14}  {:>14}"


def simulated_hosts(hosts_of: Sequence[str], results: Sequence[Result]) -> str:
    """What a run on simulated hosts means, and, per all_reduce size in ``results``, the
    bytes that cross hosts for a flat ring over every rank (gloo) and for pyddp's layout.

    ``hosts_of[r]`` names the host of rank r (an even placement).
    """
    hosts = len(set(hosts_of))
    per_host = len(hosts_of) // hosts
    layout = ("hierarchical: a reduce-scatter inside each host, an all-reduce of each "
              f"rank's 1/{per_host} shard across hosts, an all-gather inside each host"
              if per_host > 1 else "one rank per host: gloo alone")
    lines = [
        f"# simulated hosts: {hosts} hosts x {per_host} ranks ({_ranks_on_hosts(hosts_of)}), "
        "each its own UTS and mount namespace with a private /dev/shm, connected by "
        "loopback TCP",
        "# loopback is not a network: bytes between these hosts move at memory speed, so the "
        "times and bandwidths above are not those of real hosts; only the ratio of pyddp to "
        "gloo, measured on the same ranks and placement, means something",
    ]
    sizes = sorted({r.size for r in results if r.op == "all_reduce"})
    if not sizes:
        return "\n".join(lines)
    lines += [
        f"# bytes that cross hosts per all_reduce (ring model): gloo's flat ring over all "
        f"{len(hosts_of)} ranks, {hosts} of whose links cross hosts, against pyddp auto "
        f"({layout}); in all, and from the rank that sends the most",
        "#" + _HOSTS_ROW.format("size (B)", "gloo all", "pyddp all", "pyddp/gloo",
                                "gloo busiest", "pyddp busiest")[1:],
    ]
    for size in sizes:
        flat = flat_ring_inter_host_bytes(size, hosts_of)
        hier = hierarchical_inter_host_bytes(size, hosts_of)
        lines.append(_HOSTS_ROW.format(size, f"{sum(flat):.0f}", f"{sum(hier):.0f}",
                                       f"{sum(hier) / sum(flat):.3f}", f"{max(flat):.0f}",
                                       f"{max(hier):.0f}"))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """What the numbers were measured on, for the JSON output."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def write_json(path: str, plan: dict[str, Any], results: Sequence[Result],
               skipped: Sequence[Skipped]) -> None:
    """Writes ``{"plan", "environment", "results", "skipped"}`` to ``path``; one result per
    (op, peer, size), fields as in metrics.Result."""
    document = {
        "plan": plan,
        "environment": environment(),
        "results": [dataclasses.asdict(r) for r in results],
        "skipped": [dataclasses.asdict(s) for s in skipped],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def write_csv(path: str, results: Sequence[Result]) -> None:
    """Writes one CSV row per result, columns as the fields of metrics.Result ("" for None)."""
    fields = [f.name for f in dataclasses.fields(Result)]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in results:
            writer.writerow({k: ("" if v is None else v) for k, v in dataclasses.asdict(r).items()})
