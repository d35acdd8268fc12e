"""The reducer: gradients ready -> bucket all-reduces in order -> averaged gradients.

``DistributedDataParallel`` owns one Reducer. Each parameter that takes part
gets a post-accumulate-grad hook; the reducer's life in one synchronised
backward is:

1. ``prepare_for_backward`` (at the end of a forward that will be
   synchronised) arms the hooks and, with ``find_unused_parameters``, records
   which parameters the forward's autograd graph cannot reach.
2. The first hook of the backward queues ``_finalize`` to run when autograd
   finishes, and marks the unreachable parameters ready.
3. Each hook puts its gradient in the bucket (a sparse gradient, which has a
   bucket of its own, is divided by the world size and all-reduced with SUM,
   as torch's DDP does, and becomes the parameter's gradient): a copy into
   the bucket's flat buffer (or nothing, with ``gradient_as_bucket_view``,
   where the gradient already is a view into it), or, for a large gradient
   without a comm hook, the gradient itself, all-reduced in place. When a bucket's last parameter
   is ready, every ready bucket from ``_next_bucket`` on is launched, so every
   rank issues the same all-reduces in the same order, whatever order its
   gradients arrive in.
4. ``_finalize`` marks the parameters still missing ready (zeros or their
   accumulated gradient) or raises, waits for every bucket (timing the wait),
   and writes the averaged gradients back.

With a group whose collectives read registered buffers where they lie (pyddp's
fused collectives: ``ProcessGroup.can_register``), every bucket's flat buffer
is registered with the group at the first synchronised backward after the
buckets or the group change (the same point on every rank), so a bucket's
all-reduce reads the peers' buffers instead of staging them.

Large gradients are reduced in place because copying them into the bucket and
back costs as much as the all-reduces themselves when ranks share a CPU's
memory bandwidth (a 25M-parameter MLP, 2 ranks on a 2-core machine: 45 to 65 ms
per 100 MB copy, against 40 to 100 ms of waiting for the all-reduces).

The hooks and ``_finalize`` run on the thread that runs autograd for the
module's device, one at a time, so the state below needs no lock. Collectives
run on the process group's worker; their tensors are touched here only after
``wait``.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Set, Union

import torch
import torch.distributed as dist

from . import registered
from .ddp_groups import DDPGroup
from .process_group import ProcessGroup, ReduceOp, Work

logger = logging.getLogger("pyddp")

IN_PLACE_MIN_BYTES = 128 * 1024
"""Gradients of at least this many bytes are all-reduced in place, unless a comm hook or
gradient_as_bucket_view needs them in the bucket's flat buffer; smaller ones are packed.

On the 2-core development machine, 2 ranks: one more all-reduce costs 50 to 70 us
(4 KiB to 256 KiB messages); copying 128 KiB into the bucket and back costs about as
much when the ranks compete for memory bandwidth.
"""

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]
"""``hook(state, bucket) -> Future``: torch DDP's communication hook signature.

The future's value is the reduced bucket: a tensor shaped like
``bucket.buffer()`` (or a list whose first element is one).
"""


def error_message(rank: int, message: str) -> str:
    """A DDP error message, naming the rank (shared by the DDP and its reducer)."""
    return f"pyddp DistributedDataParallel: rank {rank}: {message}"


class GradBucket:
    """A bucket as a communication hook sees it (the API of ``torch.distributed.GradBucket``)."""

    def __init__(self, index: int, buffer: torch.Tensor, parameters: List[torch.Tensor],
                 gradients: List[torch.Tensor], is_last: bool) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._gradients = gradients
        self._is_last = is_last

    def index(self) -> int:
        """Position of the bucket in reduction order (0 is reduced first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat tensor holding every gradient of the bucket."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replaces the bucket's contents with ``buffer`` (same number of elements), as
        torch's hooks (PowerSGD, say) do; ``gradients()`` see the new values."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(f"pyddp: GradBucket.set_buffer: bucket {self._index} holds "
                             f"{self._buffer.numel()} elements, got {buffer.numel()}")
        self._buffer.copy_(buffer.reshape(self._buffer.shape))

    def gradients(self) -> List[torch.Tensor]:
        """Per-parameter views into ``buffer()``, shaped like the parameters."""
        return self._gradients

    def parameters(self) -> List[torch.Tensor]:
        """The bucket's parameters, in the order of their slots in ``buffer()``."""
        return self._parameters

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in the backward."""
        return self._is_last


def _zeros(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A bucket's flat buffer: on the CPU in registered memory, which pyddp's collectives
    read in place on the other ranks of this host (pyddp.registered)."""
    if device.type == "cpu":
        return registered.empty(count, dtype=dtype)
    return torch.zeros(count, dtype=dtype, device=device)


