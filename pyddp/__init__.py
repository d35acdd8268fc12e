"""pyddp: collective communication for PyTorch.

Ring and direct collectives in C++ over shared memory (CPU tensors, one
host), with ``torch.distributed``'s names::

    import pyddp
    pyddp.init_process_group("shm", init_method="env://")
    pyddp.all_reduce(tensor)              # in place, SUM
    work = pyddp.all_reduce(tensor, async_op=True)
    work.wait()

Importing pyddp also registers the ``torch.distributed`` backend ``"pyddp"``::

    torch.distributed.init_process_group("pyddp")   # or "cpu:pyddp,cuda:nccl"
"""

import logging as _logging

# torch.distributed registers the c10d types (Store, Backend, Work) that
# pyddp._C builds on; it must be imported first.
import torch.distributed as _dist  # noqa: F401

from . import _C
from .process_group import (
    BACKENDS,
    ProcessGroup,
    ReduceOp,
    RingOptions,
    Work,
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    barrier,
    broadcast,
    destroy_process_group,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    reduce_scatter_single,
    reduce_scatter_tensor,
    register_torch_backend,
)
from .ddp import DistributedDataParallel
from .rendezvous import local_rank


def _configure_logging(level: str) -> None:
    """PYDDP_DEBUG=INFO (or any logging level name or number) shows pyddp's log on stderr."""
    if not level:
        return
    value = int(level) if level.isdigit() else _logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"PYDDP_DEBUG={level!r} is not a logging level "
                         "(DEBUG, INFO, WARNING, ERROR or a number)")
    log = _logging.getLogger("pyddp")
    log.setLevel(value)
    if not log.handlers:
        log.addHandler(_logging.StreamHandler())


_configure_logging(_C.settings().get("PYDDP_DEBUG", ""))
register_torch_backend()

__all__ = [
    "BACKENDS",
    "DistributedDataParallel",
    "ProcessGroup",
    "ReduceOp",
    "RingOptions",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "local_rank",
    "new_group",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_torch_backend",
]
