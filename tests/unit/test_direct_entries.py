"""The CPU engine's direct entries: the small synchronous calls of a ProcessGroup go
straight to the engine, and every other call reaches the group's methods as it was given.
Groups of one rank; no process is started.
"""

from __future__ import annotations

import datetime
import weakref

import pytest
import torch
import torch.distributed as dist

import pyddp

ReduceOp = pyddp.ReduceOp


def test_the_direct_entries_pass_on_what_they_do_not_take_and_outlive_their_group():
    """The CPU engine's direct entries (what ProcessGroup's synchronous small-message
    calls go through) run the calls whose arguments they take, by position or keyword,
    defaults left out, and pass every other call, as it was given, to the general path:
    an asynchronous one, not a CPU tensor, an op that is not one of the members they were
    given, a src that is not an int rank of the group, arguments that do not fit the
    signature. A group destroyed under them refuses their calls."""
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    ops = [(ReduceOp.SUM, pyddp._C.RedOp.SUM), (ReduceOp.MAX, pyddp._C.RedOp.MAX)]
    passed_on = []

    def general(name):
        def call(*args, **kwargs):
            passed_on.append((name, args, kwargs))
            return "general"
        return call
    names = ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "barrier")
    now = pg._cpu_engine.direct_entries(ops, {name: general(name) for name in names})
    t = torch.arange(4.0)
    passed = [("all_reduce", (), {}), ("all_reduce", (t, ReduceOp.SUM, False, 1), {}),
              ("all_reduce", (t,), {"opp": ReduceOp.SUM}), ("all_reduce", (t,), {"tensor": t}),
              ("all_reduce", (t, ReduceOp.SUM, True), {}), ("all_reduce", (t,), {"async_op": 1}),
              ("all_reduce", (t,), {"async_op": None}), ("barrier", (t,), {}),
              ("barrier", (), {"async_op": True}), ("all_reduce", ([1.0],), {}),
              ("all_reduce", (t.to("meta"),), {}), ("all_reduce", (t, ReduceOp.AVG), {}),
              ("all_reduce", (t, 0), {}), ("all_reduce", (t,), {"op": int(pyddp._C.RedOp.SUM)}),
              ("all_gather_single", (t, [1.0]), {}), ("all_gather_single", (t,), {}),
              ("reduce_scatter_single", (t, t, "max"), {}),
              ("reduce_scatter_single", (t,), {"input": t, "async_op": True}),
              ("broadcast", (t, "0"), {}), ("broadcast", (t, False), {}),
              ("broadcast", (t,), {"src": 2 ** 70}), ("broadcast", (t, 0.0), {}),
              ("broadcast", (t,), {})]
    for name, args, kwargs in passed:
        assert now[name](*args, **kwargs) == "general", (name, args, kwargs)
        assert passed_on.pop() == (name, args, kwargs) and not passed_on
    # An int that is no rank of the group is the engine's to refuse, as on every path.
    for src in (1, -1, 2 ** 40):
        with pytest.raises(ValueError, match=f"broadcast: src={src} is not a rank of this group"):
            now["broadcast"](t, src)
    assert not passed_on
    torch.testing.assert_close(t, torch.arange(4.0), rtol=0, atol=0)
    # None of those reached the group: its collectives run, here through the entries.
    out = torch.empty(4)
    assert now["all_gather_single"](out, t) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert now["reduce_scatter_single"](output=out, input=t * 2, op=ReduceOp.MAX) is None
    torch.testing.assert_close(out, t * 2, rtol=0, atol=0)
    assert now["all_gather_single"](out, input=t, async_op=False) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert now["broadcast"](out, src=0) is None and now["all_reduce"](out) is None
    assert now["all_reduce"](tensor=out, op=ReduceOp.MAX) is None and now["barrier"](False) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    assert not passed_on
    pg.shutdown()
    del pg
    with pytest.raises(RuntimeError, match="barrier on a process group that was destroyed"):
        now["barrier"]()


def test_a_group_answers_through_its_direct_entries_as_through_its_methods(monkeypatch):
    """ProcessGroup sets the direct entries on the group under its methods' names: the
    calls they do not run reach the methods (an asynchronous call returns a Work, a
    misuse raises the method's error); a subclass's own method, a patched method and the
    barrier of a group that serves CUDA tensors too are left in place; and the entries,
    which pass calls on through a weak reference, do not keep the group alive: a group
    dropped is freed at once, and an entry kept apart from it then fails."""
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.arange(4.0)
    assert vars(pg)["all_reduce"] is pg.all_reduce and pg.all_reduce(t, async_op=False) is None
    work = pg.all_reduce(t, ReduceOp.MAX, async_op=True)
    assert isinstance(work, pyddp.Work) and work.wait()
    out = torch.empty(4)
    assert pg.all_gather_into_tensor(out, t) is None and pg.reduce_scatter_tensor(out, t) is None
    torch.testing.assert_close(out, t, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"all_reduce\(\) got an unexpected keyword"):
        pg.all_reduce(t, opp=ReduceOp.SUM)
    with pytest.raises(ValueError, match="rank 0: broadcast: src=1 is not a rank of this group"):
        pg.broadcast(t, 1)
    entries = weakref.ref(pg.barrier)
    group = weakref.ref(pg)
    kept = pg.all_reduce
    del pg
    assert group() is None and entries() is None  # freed without the cycle collector
    with pytest.raises(RuntimeError, match="rank 0: all_reduce on a process group that was "
                       "destroyed"):
        kept(t, async_op=True)
    with pytest.raises(RuntimeError, match="all_reduce on a process group that was destroyed"):
        kept(t)

    calls = []

    class Counting(pyddp.ProcessGroup):
        def all_reduce(self, tensor, op=ReduceOp.SUM, async_op=False):
            calls.append(op)
            return super().all_reduce(tensor, op, async_op)
    mine = Counting("shm", dist.HashStore(), "counting", 0, 1, datetime.timedelta(seconds=30),
                    pyddp.GroupOptions())
    try:
        assert "all_reduce" not in vars(mine) and "barrier" in vars(mine)
        assert mine.all_reduce(t, ReduceOp.MAX) is None and calls == [ReduceOp.MAX]
    finally:
        mine.shutdown()

    def patched(group, *args, **kwargs):
        calls.append("patched")
    monkeypatch.setattr(pyddp.ProcessGroup, "broadcast", patched)
    monkeypatch.setattr(pyddp._C, "device_types_of", lambda backend: ["cpu", "cuda"])
    both = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert "barrier" not in vars(both) and "all_reduce" in vars(both)
        assert both.barrier() is None and both.broadcast(t, 0) is None
        assert calls[-1] == "patched"
    finally:
        both.shutdown()
