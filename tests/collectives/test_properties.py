"""Property-based tests: hypothesis drives collectives on a pool of spawned ranks.

Hypothesis runs in the test process: it draws a program (a group
configuration and a sequence of collectives: kind, dtype, op, size including
0 and odd sizes, root, async or not, dense, strided or in-place) and a seed.
Every rank runs the same program on inputs it derives from (seed, call,
rank), so the ranks agree on the calls; the test process rebuilds every
rank's inputs the same way and checks every rank's outputs against an
independent numpy reference. Shrinking re-runs smaller programs on the same
pool. The second draws programs of point-to-point messages (tags repeating,
receives posted in any order), all_to_all with uneven splits and subgroups made
and used, checked the same way. The third gives one rank an invalid argument
and checks that every rank gets an error and that the group behaves as
documented afterwards.
A failure found here is to be kept, shrunk, as a regular test at the end of
this module.
"""

from __future__ import annotations

import datetime
import itertools
import re
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyddp
from harness import RankContext, Ranks

pytestmark = pytest.mark.multiprocess

WORLD = 3
ReduceOp = pyddp.ReduceOp
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
BITWISE = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
KINDS = ["all_reduce", "all_gather_single", "all_gather", "broadcast", "reduce_scatter_single",
         "barrier"]
REDUCING = ("all_reduce", "reduce_scatter_single")
# Group configurations: the default, and each algorithm forced with buffers
# so small that a few hundred bytes take many pieces or rounds.
CONFIGS = {
    "auto": {},
    "ring": {"algo": "RING", "slot_bytes": 256, "num_slots": 2},
    "direct": {"algo": "DIRECT", "direct_max_bytes": 256},
    "two_shot": {"algo": "TWO_SHOT", "direct_max_bytes": 0, "two_shot_max_bytes": 320},
}


@dataclass(frozen=True)
class Call:
    kind: str
    dtype: str
    op: str
    count: int  # elements per rank (the block, for the gathers and reduce-scatter)
    root: int
    async_op: bool
    layout: str  # "dense", "strided" (not contiguous) or "inplace" (output aliases input)


# --- inputs and the reference ---------------------------------------------------


def _np_dtype(dtype: str):
    return np.float32 if dtype == "bfloat16" else np.dtype(dtype).type


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32)


def inputs_of(call: Call, seed: int, index: int, rank: int) -> np.ndarray:
    """Rank `rank`'s input of call `index` (count x world for reduce-scatter), in numpy:
    integers over their whole range (they wrap), floats that every order of
    reduction sums, multiplies or averages exactly (so every rank's result
    and the reference agree bit for bit), any floats where nothing is computed."""
    rng = np.random.default_rng([seed, index, rank])
    n = call.count * (WORLD if call.kind == "reduce_scatter_single" else 1)
    if call.dtype.startswith(("int", "uint")):
        info = np.iinfo(call.dtype)
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=call.dtype)
    if call.kind in REDUCING and call.op == "PRODUCT":
        values = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size=n)
    elif call.kind in REDUCING and call.op in ("SUM", "AVG"):
        values = rng.integers(-8, 9, size=n).astype(np.float64)
    else:
        values = rng.standard_normal(n) * 1000
    if call.dtype == "bfloat16":
        return _to_bf16(values)
    return values.astype(call.dtype)


def reference_reduce(stack: np.ndarray, op: str, dtype: str) -> np.ndarray:
    """The reduction of stack's rows as pyddp documents it: integers wrap, half
    types accumulate in float32 and round once, AVG divides the sum, the bitwise
    ops act on integers' bits."""
    if dtype.startswith(("int", "uint")):
        acc = np.dtype(dtype)
    elif dtype in ("float16", "bfloat16"):
        acc = np.dtype(np.float32)
    else:
        acc = np.dtype(dtype)
    rows = stack.astype(acc)
    with np.errstate(over="ignore"):
        if op in ("SUM", "AVG"):
            out = rows.sum(axis=0, dtype=acc)
        elif op == "PRODUCT":
            out = rows.prod(axis=0, dtype=acc)
        elif op in BITWISE:
            out = BITWISE[op].reduce(rows, axis=0)
        elif op == "MIN":
            out = rows.min(axis=0)
        else:
            out = rows.max(axis=0)
    if op == "AVG":
        out = (out / acc.type(stack.shape[0])).astype(acc)
    if dtype == "bfloat16":
        return _to_bf16(out)
    return out.astype(_np_dtype(dtype))