class _Bucket:
    """A bucket's flat buffer, per-slot views and the state of the current backward.

    Slot ``s`` holds parameter ``indices[s]``. A packed slot has a view into
    ``buffer``; an in-place slot (``views[s] is None``) is reduced on its own
    tensor, recorded in ``reduced[s]`` when the parameter is marked ready.
    """

    def __init__(self, indices: Sequence[int], params: Sequence[torch.nn.Parameter],
                 pack_all: bool, sparse: Sequence[bool]) -> None:
        self.indices = tuple(indices)
        members = [params[i] for i in self.indices]
        # A sparse gradient is alone in its bucket (bucketing.assign_buckets).
        self.sparse = sparse[self.indices[0]]
        packed = [not self.sparse and (pack_all or p.numel() * p.element_size() <
                                       IN_PLACE_MIN_BYTES)
                  for p in members]
        self.buffer = _zeros(sum(p.numel() for p, pack in zip(members, packed) if pack),
                             members[0].dtype, members[0].device)
        self.views: List[Optional[torch.Tensor]] = []
        offset = 0
        for p, pack in zip(members, packed):
            self.views.append(_slot_view(self.buffer[offset:offset + p.numel()], p) if pack
                              else None)
            offset += p.numel() if pack else 0
        self.reduced: List[Optional[torch.Tensor]] = [None] * len(self.indices)
        self.pending = len(self.indices)
        self.results: List[Union[Work, torch.futures.Future]] = []


