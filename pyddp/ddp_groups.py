"""The group pyddp's DistributedDataParallel averages over: pyddp's own, or torch.distributed's.

DDP, its reducer and its built-in hooks need five things of a group: ``rank()``,
``size()``, ``broadcast(tensor, src)``, ``all_gather_single(output, input)`` and
``all_reduce(tensor, op, async_op)`` returning a Work with ``wait()`` and
``get_future()``. pyddp's ``ProcessGroup`` has them. ``TorchGroup`` gives them
to a ``torch.distributed`` ProcessGroup (``torch.distributed.group.WORLD``, a
``new_group``) through torch's collectives, so that pyddp's DDP runs on
whichever backend serves the group: pyddp's engine for ``"pyddp"``, gloo, NCCL.
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
import torch.distributed as dist

from .process_group import ProcessGroup, ReduceOp, Work, get_default_group, is_initialized

AVG_BACKENDS = ("pyddp", "nccl")
"""torch backends whose all_reduce takes ReduceOp.AVG; on the others (gloo) TorchGroup
averages as SUM followed by a division, which is what pyddp's AVG computes."""


class TorchGroup:
    """A torch.distributed ProcessGroup with the calls pyddp's DDP makes; ranks are the group's."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._rank = group.rank()
        self._size = group.size()
        self._takes_avg: Dict[str, bool] = {}

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, group=self.group, group_src=src)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_gather_into_tensor(output, input, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, async_op: bool = False
                   ) -> Optional[Union[Work, "_Averaged"]]:
        if op == ReduceOp.AVG and not self._backend_takes_avg(tensor.device):
            work = _Averaged(dist.all_reduce(tensor, ReduceOp.SUM, group=self.group,
                                             async_op=True), tensor, self._size)
            if async_op:
                return work
            work.wait()
            return None
        work = dist.all_reduce(tensor, op, group=self.group, async_op=async_op)
        return Work(work) if async_op else None

    def _backend_takes_avg(self, device: torch.device) -> bool:
        if device.type not in self._takes_avg:
            # Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch's wrapper stands in
            # front of the backend and answers with the backend's name.
            name = self.group._get_backend(device).name()
            self._takes_avg[device.type] = name in AVG_BACKENDS
        return self._takes_avg[device.type]


class _Averaged:
    """A SUM all-reduce's Work whose result is divided by the group's size once it is done."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor, size: int) -> None:
        def divide(done: torch.futures.Future) -> list:
            done.wait()  # a failed all-reduce fails this future too
            return [tensor.div_(size)]

        self._future = work.get_future().then(divide)

    def wait(self) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


DDPGroup = Union[ProcessGroup, TorchGroup]


def resolve(process_group: Optional[Union[ProcessGroup, dist.ProcessGroup]], caller: str
            ) -> DDPGroup:
    """The group to average over: ``process_group`` (pyddp's or torch's) or, when None,
    pyddp's default group, else torch.distributed's (a script that only called
    ``torch.distributed.init_process_group`` needs no second initialisation).

    Every rank gets the same answer for the same arguments, so a refusal is raised on every
    rank alike, before any collective.
    """
    if process_group is None:
        if is_initialized():
            return get_default_group()
        if dist.is_initialized():
            return TorchGroup(dist.group.WORLD)
        raise RuntimeError(f"pyddp: {caller}: no process group: call pyddp.init_process_group() "
                           "or torch.distributed.init_process_group() first, or pass "
                           "process_group")
    if isinstance(process_group, ProcessGroup):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        return TorchGroup(process_group)
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"pyddp: {caller}: this rank is not a member of the torch.distributed "
                         "group passed as process_group")
    raise TypeError(f"pyddp: {caller}: process_group must be a pyddp.ProcessGroup or a "
                    f"torch.distributed ProcessGroup, got {type(process_group).__name__}")
