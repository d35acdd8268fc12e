"""Which device a job's ranks compute on, and which GPU each rank takes.

The ``--device`` option of ``examples/train.py`` and ``python -m pyddp.bench ddp``
is resolved here (``resolve``), before any rank starts, so that a device that
cannot serve the job is refused with a message that says what to do. A rank
on CUDA takes GPU ``local_rank % device_count`` (``gpu_index``, ``use_gpu``):
one GPU per rank when the host has enough, several ranks per GPU round-robin
otherwise. The benchmark peers of ``python -m pyddp.bench`` place their ranks
the same way.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from .process_group import HAS_CUDA

DEVICE_CHOICES = ("cpu", "cuda", "auto")
"""The values of ``--device``: ``auto`` is ``cuda`` where it can serve the job, else ``cpu``."""

GROUP_BACKEND = {"cpu": "shm", "cuda": "auto"}
"""The pyddp backend of a job's group, by its device: "auto" serves CUDA tensors (over
cuda_ipc or NCCL) and CPU tensors (over shm) alike, so the scalars a job reduces on the
CPU go over the same group as its gradients."""

NCCL_MULTI_RANK_GPU_VERSION = (2, 30)
"""NCCL runs several ranks on one GPU from this version on, with
NCCL_MULTI_RANK_GPU_ENABLE=1 (``use_gpu`` sets it); pyddp's cuda_ipc always does."""


class DeviceUnavailable(RuntimeError):
    """The device asked for cannot serve the job here; the message says what to do instead."""


def cuda_refusal(gpu_visible: bool, pyddp_has_cuda: bool, pyddp_groups: bool,
                 torch_cuda: Optional[str]) -> Optional[str]:
    """Why a job cannot run on CUDA; None if it can.

    ``gpu_visible``: torch.cuda.is_available(); ``pyddp_has_cuda``: whether this
    build of pyddp has its CUDA transports; ``pyddp_groups``: whether the job
    moves CUDA tensors through pyddp's groups (one process alone moves none);
    ``torch_cuda``: torch.version.cuda (None for a CPU build).
    """
    if not gpu_visible:
        if torch_cuda is None:
            why = f"torch {torch.__version__} is a CPU build"
            fix = "install a CUDA build of torch (README.md, Set up) on a machine with a GPU"
        else:
            why = f"torch {torch.__version__} (CUDA {torch_cuda}) sees no GPU"
            fix = "check nvidia-smi and CUDA_VISIBLE_DEVICES"
        return f"--device cuda: {why}; run with --device cpu, or {fix}"
    if pyddp_groups and not pyddp_has_cuda:
        return ("--device cuda: this build of pyddp has no CUDA transports, so its groups "
                "cannot carry CUDA tensors between the ranks; rebuild it against "
                "this CUDA build of torch with nvcc installed (`PYDDP_BUILD_CUDA=1 python "
                "setup.py build_ext --inplace`, docs/building.md), or run with --device cpu")
    return None


def resolve(choice: str, pyddp_groups: bool) -> str:
    """The device type ("cpu" or "cuda") that ``--device choice`` means on this machine for
    a job that does (``pyddp_groups``) or does not move its tensors through pyddp's groups;
    raises DeviceUnavailable for "cuda" where CUDA cannot serve the job."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    if choice == "cpu":
        return "cpu"
    refusal = cuda_refusal(torch.cuda.is_available(), HAS_CUDA, pyddp_groups,
                           torch.version.cuda)
    if refusal is None:
        return "cuda"
    if choice == "auto":
        return "cpu"
    raise DeviceUnavailable(refusal)


def gpu_index(local_rank: int, device_count: int) -> int:
    """The GPU of the rank ``local_rank`` of its host, among the host's ``device_count``."""
    if device_count < 1:
        raise ValueError(f"no GPU to place local rank {local_rank} on (device_count="
                         f"{device_count})")
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    return local_rank % device_count


def shares_gpu(local_world_size: int, device_count: int) -> bool:
    """Whether some GPU of the host runs more than one of its ``local_world_size`` ranks."""
    return local_world_size > device_count


def sharing_note(local_world_size: int, device_count: int) -> Optional[str]:
    """The line a job prints once when its ranks share GPUs; None when each has its own."""
    if not shares_gpu(local_world_size, device_count):
        return None
    return (f"{local_world_size} ranks on {device_count} GPU(s): kernels of processes that "
            "share a GPU run concurrently only under NVIDIA's MPS daemon "
            "(nvidia-cuda-mps-control -d); without it they take turns")


def nccl_refusal(local_world_size: int, device_count: int,
                 nccl_version: Sequence[int]) -> Optional[str]:
    """Why NCCL cannot run ``local_world_size`` ranks on ``device_count`` GPUs; None if it can.

    ``nccl_version``: torch.cuda.nccl.version().
    """
    version = tuple(nccl_version[:2])
    if shares_gpu(local_world_size, device_count) and version < NCCL_MULTI_RANK_GPU_VERSION:
        return (f"{local_world_size} ranks on {device_count} GPU(s) need NCCL >= "
                f"{'.'.join(map(str, NCCL_MULTI_RANK_GPU_VERSION))}, torch has "
                f"{'.'.join(map(str, version))}")
    return None


def use_gpu(local_rank: int, local_world_size: int) -> torch.device:
    """Makes this rank's GPU (``gpu_index``) its current device, and returns it.

    Call it before the rank makes its groups: where ranks share a GPU, it lets
    NCCL (from NCCL_MULTI_RANK_GPU_VERSION on) put them there.
    """
    count = torch.cuda.device_count()
    device = torch.device("cuda", gpu_index(local_rank, count))
    torch.cuda.set_device(device)
    if shares_gpu(local_world_size, count):
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return device