class Reducer:
    """Averages the gradients of ``params`` over ``group`` during each synchronised backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 buckets: Sequence[Sequence[int]], group: DDPGroup,
                 find_unused_parameters: bool, gradient_as_bucket_view: bool,
                 sparse: Sequence[bool] = ()) -> None:
        self._params = list(params)
        self._sparse = list(sparse) or [False] * len(self._params)
        self._names = list(names)
        self._group = group
        self._rank = group.rank()
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        self._bucket_indices = [tuple(indices) for indices in buckets]
        self._build_buckets(pack_all=gradient_as_bucket_view)
        # The bucket buffers registered with the group (register_buffer), and
        # whether the current buckets and group still wait for it: done at the
        # next synchronised backward's prepare_for_backward, the same point on
        # every rank (a joiner's too, whose buckets are made as the others').
        self._registered: List[torch.Tensor] = []
        self._register_pending = True
        self._hook: Optional[CommHook] = None
        self._hook_state: Any = None
        # Parameters whose gradient was defined in a hook since the last
        # synchronised backward, no_sync iterations included (torch's
        # local_used_map); only kept with find_unused_parameters.
        self._locally_used = [0] * len(self._params)
        self._expect_hooks = False
        self._unreachable: List[int] = []
        # DistributedDataParallel(on_rank_failure="shrink"): a failed collective is kept
        # here (the first one of the backward) instead of raised out of backward(); the
        # backward's remaining buckets are not launched, and take_failure() hands it over.
        # Any other error is raised as without it.
        self.tolerate_failures = False
        self._failure: Optional[BaseException] = None
        self._reset_backward()
        self.last_wait_seconds = 0.0
        # The hooks hold the reducer weakly: dropping the DDP wrapper drops
        # the reducer, whose __del__ removes them from the still-living module.
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(_make_hook(ref, i))
                         for i, p in enumerate(self._params)]

    def __del__(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()

    def _build_buckets(self, pack_all: bool) -> None:
        self._buckets = [_Bucket(indices, self._params, pack_all, self._sparse)
                         for indices in self._bucket_indices]
        # _where[i] = (bucket, slot) of parameter i.
        self._where = [(0, 0)] * len(self._params)
        for b, bucket in enumerate(self._buckets):
            for slot, index in enumerate(bucket.indices):
                self._where[index] = (b, slot)

    def _register_buckets(self) -> None:
        """Registers every bucket's flat buffer with the group where it reads registered
        buffers in place (ProcessGroup.can_register: pyddp's fused collectives), so that the
        buckets' all-reduces read the peers' buffers where they lie. Every rank has the same
        buckets, so the registrations pair up. A registration the group refuses (memory
        without IPC handles, say) fails on every rank alike: the buckets from there on stage,
        as they would without it."""
        self._register_pending = False
        group = self._group
        if not isinstance(group, ProcessGroup) or not group.can_register(
                self._params[0].device):
            return
        for bucket in self._buckets:
            if not bucket.buffer.numel():
                continue
            try:
                group.register_buffer(bucket.buffer)
            except dist.DistBackendError as error:
                logger.warning("%s", self._error(f"gradient buckets stay unregistered, and their "
                                                 f"all-reduces stage: {error}"))
                return
            self._registered.append(bucket.buffer)

    def _deregister_buckets(self) -> None:
        for buffer in self._registered:
            self._group.deregister_buffer(buffer)
        self._registered = []

    def _reset_backward(self) -> None:
        self._backward_started = False
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        self._used_work: Optional[Work] = None
        self._used_counts: Optional[torch.Tensor] = None
        for bucket in self._buckets:
            bucket.pending = len(bucket.indices)
            bucket.reduced = [None] * len(bucket.indices)
            bucket.results = []

    def _error(self, message: str) -> str:
        return error_message(self._rank, message)

    # --- set-up ---------------------------------------------------------------

    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduces each bucket with ``hook(state, bucket)`` instead of an AVG all-reduce."""
        if self._hook is not None:
            raise RuntimeError(self._error("register_comm_hook can only be called once"))
        if not callable(hook):
            raise TypeError(self._error(f"register_comm_hook: hook must be callable, "
                                        f"got {type(hook).__name__}"))
        if self._backward_started:
            raise RuntimeError(self._error("register_comm_hook cannot be called during backward"))
        self._hook, self._hook_state = hook, state
        # A hook sees every gradient of its bucket in bucket.buffer(). Buckets
        # registered already (a hook set once training ran) are let go first:
        # every rank sets its hook at the same point.
        self._deregister_buckets()
        self._build_buckets(pack_all=True)
        self._register_pending = True
        self._reset_backward()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Arms the hooks for the next backward, which will be synchronised.

        ``outputs`` are the forward's output tensors; with
        find_unused_parameters the parameters their graph does not reach are
        marked ready as soon as the backward starts, as in torch.
        """
        if self._backward_started:
            # The last synchronised backward started and never reached its
            # end (it raised): its collectives are incomplete, this rank is
            # out of step with its peers.
            self._reset_backward()
            raise RuntimeError(self._error(
                "the previous synchronised backward did not finish (it raised part-way), so "
                "its gradient all-reduces are incomplete and this rank is out of step with "
                "the others; recreate the process group and the model wrapper"))
        if self._register_pending:
            self._register_buckets()
        self._expect_hooks = True
        if self._find_unused:
            reached = _reachable_parameters(outputs)
            self._unreachable = [i for i, p in enumerate(self._params) if id(p) not in reached]

    # --- during backward --------------------------------------------------------

    def set_group(self, group: DDPGroup) -> None:
        """Reduces over ``group`` from the next backward on (a group shrunk or grown)."""
        self._group = group
        self._rank = group.rank()
        # the registrations went with the old group
        self._registered = []
        self._register_pending = True
        self._failure = None
        self._expect_hooks = False
        self._reset_backward()

    def note_failure(self, error: BaseException) -> None:
        """Keeps ``error`` (the first of a step) for take_failure() when a collective
        failed; raises it when it is a mistake of the program."""
        if not communication_failed(error):
            raise error
        if self._failure is None:
            self._failure = error

    def take_failure(self) -> Optional[BaseException]:
        """The failure kept since the last call, if any; clears it."""
        failure, self._failure = self._failure, None
        return failure

    def _on_grad_ready(self, index: int) -> None:
        if not self.tolerate_failures:
            self._grad_ready(index)
            return
        try:
            self._grad_ready(index)
        except Exception as error:
            self.note_failure(error)

    def _grad_ready(self, index: int) -> None:
        if self._find_unused and self._params[index].grad is not None:
            self._locally_used[index] = 1
        if not self._expect_hooks:
            return  # no_sync, or a backward not preceded by a synchronised forward
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            for unreachable in self._unreachable:
                self._mark_ready(unreachable, produced=False)
        self._mark_ready(index, produced=True)

    def _mark_ready(self, index: int, produced: bool) -> None:
        """Puts parameter ``index``'s gradient in its bucket; ``produced``: by this backward."""
        if self._ready[index]:
            raise RuntimeError(self._error(
                f"parameter {self._names[index]!r} received its gradient twice in one "
                "backward; DDP reduces one gradient per parameter per backward"))
        self._ready[index] = True
        b, slot = self._where[index]
        bucket = self._buckets[b]
        param = self._params[index]
        view = bucket.views[slot]
        grad = param.grad
        if bucket.sparse:
            bucket.reduced[slot] = self._sparse_gradient(index, grad)
        elif grad is not None and grad.is_sparse:
            raise RuntimeError(self._error(
                f"parameter {self._names[index]!r} has a sparse gradient; pyddp DDP expects "
                "sparse gradients only for the weights of nn.Embedding and nn.EmbeddingBag "
                "modules made with sparse=True"))
        elif view is None:
            # In place on the gradient if this backward produced it; a
            # gradient from earlier (no_sync, or the user's) must stay as it
            # was if no rank used the parameter, so it is reduced in a copy.
            if grad is None:
                bucket.reduced[slot] = torch.zeros_like(param)
            elif produced and grad.is_contiguous():
                bucket.reduced[slot] = grad
            else:
                bucket.reduced[slot] = grad.clone()
        elif grad is None:
            view.zero_()
        elif not (self._as_view and grad.data_ptr() == view.data_ptr()):
            view.copy_(grad)
            if self._as_view:
                param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _sparse_gradient(self, index: int, grad: Optional[torch.Tensor]) -> torch.Tensor:
        """What the all-reduce of a sparse parameter's gradient sums: a new tensor (a
        gradient from earlier must stay as it was if no rank used the parameter), divided by
        the world size unless a comm hook reduces it, as in torch's DDP."""
        param = self._params[index]
        if grad is None:
            # No rank's rows: the layout of an embedding's gradient (one sparse dimension).
            return torch.sparse_coo_tensor(
                torch.empty((1, 0), dtype=torch.long, device=param.device),
                torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
                param.shape)
        if not grad.is_sparse:
            raise RuntimeError(self._error(
                f"parameter {self._names[index]!r} of a sparse embedding has a dense "
                "gradient; DDP expects a sparse one (sparse=True)"))
        return grad.clone() if self._hook is not None else grad / self._group.size()

    def _launch_ready_buckets(self) -> None:
        if self._failure is not None:
            return
        last = len(self._buckets) - 1
        while self._next_bucket <= last and self._buckets[self._next_bucket].pending == 0:
            b = self._next_bucket
            bucket = self._buckets[b]
            if self._hook is not None:
                params = [self._params[i] for i in bucket.indices]
                if bucket.sparse:
                    grad_bucket = GradBucket(b, bucket.reduced[0], params, bucket.reduced,
                                             b == last)
                else:
                    grad_bucket = GradBucket(b, bucket.buffer, params, bucket.views, b == last)
                bucket.results = [self._hook(self._hook_state, grad_bucket)]
            else:
                # The same calls in the same order on every rank: which slots
                # are packed depends only on the parameters' sizes.
                tensors = [bucket.buffer] if bucket.buffer.numel() else []
                tensors += [t for t in bucket.reduced if t is not None]
                bucket.results = [self._group.all_reduce(
                    t, ReduceOp.SUM if t.is_sparse else ReduceOp.AVG, async_op=True)
                    for t in tensors]
            self._next_bucket += 1
        if self._next_bucket > last and self._find_unused and self._used_work is None:
            # Which parameters some rank used: issued right after the last
            # bucket, so it has the same place in every rank's sequence.
            self._used_counts = torch.tensor(self._locally_used, dtype=torch.int32,
                                             device=self._params[0].device)
            self._used_work = self._group.all_reduce(self._used_counts, ReduceOp.SUM,
                                                     async_op=True)

    # --- end of backward ------------------------------------------------------------

    def _finalize(self) -> None:
        """Runs when autograd finishes the synchronised backward."""
        if not self.tolerate_failures:
            self._finalize_backward()
            return
        try:
            if self._failure is not None:
                self._drain_launched()
            else:
                self._finalize_backward()
        except Exception as error:
            self.note_failure(error)
        finally:
            self._expect_hooks = False
            self._reset_backward()

    def _finalize_backward(self) -> None:
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not self._find_unused:
                self._drain_launched()
                names = ", ".join(self._names[i] for i in missing)
                raise RuntimeError(self._error(
                    f"these parameters received no gradient in this backward: {names}. "
                    "Pass find_unused_parameters=True to DistributedDataParallel if the "
                    "forward does not use every parameter, or make every output of the "
                    "forward take part in the loss."))
            for index in missing:
                self._mark_ready(index, produced=False)
            start = time.perf_counter()
            hook_results = [self._wait(b) for b in range(len(self._buckets))]
            used = self._wait_used()
            self.last_wait_seconds = time.perf_counter() - start
            for bucket, result in zip(self._buckets, hook_results):
                self._write_back(bucket, result, used)
            if self._find_unused:
                self._locally_used = [0] * len(self._params)
        finally:
            self._expect_hooks = False
            self._reset_backward()

    def _describe(self, b: int) -> str:
        """Bucket ``b`` in error messages, with its first parameters' names."""
        indices = self._buckets[b].indices
        return (f"bucket {b} (0-based, of {len(self._buckets)}) "
                f"({', '.join(self._names[i] for i in indices[:3])}"
                f"{', ...' if len(indices) > 3 else ''})")

    def _wait(self, b: int) -> Optional[torch.Tensor]:
        """Waits for bucket ``b``'s collectives; returns the comm hook's result, if any."""
        bucket = self._buckets[b]
        try:
            values = [result.wait() for result in bucket.results]
        except Exception as error:
            raise RuntimeError(self._error(
                f"the gradient all-reduce of {self._describe(b)} failed: {error}. Every rank "
                "must run the same synchronised backward; a rank that raised or died part-way "
                "through its backward never starts its remaining all-reduces")) from error
        if self._hook is None:
            return None
        value = values[0]
        tensor = value[0] if isinstance(value, (list, tuple)) and value else value
        if bucket.sparse:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
                raise RuntimeError(self._error(
                    f"the communication hook's future for {self._describe(b)} holds "
                    f"{type(value).__name__}; expected the sparse gradient, reduced"))
            return tensor
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != bucket.buffer.numel():
            raise RuntimeError(self._error(
                f"the communication hook's future for {self._describe(b)} holds "
                f"{type(value).__name__}; expected a tensor of {bucket.buffer.numel()} "
                "elements like bucket.buffer()"))
        return tensor

    def _wait_used(self) -> Optional[List[int]]:
        if self._used_work is None:
            return None
        try:
            self._used_work.wait()
        except Exception as error:
            raise RuntimeError(self._error(f"the all-reduce of which parameters were used "
                                           f"failed: {error}")) from error
        return self._used_counts.tolist()

    def _drain_launched(self) -> None:
        """Waits for the buckets already launched, so their buffers are no longer in use."""
        for bucket in self._buckets[:self._next_bucket]:
            for result in bucket.results:
                try:
                    result.wait()
                except Exception as error:  # the caller raises the error that matters more
                    logger.warning("%s", self._error(f"a gradient all-reduce failed too: {error}"))

    def _write_back(self, bucket: _Bucket, hook_result: Optional[torch.Tensor],
                    used: Optional[List[int]]) -> None:
        if bucket.sparse:
            index = bucket.indices[0]
            if used is None or used[index] != 0:
                self._params[index].grad = (hook_result if hook_result is not None
                                            else bucket.reduced[0])
            return
        if hook_result is not None and hook_result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(hook_result.view(bucket.buffer.shape))
        for slot, index in enumerate(bucket.indices):
            if used is not None and used[index] == 0:
                continue  # unused on every rank: its gradient stays as it was (None stays None)
            param = self._params[index]
            view = bucket.views[slot]
            if view is None:
                reduced = bucket.reduced[slot]
                if param.grad is None:
                    param.grad = reduced
                elif reduced is not param.grad:
                    param.grad.copy_(reduced)
            elif self._as_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)


