"""pyddp's own process group, a typed Python face over the C++ engines, and the module-level
API over the default group (subgroups: subgroups.py; torch.distributed's "pyddp" backend:
torch_backend.py).

Names and argument order follow ``torch.distributed``. A group holds one engine per device
type (``_C.Engine``: pyddp's ring over shm for CPU tensors; for CUDA tensors pyddp's ring over
cuda_ipc or NCCL send/recv, or NCCL's own collectives). Which engine serves a device is decided
in C++ (``_C.make_engine``, from the group's ``backend`` name); this module only logs the
choice.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import operator
import weakref
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _C, survival
from .rendezvous import rendezvous

logger = logging.getLogger("pyddp")

ReduceOp = dist.ReduceOp
GroupOptions = _C.GroupOptions
# The name GroupOptions had before it served more than the ring; kept so that code
# written for it runs.
RingOptions = GroupOptions
Algo = _C.Algo
SlotStores = _C.SlotStores
CmaReads = _C.CmaReads

_SUPPORTED_OPS = {
    ReduceOp.SUM: _C.RedOp.SUM,
    ReduceOp.AVG: _C.RedOp.AVG,
    ReduceOp.PRODUCT: _C.RedOp.PRODUCT,
    ReduceOp.MIN: _C.RedOp.MIN,
    ReduceOp.MAX: _C.RedOp.MAX,
    ReduceOp.BAND: _C.RedOp.BAND,
    ReduceOp.BOR: _C.RedOp.BOR,
    ReduceOp.BXOR: _C.RedOp.BXOR,
}
# The same, keyed by the identity of ReduceOp's members (ReduceOp.SUM is one
# object for the life of the process): hashing a member calls a Python-level
# pybind11 function, 0.2 us of a 4 KiB all_reduce's few.
_OP_OF_MEMBER = {id(member): red for member, red in _SUPPORTED_OPS.items()}
HAS_CUDA: bool = _C.has_cuda
# The engines' src of a receive from any rank (recv(src=None)).
_ANY_SOURCE = -1
# "shm": CPU tensors. "cuda_ipc", "cuda_host" (the fused programs on host
# threads), "nccl" (NCCL's own collectives) and "nccl_ring" (pyddp's ring over
# NCCL send/recv): CUDA tensors on the current device. "auto": shm for CPU
# tensors and, from the first CUDA collective on, cuda_ipc when every rank
# shares this host, peer access works and no shared GPU runs the ranks'
# kernels in turns (no MPS), cuda_host on one host otherwise, NCCL across
# hosts. (The candidates are a table in csrc/backend/engine_registry.cpp.)
BACKENDS = tuple(_C.backend_names())
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)

# Each group gets its own store prefix, so a process can create, destroy and
# re-create groups on one store.
_group_ids = itertools.count()
_default_group: Optional["ProcessGroup"] = None


@atexit.register
def _shut_down_at_exit() -> None:
    """Before the interpreter finalises: shuts down every live engine, of pyddp's groups
    and of torch.distributed's "pyddp" groups alike (peers waiting on this rank fail at
    once, and its channels leave /dev/shm), and joins the worker threads, which may
    still be releasing Python objects (a future callback that destroyed its own group
    leaves its worker to be joined here). A thread that takes the GIL once finalisation
    has begun is ended in a way that aborts the process, so first the threads inside
    pyddp's calls are told to stay out of Python: woken by the shutdown, they park
    until the process ends."""
    _C.begin_exit()
    _C.shut_down_live_engines()
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

    def _source_rank(self) -> int:
        """The rank a completed receive took its message from (torch's Work._source_rank)."""
        return self._work._source_rank()


# ProcessGroup's methods whose synchronous calls the CPU engine's direct
# entries (Engine.direct_entries) run, and the entry of each (an alias shares
# its method's).
_DIRECT_METHODS = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather_single",
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_single": "reduce_scatter_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
    "broadcast": "broadcast",
    "barrier": "barrier",
}


def _general_path(group: "weakref.ref[ProcessGroup]", rank: int, name: str
                  ) -> Callable[..., object]:
    """ProcessGroup's method ``name``, on the group that ``group`` refers to: where a
    direct entry passes the calls it does not run. The reference is weak because the group
    holds the entry: a strong one would make a cycle through a capsule, which the garbage
    collector cannot see into, and the group would never be freed. So an entry kept apart
    from its group, as a bound method would be (``f = pg.all_reduce``), does not keep the
    group alive: once the group is gone, its calls fail as the engine's do."""
    method = _GENERAL_METHODS[name]

    def call(*args: object, **kwargs: object) -> object:
        target = group()
        if target is None:
            raise RuntimeError(f"pyddp: rank {rank}: {name} on a process group that was "
                               "destroyed")
        return method(target, *args, **kwargs)
    return call


