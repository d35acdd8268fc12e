"""The libraries under test, behind one small protocol.

Each entry of ``PEERS`` is a class with two class methods: ``probe(ctx)``
says in a rank, before any group is joined, why the peer cannot run here
(None when it can; the ranks agree on the answer before acting on it), and
``open(ctx)`` joins its group and returns a Peer, or raises ``Unavailable``
when only joining shows that it cannot run here (the ranks agree on that
too). A Peer hands out
*bound* collectives: a function that runs one collective on given buffers, so
per-call conversions (to numpy for MPI, say) happen once per buffer, not once
per timed call.

A peer is added by writing such a class and listing it in ``PEERS``.
"""

import datetime
import functools
import importlib.util
import os
import secrets
import shutil
import subprocess
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Optional, Protocol

import torch
import torch.distributed as dist

import pyddp
from pyddp import devices
from pyddp._launch import temporary_environ
# tests/tools/test_bench.py reads NCCL's version for ranks sharing a GPU here.
from pyddp.devices import NCCL_MULTI_RANK_GPU_VERSION  # noqa: F401

MPIRUN_VERSION_SECONDS = 30.0
"""How long ``mpirun --version`` may take (it answers in well under a second)."""

Run = Callable[[], None]
"""One blocking call of a collective on fixed buffers."""

SYMM_MEM_TRIAL_COUNT = 1024
"""Elements of the all-reduce a symm_mem peer runs once when it opens, to find out whether the
kernels run here before the sweep depends on them."""

SYMM_MEM_OVERLAPPING = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
"""torch's switch that lets ranks on one GPU map each other's symmetric memory (its rendezvous
refuses "allocations from overlapping devices" otherwise)."""


class Unavailable(Exception):
    """Raised by a peer's ``open`` when joining showed that it cannot run here; the message
    says why, and the peer has released what it took."""


@dataclass(frozen=True)
class RankContext:
    """What a peer needs to join its group in one rank."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    base_store: dist.Store
    timeout: datetime.timedelta
    mpi_launched: bool
    hosts: int
    """Simulated hosts the ranks are spread over (--hosts); 1: this machine as it is."""

    def store(self, name: str) -> dist.Store:
        """The run's store under the prefix ``name``, shared by all ranks."""
        return dist.PrefixStore(f"pyddp.bench/{name}", self.base_store)


class Peer(Protocol):
    """A collective library as the timing loop sees it; every bound call blocks until done
    (on a GPU: until the work is queued; ``sync`` waits for it)."""

    name: str
    device: torch.device
    detail: str
    checked: bool
    """Whether its outputs are the collective's, which --check compares with the reference."""
    memory: str
    """Where its buffers come from: "torch" (torch.empty), "registered" (pyddp's registered
    memory, pyddp.empty) or "symmetric" (torch's symmetric memory); ops.MEMORIES."""

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        """Why this peer cannot run ``op`` with ``redop`` on ``dtype``; None if it can."""

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        """Reduces ``tensor`` across ranks, in place."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        """``output`` = every rank's ``input``, in rank order."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        """Copies rank ``root``'s ``tensor`` to every rank."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        """``output`` on rank r = block r of ``input`` reduced across ranks."""

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        """Block k of ``input`` goes to rank k, block k of ``output`` comes from rank k
        (n equal blocks)."""

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        """Sends ``input`` to rank ``dst`` while receiving ``output`` from rank ``src``."""

    def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""

    def sync(self) -> None:
        """Waits until every collective issued by this rank has finished on its device."""

    def close(self) -> None:
        """Leaves the group and frees its resources."""


_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)

MESSAGE_OPS = ("all_to_all", "sendrecv")
"""The benchmarked operations that move messages between pairs of ranks."""


def _exchange(lib: types.ModuleType, group: object, output: torch.Tensor, input: torch.Tensor,
              dst: int, src: int) -> Run:
    """``sendrecv`` through ``lib``'s batch_isend_irecv and P2POp (torch.distributed's, or
    pyddp's, which has the same API) on ``group``: both started at once, then waited for."""
    ops = [lib.P2POp(lib.isend, input, dst, group), lib.P2POp(lib.irecv, output, src, group)]

    def run() -> None:
        for work in lib.batch_isend_irecv(ops):
            work.wait()
    return run


