"""The process group: a typed Python face over the C++ backends.

This is the only module that imports ``pyddp._C``. Names and argument order
follow ``torch.distributed``. A group holds one C++ backend per device type:
a RingBackend over shm for CPU tensors, and for CUDA tensors a RingBackend
over cuda_ipc or an NcclBackend, as the group's ``backend`` asks.
"""

from __future__ import annotations

import datetime
import itertools
import logging
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

from . import _C
from .rendezvous import rendezvous

logger = logging.getLogger("pyddp")

ReduceOp = dist.ReduceOp
RingOptions = _C.RingOptions

_SUPPORTED_OPS = {
    ReduceOp.SUM: _C.RedOp.SUM,
    ReduceOp.AVG: _C.RedOp.AVG,
    ReduceOp.PRODUCT: _C.RedOp.PRODUCT,
    ReduceOp.MIN: _C.RedOp.MIN,
    ReduceOp.MAX: _C.RedOp.MAX,
}
HAS_CUDA: bool = _C.has_cuda
# "shm": CPU tensors. "cuda_ipc", "nccl" (NCCL's own collectives) and
# "nccl_ring" (pyddp's ring over NCCL send/recv): CUDA tensors on the current
# device. "auto": shm for CPU tensors and, from the first CUDA collective on,
# cuda_ipc when every rank shares this host and peer access works, NCCL
# otherwise.
BACKENDS = (("shm", "auto", "cuda_ipc", "nccl", "nccl_ring") if HAS_CUDA
            else ("shm", "auto"))
# The most ranks the cuda_ipc transport serves (ipc::kMaxRanks).
CUDA_IPC_MAX_RANKS = 16
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

# Each group gets its own store prefix, so a process can create, destroy and
# re-create groups on one store.
_group_ids = itertools.count()
_default_group: Optional["ProcessGroup"] = None


class Work:
    """Handle of an asynchronous collective (``async_op=True``)."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Blocks until the collective is done; raises its error, if any.

        ``timeout`` bounds this wait only (the group's timeout bounds the
        collective itself).
        """
        if timeout is None:
            return self._work.wait()
        return self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def exception(self) -> Optional[BaseException]:
        """The error the collective failed with; None while running or on success."""
        if not self._work.is_completed():
            return None
        try:
            self._work.wait()
        except Exception as error:  # the stored failure, returned rather than raised
            return error
        return None

    def get_future(self) -> torch.futures.Future:
        """A future completed with the list of output tensors."""
        return self._work.get_future()

    def result(self) -> List[torch.Tensor]:
        return self._work.result()


def _finish(work: dist.Work, async_op: bool) -> Optional[Work]:
    if async_op:
        return Work(work)
    work.wait()
    return None


