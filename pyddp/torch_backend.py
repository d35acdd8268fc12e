"""pyddp as torch.distributed's ``"pyddp"`` backend: its registration and the creator torch
calls for each of its groups.

``import pyddp`` registers it, for CPU and CUDA tensors. torch then calls
``_create_torch_backend`` once for each group of ``init_process_group("pyddp")`` and its
``new_group`` calls, and registers the one ``c10d::Backend`` it returns for every device type
that the group maps to "pyddp" (a torch ProcessGroup holds one backend of c10d's custom type).
That backend (``_C.TorchBackend``, csrc/backend/torch_backend.h) holds the group's engines, as
pyddp's own ProcessGroup does: the CPU engine, made with the group, and a CUDA engine, made at
the group's first call on CUDA tensors; each call goes to the engine of its tensors' device.
"""

from __future__ import annotations

import logging
from typing import List

import torch
import torch.distributed as dist

from . import _C
from .process_group import _milliseconds

logger = logging.getLogger("pyddp")

TORCH_BACKEND_NAME = "pyddp"


def _create_torch_backend(options: "dist.distributed_c10d._DistributedBackendOptions",
                          pg_options: object) -> _C.TorchBackend:
    """The creator torch.distributed calls for ``init_process_group("pyddp")`` and its
    ``new_group`` calls (torch's extended creator API).

    torch hands over its own (prefixed) store, the group's rank, size and timeout, and the
    global ranks of a subgroup; the other settings come from the PYDDP_* variables, as for
    pyddp's own groups.
    """
    store, rank, world_size = options.store, options.group_rank, options.group_size
    timeout = options.timeout
    members = list(options.global_ranks_in_group)
    if members:
        # A subgroup. torch names it by a count alone and calls no creator on
        # its non-members, so its members agree on who they are (a member
        # that asked for other members fails, naming every request it saw),
        # and the member list is part of the store prefix: groups of other
        # members made under the same name never meet.
        world = dist.get_world_size()
        _C.agree_on_group(dist.PrefixStore("agree", store), dist.get_rank(), members,
                          f"ranks {members} of a world of {world}",
                          "torch.distributed.new_group", timeout)
        store = dist.PrefixStore("members=" + ",".join(map(str, members)), store)
    opts = _C.GroupOptions()
    opts.timeout_ms = _milliseconds(timeout)
    opts.validate()
    backend = _C.make_torch_backend(store, rank, world_size, opts, "auto")
    logger.info("rank %d/%d: torch.distributed backend %r: slot_bytes=%d, num_slots=%d, "
                "direct_max_bytes=%d, algo=%s", rank, world_size, TORCH_BACKEND_NAME,
                opts.slot_bytes, opts.num_slots, opts.direct_max_bytes, opts.algo)
    return backend


def _log_engine(rank: int, world_size: int, device: torch.device, transport: str,
                refusals: List[str], layout: str) -> None:
    """Logs an engine that a group of the backend made: its CPU engine with the group, its
    CUDA engine at the group's first call on CUDA tensors (csrc/bindings.cpp calls it)."""
    who = f"rank {rank}/{world_size}: torch.distributed backend {TORCH_BACKEND_NAME!r}"
    for why in refusals:
        logger.info("%s: %s tensors: passed over %s", who, device, why)
    logger.info("%s: %s tensors over %s%s", who, device, transport,
                f" ({layout})" if layout else "")


def register_torch_backend() -> None:
    """Registers ``"pyddp"`` with ``torch.distributed`` (for CPU and CUDA tensors).

    Afterwards ``torch.distributed.init_process_group("pyddp")``, or a
    per-device string such as ``"cpu:pyddp,cuda:nccl"``, routes torch's
    collectives, ``all_gather_object`` and friends, and torch's own
    ``DistributedDataParallel`` through pyddp. Idempotent.
    """
    if TORCH_BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(TORCH_BACKEND_NAME, _create_torch_backend, extended_api=True,
                                  devices=["cpu", "cuda"])
