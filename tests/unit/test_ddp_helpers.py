"""DDP's pure helpers: output tensors, inputs moved, bucket slot layouts, GradBucket."""

import collections
import dataclasses

import pytest
import torch

from pyddp.ddp import _find_tensors, _to_device
from pyddp.reducer import GradBucket, _slot_view


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extras: dict
    note: str = "x"


Pair = collections.namedtuple("Pair", "a b")


def test_find_tensors_walks_containers_and_dataclasses():
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    found = list(_find_tensors([Output(a, {"k": (b, 3)}), Pair(c, "s"), {"z": [d]}, None]))
    assert [t.item() for t in found] == [0.0, 1.0, 2.0, 3.0]
    assert all(x is y for x, y in zip(found, (a, b, c, d)))


def test_to_device_keeps_container_types():
    moved = _to_device([Pair(torch.ones(1), 2), Output(torch.zeros(1), {"k": torch.ones(2)})],
                       torch.device("meta"))
    pair, out = moved
    assert isinstance(pair, Pair) and pair.a.device.type == "meta" and pair.b == 2
    assert isinstance(out, Output) and out.logits.device.type == "meta"
    assert out.extras["k"].device.type == "meta" and out.note == "x"


def test_bucket_slots_take_the_parameters_layout():
    # torch gives a channels_last weight a channels_last gradient; with
    # gradient_as_bucket_view the gradient is the bucket slot itself.
    weight = torch.empty(4, 3, 3, 3).to(memory_format=torch.channels_last)
    flat = torch.arange(float(weight.numel()))
    slot = _slot_view(flat, weight)
    assert slot.shape == weight.shape and slot.stride() == weight.stride()
    assert slot.data_ptr() == flat.data_ptr()
    # Every element of the slot is a distinct element of the flat range.
    assert sorted(slot.flatten().tolist()) == flat.tolist()
    # A transposed (dense) parameter keeps its strides; a strided one gets a plain view.
    assert _slot_view(torch.zeros(30), torch.empty(5, 6).t()).stride() == (1, 6)
    assert _slot_view(torch.zeros(15), torch.empty(5, 6)[:, ::2]).stride() == (3, 1)


def test_grad_bucket_set_buffer_replaces_the_contents():
    flat = torch.zeros(5)
    grads = [flat[:2].view(2), flat[2:].view(3)]
    bucket = GradBucket(0, flat, [torch.empty(2), torch.empty(3)], grads, is_last=True)
    bucket.set_buffer(torch.arange(5.0))
    assert bucket.buffer().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert grads[1].tolist() == [2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="holds 5 elements, got 4"):
        bucket.set_buffer(torch.zeros(4))
