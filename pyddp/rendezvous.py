"""Rendezvous: turn an init_method into a torch c10d Store, a rank and a world size.

pyddp uses torch's own stores (TCPStore, FileStore, PrefixStore) and torch's
own URL handlers, so ``env://`` works under ``torchrun`` (including its agent
store) and under the legacy ``torch.distributed.launch``.
"""

from __future__ import annotations

import datetime
import os
import sys
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
    store, r, w = next(
        dist.rendezvous(
            init_method,
            rank=-1 if rank is None else rank,
            world_size=-1 if world_size is None else world_size,
            timeout=timeout,
        )
    )
    store.set_timeout(timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if scheme == "env" and restart is not None:
        # torchrun may keep its store across the restarts of a job: the keys of
        # an earlier attempt (a dead rank's segment name among them) must not be
        # read as this attempt's.
        store = dist.PrefixStore(f"pyddp/attempt{restart}", store)
    return store, r, w


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
