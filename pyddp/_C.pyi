"""Types of pyddp's C++ core (csrc/bindings.cpp). Use the pyddp package, not this module."""

from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

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
    BAND: "RedOp"
    BOR: "RedOp"
    BXOR: "RedOp"

class Algo:
    AUTO: "Algo"
    RING: "Algo"
    DIRECT: "Algo"
    TWO_SHOT: "Algo"

class SlotStores:
    AUTO: "SlotStores"
    CACHED: "SlotStores"
    STREAMING: "SlotStores"

class CmaReads:
    AUTO: "CmaReads"
    ALWAYS: "CmaReads"
    NEVER: "CmaReads"

class GroupOptions:
    slot_bytes: int
    num_slots: int
    direct_max_bytes: int
    two_shot_max_bytes: int
    algo: Algo
    timeout_ms: int
    p2p_buffer_bytes: int
    slot_stores: SlotStores
    cma: CmaReads
    cma_min_bytes: int
    def __init__(self, other: Optional["GroupOptions"] = ...) -> None: ...
    def validate(self) -> None: ...

def settings() -> Dict[str, str]: ...
def empty_registered(size: List[int], dtype: torch.dtype) -> torch.Tensor: ...
def is_registered(tensor: torch.Tensor) -> bool: ...

class Engine(Backend):
    """Every entry point takes async_op and an optional per-call timeout (the group's if None).

    With async_op it returns the Work at once; otherwise it returns None once the call is done.
    """
    @property
    def device(self) -> torch.device: ...
    @property
    def transport(self) -> str: ...
    def all_reduce(self, tensor: torch.Tensor, op: RedOp, async_op: bool,
                   timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool,
                          timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, async_op: bool,
                   timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool,
                  timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op: RedOp,
                              async_op: bool,
                              timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def barrier(self, async_op: bool, timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def monitored_barrier(self, timeout: Optional[timedelta], wait_all_ranks: bool) -> None: ...
    def reduce(self, tensor: torch.Tensor, op: RedOp, dst: int, async_op: bool,
               timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def gather(self, gather_list: List[torch.Tensor], tensor: torch.Tensor, dst: int,
               async_op: bool, timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def scatter(self, tensor: torch.Tensor, scatter_list: List[torch.Tensor], src: int,
                async_op: bool, timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: List[int], input_split_sizes: List[int],
                          async_op: bool, timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_to_all(self, output_tensor_list: List[torch.Tensor],
                   input_tensor_list: List[torch.Tensor], async_op: bool,
                   timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_reduce_coalesced(self, tensors: List[torch.Tensor], op: RedOp, async_op: bool,
                             timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_gather_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                             async_op: bool,
                             timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def all_gather_coalesced_lists(self, output_lists: List[List[torch.Tensor]],
                                   inputs: List[torch.Tensor], async_op: bool,
                                   timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def reduce_scatter_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                 op: RedOp, async_op: bool,
                                 timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool,
             timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def recv(self, tensor: torch.Tensor, src: int, tag: int, async_op: bool,
             timeout: Optional[timedelta] = ...) -> Optional[Work]: ...
    def direct_entries(self, ops: List[Tuple[object, RedOp]],
                       general: Dict[str, Callable[..., object]]
                       ) -> Dict[str, Callable[..., object]]:
        """Synchronous entries for this engine's tensors with ProcessGroup's signatures, op
        one of the objects ``ops`` pairs with a RedOp: all_reduce, all_gather_single,
        reduce_scatter_single, broadcast, barrier. Each runs a synchronous call on arguments
        it takes and returns None; it passes any other call on, as given, to ``general``'s
        callable of its name."""
    def shutdown(self) -> None: ...
    def abort(self) -> None:
        """Fails every pending and later call on this engine, and peers waiting on this
        rank at once, saying the group was aborted."""
    @property
    def aborted(self) -> bool: ...

class TransportEngine(Engine):
    @property
    def options(self) -> GroupOptions: ...
    @property
    def registered_refusal(self) -> str:
        """Why registered tensors are never read in place; "" if they are."""
    @property
    def process_refusal(self) -> str:
        """Why peers' plain tensors are never read through the kernel; "" if they are."""

class FusedEngine(Engine):
    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Registers tensor with every rank (a collective); ProcessGroup.register_buffer."""
    def deregister_buffer(self, tensor: torch.Tensor) -> None:
        """Ends tensor's registration on every rank (a collective with a barrier)."""
    @property
    def registers_buffers(self) -> bool:
        """Whether register_buffer serves this engine (not cuda_host)."""
    @property
    def registered_launches(self) -> int:
        """Collectives that read registered buffers in place so far."""

class NcclEngine(Engine):  # CUDA builds only
    @property
    def timeout_ms(self) -> int: ...

class TorchBackend(Backend):
    """What torch.distributed's "pyddp" backend gives torch for a group: an engine per device
    type, the CUDA one made at the group's first call on CUDA tensors."""
    @property
    def engines(self) -> List[Engine]:
        """The engines made so far, the CPU's first."""

def wait(work: Work, timeout: timedelta) -> bool: ...  # timedelta(0): no limit; Ctrl-C ends it
def begin_exit() -> None: ...
def shut_down_live_engines() -> None: ...
def join_stopped_workers() -> None: ...
def host_id() -> str: ...
def pid_namespace() -> str: ...
def process_alive(pid: int) -> bool: ...
def backend_names() -> List[str]: ...
def device_types_of(backend: str) -> List[str]: ...
def make_engine(store: Store, rank: int, size: int, options: GroupOptions,
                device: torch.device, backend: str) -> Tuple[Engine, List[str], str]: ...
def make_torch_backend(store: Store, rank: int, size: int, options: GroupOptions,
                       backend: str) -> TorchBackend: ...
def agree_on_group(store: Store, rank: int, ranks: List[int], request: str, call: str,
                   timeout: timedelta) -> None: ...