def _finish(work: Optional[dist.Work], async_op: bool) -> Optional[Work]:
    """The engines return a synchronous call once done, with no Work (None)."""
    return Work(work) if async_op else None


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
                 timeout: datetime.timedelta, options: GroupOptions,
                 ranks: Optional[List[int]] = None) -> None:
        self._kind = backend
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._options = options
        self.timeout = timeout
        # The ranks of the parent group that make this group, in group-rank
        # order (a group made by new_group(ranks)); its own ranks otherwise.
        self._ranks = list(ranks) if ranks is not None else list(range(world_size))
        # Subgroups made from this group so far: every rank of the group
        # makes them in the same order, so the count names the next one alike.
        self._subgroups = 0
        # For survival.py: agreements, shrinks and admissions on this group so far
        # (counted alike on every rank, as subgroups), the prefix of the group this
        # one descends from by shrink and admit (where processes ask to join), and
        # the join tickets admitted into that lineage.
        self._rounds = 0
        self._lineage = prefix
        self._admitted = 0
        survival.publish_member(store, prefix, rank)
        # The device types this group serves, and the engine of each so far:
        # the CPU's at once; a CUDA device's at once when the group serves
        # only CUDA tensors, else ("auto") at the first CUDA collective.
        self._device_types = tuple(_C.device_types_of(backend))
        self._engines: Dict[str, _C.Engine] = {}
        self._cpu_engine: Optional[_C.Engine] = None
        self._engine_list: Tuple[_C.Engine, ...] = ()  # _engines' values, for barrier
        self._layout = ""
        self._aborted = False
        if "cpu" in self._device_types:
            self._make_engine(torch.device("cpu"))
        else:
            self._make_engine(self._cuda_device())

    def _make_engine(self, device: torch.device) -> _C.Engine:
        if self._aborted:
            raise dist.DistBackendError(
                f"pyddp: rank {self._rank}: a {device.type} collective on a process group "
                "that was aborted; make a new group (ProcessGroup.shrink() makes one of the "
                "ranks still alive)")
        store = dist.PrefixStore(f"{self._prefix}/{device.type}", self._store)
        engine, refusals, layout = _C.make_engine(store, self._rank, self._world_size,
                                                  self._options, device, self._kind)
        who = f"rank {self._rank}/{self._world_size}: group {self._prefix}"
        for why in refusals:
            logger.info("%s: %s tensors: passed over %s", who, device, why)
        if layout:
            logger.info("%s: %s tensors: layout %s", who, device, layout)
            self._layout = layout
        logger.info("%s: %s tensors over %s (backend %r; slot_bytes=%d, num_slots=%d, "
                    "direct_max_bytes=%d, two_shot_max_bytes=%d, algo=%s)", who, device,
                    engine.transport, self._kind, self._options.slot_bytes,
                    self._options.num_slots, self._options.direct_max_bytes,
                    self._options.two_shot_max_bytes, self._options.algo)
        self._engines[device.type] = engine
        self._engine_list = tuple(self._engines.values())
        if device.type == "cpu":
            refusal = engine.registered_refusal if isinstance(engine, _C.TransportEngine) else (
                "the engine does not read registered tensors in place")
            logger.info("%s: registered tensors (pyddp.empty): %s", who,
                        f"read through staging: {refusal}" if refusal else "read in place")
            refusal = engine.process_refusal if isinstance(engine, _C.TransportEngine) else (
                "the engine does not read peers' memory through the kernel")
            logger.info("%s: plain tensors: %s", who,
                        f"not read through the kernel: {refusal}" if refusal else
                        f"all_gather, broadcast, all_reduce and reduce_scatter may read "
                        f"through the kernel "
                        f"({self._options.cma.name.lower()}) from "
                        f"{self._options.cma_min_bytes} bytes per rank")
            self._cpu_engine = engine
            self._enter_directly(engine)
        return engine

    def _enter_directly(self, engine: _C.Engine) -> None:
        """Sets the CPU engine's direct entries on this group under the names of the
        methods they serve (_DIRECT_METHODS), where they shadow the methods.

        A small synchronous collective is then one call into C++, without the method's
        Python frame (a tenth of a 2-rank barrier; bindings.cpp, namespace direct, has
        the numbers). An entry runs the calls it takes and passes every other call, as
        given, to the method (_general_path), so a group answers as its methods do.
        Left to run as written: a method replaced by the group's class (a subclass) or
        by a patch of ProcessGroup made before the group, and the barrier of a group that
        serves CUDA tensors too (it meets on every engine, and a CUDA engine may join
        later)."""
        general = {name: _general_path(weakref.ref(self), self._rank, name)
                   for name in set(_DIRECT_METHODS.values())}
        entries = engine.direct_entries(list(_SUPPORTED_OPS.items()), general)
        for method, entry in _DIRECT_METHODS.items():
            if method == "barrier" and self._device_types != ("cpu",):
                continue
            if getattr(type(self), method) is _GENERAL_METHODS[method]:
                vars(self)[method] = entries[entry]

    def _cuda_device(self, device: Optional[torch.device] = None) -> torch.device:
        """``device`` (a CUDA tensor's), or the current CUDA device."""
        if not torch.cuda.is_available():
            raise RuntimeError(f"pyddp: rank {self._rank}: backend {self._kind!r} needs a CUDA "
                               "device, and torch sees none")
        if device is not None and device.index is not None:
            return device
        return torch.device("cuda", torch.cuda.current_device())

    def _engine(self, t: object, call: str, what: str) -> _C.Engine:
        """The engine for tensors on ``t``'s device, made at first use for "auto";
        TypeError when ``t`` is not a tensor."""
        # The common case first: Tensor.is_cpu costs a tenth of Tensor.device.type.
        if isinstance(t, torch.Tensor) and t.is_cpu and self._cpu_engine is not None:
            return self._cpu_engine
        t = self._tensor(t, call, what)
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
    def ranks(self) -> List[int]:
        """The ranks of the parent group that form this group (group rank i is ``ranks[i]``)."""
        return list(self._ranks)

    @property
    def options(self) -> GroupOptions:
        return self._options

    @property
    def backend(self) -> str:
        """What the group was created with: "shm", "auto", "cuda_ipc", "nccl" or "nccl_ring"."""
        return self._kind

    def layout(self) -> str:
        """Where the ranks run and how the CPU engine composes, e.g. "1 host: ranks 0,1 on ..."
        or "hierarchical (shm inside each host, gloo between hosts ...); 2 hosts: ..."."""
        return self._layout

    def transports(self) -> Dict[str, str]:
        """The transport serving each device type so far, e.g. {"cpu": "shm", "cuda": "cuda_ipc"}.

        An "auto" group has no CUDA entry before its first CUDA collective.
        """
        return {device: engine.transport for device, engine in self._engines.items()}

    def _op(self, op: Union[ReduceOp, "ReduceOp.RedOpType"], call: str) -> _C.RedOp:
        red = _OP_OF_MEMBER.get(id(op))
        if red is not None:
            return red
        # ReduceOp.SUM is a RedOpType; ReduceOp(ReduceOp.SUM) wraps one in .op.
        # Nothing else: an int compares equal to a RedOpType (0 would be SUM).
        if isinstance(op, ReduceOp.RedOpType):
            key = op
        elif isinstance(op, ReduceOp):
            key = op.op
        else:
            raise TypeError(f"pyddp: rank {self._rank}: {call}: op must be a ReduceOp "
                            f"(ReduceOp.SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR), "
                            f"got {op!r}")
        if key not in _SUPPORTED_OPS:
            raise TypeError(
                f"pyddp: rank {self._rank}: {call}: {op} is not supported; "
                "use ReduceOp.SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR"
            )
        return _SUPPORTED_OPS[key]

    def _tensors(self, ts: object, call: str, what: str) -> List[torch.Tensor]:
        if not isinstance(ts, (list, tuple)):
            raise TypeError(f"pyddp: rank {self._rank}: {call}: {what} must be a list of "
                            f"tensors, got {type(ts).__name__}")
        return [self._tensor(t, call, f"{what} entry") for t in ts]

    def _integral(self, value: object, call: str, what: str, meaning: str = "") -> int:
        """``value`` as an int when it is any integral but a bool (an int, numpy.int64, ...),
        as torch takes ranks and tags; else TypeError naming ``what`` (and its ``meaning``)."""
        if not isinstance(value, bool):
            try:
                return operator.index(value)
            except TypeError:
                pass
        raise TypeError(f"pyddp: rank {self._rank}: {call}: {what} must be an int{meaning}, "
                        f"got {value!r}")

    def _rank_arg(self, value: object, call: str, what: str) -> int:
        """A rank, as an int (the engine checks that it is one of this group's)."""
        return self._integral(value, call, what, " (a rank of this group)")

    def _member_arg(self, value: object, call: str, what: str) -> int:
        """A rank of this group, for the calls that no engine checks (new_group's ranks)."""
        rank = self._rank_arg(value, call, what)
        if not 0 <= rank < self._world_size:
            raise ValueError(f"pyddp: rank {self._rank}: {call}: {what}={rank} is not a rank of "
                             f"this group (world_size {self._world_size})")
        return rank

    def _tag_arg(self, value: object, call: str) -> int:
        """A point-to-point tag, as an int (the engine checks that it is a 32-bit one, as
        torch.distributed's: the collectives' own messages carry tags below every such
        int, so no user message can take theirs)."""
        return self._integral(value, call, "tag")

    def _tensor(self, t: object, call: str, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"pyddp: rank {self._rank}: {call}: {what} must be a torch.Tensor, "
                f"got {type(t).__name__}"
            )
        return t

    # The calls that carry small messages (all_reduce, broadcast,
    # all_gather_single, reduce_scatter_single, barrier) reach these methods,
    # on a group with a CPU engine, only when the engine's direct entry, set
    # on the group under the method's name (_enter_directly), does not run
    # them (an asynchronous call, a tensor not on the CPU, an op that is not a
    # ReduceOp member, wrong arguments), when no entry was set (see there),
    # or when called through the class or super(). The entry checks inline
    # what it takes: each helper call here costs about 70 ns, and the three
    # took 170-270 ns of a 4 KiB all_reduce's 1.8 us on one rank.
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False
                   ) -> Optional[Work]:
        """Reduces ``tensor`` across ranks in place."""
        engine = self._engine(tensor, "all_reduce", "tensor")
        work = engine.all_reduce(tensor, self._op(op, "all_reduce"), async_op)
        return Work(work) if async_op else None

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                          ) -> Optional[Work]:
        """``output`` (world_size x input.numel() elements) = every rank's ``input``, in rank order."""
        engine = self._engine(input, "all_gather_single", "input")
        out = self._tensor(output, "all_gather_single", "output")
        work = engine.all_gather_single(out, input, async_op)
        return Work(work) if async_op else None

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
        engine = self._engine(tensor, "broadcast", "tensor")
        root = self._rank_arg(src, "broadcast", "src")
        work = engine.broadcast(tensor, root, async_op)
        return Work(work) if async_op else None

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                              async_op: bool = False) -> Optional[Work]:
        """``output`` on rank r = block r of ``input`` reduced across ranks."""
        engine = self._engine(input, "reduce_scatter_single", "input")
        out = self._tensor(output, "reduce_scatter_single", "output")
        red = self._op(op, "reduce_scatter_single")
        work = engine.reduce_scatter_single(out, input, red, async_op)
        return Work(work) if async_op else None

    reduce_scatter_tensor = reduce_scatter_single

    def reduce(self, tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, async_op: bool = False
               ) -> Optional[Work]:
        """``tensor`` of rank ``dst`` = the reduction over ranks; other ranks' are left as they were."""
        t = self._tensor(tensor, "reduce", "tensor")
        root = self._rank_arg(dst, "reduce", "dst")
        engine = self._engine(t, "reduce", "tensor")
        return _finish(engine.reduce(t, self._op(op, "reduce"), root, async_op), async_op)

    def gather(self, tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None,
               dst: int = 0, async_op: bool = False) -> Optional[Work]:
        """``gather_list[r]`` of rank ``dst`` = rank r's ``tensor`` (only ``dst`` passes a list)."""
        t = self._tensor(tensor, "gather", "tensor")
        root = self._rank_arg(dst, "gather", "dst")
        outs = [] if gather_list is None else self._tensors(gather_list, "gather", "gather_list")
        engine = self._engine(t, "gather", "tensor")
        return _finish(engine.gather(outs, t, root, async_op), async_op)

    def scatter(self, tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None,
                src: int = 0, async_op: bool = False) -> Optional[Work]:
        """``tensor`` of rank r = ``scatter_list[r]`` of rank ``src`` (only ``src`` passes a list)."""
        t = self._tensor(tensor, "scatter", "tensor")
        root = self._rank_arg(src, "scatter", "src")
        ins = [] if scatter_list is None else self._tensors(scatter_list, "scatter", "scatter_list")
        engine = self._engine(t, "scatter", "tensor")
        return _finish(engine.scatter(t, ins, root, async_op), async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[List[int]] = None,
                          input_split_sizes: Optional[List[int]] = None,
                          async_op: bool = False) -> Optional[Work]:
        """Block k of ``input`` (``input_split_sizes[k]`` rows, or an even share) goes to rank k;
        block k of ``output`` comes from rank k. Rank r's ``output_split_sizes[k]`` must equal
        rank k's ``input_split_sizes[r]``."""
        out = self._tensor(output, "all_to_all_single", "output")
        inp = self._tensor(input, "all_to_all_single", "input")
        engine = self._engine(inp, "all_to_all_single", "input")
        return _finish(engine.all_to_all_single(out, inp, list(output_split_sizes or []),
                                                list(input_split_sizes or []), async_op),
                       async_op)

    def all_to_all(self, output_tensor_list: List[torch.Tensor],
                   input_tensor_list: List[torch.Tensor], async_op: bool = False
                   ) -> Optional[Work]:
        """``output_tensor_list[k]`` = rank k's ``input_tensor_list[rank]``."""
        outs = self._tensors(output_tensor_list, "all_to_all", "output_tensor_list")
        ins = self._tensors(input_tensor_list, "all_to_all", "input_tensor_list")
        if not ins:
            raise ValueError(f"pyddp: rank {self._rank}: all_to_all: input_tensor_list is empty")
        engine = self._engine(ins[0], "all_to_all", "input_tensor_list entry")
        return _finish(engine.all_to_all(outs, ins, async_op), async_op)

    def all_reduce_coalesced(self, tensors: List[torch.Tensor], op=ReduceOp.SUM,
                             async_op: bool = False) -> Optional[Work]:
        """Reduces every tensor of ``tensors`` (one dtype) in place, as one collective."""
        ts = self._tensors(tensors, "all_reduce_coalesced", "tensors")
        engine = self._engine(ts[0], "all_reduce_coalesced", "tensors entry") if ts else None
        if engine is None:
            raise ValueError(f"pyddp: rank {self._rank}: all_reduce_coalesced: tensors is empty")
        return _finish(engine.all_reduce_coalesced(ts, self._op(op, "all_reduce_coalesced"),
                                                   async_op), async_op)

    def all_gather_into_tensor_coalesced(self, outputs: List[torch.Tensor],
                                         inputs: List[torch.Tensor], async_op: bool = False
                                         ) -> Optional[Work]:
        """``outputs[i]`` = every rank's ``inputs[i]`` in rank order, as one collective."""
        outs = self._tensors(outputs, "all_gather_into_tensor_coalesced", "outputs")
        ins = self._tensors(inputs, "all_gather_into_tensor_coalesced", "inputs")
        if not ins:
            raise ValueError(f"pyddp: rank {self._rank}: all_gather_into_tensor_coalesced: "
                             "inputs is empty")
        engine = self._engine(ins[0], "all_gather_into_tensor_coalesced", "inputs entry")
        return _finish(engine.all_gather_coalesced(outs, ins, async_op), async_op)

    def all_gather_coalesced(self, output_tensor_lists: List[List[torch.Tensor]],
                             input_tensor_list: List[torch.Tensor], async_op: bool = False
                             ) -> Optional[Work]:
        """``output_tensor_lists[r][i]`` = rank r's ``input_tensor_list[i]`` (one dtype, each
        output shaped as its input), as one collective over the packed inputs."""
        call = "all_gather_coalesced"
        ins = self._tensors(input_tensor_list, call, "input_tensor_list")
        if not isinstance(output_tensor_lists, (list, tuple)):
            raise TypeError(f"pyddp: rank {self._rank}: {call}: output_tensor_lists must be a "
                            f"list of lists of tensors, got {type(output_tensor_lists).__name__}")
        outs = [self._tensors(ts, call, "output_tensor_lists entry") for ts in output_tensor_lists]
        if not ins:
            raise ValueError(f"pyddp: rank {self._rank}: {call}: input_tensor_list is empty")
        engine = self._engine(ins[0], call, "input_tensor_list entry")
        return _finish(engine.all_gather_coalesced_lists(outs, ins, async_op), async_op)

    def reduce_scatter_tensor_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], op=ReduceOp.SUM,
                                        async_op: bool = False) -> Optional[Work]:
        """``outputs[i]`` = block rank of ``inputs[i]`` reduced over ranks, as one collective."""
        outs = self._tensors(outputs, "reduce_scatter_tensor_coalesced", "outputs")
        ins = self._tensors(inputs, "reduce_scatter_tensor_coalesced", "inputs")
        if not ins:
            raise ValueError(f"pyddp: rank {self._rank}: reduce_scatter_tensor_coalesced: "
                             "inputs is empty")
        engine = self._engine(ins[0], "reduce_scatter_tensor_coalesced", "inputs entry")
        red = self._op(op, "reduce_scatter_tensor_coalesced")
        return _finish(engine.reduce_scatter_coalesced(outs, ins, red, async_op), async_op)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Starts sending ``tensor`` to rank ``dst``; the Work completes once ``dst`` received it.

        Point-to-point messages run beside the collectives, not in their order; messages
        between two ranks with the same tag arrive in the order they were sent.
        """
        t = self._tensor(tensor, "send", "tensor")
        peer = self._rank_arg(dst, "send", "dst")
        label = self._tag_arg(tag, "send")
        return Work(self._engine(t, "send", "tensor").send(t, peer, label, True))

    def irecv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> Work:
        """Starts receiving into ``tensor`` from rank ``src`` (a message of the same size and
        dtype, with the same tag); with ``src=None``, the first such message from any rank,
        whose sender the Work's ``_source_rank()`` gives once done."""
        t = self._tensor(tensor, "recv", "tensor")
        peer = self._src_arg(src)
        label = self._tag_arg(tag, "recv")
        return Work(self._engine(t, "recv", "tensor").recv(t, peer, label, True))

    def _src_arg(self, src: Optional[int]) -> int:
        return _ANY_SOURCE if src is None else self._rank_arg(src, "recv", "src")

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Sends ``tensor`` to rank ``dst``; returns once ``dst`` received it."""
        t = self._tensor(tensor, "send", "tensor")
        peer = self._rank_arg(dst, "send", "dst")
        label = self._tag_arg(tag, "send")
        self._engine(t, "send", "tensor").send(t, peer, label, False)

    def recv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> int:
        """Receives into ``tensor`` from rank ``src`` (``None``: from any rank); returns the
        sender's rank."""
        t = self._tensor(tensor, "recv", "tensor")
        peer = self._src_arg(src)
        label = self._tag_arg(tag, "recv")
        engine = self._engine(t, "recv", "tensor")
        if peer != _ANY_SOURCE:
            engine.recv(t, peer, label, False)
            return peer
        work = Work(engine.recv(t, peer, label, True))
        work.wait()
        return work._source_rank()

    def barrier(self, async_op: bool = False) -> Optional[Work]:
        """Returns once every rank has entered the barrier, on every engine of the group
        (so a CUDA engine's queued collectives are done too)."""
        engines = self._engine_list
        if len(engines) > 1:
            for engine in engines[:-1]:
                engine.barrier(False)
        work = engines[-1].barrier(async_op)
        return Work(work) if async_op else None

    def monitored_barrier(self, timeout: Optional[datetime.timedelta] = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier on the CPU that names who did not come, as gloo's: every rank but 0
        reports to rank 0, which waits ``timeout`` (the group's when None) and raises naming
        the first rank that did not report (every such rank with ``wait_all_ranks``); the
        ranks that did report then fail too, pointing at rank 0."""
        if timeout is not None and (not isinstance(timeout, datetime.timedelta)
                                    or timeout < datetime.timedelta(0)):
            raise ValueError("pyddp: monitored_barrier: timeout must be a datetime.timedelta of "
                             f"at least 0, got {timeout!r}")
        if self._cpu_engine is None:
            raise TypeError(f"pyddp: rank {self._rank}: monitored_barrier runs on the CPU, and "
                            f"this group (backend {self._kind!r}) serves no CPU tensors")
        self._cpu_engine.monitored_barrier(timeout, bool(wait_all_ranks))

    def can_register(self, device: Union[str, torch.device]) -> bool:
        """Whether this group's collectives on ``device`` tensors read registered buffers in
        place (register_buffer): its fused collectives (backend "cuda_ipc", or "auto" on one
        host, for CUDA tensors, unless they run on the host, "cuda_host"; "emulated" for CPU
        ones). Makes the group's engine for ``device`` if it has none yet, as a first
        collective there would: every rank asks alike."""
        device = torch.device(device)
        if device.type not in self._device_types:
            return False
        engine = self._engines.get(device.type)
        if engine is None:
            engine = self._make_engine(self._cuda_device(device))
        return isinstance(engine, _C.FusedEngine) and engine.registers_buffers

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Registers ``tensor`` with every rank of the group, as NCCL's window registration:
        every rank calls it, in the same order as its collectives, with a contiguous tensor
        of as many bytes, which the group holds until deregister_buffer() or its end. Each
        rank maps every peer's, so that an all_reduce, all_gather, reduce_scatter or
        broadcast whose tensor that peers read lies in it on every rank (anywhere in it:
        an all_gather's input may be its rank's block of a registered output) reads the
        peers' bytes where they lie instead of staging them (an all_reduce above
        kFusedOneShotMaxBytes per rank: csrc/algorithms/select.h). A rank whose tensor
        lies in a registered buffer while a peer's does not (or lies in another) fails
        that collective on every rank, naming the field "registered".

        Served by the fused collectives (can_register): a CUDA tensor of torch's caching
        allocator (without expandable segments, which have no IPC handle), or for
        "emulated" a CPU tensor made by pyddp.empty. Raises DistBackendError on every rank,
        naming the rank, where one cannot register its tensor or map a peer's."""
        self._fused_engine(tensor, "register_buffer").register_buffer(tensor)

    def deregister_buffer(self, tensor: torch.Tensor) -> None:
        """Ends the registration of ``tensor`` (the tensor register_buffer took) on every
        rank: a collective that meets every rank in a barrier, so that no rank reads it any
        more, then lets the group's hold on it and the peers' mappings go."""
        self._fused_engine(tensor, "deregister_buffer").deregister_buffer(tensor)

    def _fused_engine(self, tensor: torch.Tensor, call: str) -> "_C.FusedEngine":
        engine = self._engine(tensor, call, "tensor")
        if not isinstance(engine, _C.FusedEngine):
            raise TypeError(
                f"pyddp: rank {self._rank}: {call}: this group's {tensor.device.type} "
                f"collectives run over {engine.transport}, which reads no registered buffers; "
                "the fused collectives do (backend \"cuda_ipc\", or \"auto\" on one host, for "
                "CUDA tensors; \"emulated\" for CPU ones)")
        return engine

    def shutdown(self) -> None:
        """Stops the group's engines: pending collectives fail, and peers waiting on this
        rank fail at once, saying that it destroyed its group."""
        for engine in self._engines.values():
            engine.shutdown()

    def abort(self) -> None:
        """Aborts the group, as NCCL's ncclCommAbort: every pending and later call on it
        fails at once on this rank, and every peer waiting on this rank fails within
        milliseconds (even in a collective this rank has done its part of), each saying
        the group was aborted. Safe from another thread while a collective is in flight
        and from a signal handler; idempotent. The group's memory leaves /dev/shm as at
        shutdown(). shrink() makes a group of the ranks still alive."""
        self._aborted = True
        for engine in self._engines.values():
            engine.abort()

    @property
    def aborted(self) -> bool:
        return self._aborted

    def shrink(self) -> "ProcessGroup":
        """A new group of this group's ranks still alive, as ULFM's MPIX_Comm_shrink; every
        survivor calls it (after a collective failed, say). See pyddp.survival.shrink."""
        return survival.shrink(self)

    def admit(self, pending: Optional[int] = None) -> "ProcessGroup":
        """This group grown by the processes waiting in pyddp.join(), or this group when none
        waits; every member calls it at the same point. See pyddp.survival.admit."""
        return survival.admit(self, pending)

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
    options: Optional[GroupOptions] = None,
) -> ProcessGroup:
    """Joins (and returns) the default process group.

    ``backend``: "shm" (CPU tensors), "cuda_ipc", "cuda_host", "nccl" or
    "nccl_ring" (CUDA tensors on the current device; cuda_host runs the fused
    programs on host threads, nccl_ring is pyddp's ring over NCCL send/recv),
    or "auto" (shm for CPU tensors; for CUDA tensors, cuda_ipc when every rank
    can map every peer's memory and the ranks' kernels run at once, cuda_host
    on one host otherwise, else NCCL; chosen at the first CUDA collective, the
    reason logged at PYDDP_DEBUG=INFO).
    ``init_method`` is env:// (the default), tcp://host:port or file:///path;
    or pass a ready ``store`` with ``rank`` and ``world_size``. ``options``
    overrides the PYDDP_* settings of this group. Every wait of every
    collective is bounded by ``timeout``.
    """
    global _default_group
    if _default_group is not None:
        raise RuntimeError("pyddp: the default process group is already initialized; "
                           "call pyddp.destroy_process_group() first")
    _default_group = create_group(backend, init_method, rank, world_size, timeout, store,
                                  options)
    if _default_group.rank() == 0:
        _default_group._store.set(survival.DEFAULT_LINEAGE_KEY, _default_group._prefix.encode())
    return _default_group


def create_group(
    backend: str = "shm",
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    store: Optional[dist.Store] = None,
    options: Optional[GroupOptions] = None,
) -> ProcessGroup:
    """A group of its own, as init_process_group makes, without making it the default: every
    rank that meets through ``init_method`` (or ``store``) is a member."""
    if not isinstance(backend, str):
        raise TypeError(f"pyddp.create_group: backend must be one of {BACKENDS}, got "
                        f"{backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"pyddp: backend {backend!r} is not available; this build has {BACKENDS}")
    _check_timeout(timeout)
    if store is None:
        store, rank, world_size = rendezvous(init_method or "env://", rank, world_size, timeout)
    elif rank is None or world_size is None:
        raise ValueError("pyddp: a store needs explicit rank and world_size")
    opts = GroupOptions(options) if options is not None else GroupOptions()
    opts.timeout_ms = _milliseconds(timeout)
    opts.validate()
    return ProcessGroup(backend, store, f"pyddp/{next(_group_ids)}", rank, world_size, timeout,
                        opts)


def _check_timeout(timeout: object) -> None:
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"pyddp: timeout must be a positive datetime.timedelta, got {timeout!r}")


def _milliseconds(timeout: datetime.timedelta) -> int:
    return max(1, int(timeout.total_seconds() * 1000))


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


# ProcessGroup's methods as the class defines them, taken once: the general
# path of the direct entries, and what a group's class must still have for
# an entry to stand in for the method (not a subclass's or a patch's).
_GENERAL_METHODS: Dict[str, Callable[..., object]] = {
    name: vars(ProcessGroup)[name] for name in _DIRECT_METHODS}


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


def monitored_barrier(group: Optional[ProcessGroup] = None,
                      timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    return _group(group, "monitored_barrier").monitored_barrier(timeout, wait_all_ranks)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: Optional[ProcessGroup] = None,
           async_op: bool = False) -> Optional[Work]:
    return _group(group, "reduce").reduce(tensor, dst, op, async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: int = 0,
           group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    return _group(group, "gather").gather(tensor, gather_list, dst, async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None, src: int = 0,
            group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    return _group(group, "scatter").scatter(tensor, scatter_list, src, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None,
                      group: Optional[ProcessGroup] = None, async_op: bool = False
                      ) -> Optional[Work]:
    return _group(group, "all_to_all_single").all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, async_op)


def all_to_all(output_tensor_list: List[torch.Tensor], input_tensor_list: List[torch.Tensor],
               group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    return _group(group, "all_to_all").all_to_all(output_tensor_list, input_tensor_list, async_op)


def all_reduce_coalesced(tensors: List[torch.Tensor], op=ReduceOp.SUM,
                         group: Optional[ProcessGroup] = None, async_op: bool = False
                         ) -> Optional[Work]:
    return _group(group, "all_reduce_coalesced").all_reduce_coalesced(tensors, op, async_op)


def all_gather_into_tensor_coalesced(outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                     group: Optional[ProcessGroup] = None,
                                     async_op: bool = False) -> Optional[Work]:
    return _group(group, "all_gather_into_tensor_coalesced").all_gather_into_tensor_coalesced(
        outputs, inputs, async_op)


def all_gather_coalesced(output_tensor_lists: List[List[torch.Tensor]],
                         input_tensor_list: List[torch.Tensor],
                         group: Optional[ProcessGroup] = None, async_op: bool = False
                         ) -> Optional[Work]:
    return _group(group, "all_gather_coalesced").all_gather_coalesced(
        output_tensor_lists, input_tensor_list, async_op)


def reduce_scatter_tensor_coalesced(outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    op=ReduceOp.SUM, group: Optional[ProcessGroup] = None,
                                    async_op: bool = False) -> Optional[Work]:
    return _group(group, "reduce_scatter_tensor_coalesced").reduce_scatter_tensor_coalesced(
        outputs, inputs, op, async_op)


def send(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None,
         tag: int = 0) -> None:
    _group(group, "send").send(tensor, dst, tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0) -> int:
    return _group(group, "recv").recv(tensor, src, tag)


def isend(tensor: torch.Tensor, dst: int, group: Optional[ProcessGroup] = None,
          tag: int = 0) -> Work:
    return _group(group, "isend").isend(tensor, dst, tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0) -> Work:
    return _group(group, "irecv").irecv(tensor, src, tag)


class P2POp:
    """One operation of batch_isend_irecv, as torch.distributed.P2POp: ``op`` is pyddp.isend or
    pyddp.irecv, ``peer`` a rank of ``group``."""

    def __init__(self, op, tensor: torch.Tensor, peer: int,
                 group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
        if op not in (isend, irecv):
            raise ValueError(f"pyddp.P2POp: op must be pyddp.isend or pyddp.irecv, got {op!r}")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Starts every operation of the list and returns their Works. Their order does not matter
    (nothing waits before all are started); messages between two ranks in one direction with
    the same tag are matched in list order."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("pyddp.batch_isend_irecv: expected a non-empty list of pyddp.P2POp")
    return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]

