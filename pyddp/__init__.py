"""pyddp: collective communication for PyTorch.

Ring and direct collectives in C++ and CUDA: over shared memory for CPU
tensors on one host, over CUDA IPC for GPU tensors on one host, and over
NCCL for GPU tensors across hosts, with ``torch.distributed``'s names::

    import pyddp
    pyddp.init_process_group("auto", init_method="env://")
    pyddp.all_reduce(tensor)              # in place, SUM
    work = pyddp.all_reduce(tensor, async_op=True)
    work.wait()

Importing pyddp also registers the ``torch.distributed`` backend ``"pyddp"``::

    torch.distributed.init_process_group("pyddp")   # or "cpu:pyddp,cuda:nccl"
"""

import logging as _logging

import torch as _torch

# torch.distributed registers the c10d types (Store, Backend, Work) that
# pyddp._C builds on; it must be imported first.
import torch.distributed as _dist  # noqa: F401

from ._version import __version__

_REBUILD = ("rebuild pyddp against the torch that runs it: `python -m pip install "
            "--no-build-isolation -e .` (or `python setup.py build_ext --inplace`) in pyddp's "
            "source tree")


def _refuse_a_second_runtime() -> None:
    """Raises ImportError, before it is loaded, for an extension that carries its own C++
    runtime: loading it would crash, or format numbers as empty strings (_runtime.py)."""
    import importlib.util

    from ._runtime import own_runtime

    spec = importlib.util.find_spec(f"{__name__}._C")
    why = own_runtime(spec.origin) if spec is not None and spec.origin else None
    if why:
        raise ImportError(f"pyddp's C++ extension cannot be loaded: {why}")


_refuse_a_second_runtime()
try:
    from . import _C
except ImportError as _error:
    raise ImportError(f"pyddp's C++ extension does not load with torch {_torch.__version__} "
                      f"({_error}); {_REBUILD}") from _error
if _C.torch_version != _torch.__version__.split("+")[0]:
    raise ImportError(f"pyddp's C++ extension was built against torch {_C.torch_version}, but "
                      f"torch {_torch.__version__} is running; {_REBUILD}")

from .process_group import (  # noqa: E402
    BACKENDS,
    Algo,
    P2POp,
    ProcessGroup,
    ReduceOp,
    GroupOptions,
    RingOptions,
    SlotStores,
    CmaReads,
    Work,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_into_tensor_coalesced,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    create_group,
    destroy_process_group,
    gather,
    get_default_group,
    get_rank,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter_single,
    reduce_scatter_tensor,
    reduce_scatter_tensor_coalesced,
    scatter,
    send,
)
from .subgroups import NonMemberGroup, new_group, new_subgroups  # noqa: E402
from .torch_backend import register_torch_backend  # noqa: E402
from .ddp import DistributedDataParallel  # noqa: E402
from .registered import empty, is_registered  # noqa: E402
from .rendezvous import local_rank  # noqa: E402
from .survival import Agreement, agree, join, pending_joins  # noqa: E402


def has_cuda() -> bool:
    """Whether this build of pyddp has its CUDA and NCCL parts (a CUDA build of torch and nvcc
    at build time); whether a GPU is present is torch.cuda.is_available()'s question."""
    return bool(_C.has_cuda)


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
    "Agreement",
    "Algo",
    "BACKENDS",
    "DistributedDataParallel",
    "NonMemberGroup",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "GroupOptions",
    "RingOptions",
    "SlotStores",
    "CmaReads",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "create_group",
    "destroy_process_group",
    "empty",
    "gather",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "has_cuda",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_registered",
    "isend",
    "local_rank",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "recv",
    "reduce",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "register_torch_backend",
    "scatter",
    "send",
    "agree",
    "join",
    "pending_joins",
    "__version__",
]
