"""Surviving a lost rank without a restart: agree, shrink, admit and join, on torch's store.

A job whose rank dies keeps going on the survivors: they agree on who is alive
(``agree``), make a group of themselves (``ProcessGroup.shrink``), and later take
replacements in at a point they choose (``ProcessGroup.admit``, answered by
``pyddp.join`` in the new process). Nothing here needs a coordinator beyond the
group's store, which must outlive every rank: torchrun's agent store, a TCPStore
served by a process that is not a rank, or a FileStore.

Protocol (keys under the group's prefix P on its store; every rank of a group calls
agree, shrink and admit in the same order, as collectives):

- Membership. Every rank of a group publishes ``P/member/<rank>`` = its host, pid
  namespace and pid when it makes the group (publish_member), before any collective.
- Rounds. Each agree, shrink and admit on a group is round n of that group (n counts
  alike on every member); its keys live under ``P/round/<n>``, so a late rank of an
  earlier round, or of an older group, reads and writes keys nobody waits on any more.
- Agree. A rank writes its vote ``vote/<rank>``, then waits for every other member to
  be accounted for: voted, or dead. A member is dead when a rank on its host (same
  host id and pid namespace) finds its pid gone, which that rank records as
  ``dead/<rank>`` for the ranks that cannot look; or when the group's timeout passes
  without its vote (a host lost whole is found only so). Each rank then proposes
  (AND of the votes it saw, the dead it found) with ``compare_set(decision, "",
  proposal)``: the first proposal stored is the decision, and every rank adopts it.
  Invariant: every rank that returns from round n returns the same decision; a rank
  the decision counts dead raises instead (it was too slow or cut off, and its peers
  have moved on without it).
- Shrink. The old group is aborted first (a survivor still blocked in it fails at
  once), then the survivors agree, and the ranks not counted dead make a group of
  their own under ``P/round/<n>/group``, renumbered in their old order. A survivor
  that dies while that group is made fails the making on the others, who agree again
  (the next round) without it.
- Join and admit. A new process takes a ticket (``L/join/next``, a counter, under the
  lineage prefix L: the prefix of the group the current one descends from) and waits
  for ``L/join/<ticket>``. At admit, rank 0 counts the tickets not yet admitted and
  every member learns the count through an all_reduce; rank 0 writes each admitted
  ticket its rank and the new group's prefix; members keep their ranks, joiners
  follow in ticket order, and all make the new group together.

What is not guaranteed: a rank that is alive but does not vote within the timeout
(stopped, or cut off from its peers' host) is counted dead and fails when it comes
back; a rank slower than that but within the timeout is waited for. A split between
hosts that both keep the store splits the job along the first decision's line: the
ranks the decision counts dead raise.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C

if TYPE_CHECKING:
    from .process_group import ProcessGroup

logger = logging.getLogger("pyddp")

# Pause between looks at the store and at peers' pids while agreeing: a kill is found
# within a few pauses (the 100 ms the protocol aims at), and a store round trip costs
# tens of microseconds on one host.
POLL_S = 0.005
# The key a job's default group writes its prefix under, for pyddp.join.
DEFAULT_LINEAGE_KEY = "pyddp/default-lineage"


@dataclass(frozen=True)
class Agreement:
    """What agree() decided: ``flag``, the AND of the votes counted; ``dead``, the group
    ranks counted dead (in order); ``alive``, the others."""
    flag: bool
    dead: Tuple[int, ...]
    alive: Tuple[int, ...]


def _where() -> str:
    return f"{_C.host_id()}\n{_C.pid_namespace()}\n{os.getpid()}"


def publish_member(store: dist.Store, prefix: str, rank: int) -> None:
    """Records where ``rank`` of the group at ``prefix`` runs, for agree()."""
    store.set(f"{prefix}/member/{rank}", _where().encode())


def _next_round(group: "ProcessGroup") -> str:
    n = group._rounds
    group._rounds += 1
    return f"{group._prefix}/round/{n}"


def _deadline(group: "ProcessGroup", timeout: Optional[datetime.timedelta]) -> float:
    return time.monotonic() + (timeout or group.timeout).total_seconds()


class _Store:
    """The group's store, whose failures say that it must outlive every rank."""

    def __init__(self, group: "ProcessGroup", what: str) -> None:
        self._store, self._rank, self._what = group._store, group.rank(), what

    def __getattr__(self, name: str):
        call = getattr(self._store, name)

        def guarded(*args):
            try:
                return call(*args)
            except Exception as e:
                raise dist.DistStoreError(
                    f"pyddp: rank {self._rank}: {self._what}: the group's store failed (it "
                    "must outlive every rank: torchrun's agent store, a TCPStore served by a "
                    f"process that is not a rank, or a FileStore): {e}") from e
        return guarded