def expected_of(call: Call, seed: int, index: int, rank: int):
    ins = [inputs_of(call, seed, index, r) for r in range(WORLD)]
    if call.kind == "all_reduce":
        return reference_reduce(np.stack(ins), call.op, call.dtype)
    if call.kind == "reduce_scatter_single":
        whole = reference_reduce(np.stack(ins), call.op, call.dtype)
        return whole[rank * call.count:(rank + 1) * call.count]
    if call.kind == "all_gather_single":
        return np.concatenate(ins)
    if call.kind == "all_gather":
        return ins
    if call.kind == "broadcast":
        return ins[call.root]
    return None


# --- on the ranks -------------------------------------------------------------------


def _torch(values: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.to(torch.bfloat16) if dtype == "bfloat16" else t


def _numpy(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy().copy()


def _tensor(values: np.ndarray, dtype: str, strided: bool) -> torch.Tensor:
    """A tensor holding `values`, laid out every other element when strided."""
    t = _torch(values, dtype)
    if not strided:
        return t
    spread = torch.zeros(2 * t.numel(), dtype=t.dtype)
    spread[::2] = t
    return spread[::2]


def _issue(pg: pyddp.ProcessGroup, call: Call, mine: np.ndarray, rank: int):
    """Issues `call`; returns (Work or None, a function reading the outputs)."""
    strided = call.layout == "strided"
    op = getattr(ReduceOp, call.op)
    a = call.async_op
    if call.kind == "all_reduce":
        t = _tensor(mine, call.dtype, strided)
        return pg.all_reduce(t, op, async_op=a), lambda: _numpy(t)
    if call.kind == "broadcast":
        t = _tensor(mine, call.dtype, strided)
        return pg.broadcast(t, call.root, async_op=a), lambda: _numpy(t)
    if call.kind == "all_gather_single":
        out = _tensor(np.zeros(call.count * WORLD, _np_dtype(call.dtype)), call.dtype, strided)
        if call.layout == "inplace":
            inp = out.narrow(0, rank * call.count, call.count)
            inp.copy_(_torch(mine, call.dtype))
        else:
            inp = _torch(mine, call.dtype)
        return pg.all_gather_single(out, inp, async_op=a), lambda: _numpy(out)
    if call.kind == "all_gather":
        outs = [_tensor(np.zeros(call.count, _np_dtype(call.dtype)), call.dtype, strided)
                for _ in range(WORLD)]
        if call.layout == "inplace":
            inp = outs[rank]
            inp.copy_(_torch(mine, call.dtype))
        else:
            inp = _torch(mine, call.dtype)
        return pg.all_gather(outs, inp, async_op=a), lambda: [_numpy(o) for o in outs]
    if call.kind == "reduce_scatter_single":
        inp = _tensor(mine, call.dtype, strided)
        if call.layout == "inplace":
            out = inp.narrow(0, rank * call.count, call.count)
        else:
            out = _tensor(np.zeros(call.count, _np_dtype(call.dtype)), call.dtype, strided)
        return pg.reduce_scatter_single(out, inp, op, async_op=a), lambda: _numpy(out)
    return pg.barrier(async_op=a), lambda: None


def _make_group(ctx: RankContext, example: int, config: str, timeout: float
                ) -> pyddp.ProcessGroup:
    """A fresh group per example: a failure cannot spill into the next one."""
    options = pyddp.GroupOptions()
    for key, value in CONFIGS[config].items():
        setattr(options, key, getattr(pyddp.Algo, value) if key == "algo" else value)
    store = dist.FileStore(ctx.store_path(f"prop-{example}"), ctx.world_size)
    pg = pyddp.new_group("shm", store=store, rank=ctx.rank, world_size=ctx.world_size,
                         timeout=datetime.timedelta(seconds=timeout), options=options)
    ctx.groups["prop"] = pg
    return pg


def run_program(ctx: RankContext, example: int, config: str, calls: List[Call],
                seed: int) -> list:
    pg = _make_group(ctx, example, config, 60)
    try:
        pending, results = [], []
        for i, call in enumerate(calls):
            work, read = _issue(pg, call, inputs_of(call, seed, i, ctx.rank), ctx.rank)
            if call.async_op and not isinstance(work, pyddp.Work):
                raise AssertionError(f"{call.kind}(async_op=True) returned {work!r}")
            pending.append((work, read))
            if not call.async_op:
                # Collectives run in call order: the earlier ones are done too.
                for earlier, read_earlier in pending:
                    if earlier is not None:
                        assert earlier.is_completed(), f"call {i}: {call}"
                        earlier.wait(datetime.timedelta(seconds=60))
                    results.append(read_earlier())
                pending = []
        for work, read in pending:
            work.wait(datetime.timedelta(seconds=60))
            results.append(read())
        return results
    finally:
        pg.shutdown()


# --- strategies -----------------------------------------------------------------------

COUNTS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 31, 33, 64, 65, 127, 1001]),
                   st.integers(0, 3000))


