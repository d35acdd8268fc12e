"""Types of pyddp's C++ core (csrc/bindings.cpp). Use the pyddp package, not this module."""

from typing import Dict, List, Optional, Tuple

import torch
from torch._C._distributed_c10d import Backend, Store, Work

torch_version: str
has_cuda: bool

def nccl_version() -> Tuple[int, int, int]: ...  # CUDA builds only

class RedOp:
    SUM: "RedOp"
    AVG: "RedOp"
    PRODUCT: "RedOp"
    MIN: "RedOp"
    MAX: "RedOp"

class Algo:
    AUTO: "Algo"
    RING: "Algo"
    DIRECT: "Algo"
    TWO_SHOT: "Algo"

class RingOptions:
    slot_bytes: int
    num_slots: int
    direct_max_bytes: int
    two_shot_max_bytes: int
    algo: Algo
    timeout_ms: int
    def __init__(self, other: Optional["RingOptions"] = ...) -> None: ...
    def validate(self) -> None: ...

def settings() -> Dict[str, str]: ...

class Engine(Backend):
    @property
    def device(self) -> torch.device: ...
    @property
    def transport(self) -> str: ...
    def all_reduce(self, tensor: torch.Tensor, op: RedOp, async_op: bool) -> Work: ...
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          async_op: bool) -> Work: ...
    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor,
                   async_op: bool) -> Work: ...
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work: ...
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op: RedOp,
                              async_op: bool) -> Work: ...
    def barrier(self, async_op: bool) -> Work: ...
    def reduce(self, tensor: torch.Tensor, op: RedOp, dst: int, async_op: bool) -> Work: ...
    def gather(self, gather_list: List[torch.Tensor], tensor: torch.Tensor, dst: int,
               async_op: bool) -> Work: ...
    def scatter(self, tensor: torch.Tensor, scatter_list: List[torch.Tensor], src: int,
                async_op: bool) -> Work: ...
    def shutdown(self) -> None: ...

class RingEngine(Engine):
    @property
    def options(self) -> RingOptions: ...

class NcclEngine(Engine):  # CUDA builds only
    @property
    def timeout_ms(self) -> int: ...

def backend_names() -> List[str]: ...
def device_types_of(backend: str) -> List[str]: ...
def make_engine(store: Store, rank: int, size: int, options: RingOptions,
                device: torch.device, backend: str) -> Tuple[Engine, List[str]]: ...