class ProcessGroup:
    """A group of ranks that run collectives together (create with init_process_group)."""

    def __init__(self, kind: str, store: dist.Store, prefix: str, rank: int, world_size: int,
                 timeout: datetime.timedelta, options: RingOptions) -> None:
        self._kind = kind
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._options = options
        self.timeout = timeout
        # One C++ backend per device type ("cpu", "cuda"), each on its own
        # store prefix, and the transport it uses.
        self._backends: Dict[str, object] = {}
        self._transports: Dict[str, str] = {}
        if kind in ("shm", "auto"):
            logger.info("rank %d/%d: group %s: CPU tensors over shm (every rank on one host; "
                        "slot_bytes=%d, num_slots=%d, direct_max_bytes=%d, two_shot_max_bytes=%d, "
                        "algo=%s)", rank, world_size, prefix, options.slot_bytes,
                        options.num_slots, options.direct_max_bytes, options.two_shot_max_bytes,
                        options.algo)
            self._add("cpu", "shm", self._ring(torch.device("cpu")))
        else:
            logger.info("rank %d/%d: group %s: CUDA tensors over %s (asked for)",
                        rank, world_size, prefix, kind)
            device = self._cuda_device()
            self._add("cuda", kind, self._nccl(device) if kind == "nccl" else
                      self._ring(device, "nccl" if kind == "nccl_ring" else "cuda_ipc"))

    def _add(self, device_type: str, transport: str, backend: object) -> object:
        self._backends[device_type] = backend
        self._transports[device_type] = transport
        return backend

    def _cuda_device(self, device: Optional[torch.device] = None) -> torch.device:
        """``device`` (a CUDA tensor's), or the current CUDA device."""
        if not torch.cuda.is_available():
            raise RuntimeError(f"pyddp: rank {self._rank}: backend {self._kind!r} needs a CUDA "
                               "device, and torch sees none")
        if device is not None and device.index is not None:
            return device
        return torch.device("cuda", torch.cuda.current_device())

    def _ring(self, device: torch.device, transport: str = "") -> "_C.RingBackend":
        store = dist.PrefixStore(f"{self._prefix}/{device.type}", self._store)
        return _C.RingBackend(store, self._rank, self._world_size, self._options, device,
                              transport)

    def _nccl(self, device: torch.device) -> "_C.NcclBackend":
        store = dist.PrefixStore(f"{self._prefix}/nccl", self._store)
        return _C.NcclBackend(store, self._rank, self._world_size, self._options.timeout_ms,
                              device.index)

    def _auto_cuda(self, device: torch.device) -> object:
        """The CUDA backend of an "auto" group, made at its first CUDA collective.

        cuda_ipc when every rank can map every peer's memory (one host, peer
        access proven by a write and a read, at most CUDA_IPC_MAX_RANKS
        ranks); NCCL otherwise. Every rank sees the same refusals, so all
        choose alike.
        """
        device = self._cuda_device(device)
        backend = None
        if self._world_size > CUDA_IPC_MAX_RANKS:
            why = f"cuda_ipc serves at most {CUDA_IPC_MAX_RANKS} ranks"
        else:
            try:
                backend = self._ring(device, "cuda_ipc")
            except dist.DistBackendError as refusal:
                why = "cuda_ipc cannot connect: " + str(refusal).splitlines()[0]
        if backend is None:
            logger.info("rank %d/%d: group %s: CUDA tensors over NCCL, because %s", self._rank,
                        self._world_size, self._prefix, why)
            return self._add("cuda", "nccl", self._nccl(device))
        logger.info("rank %d/%d: group %s: CUDA tensors over cuda_ipc (every rank reached "
                    "every peer's memory on %s)", self._rank, self._world_size, self._prefix,
                    device)
        return self._add("cuda", "cuda_ipc", backend)

    def _backend(self, t: torch.Tensor, call: str, what: str) -> object:
        """The backend for tensors on ``t``'s device."""
        backend = self._backends.get(t.device.type)
        if backend is None and t.device.type == "cuda" and self._kind == "auto" and HAS_CUDA:
            backend = self._auto_cuda(t.device)
        if backend is None:
            serves = " and ".join(sorted(self._backends)) or "no"
            raise TypeError(f"pyddp: rank {self._rank}: {call}: {what} is on {t.device}; this "
                            f"group (backend {self._kind!r}) serves {serves} tensors")
        return backend

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world_size

    @property
    def options(self) -> RingOptions:
        return self._options

    @property
    def backend(self) -> str:
        """What the group was created with: "shm", "auto", "cuda_ipc", "nccl" or "nccl_ring"."""
        return self._kind

    def transports(self) -> Dict[str, str]:
        """The transport serving each device type so far, e.g. {"cpu": "shm", "cuda": "cuda_ipc"}.

        An "auto" group has no CUDA entry before its first CUDA collective.
        """
        return dict(self._transports)

    def _op(self, op: Union[ReduceOp, "ReduceOp.RedOpType"], call: str) -> _C.RedOp:
        # ReduceOp.SUM is a RedOpType; ReduceOp(ReduceOp.SUM) wraps one in .op.
        key = op if isinstance(op, ReduceOp.RedOpType) else getattr(op, "op", op)
        if key not in _SUPPORTED_OPS:
            raise TypeError(
                f"pyddp: rank {self._rank}: {call}: {op} is not supported; "
                "use ReduceOp.SUM, AVG, PRODUCT, MIN or MAX"
            )
        return _SUPPORTED_OPS[key]

    def _tensor(self, t: object, call: str, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"pyddp: rank {self._rank}: {call}: {what} must be a torch.Tensor, "
                f"got {type(t).__name__}"
            )
        return t

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False
                   ) -> Optional[Work]:
        """Reduces ``tensor`` across ranks in place."""
        t = self._tensor(tensor, "all_reduce", "tensor")
        backend = self._backend(t, "all_reduce", "tensor")
        return _finish(backend.all_reduce(t, self._op(op, "all_reduce"), async_op), async_op)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                          ) -> Optional[Work]:
        """``output`` (world_size x input.numel() elements) = every rank's ``input``, in rank order."""
        out = self._tensor(output, "all_gather_single", "output")
        inp = self._tensor(input, "all_gather_single", "input")
        backend = self._backend(inp, "all_gather_single", "input")
        return _finish(backend.all_gather_single(out, inp, async_op), async_op)

    all_gather_into_tensor = all_gather_single

    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor,
                   async_op: bool = False) -> Optional[Work]:
        """``tensor_list[r]`` = rank r's ``tensor``."""
        if not isinstance(tensor_list, (list, tuple)):
            raise TypeError(
                f"pyddp: rank {self._rank}: all_gather: tensor_list must be a list of tensors, "
                f"got {type(tensor_list).__name__}"
            )
        outs = [self._tensor(t, "all_gather", "tensor_list entry") for t in tensor_list]
        inp = self._tensor(tensor, "all_gather", "tensor")
        backend = self._backend(inp, "all_gather", "tensor")
        return _finish(backend.all_gather(outs, inp, async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Work]:
        """Copies rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
        t = self._tensor(tensor, "broadcast", "tensor")
        if not isinstance(src, int) or isinstance(src, bool):
            raise TypeError(f"pyddp: rank {self._rank}: broadcast: src must be an int, got {src!r}")
        backend = self._backend(t, "broadcast", "tensor")
        return _finish(backend.broadcast(t, src, async_op), async_op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False) -> Optional[Work]:
        """``output`` on rank r = block r of ``input`` reduced across ranks."""
        out = self._tensor(output, "reduce_scatter_single", "output")
        inp = self._tensor(input, "reduce_scatter_single", "input")
        red = self._op(op, "reduce_scatter_single")
        backend = self._backend(inp, "reduce_scatter_single", "input")
        return _finish(backend.reduce_scatter_single(out, inp, red, async_op), async_op)

    reduce_scatter_tensor = reduce_scatter_single

    def barrier(self, async_op: bool = False) -> Optional[Work]:
        """Returns once every rank has entered the barrier, on every backend of the group
        (so a CUDA backend's queued collectives are done too)."""
        *others, last = self._backends.values()
        for backend in others:
            backend.barrier(False).wait()
        return _finish(last.barrier(async_op), async_op)

    def shutdown(self) -> None:
        """Stops the group's backends; pending collectives fail."""
        for backend in self._backends.values():
            backend.shutdown()

    def __del__(self) -> None:
        # Join the worker here, where the binding releases the GIL: a last
        # reference dropped elsewhere could join it with the GIL held while
        # a future callback on the worker waits for the GIL.
        for backend in getattr(self, "_backends", {}).values():
            backend.shutdown()


def init_process_group(
    backend: str = "shm",
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    store: Optional[dist.Store] = None,
    options: Optional[RingOptions] = None,
) -> ProcessGroup:
    """Joins (and returns) the default process group.

    ``backend``: "shm" (CPU tensors), "cuda_ipc", "nccl" or "nccl_ring" (CUDA
    tensors on the current device; nccl_ring is pyddp's ring over NCCL
    send/recv), or "auto" (shm for CPU tensors; for CUDA tensors,
    cuda_ipc when every rank can map every peer's memory, else NCCL; chosen
    at the first CUDA collective, the reason logged at PYDDP_DEBUG=INFO).
    ``init_method`` is env:// (the default), tcp://host:port or file:///path;
    or pass a ready ``store`` with ``rank`` and ``world_size``. ``options``
    overrides the PYDDP_* settings of this group. Every wait of every
    collective is bounded by ``timeout``.
    """
    global _default_group
    if _default_group is not None:
        raise RuntimeError("pyddp: the default process group is already initialized; "
                           "call pyddp.destroy_process_group() first")
    _default_group = new_group(backend, init_method, rank, world_size, timeout, store, options)
    return _default_group


def new_group(
    backend: str = "shm",
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    store: Optional[dist.Store] = None,
    options: Optional[RingOptions] = None,
) -> ProcessGroup:
    """Like init_process_group, but returns a group without making it the default."""
    if not isinstance(backend, str):
        raise TypeError(f"pyddp.new_group: backend must be one of {BACKENDS}, got {backend!r}; "
                        "a pyddp group spans every rank of its store (no subgroups by ranks)")
    if backend not in BACKENDS:
        raise ValueError(f"pyddp: backend {backend!r} is not available; this build has {BACKENDS}")
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"pyddp: timeout must be a positive datetime.timedelta, got {timeout!r}")
    if store is None:
        store, rank, world_size = rendezvous(init_method or "env://", rank, world_size, timeout)
    elif rank is None or world_size is None:
        raise ValueError("pyddp: a store needs explicit rank and world_size")
    opts = RingOptions(options) if options is not None else RingOptions()
    opts.timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    opts.validate()
    return ProcessGroup(backend, store, f"pyddp/{next(_group_ids)}", rank, world_size, timeout,
                        opts)


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Shuts down ``group`` (default: the default group, which is then uninitialized)."""
    global _default_group
    target = group if group is not None else _default_group
    if target is None:
        return
    target.shutdown()
    if target is _default_group:
        _default_group = None


def is_initialized() -> bool:
    return _default_group is not None


def _group(group: Optional[ProcessGroup], call: str) -> ProcessGroup:
    if group is not None:
        return group
    if _default_group is None:
        raise RuntimeError(f"pyddp.{call}: the default process group is not initialized; "
                           "call pyddp.init_process_group() first")
    return _default_group


def get_default_group() -> ProcessGroup:
    return _group(None, "get_default_group")


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    return _group(group, "get_rank").rank()


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    return _group(group, "get_world_size").size()


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False) -> Optional[Work]:
    return _group(group, "all_reduce").all_reduce(tensor, op, async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor,
                      group: Optional[ProcessGroup] = None, async_op: bool = False
                      ) -> Optional[Work]:
    return _group(group, "all_gather_single").all_gather_single(output, input, async_op)


all_gather_into_tensor = all_gather_single


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor,
               group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    return _group(group, "all_gather").all_gather(tensor_list, tensor, async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Optional[ProcessGroup] = None,
              async_op: bool = False) -> Optional[Work]:
    return _group(group, "broadcast").broadcast(tensor, src, async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group: Optional[ProcessGroup] = None, async_op: bool = False
                          ) -> Optional[Work]:
    return _group(group, "reduce_scatter_single").reduce_scatter_single(output, input, op,
                                                                        async_op)


reduce_scatter_tensor = reduce_scatter_single


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    return _group(group, "barrier").barrier(async_op)


# --- pyddp as a torch.distributed backend -------------------------------------

TORCH_BACKEND_NAME = "pyddp"


def _create_torch_backend(store: dist.Store, rank: int, world_size: int,
                          timeout: datetime.timedelta) -> _C.RingBackend:
    """The creator torch.distributed calls for ``init_process_group("pyddp")``.

    torch hands over its own (prefixed) store and the group's timeout; the
    other settings come from the PYDDP_* variables, as for pyddp's own groups.
    """
    opts = RingOptions()
    opts.timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    opts.validate()
    logger.info("rank %d/%d: torch.distributed backend %r over shm (slot_bytes=%d, "
                "num_slots=%d, direct_max_bytes=%d, algo=%s)", rank, world_size,
                TORCH_BACKEND_NAME, opts.slot_bytes, opts.num_slots, opts.direct_max_bytes,
                opts.algo)
    return _C.RingBackend(store, rank, world_size, opts)


def register_torch_backend() -> None:
    """Registers ``"pyddp"`` with ``torch.distributed`` (for CPU tensors).

    Afterwards ``torch.distributed.init_process_group("pyddp")``, or a
    per-device string such as ``"cpu:pyddp,cuda:nccl"``, routes torch's
    collectives, ``all_gather_object`` and friends, and torch's own
    ``DistributedDataParallel`` through pyddp. Idempotent.
    """
    if TORCH_BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(TORCH_BACKEND_NAME, _create_torch_backend, devices=["cpu"])