@st.composite
def calls(draw) -> Call:
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    floating = dtype.startswith(("float", "bfloat"))
    # AVG is for floating types, the bitwise ops for integer types.
    op = draw(st.sampled_from([o for o in OPS if (o != "AVG" or floating)
                               and (o not in BITWISE or not floating)]))
    layouts = ["dense", "strided"] + (["inplace"] if kind in (
        "all_gather_single", "all_gather", "reduce_scatter_single") else [])
    return Call(kind, dtype, op, draw(COUNTS), draw(st.integers(0, WORLD - 1)),
                draw(st.booleans()), draw(st.sampled_from(layouts)))


def check_results(calls_: List[Call], seed: int, per_rank: list) -> None:
    for rank, results in enumerate(per_rank):
        for i, (call, got) in enumerate(zip(calls_, results)):
            want = expected_of(call, seed, i, rank)
            what = f"rank {rank}, call {i}: {call}"
            if want is None:
                assert got is None, what
            elif isinstance(want, list):
                assert len(got) == len(want), what
                for r, (g, w) in enumerate(zip(got, want)):
                    np.testing.assert_array_equal(g, w, err_msg=f"{what} [{r}]")
            else:
                np.testing.assert_array_equal(got, want, err_msg=what)


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks(WORLD)
    yield pool
    pool.close()


_examples = itertools.count()


