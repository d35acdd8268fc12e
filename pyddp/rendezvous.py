"""Rendezvous: turn an init_method into a torch c10d Store, a rank and a world size.

pyddp uses torch's own stores (TCPStore, FileStore, PrefixStore) and torch's
own URL handlers, so ``env://`` works under ``torchrun`` (including its agent
store) and under the legacy ``torch.distributed.launch``. One difference:
where rank 0 hosts the TCPStore (``env://`` without torchrun's agent store,
``tcp://``), it does not wait in the store's constructor for every rank to
connect, which fails saying only how many came ("1/2 clients joined"):
pyddp's bootstrap waits instead, naming the ranks that did not join.
"""

from __future__ import annotations

import datetime
import os
import sys
import urllib.parse
from typing import Optional, Tuple

import torch.distributed as dist


def rendezvous(
    init_method: str,
    rank: Optional[int],
    world_size: Optional[int],
    timeout: datetime.timedelta,
) -> Tuple[dist.Store, int, int]:
    """Returns ``(store, rank, world_size)`` for ``env://``, ``tcp://host:port`` or ``file:///path``.

    ``env://`` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for whatever
    ``rank``/``world_size`` leaves as None; ``tcp://`` and ``file://`` need both.
    """
    scheme = init_method.split("://", 1)[0] if "://" in init_method else ""
    if scheme not in ("env", "tcp", "file"):
        raise ValueError(
            f"pyddp: init_method {init_method!r} is not env://, tcp://host:port or file:///path"
        )
    if scheme != "env" and (rank is None or world_size is None):
        raise ValueError(
            f"pyddp: init_method {init_method!r} needs explicit rank and world_size "
            f"(got rank={rank}, world_size={world_size})"
        )
    hosted = _hosted_tcp_store(scheme, init_method, rank, world_size, timeout)
    if hosted is not None:
        return hosted
    store, r, w = next(
        dist.rendezvous(
            init_method,
            rank=-1 if rank is None else rank,
            world_size=-1 if world_size is None else world_size,
            timeout=timeout,
        )
    )
    store.set_timeout(timeout)
    return _this_attempt(scheme, store), r, w


def _this_attempt(scheme: str, store: dist.Store) -> dist.Store:
    """``store``, or under torchrun (env://) the part of it that this attempt of the job
    uses: torchrun may keep its store across the restarts of a job, and the keys of an
    earlier attempt (a dead rank's segment name among them) must not be read as this
    attempt's."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if scheme != "env" or restart is None:
        return store
    return dist.PrefixStore(f"pyddp/attempt{restart}", store)


def _hosted_tcp_store(scheme: str, init_method: str, rank: Optional[int],
                      world_size: Optional[int], timeout: datetime.timedelta
                      ) -> Optional[Tuple[dist.Store, int, int]]:
    """Rank 0's TCPStore for env:// and tcp://, made as torch makes it but without
    waiting for the other ranks; None where torch's handler should run (any other
    rank, torchrun's agent store, settings torch would refuse with its own message)."""
    if scheme not in ("env", "tcp") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    url = urllib.parse.urlparse(init_method)
    query = dict(pair.split("=", 1) for pair in url.query.split("&") if "=" in pair)
    if scheme == "env":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        rank_text = query.get("rank", os.environ.get("RANK")) if rank is None else str(rank)
        size_text = (query.get("world_size", os.environ.get("WORLD_SIZE"))
                     if world_size is None else str(world_size))
    else:
        host, port = url.hostname, url.port
        rank_text, size_text = str(rank), str(world_size)
    try:
        r, w, p = int(rank_text), int(size_text), int(port)
    except (TypeError, ValueError):
        return None
    if r != 0 or not host:
        return None
    use_libuv = query.get("use_libuv", os.environ.get("USE_LIBUV", "1")) == "1"
    store = dist.TCPStore(host, p, w, is_master=True, timeout=timeout, wait_for_workers=False,
                          multi_tenant=True, use_libuv=use_libuv)
    return store, r, w


def client_store(init_method: str, timeout: datetime.timedelta) -> dist.Store:
    """The store of a running job, for a process that joins it (pyddp.join): a client of
    its TCPStore for ``env://`` (MASTER_ADDR and MASTER_PORT) and ``tcp://host:port``, its
    FileStore for ``file:///path`` (one that never removes the file: the job's ranks own
    it)."""
    scheme = init_method.split("://", 1)[0] if "://" in init_method else ""
    url = urllib.parse.urlparse(init_method)
    if scheme == "file":
        return dist.FileStore(url.path)
    if scheme == "env":
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    elif scheme == "tcp":
        host, port = url.hostname, url.port
    else:
        raise ValueError(
            f"pyddp: init_method {init_method!r} is not env://, tcp://host:port or file:///path"
        )
    if not host or not port:
        raise ValueError(f"pyddp: init_method {init_method!r} names no store address "
                         "(env:// reads MASTER_ADDR and MASTER_PORT)")
    return _this_attempt(scheme, dist.TCPStore(host, int(port), is_master=False,
                                               timeout=timeout))


def local_rank() -> int:
    """This process's rank on its host.

    LOCAL_RANK from the environment (torchrun), else the legacy launcher's
    ``--local_rank``/``--local-rank`` argument, else 0.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 0