def agree(group: "ProcessGroup", flag: bool = True,
          timeout: Optional[datetime.timedelta] = None) -> Agreement:
    """ULFM's agree on ``group``: every member still alive returns the same Agreement (the
    AND of the flags of the members it counted, and the members counted dead), even when
    members die during it. Every member calls it at the same point; it uses the group's
    store only, so it works on a group whose collectives fail or that was aborted. Bounded
    by ``timeout`` (the group's when None): a member that neither votes nor is seen dead by
    then is counted dead. A member that the decision counts dead raises
    DistBackendError."""
    value, dead, _ = _agree(group, int(bool(flag)), min, timeout)
    return Agreement(flag=value == 1, dead=dead,
                     alive=tuple(r for r in range(group.size()) if r not in dead))


def agree_max(group: "ProcessGroup", value: int,
              timeout: Optional[datetime.timedelta] = None) -> int:
    """agree() on integers: the largest ``value`` of the members counted (a count of
    steps that some member may have got further in, say)."""
    return _agree(group, int(value), max, timeout)[0]


def _agree(group: "ProcessGroup", vote: int, combine,
           timeout: Optional[datetime.timedelta]) -> Tuple[int, Tuple[int, ...], str]:
    """The agreement of ``combine`` over the votes counted: (its value, the ranks counted
    dead, the round's key prefix)."""
    base = _next_round(group)
    store, me, size = _Store(group, "agree"), group.rank(), group.size()
    deadline = _deadline(group, timeout)
    store.set(f"{base}/vote/{me}", str(vote).encode())
    votes: Dict[int, int] = {me: vote}
    dead: List[int] = []
    pending = [r for r in range(size) if r != me]
    places: Dict[int, Tuple[str, str, int]] = {}
    here = (_C.host_id(), _C.pid_namespace())
    while pending:
        for r in list(pending):
            if store.check([f"{base}/vote/{r}"]):
                votes[r] = int(store.get(f"{base}/vote/{r}"))
            elif _seen_dead(group, store, base, r, places, here):
                dead.append(r)
            else:
                continue
            pending.remove(r)
        if pending and time.monotonic() >= deadline:
            logger.warning("rank %d/%d: agree: ranks %s neither voted nor were seen dead "
                           "within the timeout; counted dead", me, size, pending)
            dead.extend(pending)
            pending = []
        if pending:
            time.sleep(POLL_S)
    proposal = f"{combine(votes.values())};{','.join(map(str, sorted(dead)))}"
    decision = store.compare_set(f"{base}/decision", "", proposal).decode()
    value, _, dead_text = decision.partition(";")
    counted_dead = tuple(int(r) for r in dead_text.split(",") if r)
    if me in counted_dead:
        raise dist.DistBackendError(
            f"pyddp: rank {me}: agree: the group's other members counted this rank dead (it "
            f"did not vote within the timeout of {(timeout or group.timeout)}); they went on "
            "without it")
    return int(value), counted_dead, base


def _seen_dead(group: "ProcessGroup", store: _Store, base: str, rank: int,
               places: Dict[int, Tuple[str, str, int]], here: Tuple[str, str]) -> bool:
    """Whether ``rank`` is dead: its pid gone (looked at when it runs on this host, and
    then recorded for the others), or recorded so by a rank that could look."""
    if store.check([f"{base}/dead/{rank}"]):
        return True
    if rank not in places:
        key = f"{group._prefix}/member/{rank}"
        if not store.check([key]):
            return False
        host, ns, pid = store.get(key).decode().split("\n")
        places[rank] = (host, ns, int(pid))
    host, ns, pid = places[rank]
    if (host, ns) != here or _C.process_alive(pid):
        return False
    store.set(f"{base}/dead/{rank}", str(group.rank()).encode())
    return True


def shrink(group: "ProcessGroup") -> "ProcessGroup":
    """A new group of ``group``'s members still alive (ULFM's shrink, NCCL's
    ncclCommShrink): ``group`` is aborted, the survivors agree on who they are, and make a
    group of themselves, ranked in their old order, on the same backend, store, options
    and timeout. Every survivor calls it. A survivor lost while the new group is made is
    left out by a further agreement. Raises DistBackendError on a rank the others counted
    dead."""
    from .process_group import ProcessGroup

    group.abort()
    for _ in range(group.size()):
        _, dead, base = _agree(group, 1, min, None)
        survivors = tuple(r for r in range(group.size()) if r not in dead)
        rank = survivors.index(group.rank())
        start = time.monotonic()
        try:
            new = ProcessGroup(group._kind, group._store, f"{base}/group", rank,
                               len(survivors), group.timeout, group._options,
                               ranks=[group._ranks[r] for r in survivors])
        except RuntimeError as e:
            logger.warning("rank %d/%d: shrink: making the group of ranks %s failed (%s); "
                           "agreeing again", group.rank(), group.size(), list(survivors), e)
            continue
        new._lineage, new._admitted = group._lineage, group._admitted
        logger.info("rank %d/%d: shrink: ranks %s counted dead; now rank %d/%d (group made in "
                    "%.3f s)", group.rank(), group.size(), list(dead), rank,
                    len(survivors), time.monotonic() - start)
        return _succeed(group, new)
    raise dist.DistBackendError(f"pyddp: rank {group.rank()}: shrink: no group of the "
                                f"survivors could be made in {group.size()} agreements")


