"""The plan TransportEngine (and FusedEngine: its all-reduce's program) runs for each
collective (csrc/algorithms/select.h), as a table:
(the call, what the transport offers, the options) -> the algorithm on the descriptor,
the one that runs where the tensors are not read in place, messages or not, and the copy
path (registered tensors mapped, plain ones through the kernel, the voter's vote). Every
branch, each threshold exactly at its edge and one byte beyond, and the kernel chooser's
pick through a fake. No process is started; the collectives that take these plans are in
tests/collectives (test_algorithm_choice, test_registered, test_cma).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

import pyddp
from harness import raises
from pyddp._C import _testing

KiB, MiB = 1024, 1024 * 1024
AUTO, RING, DIRECT, TWO_SHOT = (pyddp.Algo.AUTO, pyddp.Algo.RING, pyddp.Algo.DIRECT,
                                pyddp.Algo.TWO_SHOT)
CMA_AUTO, CMA_ALWAYS, CMA_NEVER = pyddp.CmaReads.AUTO, pyddp.CmaReads.ALWAYS, pyddp.CmaReads.NEVER

# The windows of registered memory (kRegistered* in csrc/algorithms/select.h):
# all_gather and broadcast from 64 KiB, all_reduce from 512 KiB, both up to
# 8 MiB; reduce_scatter from 4 KiB on.
REG_MIN, REG_AR_MIN, REG_MAX, REG_RS_MIN = 64 * KiB, 512 * KiB, 8 * MiB, 4 * KiB


def caps(rank=0, world_size=2, peer_memory=True, messages=True, registered=False,
         kernel=False, fused=False):
    return {"rank": rank, "world_size": world_size, "peer_memory": peer_memory,
            "messages": messages, "reads_registered": registered, "reads_through_kernel": kernel,
            "fused": fused}


SHM = caps()  # no in-place reads: the staged algorithms alone
SHM_REG = caps(registered=True)
SHM_KERNEL = caps(kernel=True)
SHM_BOTH = caps(registered=True, kernel=True)
NCCL = caps(peer_memory=False, messages=False)  # the NCCL ring: neither
CUDA_IPC = caps(messages=False)  # mapped staging buffers, no messages
# the fused engine (cuda_ipc, emulated): one program per collective, whatever
# else its memory offers
FUSED = caps(peer_memory=False, messages=False, fused=True)
FUSED_ALL = caps(registered=True, kernel=True, fused=True)

# The fused all-reduce's one-shot window (kFusedOneShotMaxBytes in
# csrc/algorithms/select.h).
FUSED_ONE_SHOT_MAX = 256 * KiB


def options(algo=AUTO, direct=8 * KiB, two_shot=0, cma=CMA_AUTO, cma_min=64 * KiB):
    o = pyddp.GroupOptions()
    o.algo, o.direct_max_bytes, o.two_shot_max_bytes = algo, direct, two_shot
    o.cma, o.cma_min_bytes = cma, cma_min
    return o


DEFAULT = options()


class Expect(NamedTuple):
    algo: str
    staged: str | None = None  # None: algo
    copy: str = ""  # "mapped", "kernel", "mapped+kernel" or "" (staged only)
    messages: bool = False
    votes: bool = False


# (kind, count, dtype, root, caps, options) -> Expect. uint8 counts are bytes.
TABLE = [
    # all_reduce, staged: direct up to direct_max_bytes, two-shot up to
    # two_shot_max_bytes, ring above
    (("all_reduce", 0, "uint8", -1, SHM, DEFAULT), Expect("direct")),
    (("all_reduce", 8 * KiB, "uint8", -1, SHM, DEFAULT), Expect("direct")),
    (("all_reduce", 8 * KiB + 1, "uint8", -1, SHM, DEFAULT), Expect("ring")),
    (("all_reduce", 2 * KiB, "float32", -1, SHM, DEFAULT), Expect("direct")),
    (("all_reduce", 2 * KiB + 1, "float32", -1, SHM, DEFAULT), Expect("ring")),
    (("all_reduce", 1 * KiB, "float64", -1, SHM, DEFAULT), Expect("direct")),
    (("all_reduce", 4 * KiB + 1, "bfloat16", -1, SHM, DEFAULT), Expect("ring")),
    (("all_reduce", 8 * KiB + 1, "uint8", -1, SHM, options(two_shot=64 * KiB)),
     Expect("two_shot")),
    (("all_reduce", 64 * KiB, "uint8", -1, SHM, options(two_shot=64 * KiB)), Expect("two_shot")),
    (("all_reduce", 64 * KiB + 1, "uint8", -1, SHM, options(two_shot=64 * KiB)), Expect("ring")),
    (("all_reduce", 1, "uint8", -1, SHM, options(direct=0, two_shot=64 * KiB)),
     Expect("two_shot")),
    # with both thresholds 0, the empty tensor is within two_shot_max_bytes
    (("all_reduce", 0, "uint8", -1, SHM, options(direct=0)), Expect("two_shot")),
    (("all_reduce", 1, "uint8", -1, SHM, options(direct=0)), Expect("ring")),
    # forced, whatever the size; without mapped peer memory, always the ring
    (("all_reduce", 4, "uint8", -1, SHM, options(algo=RING)), Expect("ring")),
    (("all_reduce", MiB, "uint8", -1, SHM, options(algo=DIRECT)), Expect("direct")),
    (("all_reduce", 4, "uint8", -1, SHM, options(algo=TWO_SHOT, two_shot=64 * KiB)),
     Expect("two_shot")),
    (("all_reduce", 4, "uint8", -1, NCCL, DEFAULT), Expect("ring")),
    (("all_reduce", MiB, "uint8", -1, NCCL, options(algo=DIRECT)), Expect("ring")),
    (("all_reduce", 4, "uint8", -1, CUDA_IPC, DEFAULT), Expect("direct")),
    # all_reduce in place: registered tensors mapped inside its window
    (("all_reduce", REG_AR_MIN - 1, "uint8", -1, SHM_REG, DEFAULT), Expect("ring")),
    (("all_reduce", REG_AR_MIN, "uint8", -1, SHM_REG, DEFAULT),
     Expect("registered", "ring", "mapped")),
    (("all_reduce", REG_MAX, "uint8", -1, SHM_REG, DEFAULT),
     Expect("registered", "ring", "mapped")),
    (("all_reduce", REG_MAX + 1, "uint8", -1, SHM_REG, DEFAULT), Expect("ring")),
    (("all_reduce", REG_AR_MIN, "uint8", -1, SHM_REG, options(two_shot=MiB)),
     Expect("registered", "two_shot", "mapped")),
    # ... plain ones through the kernel from cma_min_bytes on, the voter
    # (rank 0) voting; never with cma never
    (("all_reduce", 64 * KiB - 1, "uint8", -1, SHM_KERNEL, DEFAULT), Expect("ring")),
    (("all_reduce", 64 * KiB, "uint8", -1, SHM_KERNEL, DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    (("all_reduce", 100 * MiB, "uint8", -1, SHM_KERNEL, DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    (("all_reduce", 8 * KiB, "uint8", -1, SHM_KERNEL, options(cma_min=8 * KiB)),
     Expect("registered", "direct", "kernel", votes=True)),
    (("all_reduce", MiB, "uint8", -1, SHM_KERNEL, options(cma=CMA_NEVER)), Expect("ring")),
    (("all_reduce", MiB, "uint8", -1, SHM_KERNEL, options(cma=CMA_ALWAYS)),
     Expect("registered", "ring", "kernel", votes=True)),
    (("all_reduce", MiB, "uint8", -1, caps(rank=1, kernel=True), DEFAULT),
     Expect("registered", "ring", "kernel")),
    (("all_reduce", REG_MAX + 1, "uint8", -1, SHM_BOTH, DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    (("all_reduce", MiB, "uint8", -1, SHM_BOTH, DEFAULT),
     Expect("registered", "ring", "mapped+kernel", votes=True)),
    # all_gather: direct while a rank's block fits direct_max_bytes
    (("all_gather", 8 * KiB, "uint8", -1, SHM, DEFAULT), Expect("direct")),
    (("all_gather", 8 * KiB + 1, "uint8", -1, SHM, DEFAULT), Expect("ring")),
    (("all_gather", 8 * KiB, "uint8", -1, SHM, options(direct=0, two_shot=64 * KiB)),
     Expect("ring")),
    (("all_gather", 4, "uint8", -1, SHM, options(algo=RING)), Expect("ring")),
    (("all_gather", MiB, "uint8", -1, SHM, options(algo=DIRECT)), Expect("direct")),
    (("all_gather", 4, "uint8", -1, SHM, options(algo=TWO_SHOT, two_shot=64 * KiB)),
     Expect("direct")),
    (("all_gather", MiB, "uint8", -1, SHM, options(algo=TWO_SHOT, two_shot=64 * KiB)),
     Expect("ring")),
    (("all_gather", 4, "uint8", -1, NCCL, options(algo=DIRECT)), Expect("ring")),
    (("all_gather", REG_MIN - 1, "uint8", -1, SHM_REG, DEFAULT), Expect("ring")),
    (("all_gather", REG_MIN, "uint8", -1, SHM_REG, DEFAULT),
     Expect("registered", "ring", "mapped")),
    (("all_gather", REG_MAX, "uint8", -1, SHM_REG, DEFAULT),
     Expect("registered", "ring", "mapped")),
    (("all_gather", REG_MAX + 1, "uint8", -1, SHM_REG, DEFAULT), Expect("ring")),
    (("all_gather", 64 * KiB, "uint8", -1, SHM_BOTH, DEFAULT),
     Expect("registered", "ring", "mapped+kernel", votes=True)),
    # reduce_scatter: direct while a rank's whole input (world size blocks)
    # fits direct_max_bytes; registered from 4 KiB a block, with no top
    (("reduce_scatter", 4 * KiB, "uint8", -1, SHM, DEFAULT), Expect("direct")),
    (("reduce_scatter", 4 * KiB + 1, "uint8", -1, SHM, DEFAULT), Expect("ring")),
    (("reduce_scatter", 2 * KiB, "uint8", -1, caps(world_size=4), DEFAULT), Expect("direct")),
    (("reduce_scatter", 2 * KiB + 1, "uint8", -1, caps(world_size=4), DEFAULT), Expect("ring")),
    (("reduce_scatter", 4, "uint8", -1, SHM, options(algo=RING)), Expect("ring")),
    (("reduce_scatter", 4, "uint8", -1, NCCL, DEFAULT), Expect("ring")),
    (("reduce_scatter", REG_RS_MIN - 1, "uint8", -1, SHM_REG, DEFAULT), Expect("direct")),
    (("reduce_scatter", REG_RS_MIN, "uint8", -1, SHM_REG, DEFAULT),
     Expect("registered", "direct", "mapped")),
    (("reduce_scatter", 64 * MiB, "uint8", -1, SHM_REG, DEFAULT),
     Expect("registered", "ring", "mapped")),
    (("reduce_scatter", 64 * KiB, "uint8", -1, SHM_KERNEL, DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    # broadcast: the chain; in place as all_gather; its voter is the last
    # rank of the chain from the root
    (("broadcast", MiB, "uint8", 0, SHM, DEFAULT), Expect("ring")),
    (("broadcast", 4, "uint8", 1, SHM, options(algo=DIRECT)), Expect("ring")),
    (("broadcast", REG_MIN - 1, "uint8", 0, SHM_REG, DEFAULT), Expect("ring")),
    (("broadcast", REG_MIN, "uint8", 0, SHM_REG, DEFAULT),
     Expect("registered", "ring", "mapped")),
    (("broadcast", REG_MAX + 1, "uint8", 0, SHM_REG, DEFAULT), Expect("ring")),
    (("broadcast", MiB, "uint8", 0, SHM_KERNEL, DEFAULT),
     Expect("registered", "ring", "kernel")),
    (("broadcast", MiB, "uint8", 0, caps(rank=1, kernel=True), DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    (("broadcast", MiB, "uint8", 0, caps(rank=2, world_size=3, kernel=True), DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    (("broadcast", MiB, "uint8", 2, caps(rank=1, world_size=3, kernel=True), DEFAULT),
     Expect("registered", "ring", "kernel", votes=True)),
    # reduce: the all-reduce's direct algorithm, else the ring's reduce
    # phase by messages (or an all-reduce without them); never in place
    (("reduce", 8 * KiB, "uint8", 0, SHM, DEFAULT), Expect("direct", messages=True)),
    (("reduce", 8 * KiB + 1, "uint8", 0, SHM, DEFAULT), Expect("ring", messages=True)),
    (("reduce", 8 * KiB + 1, "uint8", 0, SHM, options(two_shot=64 * KiB)),
     Expect("ring", messages=True)),
    (("reduce", MiB, "uint8", 0, SHM, options(algo=DIRECT)), Expect("direct", messages=True)),
    (("reduce", 4, "uint8", 0, SHM, options(algo=RING)), Expect("ring", messages=True)),
    (("reduce", 4, "uint8", 1, CUDA_IPC, DEFAULT), Expect("direct")),
    (("reduce", 4, "uint8", 1, NCCL, DEFAULT), Expect("ring")),
    (("reduce", MiB, "uint8", 0, SHM_BOTH, DEFAULT), Expect("ring", messages=True)),
    # gather, scatter: one message a rank, else the ring's all-gather and the
    # broadcast chain (scatter keeps the descriptor's algo)
    (("gather", 4, "uint8", 0, SHM, DEFAULT), Expect("direct", messages=True)),
    (("gather", MiB, "uint8", 0, SHM_BOTH, DEFAULT), Expect("direct", messages=True)),
    (("gather", 4, "uint8", 0, CUDA_IPC, DEFAULT), Expect("ring")),
    (("scatter", 4, "uint8", 1, SHM, DEFAULT), Expect("direct", messages=True)),
    (("scatter", 4, "uint8", 1, NCCL, DEFAULT), Expect("ring")),
    (("all_to_all", 4, "uint8", -1, SHM, DEFAULT), Expect("direct", messages=True)),
    (("barrier", 0, "float32", -1, SHM_BOTH, DEFAULT), Expect("ring")),
    # fused: the all-reduce (and reduce) one-shot up to the fused window,
    # two-shot above, whatever the CPU's thresholds and what the memory offers
    (("all_reduce", 0, "uint8", -1, FUSED, DEFAULT), Expect("direct")),
    (("all_reduce", FUSED_ONE_SHOT_MAX, "uint8", -1, FUSED, DEFAULT), Expect("direct")),
    (("all_reduce", FUSED_ONE_SHOT_MAX + 1, "uint8", -1, FUSED, DEFAULT), Expect("two_shot")),
    (("all_reduce", FUSED_ONE_SHOT_MAX // 4, "float32", -1, FUSED, DEFAULT), Expect("direct")),
    (("all_reduce", FUSED_ONE_SHOT_MAX // 4 + 1, "float32", -1, FUSED, DEFAULT),
     Expect("two_shot")),
    (("all_reduce", FUSED_ONE_SHOT_MAX // 2 + 1, "bfloat16", -1, FUSED, options(direct=0)),
     Expect("two_shot")),
    (("all_reduce", MiB, "uint8", -1, FUSED_ALL, options(two_shot=64 * MiB)),
     Expect("two_shot")),
    (("reduce", FUSED_ONE_SHOT_MAX, "uint8", 0, FUSED, DEFAULT), Expect("direct")),
    (("reduce", FUSED_ONE_SHOT_MAX + 1, "uint8", 0, FUSED_ALL, DEFAULT), Expect("two_shot")),
    # ... forced: direct is one-shot at any size; two-shot, and ring (the
    # fused engine has none), two-shot at any size
    (("all_reduce", 64 * MiB, "uint8", -1, FUSED, options(algo=DIRECT)), Expect("direct")),
    (("all_reduce", 4, "uint8", -1, FUSED, options(algo=TWO_SHOT)), Expect("two_shot")),
    (("all_reduce", 4, "uint8", -1, FUSED, options(algo=RING)), Expect("two_shot")),
    # ... the others have one program each: the descriptor's algo, nothing
    # read in place, no messages, no vote
    (("all_gather", MiB, "uint8", -1, FUSED_ALL, DEFAULT), Expect("ring")),
    (("reduce_scatter", MiB, "uint8", -1, FUSED_ALL, DEFAULT), Expect("ring")),
    (("broadcast", MiB, "uint8", 0, FUSED_ALL, DEFAULT), Expect("ring")),
    (("gather", 4, "uint8", 0, FUSED_ALL, DEFAULT), Expect("ring")),
    (("scatter", 4, "uint8", 1, FUSED_ALL, DEFAULT), Expect("ring")),
    (("all_to_all", 4, "uint8", -1, FUSED_ALL, DEFAULT), Expect("ring")),
]


def _plan(kind, count, dtype, root, c, o, pick=(False, False), algo="ring", window=0):
    return _testing.select(kind, count, dtype, root, algo, c, o, pick, window)


def _expected(kind, count, dtype, e: Expect) -> dict:
    sizes = {"uint8": 1, "bfloat16": 2, "float32": 4, "float64": 8}
    return {"kind": kind, "bytes": count * sizes[dtype], "algo": e.algo,
            "staged": e.staged or e.algo, "messages": e.messages,
            "mapped": "mapped" in e.copy, "through_kernel": "kernel" in e.copy,
            "votes": e.votes, "kernel_vote": False, "timed": False,
            "asked": (kind, count * sizes[dtype]) if e.votes else None}


@pytest.mark.parametrize("row, expect", TABLE,
                         ids=[f"{r[0]}-{r[1]}x{r[2]}-{i}" for i, (r, _) in enumerate(TABLE)])
def test_the_plan_of_each_call(row, expect):
    kind, count, dtype, *_ = row
    assert _plan(*row) == _expected(kind, count, dtype, expect)


def test_a_plan_that_votes_takes_the_chooser_s_pick():
    # rank 0 votes on an all_reduce through the kernel: the plan carries the
    # pick (whether peers read through the kernel; whether to time it)
    for pick in ((True, True), (True, False), (False, True), (False, False)):
        plan = _plan("all_reduce", MiB, "uint8", -1, SHM_BOTH, DEFAULT, pick)
        assert plan["asked"] == ("all_reduce", MiB)
        assert (plan["kernel_vote"], plan["timed"]) == pick
        assert (plan["algo"], plan["mapped"], plan["through_kernel"], plan["votes"]) == \
            ("registered", True, True, True)


def test_a_plan_that_does_not_vote_never_asks_the_chooser():
    # another rank than the voter, a size below cma_min_bytes, a collective
    # that never reads in place, or a group that cannot read through the
    # kernel: the pick is not read and the plan has no vote
    for row in (("all_reduce", MiB, "uint8", -1, caps(rank=1, kernel=True), DEFAULT),
                ("broadcast", MiB, "uint8", 1, caps(rank=1, kernel=True), DEFAULT),
                ("all_gather", 64 * KiB - 1, "uint8", -1, SHM_BOTH, DEFAULT),
                ("reduce", MiB, "uint8", 0, SHM_BOTH, DEFAULT),
                ("all_gather", MiB, "uint8", -1, SHM_REG, DEFAULT)):
        plan = _plan(*row, pick=(True, True))
        assert plan["asked"] is None and not plan["votes"], row
        assert (plan["kernel_vote"], plan["timed"]) == (False, False), row


def test_collectives_without_a_choice_keep_the_descriptor_s_algo():
    for kind, c in (("barrier", SHM), ("scatter", NCCL)):
        for algo in ("ring", "direct"):
            plan = _plan(kind, 0, "float32", 0 if kind == "scatter" else -1, c, DEFAULT,
                         algo=algo)
            assert (plan["algo"], plan["staged"]) == (algo, algo)


# A fused engine's call on a tensor in registered buffer 1 (CollectiveDesc::window):
# (kind, count, root, options) -> Expect.
REGISTERED_TABLE = [
    # all_reduce: in place (two-shot's blocks) above the one-shot window, or
    # when two-shot (or ring) is forced; the one-shot sizes stage
    (("all_reduce", FUSED_ONE_SHOT_MAX, -1, DEFAULT), Expect("direct")),
    (("all_reduce", FUSED_ONE_SHOT_MAX + 1, -1, DEFAULT),
     Expect("registered", "two_shot", "mapped")),
    (("all_reduce", 4, -1, options(algo=TWO_SHOT)), Expect("registered", "two_shot", "mapped")),
    (("all_reduce", 4, -1, options(algo=RING)), Expect("registered", "two_shot", "mapped")),
    (("all_reduce", 64 * MiB, -1, options(algo=DIRECT)), Expect("direct")),
    # the others at every size
    (("all_gather", 1, -1, DEFAULT), Expect("registered", "ring", "mapped")),
    (("reduce_scatter", 1, -1, DEFAULT), Expect("registered", "ring", "mapped")),
    (("broadcast", 64 * MiB, 1, DEFAULT), Expect("registered", "ring", "mapped")),
    # never the collectives that do not read in place
    (("reduce", 64 * MiB, 0, DEFAULT), Expect("two_shot")),
    (("gather", 4, 0, DEFAULT), Expect("ring")),
    (("scatter", 4, 1, DEFAULT), Expect("ring")),
    (("barrier", 0, -1, DEFAULT), Expect("ring")),
]


@pytest.mark.parametrize("row, expect", REGISTERED_TABLE,
                         ids=[f"{r[0]}-{r[1]}-{i}" for i, (r, _) in enumerate(REGISTERED_TABLE)])
def test_the_fused_plan_of_a_tensor_in_a_registered_buffer(row, expect):
    kind, count, root, o = row
    plan = _plan(kind, count, "uint8", root, FUSED, o, window=1)
    assert plan == _expected(kind, count, "uint8", expect)
    # without a window, the same call stages as the table above says
    assert _plan(kind, count, "uint8", root, FUSED, o)["algo"] != "registered"


def test_a_window_means_nothing_to_the_transport_engine():
    # TransportEngine's registered memory is found at the arrival (pyddp.empty),
    # not named on the descriptor
    for c in (SHM, SHM_BOTH, NCCL):
        assert _plan("all_gather", 4, "uint8", -1, c, DEFAULT, window=1) == \
            _plan("all_gather", 4, "uint8", -1, c, DEFAULT)


def test_a_name_that_is_not_a_collective_is_refused():
    raises(ValueError, "unknown collective", _plan, "all_reduce_all", 4, "uint8", -1, SHM,
           DEFAULT)