# Repeatable in CI: a fixed number of examples drawn from a fixed seed
# (derandomize), no example database carried between runs, no per-example
# deadline (spawned ranks on 2 shared cores vary by seconds). The counts keep
# the module near a minute on such a machine.
BOUNDED = dict(deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROPERTY = settings(max_examples=40, **BOUNDED)


@PROPERTY
@given(config=st.sampled_from(sorted(CONFIGS)), program=st.lists(calls(), min_size=1, max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_random_collective_sequences_match_numpy(ranks, config, program, seed):
    check_results(program, seed, ranks.run(run_program, next(_examples), config, program, seed))


# --- point-to-point, all_to_all and subgroups -----------------------------------------
#
# A program of steps, each one of: messages between pairs of ranks (isend in list order,
# irecv in a drawn order, then every Work waited for), an all_to_all_single with drawn
# uneven splits, or a subgroup of drawn members made, all-reduced in and destroyed. Tags
# repeat, so messages of one pair and tag must arrive in the order they were sent.

TAGS = st.one_of(st.integers(0, 3), st.sampled_from([2**31 - 1, 12345]))


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    tag: int
    count: int
    dtype: str


@dataclass(frozen=True)
class Step:
    kind: str  # "p2p", "all_to_all" or "subgroup"
    dtype: str
    messages: Tuple[Message, ...] = ()
    # Receive order (indices into messages); messages of one (src, dst, tag) keep theirs.
    order: Tuple[int, ...] = ()
    splits: Tuple[Tuple[int, ...], ...] = ()  # splits[i][j]: elements rank i sends rank j
    members: Tuple[int, ...] = ()
    count: int = 0  # elements of a subgroup's all_reduce


def _moved(dtype: str, count: int) -> Call:
    """The Call whose inputs (inputs_of) fill a message of `count` moved elements."""
    return Call("broadcast", dtype, "SUM", count, 0, False, "dense")


def message_data(seed: int, step: int, index: int, m: Message) -> np.ndarray:
    return inputs_of(_moved(m.dtype, m.count), seed, step * 1000 + index, m.src)


def all_to_all_input(seed: int, step: int, s: Step, rank: int) -> np.ndarray:
    return inputs_of(_moved(s.dtype, sum(s.splits[rank])), seed, step * 1000, rank)


def _sum_call(s: Step) -> Call:
    return Call("all_reduce", s.dtype, "SUM", s.count, 0, False, "dense")


def run_exchanges(ctx: RankContext, example: int, steps: List[Step], seed: int) -> list:
    pg = _make_group(ctx, example, "auto", 60)
    limit = datetime.timedelta(seconds=60)
    me = ctx.rank
    try:
        results = []
        for i, s in enumerate(steps):
            if s.kind == "p2p":
                sends = [pg.isend(_torch(message_data(seed, i, k, m), m.dtype), m.dst, m.tag)
                         for k, m in enumerate(s.messages) if m.src == me]
                recvs = []
                for k in s.order:
                    m = s.messages[k]
                    if m.dst == me:
                        t = _torch(np.zeros(m.count, _np_dtype(m.dtype)), m.dtype)
                        recvs.append((k, t, pg.irecv(t, m.src, m.tag)))
                for work in sends:
                    work.wait(limit)
                for _, _, work in recvs:
                    work.wait(limit)
                results.append({k: _numpy(t) for k, t, _ in recvs})
            elif s.kind == "all_to_all":
                inp = _torch(all_to_all_input(seed, i, s, me), s.dtype)
                received = [s.splits[k][me] for k in range(WORLD)]
                out = _torch(np.zeros(sum(received), _np_dtype(s.dtype)), s.dtype)
                pg.all_to_all_single(out, inp, received, list(s.splits[me]))
                results.append(_numpy(out))
            else:
                sub = pyddp.new_group(list(s.members), group=pg)
                if me not in s.members:
                    results.append(None)
                    continue
                t = _torch(inputs_of(_sum_call(s), seed, i * 1000, me), s.dtype)
                sub.all_reduce(t)
                results.append(_numpy(t))
                sub.shutdown()
        return results
    finally:
        pg.shutdown()


@st.composite
def steps(draw) -> Step:
    kind = draw(st.sampled_from(["p2p", "all_to_all", "subgroup"]))
    dtype = draw(st.sampled_from(DTYPES))
    if kind == "all_to_all":
        row = st.tuples(*[st.integers(0, 40)] * WORLD)
        return Step(kind, dtype, splits=draw(st.tuples(*[row] * WORLD)))
    if kind == "subgroup":
        members = draw(st.sets(st.integers(0, WORLD - 1), min_size=1))
        return Step(kind, dtype, members=tuple(sorted(members)), count=draw(COUNTS))
    pairs = st.tuples(st.integers(0, WORLD - 1), st.integers(1, WORLD - 1))
    messages = tuple(Message(src, (src + hop) % WORLD, draw(TAGS), draw(COUNTS),
                             draw(st.sampled_from(DTYPES)))
                     for src, hop in draw(st.lists(pairs, min_size=1, max_size=8)))
    # A drawn permutation, then each (src, dst, tag)'s positions refilled in send order.
    order = list(draw(st.permutations(range(len(messages)))))
    for key in {(m.src, m.dst, m.tag) for m in messages}:
        same = [k for k in range(len(messages)) if (messages[k].src, messages[k].dst,
                                                    messages[k].tag) == key]
        at = sorted(order.index(k) for k in same)
        for position, k in zip(at, same):
            order[position] = k
    return Step(kind, dtype, messages=messages, order=tuple(order))


def check_exchanges(program: List[Step], seed: int, per_rank: list) -> None:
    for rank, results in enumerate(per_rank):
        for i, (s, got) in enumerate(zip(program, results)):
            what = f"rank {rank}, step {i}: {s}"
            if s.kind == "p2p":
                mine = {k for k, m in enumerate(s.messages) if m.dst == rank}
                assert set(got) == mine, what
                for k in mine:
                    np.testing.assert_array_equal(
                        got[k], message_data(seed, i, k, s.messages[k]), err_msg=f"{what} [{k}]")
            elif s.kind == "all_to_all":
                blocks = []
                for k in range(WORLD):
                    start = sum(s.splits[k][:rank])
                    blocks.append(all_to_all_input(seed, i, s, k)[start:start +
                                                                   s.splits[k][rank]])
                np.testing.assert_array_equal(got, np.concatenate(blocks), err_msg=what)
            elif rank not in s.members:
                assert got is None, what
            else:
                want = reference_reduce(np.stack([inputs_of(_sum_call(s), seed, i * 1000, r)
                                                  for r in s.members]), "SUM", s.dtype)
                np.testing.assert_array_equal(got, want, err_msg=what)


@settings(max_examples=20, **BOUNDED)
@given(program=st.lists(steps(), min_size=1, max_size=5), seed=st.integers(0, 2**32 - 1))
def test_random_p2p_all_to_all_and_subgroup_sequences_match_numpy(ranks, program, seed):
    check_exchanges(program, seed, ranks.run(run_exchanges, next(_examples), program, seed))


# --- invalid arguments on one rank ---------------------------------------------------

SHORT = 2.0  # seconds: ranks whose peer refused a call locally wait this long
# Mistakes a rank refuses at once (the group stays usable there), and calls
# that are valid alone but differ from the other ranks' (every rank fails at
# once). Each returns the exception type expected on the rank that makes it.
LOCAL = {
    "dtype int16": TypeError,
    "AVG of integers": TypeError,
    "src out of range": ValueError,
    "huge src": ValueError,
    "op as an int": TypeError,
    "output too small": ValueError,
    "overlapping output": ValueError,
    "not a tensor": TypeError,
}
MISMATCH = ["count", "dtype", "op", "root", "kind"]


def _bad_call(pg: pyddp.ProcessGroup, mistake: str) -> None:
    n = WORLD
    if mistake == "dtype int16":
        pg.all_reduce(torch.ones(4, dtype=torch.int16))
    elif mistake == "AVG of integers":
        pg.all_reduce(torch.ones(4, dtype=torch.int32), ReduceOp.AVG)
    elif mistake == "src out of range":
        pg.broadcast(torch.ones(4), n)
    elif mistake == "huge src":
        pg.broadcast(torch.ones(4), 2**40)
    elif mistake == "op as an int":
        pg.all_reduce(torch.ones(4), 0)
    elif mistake == "output too small":
        pg.all_gather_single(torch.zeros(4 * n - 1), torch.ones(4))
    elif mistake == "overlapping output":
        pg.all_reduce(torch.ones(1).expand(4))
    elif mistake == "not a tensor":
        pg.all_reduce([1.0, 2.0, 3.0, 4.0])
    elif mistake == "count":
        pg.all_reduce(torch.ones(5))
    elif mistake == "dtype":
        pg.all_reduce(torch.ones(4, dtype=torch.float64))
    elif mistake == "op":
        pg.all_reduce(torch.ones(4), ReduceOp.MAX)
    elif mistake == "root":
        pg.broadcast(torch.ones(4), 1)
    else:  # "kind"
        pg.all_gather_single(torch.zeros(4 * n), torch.ones(4))


def _good_call(pg: pyddp.ProcessGroup, mistake: str) -> None:
    """What the other ranks call where one rank makes `mistake`."""
    if mistake in ("src out of range", "huge src", "root"):
        pg.broadcast(torch.ones(4), 0)
    else:
        pg.all_reduce(torch.ones(4))


def make_mistake(ctx: RankContext, example: int, config: str, prefix: List[Call], seed: int,
                 culprit: int, mistake: str) -> Tuple[str, str]:
    """Valid calls, then `mistake` on rank `culprit` where the others make the
    right call: (name of what that raised, its message)."""
    pg = _make_group(ctx, example, config, SHORT)
    for i, call in enumerate(prefix):
        work, _ = _issue(pg, call, inputs_of(call, seed, i, ctx.rank), ctx.rank)
        if work is not None:
            work.wait(datetime.timedelta(seconds=60))
    try:
        if ctx.rank == culprit:
            _bad_call(pg, mistake)
        else:
            _good_call(pg, mistake)
    except Exception as error:  # what the test checks
        return type(error).__name__, str(error)
    return "nothing", ""


def call_again(ctx: RankContext) -> str:
    """An all-reduce, once every rank has seen the mistake's outcome."""
    pg = ctx.groups.pop("prop")
    try:
        pg.all_reduce(torch.ones(4))
    except Exception as error:  # what the test checks
        return f"{type(error).__name__}: {error}"
    finally:
        pg.shutdown()
    return "nothing"


@settings(max_examples=10, **BOUNDED)
@given(config=st.sampled_from(sorted(CONFIGS)),
       prefix=st.lists(calls().filter(lambda c: not c.async_op), max_size=2),
       seed=st.integers(0, 2**32 - 1), culprit=st.integers(0, WORLD - 1),
       mistake=st.sampled_from(sorted(LOCAL) + MISMATCH))
def test_a_mistake_on_one_rank_fails_every_rank_as_documented(ranks, config, prefix, seed,
                                                                culprit, mistake):
    first = ranks.run(make_mistake, next(_examples), config, prefix, seed, culprit, mistake)
    after = ranks.run(call_again)
    check_mistake([f + (a,) for f, a in zip(first, after)], culprit, mistake)


def check_mistake(outcomes: list, culprit: int, mistake: str) -> None:
    for rank, (kind, message, after) in enumerate(outcomes):
        where = f"rank {rank} ({mistake} on rank {culprit}): {kind}: {message} / then {after}"
        if mistake in LOCAL:
            if rank == culprit:
                # Refused before anything reached the peers: named, typed, local.
                assert kind == LOCAL[mistake].__name__, where
                assert message.startswith(f"pyddp: rank {rank}: "), where
                # The peers gave up waiting for it: its next call fails, as
                # the collective they gave up on (or as another one).
                assert after.startswith("DistBackendError") and (
                    "gave up" in after or "differs between ranks" in after), where
            else:
                assert kind == "DistBackendError", where
                assert re.search(rf"rank {culprit} did not arrive at \w+ #\d+ within the "
                                 rf"timeout of {int(SHORT * 1000)} ms", message), where
                assert "earlier collective failed" in after, where
        else:
            # Valid alone, different across ranks: every rank fails at once.
            assert kind == "DistBackendError" and "differs between ranks" in message, where
            assert "earlier collective failed" in after, where
