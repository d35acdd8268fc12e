"""The process group: a typed Python face over the C++ engines.

This is the only module that imports ``pyddp._C``. Names and argument order
follow ``torch.distributed``. A group holds one engine per device type
(``_C.Engine``: pyddp's ring over shm for CPU tensors; for CUDA tensors
pyddp's ring over cuda_ipc or NCCL send/recv, or NCCL's own collectives).
Which engine serves a device is decided in C++ (``_C.make_engine``, from the
group's ``backend`` name); this module only logs the choice.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import operator
import weakref
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

from . import _C
from .rendezvous import rendezvous

logger = logging.getLogger("pyddp")

ReduceOp = dist.ReduceOp
RingOptions = _C.RingOptions
Algo = _C.Algo

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
# otherwise. (The candidates are a table in csrc/backend/engine_registry.cpp.)
BACKENDS = tuple(_C.backend_names())
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

# Each group gets its own store prefix, so a process can create, destroy and
# re-create groups on one store.
_group_ids = itertools.count()
_default_group: Optional["ProcessGroup"] = None
# Groups not yet shut down, for the exit hook.
_live_groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


@atexit.register
def _shut_down_at_exit() -> None:
    """Before the interpreter finalises: shuts down every live group (peers
    waiting on this rank fail at once) and joins the worker threads, which
    may still be releasing Python objects (a future callback that destroyed
    its own group leaves its worker to be joined here). A thread that takes
    the GIL once finalisation has begun is ended in a way that aborts the
    process."""
    for group in list(_live_groups):
        group.shutdown()
    _C.join_stopped_workers()


def _timeout_arg(timeout: object, what: str) -> datetime.timedelta:
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"pyddp: {what} must be a datetime.timedelta, got {timeout!r}")
    if timeout <= datetime.timedelta(0):
        raise ValueError(f"pyddp: {what} must be positive, got {timeout!r}")
    return timeout


class Work:
    """Handle of an asynchronous collective (``async_op=True``)."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Blocks until the collective is done; raises its error, if any.

        ``timeout`` (a positive timedelta) bounds this wait only (the group's
        timeout bounds the collective itself). Ctrl-C while waiting makes
        this rank give up on the group (its peers are told) and raises
        KeyboardInterrupt.
        """
        limit = datetime.timedelta(0) if timeout is None else _timeout_arg(timeout, "timeout")
        return _C.wait(self._work, limit)

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
    _C.wait(work, datetime.timedelta(0))
    return None


class ProcessGroup:
    """A group of ranks that run collectives together (create with init_process_group).

    A group is used from one thread at a time, as in ``torch.distributed``:
    every rank must issue the same collectives in the same order, and the
    calls of two threads have no order. A synchronous collective made while
    another thread of this process is inside one on the same group raises
    RuntimeError (future callbacks, which run on the group's worker thread,
    may issue collectives: they are ordered by the collective that completed).
    Use one group per thread instead.

    Ctrl-C (or any signal handler that raises) interrupts a rank waiting in a
    collective within milliseconds: the rank gives up on the group, its peers
    fail at once naming it, and the handler's exception (KeyboardInterrupt)
    is raised.
    """

    def __init__(self, backend: str, store: dist.Store, prefix: str, rank: int, world_size: int,
                 timeout: datetime.timedelta, options: RingOptions) -> None:
        self._kind = backend
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._options = options
        self.timeout = timeout
        # The device types this group serves, and the engine of each so far:
        # the CPU's at once; a CUDA device's at once when the group serves
        # only CUDA tensors, else ("auto") at the first CUDA collective.
        self._device_types = tuple(_C.device_types_of(backend))
        self._engines: Dict[str, _C.Engine] = {}
        if "cpu" in self._device_types:
            self._make_engine(torch.device("cpu"))
        else:
            self._make_engine(self._cuda_device())
        _live_groups.add(self)

    def _make_engine(self, device: torch.device) -> _C.Engine:
        store = dist.PrefixStore(f"{self._prefix}/{device.type}", self._store)
        engine, refusals = _C.make_engine(store, self._rank, self._world_size, self._options,
                                          device, self._kind)
        who = f"rank {self._rank}/{self._world_size}: group {self._prefix}"
        for why in refusals:
            logger.info("%s: %s tensors: passed over %s", who, device, why)
        logger.info("%s: %s tensors over %s (backend %r; slot_bytes=%d, num_slots=%d, "
                    "direct_max_bytes=%d, two_shot_max_bytes=%d, algo=%s)", who, device,
                    engine.transport, self._kind, self._options.slot_bytes,
                    self._options.num_slots, self._options.direct_max_bytes,
                    self._options.two_shot_max_bytes, self._options.algo)
        self._engines[device.type] = engine
        return engine

    def _cuda_device(self, device: Optional[torch.device] = None) -> torch.device:
        """``device`` (a CUDA tensor's), or the current CUDA device."""
        if not torch.cuda.is_available():
            raise RuntimeError(f"pyddp: rank {self._rank}: backend {self._kind!r} needs a CUDA "
                               "device, and torch sees none")
        if device is not None and device.index is not None:
            return device
        return torch.device("cuda", torch.cuda.current_device())

    def _engine(self, t: torch.Tensor, call: str, what: str) -> _C.Engine:
        """The engine for tensors on ``t``'s device, made at first use for "auto"."""
        engine = self._engines.get(t.device.type)
        if engine is not None:
            return engine
        if t.device.type == "cuda" and "cuda" in self._device_types:
            return self._make_engine(self._cuda_device(t.device))
        serves = " and ".join(self._device_types) or "no"
        raise TypeError(f"pyddp: rank {self._rank}: {call}: {what} is on {t.device}; this "
                        f"group (backend {self._kind!r}) serves {serves} tensors")

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
        return {device: engine.transport for device, engine in self._engines.items()}

    def _op(self, op: Union[ReduceOp, "ReduceOp.RedOpType"], call: str) -> _C.RedOp:
        # ReduceOp.SUM is a RedOpType; ReduceOp(ReduceOp.SUM) wraps one in .op.
        # Nothing else: an int compares equal to a RedOpType (0 would be SUM).
        if isinstance(op, ReduceOp.RedOpType):
            key = op
        elif isinstance(op, ReduceOp):
            key = op.op
        else:
            raise TypeError(f"pyddp: rank {self._rank}: {call}: op must be a ReduceOp "
                            f"(ReduceOp.SUM, AVG, PRODUCT, MIN or MAX), got {op!r}")
        if key not in _SUPPORTED_OPS:
            raise TypeError(
                f"pyddp: rank {self._rank}: {call}: {op} is not supported; "
                "use ReduceOp.SUM, AVG, PRODUCT, MIN or MAX"
            )
        return _SUPPORTED_OPS[key]

    def _rank_arg(self, value: object, call: str, what: str) -> int:
        """A rank of this group given as any integral (int, numpy.int64...), as torch
        takes it; out-of-range values get the message the engine's checks give."""
        if isinstance(value, bool):
            raise TypeError(f"pyddp: rank {self._rank}: {call}: {what} must be an int, got "
                            f"{value!r}")
        try:
            rank = operator.index(value)
        except TypeError:
            raise TypeError(f"pyddp: rank {self._rank}: {call}: {what} must be an int, got "
                            f"{value!r}") from None
        if not 0 <= rank < self._world_size:
            raise ValueError(f"pyddp: rank {self._rank}: {call}: {what}={rank} is not a rank of "
                             f"this group (world_size {self._world_size})")
        return rank

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
        engine = self._engine(t, "all_reduce", "tensor")
        return _finish(engine.all_reduce(t, self._op(op, "all_reduce"), async_op), async_op)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                          ) -> Optional[Work]:
        """``output`` (world_size x input.numel() elements) = every rank's ``input``, in rank order."""
        out = self._tensor(output, "all_gather_single", "output")
        inp = self._tensor(input, "all_gather_single", "input")
        engine = self._engine(inp, "all_gather_single", "input")
        return _finish(engine.all_gather_single(out, inp, async_op), async_op)

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
        engine = self._engine(inp, "all_gather", "tensor")
        return _finish(engine.all_gather(outs, inp, async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Work]:
        """Copies rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
        t = self._tensor(tensor, "broadcast", "tensor")
        root = self._rank_arg(src, "broadcast", "src")
        engine = self._engine(t, "broadcast", "tensor")
        return _finish(engine.broadcast(t, root, async_op), async_op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False) -> Optional[Work]:
        """``output`` on rank r = block r of ``input`` reduced across ranks."""
        out = self._tensor(output, "reduce_scatter_single", "output")
        inp = self._tensor(input, "reduce_scatter_single", "input")
        red = self._op(op, "reduce_scatter_single")
        engine = self._engine(inp, "reduce_scatter_single", "input")
        return _finish(engine.reduce_scatter_single(out, inp, red, async_op), async_op)

    reduce_scatter_tensor = reduce_scatter_single

    def barrier(self, async_op: bool = False) -> Optional[Work]:
        """Returns once every rank has entered the barrier, on every engine of the group
        (so a CUDA engine's queued collectives are done too)."""
        *others, last = self._engines.values()
        for engine in others:
            engine.barrier(False).wait()
        return _finish(last.barrier(async_op), async_op)

    def shutdown(self) -> None:
        """Stops the group's engines: pending collectives fail, and peers waiting on this
        rank fail at once, saying that it destroyed its group."""
        for engine in self._engines.values():
            engine.shutdown()
        _live_groups.discard(self)

    def __del__(self) -> None:
        # Join the worker here, where the binding releases the GIL: a last
        # reference dropped elsewhere could join it with the GIL held while
        # a future callback on the worker waits for the GIL.
        for engine in getattr(self, "_engines", {}).values():
            engine.shutdown()


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
                          timeout: datetime.timedelta) -> _C.Engine:
    """The creator torch.distributed calls for ``init_process_group("pyddp")``.

    torch hands over its own (prefixed) store and the group's timeout; the
    other settings come from the PYDDP_* variables, as for pyddp's own groups.
    """
    opts = RingOptions()
    opts.timeout_ms = max(1, int(timeout.total_seconds() * 1000))
    opts.validate()
    engine, _ = _C.make_engine(store, rank, world_size, opts, torch.device("cpu"), "shm")
    logger.info("rank %d/%d: torch.distributed backend %r over %s (slot_bytes=%d, "
                "num_slots=%d, direct_max_bytes=%d, algo=%s)", rank, world_size,
                TORCH_BACKEND_NAME, engine.transport, opts.slot_bytes, opts.num_slots,
                opts.direct_max_bytes, opts.algo)
    return engine


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