def communication_failed(error: Optional[BaseException]) -> bool:
    """Whether ``error`` is, or was raised from, a failed collective (torch's DistError: a
    peer lost, a group aborted, the store gone), rather than a mistake of the program."""
    while error is not None:
        if isinstance(error, dist.DistError):
            return True
        error = error.__cause__
    return False


def _is_dense(t: torch.Tensor) -> bool:
    """Whether some order of ``t``'s dimensions makes it contiguous (channels_last, say)."""
    expected = 1
    for dim in sorted(range(t.dim()), key=t.stride):
        if t.size(dim) != 1 and t.stride(dim) != expected:
            return False
        expected *= t.size(dim)
    return True


def _slot_view(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``param``'s slot of a bucket buffer, laid out with ``param``'s strides when they are
    dense, as torch gives gradients (a channels_last weight gets a channels_last gradient)."""
    if _is_dense(param):
        return flat.as_strided(param.shape, param.stride())
    return flat.view(param.shape)


def _make_hook(reducer: "weakref.ref[Reducer]", index: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        live = reducer()
        if live is not None:
            live._on_grad_ready(index)
    return hook


def _reachable_parameters(outputs: Sequence[torch.Tensor]) -> Set[int]:
    """ids of the leaf tensors whose gradient accumulators the outputs' autograd graph reaches."""
    seen: Set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    reached: Set[int] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return reached
