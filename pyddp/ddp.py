"""``DistributedDataParallel``: torch's DDP, in Python, over a pyddp process group.

Swap ``torch.nn.parallel.DistributedDataParallel`` for
``pyddp.DistributedDataParallel`` and train as before::

    pyddp.init_process_group("shm")     # or torch.distributed.init_process_group(...)
    model = pyddp.DistributedDataParallel(Net())
    for x, y in loader:
        loss_fn(model(x), y).backward()   # gradients averaged over ranks, in buckets
        optimizer.step()
        optimizer.zero_grad()

Construction checks that every rank holds the same parameters and copies
rank 0's parameters (and buffers) to the others. Each backward all-reduces
gradients in buckets while autograd is still running (``pyddp.reducer``);
bucket assignment is in ``pyddp.bucketing``. This module also holds the
built-in communication hooks (``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``) for ``register_comm_hook``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from . import bucketing, survival
from .ddp_groups import DDPGroup, TorchGroup, resolve
from .process_group import ProcessGroup, ReduceOp
from .reducer import CommHook, GradBucket, Reducer, error_message

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024
"""Bytes of parameters or buffers per coalesced broadcast (torch DDP's broadcast_bucket_size)."""

BROADCAST_ALIGN = 64
"""Byte alignment of each tensor in a coalesced broadcast: enough for every dtype."""

_MIB = 1024 * 1024

logger = logging.getLogger("pyddp")


class DistributedDataParallel(nn.Module):
    """Data parallelism over a pyddp process group, with the semantics of torch's DDP.

    Args:
        module: the model; every rank must hold one with the same parameters.
        device_ids: None for CPU modules; for a module on one GPU, None or that
            device (``[i]``), in which case inputs are moved to it.
        output_device: accepted for torch compatibility; outputs stay where the
            module puts them.
        broadcast_buffers: copy rank 0's buffers to every rank at construction
            and before each forward (as torch decides: not after a forward under
            no_grad or no_sync).
        process_group: the group to average over: pyddp's, or torch.distributed's (then
            torch's collectives run on whichever backend serves it: pyddp's engine for
            "pyddp", gloo, NCCL). None means pyddp's default group, or
            torch.distributed's when pyddp has none.
        bucket_cap_mb: bucket size in MiB. None means torch's default: 25 MiB,
            with a 1 MiB first bucket; an explicit value caps every bucket.
        find_unused_parameters: let parameters get no gradient in a backward.
            A parameter unused on every rank keeps its ``grad`` as it was (None
            stays None); one used on some ranks gets the average on all.
        gradient_as_bucket_view: make each ``param.grad`` a view into its
            bucket, so no gradient is copied after the all-reduce.
        on_rank_failure: "raise" (as torch's DDP: a failed gradient all-reduce raises
            out of ``backward()``), or "shrink": training goes on without lost ranks
            (pyddp/survival.py). Then the loop asks ``should_commit()`` after each
            backward and applies the step only when it says so::

                loss_fn(model(x), y).backward()
                if model.should_commit():
                    optimizer.step()
                optimizer.zero_grad()

            A step whose gradient all-reduce failed on any rank is applied on no rank
            (or on every survivor, when a rank already applied it); the survivors shrink
            the group, and the average follows the new world size. Processes that call
            ``pyddp.join()`` are admitted before the next forward, and receive the
            parameters, buffers and ``optimizer``'s state from rank 0. Needs a pyddp
            group whose store outlives every rank.
        optimizer: with on_rank_failure="shrink", the optimizer whose state a joining
            rank receives (None: no optimizer state is sent).
    """

    def __init__(self, module: nn.Module,
                 device_ids: Optional[Sequence[Union[int, torch.device]]] = None,
                 output_device: Optional[Union[int, torch.device]] = None, *,
                 broadcast_buffers: bool = True,
                 process_group: Optional[Union[ProcessGroup, dist.ProcessGroup]] = None,
                 bucket_cap_mb: Optional[float] = None, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, on_rank_failure: str = "raise",
                 optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        super().__init__()
        self.module = module
        # The group as DDP calls it, and as the user knows it.
        self._group: DDPGroup = resolve(process_group, "DistributedDataParallel")
        self.process_group = (self._group.group if isinstance(self._group, TorchGroup)
                              else self._group)
        self._rank = self._group.rank()
        if on_rank_failure not in ("raise", "shrink"):
            raise ValueError(self._error(f"on_rank_failure must be 'raise' or 'shrink', got "
                                         f"{on_rank_failure!r}"))
        if on_rank_failure == "shrink" and not isinstance(self._group, ProcessGroup):
            raise ValueError(self._error("on_rank_failure='shrink' needs a pyddp process group "
                                         "(pyddp.init_process_group or pyddp.join)"))
        self._survive = on_rank_failure == "shrink"
        self._optimizer = optimizer
        # Steps committed so far (the same on every rank), and processes to admit before
        # the next forward.
        self._committed = 0
        self._joins = 0
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(self._error("the module has no parameter that requires a gradient; "
                                         "DistributedDataParallel is not needed"))
        self.device = self._check_devices(module, device_ids, output_device)
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        # torch's require_forward_param_sync: whether the last forward was a
        # synchronised one; buffers are broadcast before a forward only then.
        self._last_forward_synced = True

        self._check_same_model_on_every_rank()
        self._sync_state()

        if bucket_cap_mb is None:
            cap, first_cap = bucketing.DEFAULT_CAP_BYTES, bucketing.DEFAULT_FIRST_CAP_BYTES
        elif bucket_cap_mb > 0:
            cap = first_cap = max(1, int(bucket_cap_mb * _MIB))
        else:
            raise ValueError(self._error(f"bucket_cap_mb must be positive, got {bucket_cap_mb}"))
        params = [p for _, p in named]
        # As torch's DDP: the weights of sparse embeddings get sparse gradients.
        sparse_weights = {id(m.weight) for m in module.modules()
                          if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        sparse = [id(p) in sparse_weights for p in params]
        buckets = bucketing.assign_buckets([p.numel() for p in params],
                                           [p.element_size() for p in params],
                                           [(p.dtype, p.device) for p in params], cap, first_cap,
                                           sparse)
        self.reducer = Reducer(params, [name for name, _ in named], buckets, self._group,
                               find_unused_parameters, gradient_as_bucket_view, sparse)
        self.reducer.tolerate_failures = self._survive

    def _error(self, message: str) -> str:
        return error_message(self._rank, message)

    # --- construction ----------------------------------------------------------

    def _check_devices(self, module: nn.Module, device_ids, output_device) -> torch.device:
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            raise ValueError(self._error(f"the module's parameters are on "
                                         f"{sorted(map(str, devices))}; pyddp DDP needs a "
                                         "module on a single device"))
        device = devices.pop()
        if device.type == "cpu":
            if device_ids is not None or output_device is not None:
                raise ValueError(self._error(
                    f"device_ids={device_ids} and output_device={output_device} must be None "
                    "for a CPU module"))
        elif device_ids is not None:
            wanted = [d if isinstance(d, torch.device) else torch.device(device.type, d)
                      for d in device_ids]
            if wanted != [device]:
                raise ValueError(self._error(f"device_ids={list(device_ids)} must name the "
                                             f"module's device, {device}"))
        return device

    def _check_same_model_on_every_rank(self) -> None:
        """Raises on every rank, naming the first difference, if the ranks' models differ."""
        mine = [f"parameter {name!r}: {_describe(p)}" for name, p in self.module.named_parameters()]
        if self.broadcast_buffers:
            mine += [f"buffer {name!r}: {_describe(b)}" for name, b in self.module.named_buffers()]
        everyone = _all_gather_strings(self._group, "\n".join(mine), self.device)
        tables = [text.split("\n") if text else [] for text in everyone]
        longest = max(len(t) for t in tables)
        for i in range(longest):
            entries = [t[i] if i < len(t) else "nothing (fewer parameters and buffers)"
                       for t in tables]
            if len(set(entries)) > 1:
                by_entry: Dict[str, List[int]] = {}
                for rank, entry in enumerate(entries):
                    by_entry.setdefault(entry, []).append(rank)
                detail = "; ".join(f"rank{'s' if len(r) > 1 else ''} "
                                   f"{', '.join(map(str, r))}: {entry}"
                                   for entry, r in by_entry.items())
                raise ValueError(self._error(
                    f"the ranks' models differ at parameter/buffer #{i}: {detail}. Every rank "
                    "must construct the same model (same parameters in the same order, with "
                    "the same shapes and dtypes)"))

    def _sync_state(self) -> None:
        """Copies rank 0's parameters and buffers to every rank; with on_rank_failure=
        "shrink" also its optimizer's state and its count of committed steps. A joining
        rank's constructor and the members' admission run it alike."""
        with torch.no_grad():
            states = [p for _, p in self.module.named_parameters()]
            if self.broadcast_buffers:
                states += [b for _, b in self.module.named_buffers()]
            self._broadcast_from_rank0(states)
        if not self._survive:
            return
        payload = b""
        if self._rank == 0 and self._optimizer is not None:
            out = io.BytesIO()
            torch.save(self._optimizer.state_dict(), out)
            payload = out.getvalue()
        header = torch.tensor([len(payload), self._committed], dtype=torch.int64)
        self._group.broadcast(header, 0)
        self._committed = int(header[1])
        if int(header[0]) == 0:
            return
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self._rank == 0
                else torch.empty(int(header[0]), dtype=torch.uint8))
        self._group.broadcast(data, 0)
        if self._rank != 0 and self._optimizer is not None:
            self._optimizer.load_state_dict(
                torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True))

    # --- surviving lost ranks (on_rank_failure="shrink") -------------------------

    def should_commit(self) -> bool:
        """With on_rank_failure="shrink", after each backward: whether every rank's
        gradients were averaged, so that the caller applies the step (optimizer.step()),
        the same answer on every rank. On a failure the survivors agree whether any of
        them had already applied this step (then all apply it), shrink the group and go on
        with it; a lost rank costs the step that failed, not a restart."""
        if not self._survive:
            raise RuntimeError(self._error("should_commit() needs on_rank_failure='shrink'"))
        failure = self.reducer.take_failure()
        group = self._group
        if failure is None:
            # [gradients averaged here, processes waiting to join (rank 0's count)]
            votes = torch.tensor([1, survival.pending_joins(group) if self._rank == 0 else 0],
                                 dtype=torch.int64)
            try:
                group.all_reduce(votes)
            except Exception as error:
                failure = error
            else:
                if int(votes[0]) == group.size():
                    self._committed += 1
                    self._joins = int(votes[1])
                    return True
                failure = RuntimeError("another rank's gradient all-reduce failed")
        return self._recover(failure)

    @property
    def committed_steps(self) -> int:
        """With on_rank_failure="shrink": the steps should_commit() has committed, the same
        on every rank (a joining rank receives it)."""
        return self._committed

    def _recover(self, failure: BaseException) -> bool:
        group = self._group
        logger.warning("%s", self._error(f"step {self._committed + 1} failed ({failure}); "
                                         "shrinking the group to the ranks still alive"))
        # Aborted first: a peer still blocked in this group fails at once and joins in.
        group.abort()
        # A rank whose commit completed applied the step before it learnt of the loss.
        applied = survival.agree_max(group, self._committed) > self._committed
        new = group.shrink()
        if applied:
            self._committed += 1
        self._use_group(new)
        self._joins = 0
        return applied

    def _use_group(self, group: ProcessGroup) -> None:
        self._group = group
        self.process_group = group
        self._rank = group.rank()
        self.reducer.set_group(group)

    def admit(self) -> bool:
        """With on_rank_failure="shrink": admits the processes that the last should_commit()
        found waiting to join (pyddp.join), and sends them the state to start from; whether
        any was. forward() calls it first; call it before a forward where the group's size
        matters (each rank's share of a batch)."""
        if not self._joins:
            return False
        joins, self._joins = self._joins, 0
        self._use_group(self._group.admit(joins))
        self._check_same_model_on_every_rank()
        self._sync_state()
        return True

    def _broadcast_from_rank0(self, tensors: List[torch.Tensor]) -> None:
        """Copies rank 0's ``tensors`` to every rank, in coalesced byte chunks."""
        chunk: List[torch.Tensor] = []
        size = 0
        for t in tensors:
            chunk.append(t)
            size += t.numel() * t.element_size()
            if size >= BROADCAST_CHUNK_BYTES:
                self._broadcast_chunk(chunk)
                chunk, size = [], 0
        if chunk:
            self._broadcast_chunk(chunk)

    def _broadcast_chunk(self, tensors: List[torch.Tensor]) -> None:
        # Bytes, so tensors of every dtype (bool included) travel in one call;
        # each starts at a multiple of BROADCAST_ALIGN so it can be viewed back.
        offsets = []
        total = 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // BROADCAST_ALIGN) * BROADCAST_ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        if self._rank == 0:
            for t, offset in zip(tensors, offsets):
                flat[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(
                    t.shape).copy_(t)
        self._group.broadcast(flat, 0)
        if self._rank != 0:
            for t, offset in zip(tensors, offsets):
                t.copy_(flat[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(
                    t.shape))

    # --- training ----------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.admit()
        buffers = [b for _, b in self.module.named_buffers()]
        if self.broadcast_buffers and self._last_forward_synced and buffers:
            try:
                with torch.no_grad():
                    self._broadcast_from_rank0(buffers)
            except Exception as error:
                if not self._survive:
                    raise
                self.reducer.note_failure(error)
        if self.device_ids is not None:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._last_forward_synced = True
            self.reducer.prepare_for_backward(
                list(_find_tensors(output)) if self.find_unused_parameters else [])
        else:
            self._last_forward_synced = False
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards and backwards inside accumulate gradients locally, without communication.

        The first synchronised forward and backward after it reduce the accumulated sum.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduces each bucket with ``hook(state, bucket)`` (torch's signature); call it once.

        ``bucket`` is a ``GradBucket`` (``buffer()``, ``index()``, ``is_last()``,
        ``parameters()``, ``gradients()``); the hook returns a
        ``torch.futures.Future`` of the reduced bucket, a tensor shaped like
        ``bucket.buffer()``, holding the *average* over ranks.
        """
        self.reducer.set_comm_hook(state, hook)

    @property
    def last_comm_wait_seconds(self) -> float:
        """Seconds the last synchronised backward waited, at its end, for its all-reduces."""
        return self.reducer.last_wait_seconds


# --- built-in communication hooks ------------------------------------------------


def allreduce_hook(process_group: Optional[Union[ProcessGroup, dist.ProcessGroup]],
                   bucket: GradBucket) -> torch.futures.Future:
    """Averages ``bucket`` over ``process_group`` (pyddp's or torch's; None: the default
    group, as for DistributedDataParallel), as without a hook."""
    group = resolve(process_group, "allreduce_hook")
    future = group.all_reduce(bucket.buffer(), ReduceOp.AVG, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


def fp16_compress_hook(process_group: Optional[Union[ProcessGroup, dist.ProcessGroup]],
                       bucket: GradBucket) -> torch.futures.Future:
    """Averages ``bucket`` in float16: half the bytes on the wire, float16 precision."""
    return _compressed(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: Optional[Union[ProcessGroup, dist.ProcessGroup]],
                       bucket: GradBucket) -> torch.futures.Future:
    """Averages ``bucket`` in bfloat16: half the bytes on the wire, bfloat16 precision."""
    return _compressed(process_group, bucket, torch.bfloat16)


def _compressed(process_group: Optional[Union[ProcessGroup, dist.ProcessGroup]],
                bucket: GradBucket, dtype: torch.dtype) -> torch.futures.Future:
    group = resolve(process_group, "compress hook")
    buffer = bucket.buffer()
    # pyddp's AVG accumulates half types in float32, so only the inputs and
    # the result are rounded (torch's hooks also round the partial sums).
    compressed = buffer.to(dtype)
    future = group.all_reduce(compressed, ReduceOp.AVG, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


# --- helpers ---------------------------------------------------------------------------


def _describe(t: torch.Tensor) -> str:
    frozen = "" if t.requires_grad or not isinstance(t, nn.Parameter) else ", frozen"
    return f"shape {list(t.shape)}, {str(t.dtype).replace('torch.', '')}{frozen}"


def _all_gather_strings(group: DDPGroup, text: str, device: torch.device) -> List[str]:
    """Every rank's ``text``, in rank order."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = torch.zeros(group.size(), dtype=torch.int64, device=device)
    group.all_gather_single(lengths, torch.tensor([data.numel()], dtype=torch.int64,
                                                  device=device))
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = torch.zeros(group.size() * longest, dtype=torch.uint8, device=device)
    group.all_gather_single(gathered, padded)
    rows = gathered.view(group.size(), longest).cpu()
    return [bytes(rows[r, :int(lengths[r])].tolist()).decode() for r in range(group.size())]


def _find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output (nested lists, tuples, dicts and dataclasses)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _find_tensors(getattr(obj, f.name))


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it moved to ``device``; containers keep their types
    (lists, tuples and namedtuples, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        items = [_to_device(item, device) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_to_device(item, device) for item in obj]
    if isinstance(obj, dict):
        return {key: _to_device(value, device) for key, value in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


__all__ = ["DistributedDataParallel", "allreduce_hook", "bf16_compress_hook",
           "fp16_compress_hook", "GradBucket"]