def pending_joins(group: "ProcessGroup") -> int:
    """How many processes wait in pyddp.join() to enter ``group``'s lineage, as this rank
    reads the store now (ranks may read different counts: admit() takes rank 0's)."""
    issued = _Store(group, "pending_joins").add(f"{group._lineage}/join/next", 0)
    return issued - group._admitted


def admit(group: "ProcessGroup", pending: Optional[int] = None) -> "ProcessGroup":
    """``group`` grown by the processes waiting in pyddp.join(): members keep their ranks,
    joiners follow in the order they asked. Every member calls it at the same point;
    ``pending`` is the number to admit, the same on every member (rank 0's
    pending_joins(), say, sent with a collective the caller makes anyway); when None,
    admit() learns rank 0's count with an all_reduce of its own. Returns ``group`` itself
    when none waits; otherwise the new group, and ``group`` is shut down."""
    from .process_group import ProcessGroup

    if pending is None:
        count = torch.tensor([pending_joins(group) if group.rank() == 0 else 0])
        group.all_reduce(count)
        pending = int(count.item())
    base = _next_round(group)
    if pending <= 0:
        return group
    size = group.size() + pending
    prefix = f"{base}/group"
    admitted = group._admitted + pending
    if group.rank() == 0:
        store = _Store(group, "admit")
        for i in range(pending):
            record = f"{prefix}\n{group.size() + i}\n{size}\n{admitted}"
            store.set(f"{group._lineage}/join/{group._admitted + 1 + i}", record.encode())
    new = ProcessGroup(group._kind, group._store, prefix, group.rank(), size, group.timeout,
                       group._options)
    new._lineage, new._admitted = group._lineage, admitted
    logger.info("rank %d/%d: admit: %d joined; now %d ranks", group.rank(), group.size(),
                pending, size)
    group.shutdown()
    return _succeed(group, new)


def _succeed(old: "ProcessGroup", new: "ProcessGroup") -> "ProcessGroup":
    """``new``, made the default group when ``old`` was (as torch's shrink_group does)."""
    from . import process_group as pg

    if pg._default_group is old:
        pg._default_group = new
    return new


def join(init_method: Optional[str] = None, *, store: Optional[dist.Store] = None,
         backend: str = "shm", timeout: datetime.timedelta = datetime.timedelta(minutes=5),
         options: Optional["_C.GroupOptions"] = None,
         lineage: Optional[str] = None) -> "ProcessGroup":
    """Joins a running job from a new process (a replacement for a lost rank, say) and
    makes the group it joins this process's default group: takes a ticket on the job's
    store (``store``, or the one ``init_method`` names: env://, the default, tcp://host:port
    or file:///path), waits up to ``timeout`` for the job's members to admit() it, and
    returns the group made with them. ``lineage``: the prefix of the job's group to join
    (default: the job's default group, which init_process_group records on the store).
    ``backend``, ``options`` and ``timeout`` must be the members'."""
    from . import process_group as pg
    from .rendezvous import client_store

    if pg._default_group is not None:
        raise RuntimeError("pyddp.join: this process already has a default process group")
    if store is None:
        store = client_store(init_method or "env://", timeout)
    if lineage is None:
        store.wait([DEFAULT_LINEAGE_KEY], timeout)
        lineage = store.get(DEFAULT_LINEAGE_KEY).decode()
    ticket = store.add(f"{lineage}/join/next", 1)
    key = f"{lineage}/join/{ticket}"
    logger.info("pyddp.join: ticket %d of %s; waiting to be admitted", ticket, lineage)
    store.wait([key], timeout)
    prefix, rank, size, admitted = store.get(key).decode().split("\n")
    opts = pg.GroupOptions(options) if options is not None else pg.GroupOptions()
    opts.timeout_ms = pg._milliseconds(timeout)
    opts.validate()
    group = pg.ProcessGroup(backend, store, prefix, int(rank), int(size), timeout, opts)
    group._lineage, group._admitted = lineage, int(admitted)
    pg._default_group = group
    return group
