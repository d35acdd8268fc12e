"""Models, data and the single-process reference for the DDP tests.

A ``Case`` says what to train (model options, optimizer, steps, gradient
accumulation, which ranks use the optional layer) and how to wrap it. Every
rank can rebuild every rank's batch, so the test process computes the
reference itself: one process, no communication, summing each rank's
``loss / world_size`` gradients, which is what data parallelism promises.
Tensors cross the pipe from the ranks as ``torch.save`` bytes.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

IN, HIDDEN, OUT = 12, 20, 5
BATCH = 6  # per rank
INIT_SEED = 100  # rank r builds its model with INIT_SEED + r; DDP must copy rank 0's


class Net(nn.Module):
    """A small MLP with parameters of assorted sizes and optional extras.

    batchnorm: a BatchNorm1d (running-stat buffers); mixed: the head in float64;
    extra: ``unused`` (never called) and ``sometimes`` (called when the
    forward's ``use_extra`` is set).
    """

    def __init__(self, batchnorm: bool = False, mixed: bool = False, extra: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN) if batchnorm else None
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        if mixed:
            self.head.double()
        self.mixed = mixed
        if extra:
            self.unused = nn.Linear(HIDDEN, 3)
            self.sometimes = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        h = torch.relu(self.fc2(h))
        out = self.head(h.double() if self.mixed else h).float()
        if use_extra:
            out = out + self.sometimes(h)
        return out


@dataclass(frozen=True)
class Case:
    model: Dict[str, bool] = field(default_factory=dict)
    ddp: Dict[str, Any] = field(default_factory=dict)
    optimizer: str = "sgd"
    steps: int = 3
    accumulate: int = 0  # no_sync micro-batches before each synchronised one
    extra_ranks: Tuple[int, ...] = ()  # ranks whose forward uses the ``sometimes`` layer
    extra_in_sync: bool = True  # False: only in the no_sync micro-batches
    # pyddp.reducer.IN_PLACE_MIN_BYTES for the case (None: the default): 256 makes
    # every weight of Net reduced in place and every bias packed.
    in_place_min_bytes: Optional[int] = 256
    set_to_none: bool = True
    seed: int = 0


def make_model(case: Case, rank: int) -> Net:
    torch.manual_seed(INIT_SEED + rank)
    return Net(**case.model)


def make_optimizer(case: Case, params) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def batch(case: Case, step: int, micro: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(((case.seed * 1009 + step) * 101 + micro) * 13 + rank)
    return torch.randn(BATCH, IN, generator=gen), torch.randint(0, OUT, (BATCH,), generator=gen)


def uses_extra(case: Case, rank: int, micro: int) -> bool:
    return rank in case.extra_ranks and (case.extra_in_sync or micro < case.accumulate)


def grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
            for n, p in model.named_parameters()}


def params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def train(case: Case, model: nn.Module, wrapped: Callable, rank: int,
          no_sync: Callable[[], Any], device: Union[str, torch.device] = "cpu"
          ) -> List[Dict[str, Any]]:
    """Runs ``case`` through ``wrapped`` (a DDP) on ``rank``; a record per step.

    Record 0 holds the parameters before training; record s the gradients
    just before step s's optimizer step and the parameters after it, copied to
    the CPU. Batches are made on the CPU and moved to ``device``, the model's.
    """
    opt = make_optimizer(case, model.parameters())
    records: List[Dict[str, Any]] = [{"params": params(model)}]
    for step in range(case.steps):
        for micro in range(case.accumulate + 1):
            x, y = (t.to(device) for t in batch(case, step, micro, rank))
            sync = micro == case.accumulate
            with contextlib.nullcontext() if sync else no_sync():
                loss = F.cross_entropy(wrapped(x, use_extra=uses_extra(case, rank, micro)), y)
                loss.backward()
        record = {"grads": grads(model)}
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
        record["params"] = params(model)
        records.append(record)
    return records


def reference(case: Case, world_size: int) -> List[Dict[str, Any]]:
    """``train``'s records for one process holding every rank's batches."""
    model = make_model(case, 0)
    opt = make_optimizer(case, model.parameters())
    records: List[Dict[str, Any]] = [{"params": params(model)}]
    for step in range(case.steps):
        for micro in range(case.accumulate + 1):
            for rank in range(world_size):
                x, y = batch(case, step, micro, rank)
                out = model(x, use_extra=uses_extra(case, rank, micro))
                (F.cross_entropy(out, y) / world_size).backward()
        record = {"grads": grads(model)}
        opt.step()
        opt.zero_grad(set_to_none=case.set_to_none)
        record["params"] = params(model)
        records.append(record)
    return records


def pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def assert_close_records(actual: List[Dict[str, Any]], expected: List[Dict[str, Any]],
                         what: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Same steps, same parameter names; tensors allclose and None exactly where expected."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} records, expected {len(expected)}"
    for step, (a, e) in enumerate(zip(actual, expected)):
        for kind in e:
            assert a[kind].keys() == e[kind].keys(), f"{what}: step {step} {kind} names differ"
            for name, want in e[kind].items():
                got = a[kind][name]
                where = f"{what}: step {step} {kind} {name}"
                if want is None or got is None:
                    assert got is None and want is None, f"{where}: got {got}, expected {want}"
                    continue
                assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
                torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                                           msg=lambda m: f"{where}: {m}")


def assert_identical_records(records_by_rank: List[List[Dict[str, Any]]], what: str) -> None:
    """Parameters (and gradients after a synchronised backward) bitwise equal on every rank."""
    first = records_by_rank[0]
    for rank, records in enumerate(records_by_rank[1:], start=1):
        for step, (a, b) in enumerate(zip(first, records)):
            for kind in ("params", "grads"):
                for name, t in a.get(kind, {}).items():
                    u = b[kind][name]
                    same = (t is None and u is None) or (
                        t is not None and u is not None and torch.equal(t, u))
                    assert same, f"{what}: step {step} {kind} {name}: rank {rank} != rank 0"
