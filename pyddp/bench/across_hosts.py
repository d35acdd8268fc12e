"""Simulated hosts (``--hosts``): where the ranks go, and what an all_reduce sends between hosts.

The byte counts follow the ring model that busbw uses (metrics.busbw_factor):
in a ring all-reduce of B bytes over m ranks, every rank sends 2(m-1)/m x B
to the next rank of the ring (a reduce-scatter, then an all-gather, each
sending m-1 blocks of B/m). They count bytes as the model does, leaving out
the rounding of blocks to whole elements. Pure: nothing here communicates.
"""

from collections.abc import Hashable, Sequence


def placement(world_size: int, hosts: int) -> list[str]:
    """The host of each rank when ``world_size`` ranks are split evenly over ``hosts``
    hosts, host by host: ranks 0..K-1 on "host0", the next K on "host1", and so on.

    Raises ValueError unless ``world_size`` is a positive multiple of ``hosts``.
    """
    if hosts < 1 or world_size < 1 or world_size % hosts:
        raise ValueError(f"{world_size} ranks do not split evenly over {hosts} hosts "
                         "(the world size must be a multiple of the number of hosts)")
    per_host = world_size // hosts
    return [f"host{rank // per_host}" for rank in range(world_size)]


def ring_sends(nbytes: float, ring_size: int) -> float:
    """What each rank of a ring all-reduce of ``nbytes`` over ``ring_size`` ranks sends."""
    if ring_size < 1:
        raise ValueError(f"a ring needs at least one rank, got {ring_size}")
    return 2 * (ring_size - 1) / ring_size * nbytes


def flat_ring_inter_host_bytes(nbytes: float, hosts_of: Sequence[Hashable]) -> list[float]:
    """By rank, the bytes it sends to another host in a flat ring all_reduce of ``nbytes``.

    The ring runs over every rank in rank order (torch's gloo): rank r sends
    ``ring_sends(nbytes, n)`` to rank r+1 mod n, and that counts when r+1 is on
    another host than r (``hosts_of[r]`` names the host of rank r). With the
    ranks placed host by host on H > 1 hosts, H links of the ring cross.
    """
    n = len(hosts_of)
    sent = ring_sends(nbytes, n)
    return [sent if hosts_of[r] != hosts_of[(r + 1) % n] else 0.0 for r in range(n)]


def hierarchical_inter_host_bytes(nbytes: float, hosts_of: Sequence[Hashable]) -> list[float]:
    """By rank, the bytes it sends to another host in pyddp's all_reduce of ``nbytes``
    across hosts (backend "auto"), every host holding the same number K of ranks.

    K > 1 is pyddp's even hierarchical layout: a reduce-scatter inside each
    host leaves each rank a shard of B/K bytes; the ranks of one local rank,
    one per host, all-reduce their shard over a gloo ring of H ranks, so every
    byte they send crosses hosts: ``ring_sends(B/K, H)`` per rank; the
    all-gather of the shards stays inside each host. K = 1 is pyddp's
    gloo-alone layout, a ring over the H hosts: the same formula.

    Raises ValueError when the hosts hold different numbers of ranks (pyddp
    then goes through host leaders, which this does not count).
    """
    per_host: dict[Hashable, int] = {}
    for host in hosts_of:
        per_host[host] = per_host.get(host, 0) + 1
    if len(set(per_host.values())) != 1:
        raise ValueError(f"the hosts hold different numbers of ranks ({per_host}); "
                         "only an even placement is counted")
    k = next(iter(per_host.values()))
    return [ring_sends(nbytes / k, len(per_host))] * len(hosts_of)