def _cuda_reason(ctx: RankContext, nccl: bool = False) -> Optional[str]:
    """Why this rank cannot run a CUDA peer here; None if it can.

    Ranks share GPUs round-robin when there are fewer than ranks (the GPU
    machines of this project have one); NCCL then needs a recent version.
    """
    if not torch.cuda.is_available():
        return "no CUDA device"
    if nccl:
        return devices.nccl_refusal(ctx.local_world_size, torch.cuda.device_count(),
                                    torch.cuda.nccl.version())
    return None


class _TorchGroupCalls:
    """Bound collectives through torch.distributed on ``self._group`` (None: the default)."""

    checked: ClassVar[bool] = True
    memory: ClassVar[str] = "torch"

    _group: Optional[dist.ProcessGroup]
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        op, group = _TORCH_OPS[redop], self._group
        return lambda: dist.all_reduce(tensor, op, group=group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        group = self._group
        return lambda: _all_gather_single(output, input, group=group)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        group = self._group
        return lambda: dist.broadcast(tensor, root, group=group)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        op, group = _TORCH_OPS[redop], self._group
        return lambda: _reduce_scatter_single(output, input, op, group=group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        group = self._group
        return lambda: dist.all_to_all_single(output, input, group=group)

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        return _exchange(dist, self._group, output, input, dst, src)

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class GlooPeer(_TorchGroupCalls):
    """torch.distributed's default group, which the worker creates with gloo.

    The same group carries the benchmark's bookkeeping (max of timings, sum of
    wrong counts), always outside the timed loops; the worker destroys it.
    """

    name: ClassVar[str] = "gloo"
    device = torch.device("cpu")
    detail = "torch.distributed gloo"

    def __init__(self) -> None:
        self._group = None

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        return None

    @classmethod
    def open(cls, ctx: RankContext) -> "GlooPeer":
        _require_gloo_default_group(cls.name)
        return cls()

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        return None

    def close(self) -> None:
        """Nothing to do: the default group outlives the peers."""


def _require_gloo_default_group(peer: str) -> None:
    """Raises unless torch.distributed's default group, which ``peer`` runs on, is gloo's."""
    if dist.get_backend() != "gloo":
        raise RuntimeError(f"the {peer} peer needs the default group to be a gloo group")


class _OnTheRanksGpu:
    """Makes a CPU peer its CUDA twin: the same calls, on buffers on this rank's GPU
    (``devices.use_gpu``), timed until that GPU is done. Listed first among the bases."""

    device: torch.device

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        return _cuda_reason(ctx)

    @classmethod
    def open(cls, ctx: RankContext) -> "_OnTheRanksGpu":
        return cls(devices.use_gpu(ctx.local_rank, ctx.local_world_size))

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


class GlooCudaPeer(_OnTheRanksGpu, GlooPeer):
    """torch.distributed's gloo on CUDA tensors: the default group, as ``gloo``, with every
    buffer on this rank's GPU.

    Gloo copies a CUDA tensor to pinned host memory, runs its CPU algorithm
    there and copies the result back (its reduce_scatter all-reduces the whole
    input): the path any library that keeps the bytes on the GPU should beat,
    and one that runs wherever torch does. Its send and recv hand the tensor's
    memory to the host transport as it is, so it cannot send a CUDA tensor.
    """

    name = "gloo_cuda"
    detail = "torch.distributed gloo on CUDA tensors, staged through pinned host memory"

    @classmethod
    def open(cls, ctx: RankContext) -> "GlooCudaPeer":
        _require_gloo_default_group(cls.name)
        return super().open(ctx)

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        if op == "sendrecv":
            return ("gloo's send and recv hand the tensor's memory to its host transport as "
                    "it is: they stage no CUDA tensor")
        if op == "barrier":
            return "a barrier has no tensor to put on a GPU: the gloo row times it"
        return None


class TorchNcclPeer(_TorchGroupCalls):
    """torch.distributed's NCCL, one GPU per rank."""

    name: ClassVar[str] = "nccl"
    detail = "torch.distributed nccl"

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self._group = group
        self.device = device

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        reason = _cuda_reason(ctx, nccl=True)
        if reason is None and not dist.is_nccl_available():
            reason = "this torch build has no NCCL"
        return reason

    @classmethod
    def open(cls, ctx: RankContext) -> "TorchNcclPeer":
        device = devices.use_gpu(ctx.local_rank, ctx.local_world_size)
        return cls(dist.new_group(backend="nccl", timeout=ctx.timeout), device)

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        return None

    def close(self) -> None:
        dist.destroy_process_group(self._group)


class _PyddpPeer:
    """A pyddp ProcessGroup of one transport (``_transport``) and algorithm (``_algo``).

    The algorithm is chosen the way a user chooses it, with PYDDP_ALGO, which
    pyddp reads when the group is created. ``_messages`` says whether the
    transport moves messages between pairs of ranks (all-to-all and
    point-to-point); pyddp refuses those where it does not.
    """

    checked: ClassVar[bool] = True
    memory: ClassVar[str] = "torch"

    name: ClassVar[str]
    _transport: ClassVar[str]
    _algo: ClassVar[Optional[str]] = None
    _cuda: ClassVar[bool]
    _messages: ClassVar[bool] = True

    def __init__(self, group: "pyddp.ProcessGroup", device: torch.device) -> None:
        self._group = group
        self.device = device
        algo = self._algo or os.environ.get("PYDDP_ALGO", "auto")
        self.detail = f"pyddp {group.backend}, PYDDP_ALGO={algo}"
        if group.backend == "auto":
            self.detail += f"; {group.layout()}"

    @classmethod
    def _backend(cls, ctx: RankContext) -> str:
        """The pyddp backend the group is made with."""
        return cls._transport

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        if cls._cuda:
            # "nccl" and "nccl_ring" run over NCCL communicators
            reason = _cuda_reason(ctx, nccl=cls._transport.startswith("nccl"))
            if reason is not None:
                return reason
        available = tuple(getattr(pyddp, "BACKENDS", ()))
        if cls._backend(ctx) not in available:
            return (f"this pyddp build has no {cls._backend(ctx)!r} backend "
                    f"(it has {', '.join(available) or 'none'})")
        return None

    @classmethod
    def open(cls, ctx: RankContext) -> "_PyddpPeer":
        device = (devices.use_gpu(ctx.local_rank, ctx.local_world_size) if cls._cuda
                  else torch.device("cpu"))
        env = {"PYDDP_ALGO": cls._algo} if cls._algo else {}
        with temporary_environ(env):
            group = pyddp.new_group(cls._backend(ctx), store=ctx.store(cls.name),
                                    rank=ctx.rank, world_size=ctx.world_size,
                                    timeout=ctx.timeout)
        return cls(group, device)

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        if op in MESSAGE_OPS and not self._messages:
            return (f"pyddp's {self._transport} transport has no messages between pairs of "
                    "ranks, so pyddp refuses all-to-all and point-to-point on it")
        return None

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        op, group = _TORCH_OPS[redop], self._group
        return lambda: group.all_reduce(tensor, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        group = self._group
        return lambda: group.all_gather_single(output, input)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        group = self._group
        return lambda: group.broadcast(tensor, root)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        op, group = _TORCH_OPS[redop], self._group
        return lambda: group.reduce_scatter_single(output, input, op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        group = self._group
        return lambda: group.all_to_all_single(output, input)

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        return _exchange(pyddp, self._group, output, input, dst, src)

    def barrier(self) -> None:
        self._group.barrier()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pyddp.destroy_process_group(self._group)


class PyddpShmPeer(_PyddpPeer):
    """pyddp over shared memory (CPU tensors); across simulated hosts (--hosts), pyddp's
    backend "auto", which composes shared memory inside each host with gloo between hosts."""

    name = "pyddp"
    _transport = "shm"
    _cuda = False

    @classmethod
    def _backend(cls, ctx: RankContext) -> str:
        return "auto" if ctx.hosts > 1 else cls._transport


class PyddpRegisteredPeer(PyddpShmPeer):
    """pyddp over shared memory on buffers in its registered memory (pyddp.empty), which the
    peers read where they lie; the same group as ``pyddp`` otherwise."""

    name = "pyddp_registered"
    memory = "registered"

    def __init__(self, group: "pyddp.ProcessGroup", device: torch.device) -> None:
        super().__init__(group, device)
        self.detail += "; buffers in registered memory"


class PyddpIpcPeer(_PyddpPeer):
    """pyddp's fused collectives over CUDA IPC (one kernel per collective), the protocol
    chosen by size."""

    name = "pyddp_ipc"
    _transport = "cuda_ipc"
    _cuda = True


class PyddpIpcOneShotPeer(PyddpIpcPeer):
    """pyddp's fused collectives over CUDA IPC, all-reduce one-shot at every size."""

    name = "pyddp_ipc_one_shot"
    _algo = "direct"


class PyddpIpcTwoShotPeer(PyddpIpcPeer):
    """pyddp's fused collectives over CUDA IPC, all-reduce two-shot at every size."""

    name = "pyddp_ipc_two_shot"
    _algo = "two_shot"


class PyddpIpcRegisteredPeer(PyddpIpcPeer):
    """pyddp's fused collectives over CUDA IPC on buffers registered with the group
    (ProcessGroup.register_buffer), which the peers read where they lie; the protocol chosen
    by size (all_reduce stages up to its one-shot sizes, as it would).

    A point's bind registers the buffer that peers read (one at a time: the previous one's
    registration ends first; both are collectives, which every rank makes in the same
    order), so that the timed calls only launch."""

    name = "pyddp_ipc_registered"

    def __init__(self, group: "pyddp.ProcessGroup", device: torch.device) -> None:
        super().__init__(group, device)
        self.detail += "; buffers registered with the group"
        self._registered: Optional[torch.Tensor] = None

    def _register(self, tensor: torch.Tensor) -> None:
        if self._registered is not None:
            self._group.deregister_buffer(self._registered)
            self._registered = None
        self._group.register_buffer(tensor)
        self._registered = tensor

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        self._register(tensor)
        return super().all_reduce(tensor, redop)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        self._register(input)
        return super().all_gather(output, input)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        self._register(tensor)
        return super().broadcast(tensor, root)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        self._register(input)
        return super().reduce_scatter(output, input, redop)


class PyddpNcclPeer(_PyddpPeer):
    """NCCL's collectives through pyddp's NcclEngine."""

    name = "pyddp_nccl"
    _transport = "nccl"
    _cuda = True


class PyddpNcclRingPeer(_PyddpPeer):
    """pyddp's ring over NCCL send/recv (the path across hosts)."""

    name = "pyddp_nccl_ring"
    _transport = "nccl_ring"
    _cuda = True
    _messages = False


@functools.lru_cache(maxsize=None)
def mpi_launchable() -> Optional[str]:
    """Why this machine cannot start MPI ranks (no mpi4py, no Open MPI mpirun); None if it can.

    The launcher passes Open MPI's flags, so another MPI's mpirun does not do.
    """
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "mpirun is not on PATH"
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                                 timeout=MPIRUN_VERSION_SECONDS).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{mpirun} --version failed: {error}"
    if "Open MPI" not in version:
        return f"{mpirun} is not Open MPI's (the launcher passes Open MPI's flags)"
    return None


class MpiPeer:
    """MPI through mpi4py (CPU tensors as numpy views); needs ranks started by mpirun.

    MPI_Init in a process that mpirun did not start makes a one-rank
    COMM_WORLD (a singleton), so the launcher starts every rank with mpirun
    when this peer is wanted; under torchrun it is skipped.
    """

    checked: ClassVar[bool] = True
    memory: ClassVar[str] = "torch"

    name: ClassVar[str] = "mpi"
    device = torch.device("cpu")

    def __init__(self, comm: "object", library: str) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self._comm = comm
        self.detail = f"mpi4py, {library}"
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
        self._types = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
        }

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        reason = mpi_launchable()
        if reason is None and not ctx.mpi_launched:
            reason = ("the ranks were not started by mpirun (pyddp.bench starts mpirun "
                      "itself when it spawns the ranks; not under torchrun)")
        return reason

    @classmethod
    def open(cls, ctx: RankContext) -> "MpiPeer":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if (world.Get_size(), world.Get_rank()) != (ctx.world_size, ctx.rank):
            raise RuntimeError(
                f"rank {ctx.rank}: MPI's COMM_WORLD is rank {world.Get_rank()} of "
                f"{world.Get_size()}, expected rank {ctx.rank} of {ctx.world_size}")
        library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        return cls(world.Dup(), library)

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        if op in ("all_reduce", "reduce_scatter"):
            if redop not in self._ops:
                return f"MPI has no {redop} reduction"
            if dtype not in self._types:
                return f"MPI has no {dtype} reduction"
        return None

    def _buffer(self, tensor: torch.Tensor) -> list:
        """``[numpy view, MPI datatype]``; dtypes without an MPI type travel as bytes."""
        if tensor.dtype in self._types:
            return [tensor.numpy(), self._types[tensor.dtype]]
        return [tensor.view(torch.uint8).numpy(), self._mpi.BYTE]

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        comm, buf, op = self._comm, self._buffer(tensor), self._ops[redop]
        in_place = self._mpi.IN_PLACE
        return lambda: comm.Allreduce(in_place, buf, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        comm, out, inp = self._comm, self._buffer(output), self._buffer(input)
        return lambda: comm.Allgather(inp, out)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        comm, buf = self._comm, self._buffer(tensor)
        return lambda: comm.Bcast(buf, root)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        comm, out, inp, op = self._comm, self._buffer(output), self._buffer(input), self._ops[redop]
        return lambda: comm.Reduce_scatter_block(inp, out, op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        comm, out, inp = self._comm, self._buffer(output), self._buffer(input)
        return lambda: comm.Alltoall(inp, out)

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        comm, out, inp = self._comm, self._buffer(output), self._buffer(input)
        return lambda: comm.Sendrecv(inp, dst, recvbuf=out, source=src)

    def barrier(self) -> None:
        self._comm.Barrier()

    def sync(self) -> None:
        """Nothing to do: MPI calls on host memory finish before they return."""

    def close(self) -> None:
        self._comm.Free()


class DeepSpeedShmPeer:
    """DeepSpeed's CPU shared-memory all-reduce (``torch.ops.deepspeed.inference_all_reduce_``).

    Built on first use by DeepSpeed's ShareMemCommBuilder (ninja JIT, cached
    in ~/.cache/torch_extensions). DeepSpeed names its segments from
    MASTER_ADDR and MASTER_PORT and never unlinks them; here they are named
    from a per-run token and unlinked once every rank has mapped them, so
    /dev/shm is left clean. Its state is per process: one group per process.
    """

    checked: ClassVar[bool] = True
    memory: ClassVar[str] = "torch"

    name: ClassVar[str] = "deepspeed"
    device = torch.device("cpu")
    SEGMENT_PREFIX: ClassVar[str] = "deepspeed_allreduce_buffer"
    """DeepSpeed's SHM_BUFFER_NAME (csrc/cpu/comm/shm.cpp)."""

    def __init__(self, kernel_level: int, version: str) -> None:
        self._kernel_level = kernel_level
        self.detail = f"DeepSpeed {version} shm all_reduce"

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _load() -> "object":
        """DeepSpeed's shm comm extension, JIT-built the first time (then from the cache)."""
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        builder = ShareMemCommBuilder()
        if not builder.is_compatible():
            raise RuntimeError(f"DeepSpeed says its {builder.NAME} op is not compatible here")
        return builder.load(verbose=False)

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed"
        try:
            cls._load()
        except Exception as error:  # any build failure makes the peer unavailable
            return f"DeepSpeed's shm op could not be built: {error}"
        return None

    @classmethod
    def open(cls, ctx: RankContext) -> "DeepSpeedShmPeer":
        import deepspeed

        module = cls._load()
        store = ctx.store(cls.name)
        if ctx.rank == 0:
            store.set("token", secrets.token_hex(8))
        token = store.get("token").decode()
        with temporary_environ({"LOCAL_SIZE": str(ctx.world_size), "MASTER_ADDR": "pyddp.bench",
                                "MASTER_PORT": token}):
            module.initialize(ctx.world_size, ctx.rank)
        # initialize() returns once this rank has mapped every peer's segment;
        # after the barrier every rank has, so the names can go.
        store.set(f"mapped/{ctx.rank}", "1")
        store.wait([f"mapped/{r}" for r in range(ctx.world_size)])
        os.unlink(f"/dev/shm/{cls.SEGMENT_PREFIX}_{os.getuid()}_pyddp.bench_{token}_{ctx.rank}")
        # Releases before the ISA guard had no vector_kernel_level and ran the
        # AVX512 kernels unconditionally.
        level = module.vector_kernel_level() if hasattr(module, "vector_kernel_level") else 2
        return cls(level, deepspeed.__version__)

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        if op != "all_reduce":
            return "DeepSpeed's shm comm op implements all_reduce only"
        if redop != "sum":
            return "DeepSpeed's shm all_reduce sums only"
        # The fp32 kernels need AVX2 (level 1), the fp16/bf16 ones AVX512BW (level 2);
        # DeepSpeed itself falls back to torch.distributed below these levels.
        needed = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 2}.get(dtype)
        if needed is None:
            return f"DeepSpeed's shm all_reduce has no {dtype} kernel"
        if self._kernel_level < needed:
            return f"this CPU lacks the vector ISA DeepSpeed's {dtype} shm kernel needs"
        return None

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        op = torch.ops.deepspeed.inference_all_reduce_
        return lambda: op(tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        raise NotImplementedError("deepspeed: all_gather is not supported (see unsupported)")

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        raise NotImplementedError("deepspeed: broadcast is not supported (see unsupported)")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        raise NotImplementedError("deepspeed: reduce_scatter is not supported (see unsupported)")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        raise NotImplementedError("deepspeed: all_to_all is not supported (see unsupported)")

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        raise NotImplementedError("deepspeed: sendrecv is not supported (see unsupported)")

    def barrier(self) -> None:
        dist.barrier()

    def sync(self) -> None:
        """Nothing to do: the shm all-reduce finishes before it returns."""

    def close(self) -> None:
        """Nothing to do: DeepSpeed keeps its mapping until the process exits."""


class LimitPeer:
    """Not a library: the memory system's ceiling, measured beside the peers.

    Every rank copies the collective's largest buffer once (torch's copy_,
    with the threads every peer gets), all ranks at once: no collective can
    take less time than moving its bytes once, so a peer's time over this one
    says how far it is from the machine's limit. It computes nothing, so
    --check leaves it out.
    """

    name: ClassVar[str] = "limit"
    device = torch.device("cpu")
    detail = "every rank copies the largest buffer once, all at once"
    checked: ClassVar[bool] = False
    memory: ClassVar[str] = "torch"

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        return None

    @classmethod
    def open(cls, ctx: RankContext) -> "LimitPeer":
        return cls()

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        if op == "barrier":
            return "a barrier moves no bytes: there is no copy to bound it"
        return None

    @staticmethod
    def _copy(buffer: torch.Tensor) -> Run:
        scratch = torch.empty_like(buffer)
        return lambda: scratch.copy_(buffer)

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        return self._copy(tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        return self._copy(output)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        return self._copy(tensor)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        return self._copy(input)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        return self._copy(input)

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        return self._copy(input)

    def barrier(self) -> None:
        dist.barrier()

    def sync(self) -> None:
        """Nothing to do: the copy is done when it returns."""

    def close(self) -> None:
        """Nothing to do: it holds no group."""


class LimitCudaPeer(_OnTheRanksGpu, LimitPeer):
    """The ``limit`` row on GPUs: every rank copies the collective's largest buffer once on
    its own GPU, device to device (``dst.copy_(src)``), all ranks at once, timed as every
    peer is (until its GPU is done). Ranks that share a GPU copy on it together, so the row
    is what its memory gives them at once."""

    name = "limit_cuda"
    detail = "every rank copies the largest buffer once on its GPU, device to device, all at once"


class _SymmMemPeer:
    """PyTorch's own all-reduce kernels over CUDA IPC (``torch.ops.symm_mem``): every rank
    maps every other rank's buffer and the kernel reads them in place, with flags in the
    same mapped memory as its barriers.

    Its buffers come from torch's symmetric memory (``symm_mem.empty``; the
    case allocates them, ``memory``) and are exchanged once per buffer
    (``symm_mem.rendezvous`` over a gloo group of its own) when a collective is
    bound, which every rank does in the same order. The kernels sum float32
    and bfloat16 only, in messages of whole 4-byte words (torch checks).
    Where ranks share a GPU, torch's rendezvous refuses unless
    SYMM_MEM_OVERLAPPING is set, which this peer does for its rendezvous;
    their kernels wait for each other by spinning, so they run well only
    under NVIDIA's MPS daemon. ``open`` runs one small all-reduce: a
    rendezvous or a kernel that fails there makes the peer Unavailable with
    torch's message, instead of failing the sweep.
    """

    checked: ClassVar[bool] = True
    memory: ClassVar[str] = "symmetric"

    name: ClassVar[str]
    _op: ClassVar[str]
    """The operator of torch.ops.symm_mem this peer runs."""
    _in_place: ClassVar[bool]
    """Whether the operator reduces its input in place; otherwise its output is copied back,
    as the benchmark's all_reduce is in place."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 environ: dict[str, str]) -> None:
        self._group = group
        self.device = device
        self._environ = environ
        self.detail = f"torch symm_mem {self._op}, " + (
            "in place" if self._in_place
            else "its output copied back into the buffer (one more local copy of the message)")
        if environ:
            self.detail += f"; ranks share a GPU ({SYMM_MEM_OVERLAPPING}=1)"

    @classmethod
    def probe(cls, ctx: RankContext) -> Optional[str]:
        reason = _cuda_reason(ctx)
        if reason is not None:
            return reason
        if ctx.world_size != ctx.local_world_size or ctx.hosts > 1:
            return "symm_mem maps its peers' GPU memory through CUDA IPC: every rank on one host"
        if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
            return f"torch {torch.__version__} has no torch.distributed._symmetric_memory"
        operator = f"symm_mem::{cls._op}"
        try:
            has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(operator, "CUDA")
        except RuntimeError:
            return f"torch {torch.__version__} has no operator {operator}"
        if not has_kernel:
            return f"torch {torch.__version__} has no CUDA kernel for {operator}"
        return None

    @classmethod
    def open(cls, ctx: RankContext) -> "_SymmMemPeer":
        from torch.distributed import _symmetric_memory as symm_mem

        device = devices.use_gpu(ctx.local_rank, ctx.local_world_size)
        shared = devices.shares_gpu(ctx.local_world_size, torch.cuda.device_count())
        peer = cls(dist.new_group(backend="gloo", timeout=ctx.timeout), device,
                   {SYMM_MEM_OVERLAPPING: "1"} if shared else {})
        try:
            # Releases of torch before it was deprecated need it before a rendezvous; later
            # ones only warn that it is no longer needed.
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    enable(peer._group.group_name)
            trial = symm_mem.empty(SYMM_MEM_TRIAL_COUNT, dtype=torch.float32, device=device)
            trial.fill_(1.0)
            peer.all_reduce(trial, "sum")()
            peer.sync()
        except RuntimeError as error:
            peer.close()
            raise Unavailable(f"torch symm_mem {cls._op} failed here: {error}") from error
        return peer

    def unsupported(self, op: str, redop: str, dtype: torch.dtype) -> Optional[str]:
        if op != "all_reduce":
            return f"torch.ops.symm_mem.{self._op} is an all_reduce"
        if redop != "sum":
            return f"torch.ops.symm_mem.{self._op} sums only"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"torch.ops.symm_mem.{self._op} has float32 and bfloat16 kernels only"
        return None

    def all_reduce(self, tensor: torch.Tensor, redop: str) -> Run:
        from torch.distributed import _symmetric_memory as symm_mem

        # Binding exchanges the buffer's mapping with every rank (a collective; the ranks
        # bind in the same order), so that the timed calls only launch the kernel.
        group_name = self._group.group_name
        with temporary_environ(self._environ):
            symm_mem.rendezvous(tensor, group_name)
        op = getattr(torch.ops.symm_mem, self._op)
        if self._in_place:
            return lambda: op(tensor, redop, group_name)
        return lambda: tensor.copy_(op(tensor, redop, group_name))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        raise NotImplementedError(f"{self.name}: all_reduce only (see unsupported)")

    def broadcast(self, tensor: torch.Tensor, root: int) -> Run:
        raise NotImplementedError(f"{self.name}: all_reduce only (see unsupported)")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, redop: str) -> Run:
        raise NotImplementedError(f"{self.name}: all_reduce only (see unsupported)")

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Run:
        raise NotImplementedError(f"{self.name}: all_reduce only (see unsupported)")

    def sendrecv(self, output: torch.Tensor, input: torch.Tensor, dst: int, src: int) -> Run:
        raise NotImplementedError(f"{self.name}: all_reduce only (see unsupported)")

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        dist.destroy_process_group(self._group)


class SymmMemOneShotPeer(_SymmMemPeer):
    """``torch.ops.symm_mem.one_shot_all_reduce``: each rank reads every rank's whole buffer
    and reduces it into a new tensor, which is copied back (the benchmark's all_reduce is in
    place, and the kernel's output may not be its input: peers still read it)."""

    name = "symm_mem_one_shot"
    _op = "one_shot_all_reduce"
    _in_place = False


class SymmMemTwoShotPeer(_SymmMemPeer):
    """``torch.ops.symm_mem.two_shot_all_reduce_``: each rank reduces its share of every
    rank's buffer and writes it into all of them, in place."""

    name = "symm_mem_two_shot"
    _op = "two_shot_all_reduce_"
    _in_place = True


PEERS: dict[str, type] = {
    cls.name: cls for cls in (
        PyddpShmPeer, PyddpRegisteredPeer, GlooPeer, MpiPeer, DeepSpeedShmPeer, LimitPeer,
        TorchNcclPeer, PyddpIpcPeer, PyddpIpcOneShotPeer, PyddpIpcTwoShotPeer,
        PyddpIpcRegisteredPeer, PyddpNcclPeer,
        PyddpNcclRingPeer, GlooCudaPeer, SymmMemOneShotPeer, SymmMemTwoShotPeer, LimitCudaPeer)
}
"""Every peer the tool knows, CPU ones first, in table order."""

HOST_PEERS = (PyddpShmPeer.name, GlooPeer.name)
"""The peers that run across simulated hosts (--hosts): pyddp, with its backend "auto", and
gloo."""

BASELINES = {"cpu": "gloo", "cuda": "nccl"}
"""The peer every other peer on a device is compared with by default."""

CEILINGS = {"cpu": LimitPeer.name, "cuda": LimitCudaPeer.name}
"""The peer that measures a device's limit, which every other peer is compared with too."""

FLOORS = {"cuda": GlooCudaPeer.name}
"""The plain path every other peer on a device is compared with too, whatever the baseline:
on GPUs torch's gloo, which stages CUDA tensors through host memory."""

RIVALS = {"cpu": "mpi"}
"""The fastest other library on a device, which every other peer is compared with too when
it ran: the summary's "speed-up over mpi" is MPI time / peer time."""
