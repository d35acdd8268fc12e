"""Subgroups of a pyddp group, as torch.distributed's ``new_group`` and ``new_subgroups``
make them: every rank of the parent asks for the same members before any subgroup is made,
and each subgroup meets under a prefix of the parent's store."""

from __future__ import annotations

import datetime
import operator
from typing import List, Optional, Tuple, Union

import torch.distributed as dist

from . import _C
from .process_group import (BACKENDS, ProcessGroup, GroupOptions, _check_timeout, _group,
                            _milliseconds, create_group)


class NonMemberGroup:
    """What ``new_group`` returns on a rank that is not among its ``ranks`` (torch returns
    ``GroupMember.NON_GROUP_MEMBER``): it refuses every collective, naming the group."""

    def __init__(self, rank: int, ranks: List[int]) -> None:
        self._rank = rank
        self.ranks = list(ranks)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise RuntimeError(f"pyddp: rank {self._rank} is not a member of this group (ranks "
                           f"{self.ranks}): {name} is for its members only")

    def __repr__(self) -> str:
        return f"NonMemberGroup(ranks={self.ranks})"


def new_group(
    ranks: Optional[List[int]] = None,
    timeout: Optional[datetime.timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Optional[GroupOptions] = None,
    *,
    group: Optional[ProcessGroup] = None,
    **standalone,
) -> Union[ProcessGroup, NonMemberGroup]:
    """A subgroup of ``group`` (default: the default group) of its ranks ``ranks``, as
    ``torch.distributed.new_group``.

    Every rank of ``group`` calls it with the same ``ranks``, in the same order as its other
    new_group calls; members get a ProcessGroup whose rank i is ``sorted(ranks)[i]`` (its
    ``ranks``), others a NonMemberGroup that refuses collectives. ``ranks`` None: every rank.
    ``timeout``, ``backend`` and ``pg_options`` default to the parent's. The subgroup has shared
    memory of its own.

    The form of pyddp 0.1, ``new_group("shm", store=..., rank=..., world_size=...)``, still makes
    a group of its own: see create_group.
    """
    if isinstance(ranks, str) or standalone:
        positional = {} if ranks is None else {"backend": ranks}
        if timeout is not None:
            standalone.setdefault("timeout", timeout)
        return create_group(**positional, **standalone)
    parent = _group(group, "new_group")
    members = sorted(range(parent.size()) if ranks is None else
                     (parent._member_arg(r, "new_group", "ranks entry") for r in ranks))
    if len(set(members)) != len(members) or not members:
        raise ValueError(f"pyddp: rank {parent.rank()}: new_group: ranks must be distinct ranks "
                         f"of the group, got {ranks!r}")
    settings = _subgroup_settings(parent, timeout, backend, pg_options)
    index = parent._subgroups
    return _make_subgroups(parent, [members], settings,
                           f"ranks {members} of a group of {parent.size()}",
                           f"new_group #{index + 1} of group {parent._prefix!r}")[0]


def new_subgroups(group_size: int, group: Optional[ProcessGroup] = None,
                  timeout: Optional[datetime.timedelta] = None, backend: Optional[str] = None,
                  pg_options: Optional[GroupOptions] = None
                  ) -> Tuple[ProcessGroup, List[Union[ProcessGroup, NonMemberGroup]]]:
    """Splits ``group`` (default: the default group) into consecutive subgroups of
    ``group_size`` ranks, as ``torch.distributed.new_subgroups``; returns this rank's subgroup
    and all of them (NonMemberGroup for the others)."""
    parent = _group(group, "new_subgroups")
    size = operator.index(group_size)
    if size <= 0 or parent.size() % size:
        raise ValueError(f"pyddp: rank {parent.rank()}: new_subgroups: group_size {group_size} "
                         f"must divide the group's size {parent.size()}")
    settings = _subgroup_settings(parent, timeout, backend, pg_options)
    first = parent._subgroups
    count = parent.size() // size
    subgroups = _make_subgroups(
        parent, [list(range(k * size, (k + 1) * size)) for k in range(count)], settings,
        f"subgroups of {size} ranks of a group of {parent.size()}",
        f"new_subgroups (subgroups #{first + 1} to #{first + count}) of group "
        f"{parent._prefix!r}")
    return subgroups[parent.rank() // size], subgroups


def _subgroup_settings(parent: ProcessGroup, timeout: Optional[datetime.timedelta],
                       backend: Optional[str], pg_options: Optional[GroupOptions]
                       ) -> Tuple[str, datetime.timedelta, GroupOptions]:
    """A subgroup's backend, timeout and options: the arguments, else the parent's."""
    kind = parent.backend if backend is None else backend
    if kind not in BACKENDS:
        raise ValueError(f"pyddp: backend {kind!r} is not available; this build has {BACKENDS}")
    limit = parent.timeout if timeout is None else timeout
    _check_timeout(limit)
    opts = GroupOptions(pg_options if pg_options is not None else parent.options)
    opts.timeout_ms = _milliseconds(limit)
    opts.validate()
    return kind, limit, opts


def _make_subgroups(parent: ProcessGroup, member_lists: List[List[int]],
                    settings: Tuple[str, datetime.timedelta, GroupOptions], request: str,
                    call: str) -> List[Union[ProcessGroup, NonMemberGroup]]:
    """The subgroups of ``parent`` with these members, on the parent's next counts, made
    once every rank of the parent has asked for the same (``request``)."""
    kind, limit, opts = settings
    first = parent._subgroups
    parent._subgroups += len(member_lists)
    # Every rank of the parent, member or not, says which groups it asked
    # for before any is made: ranks that disagree (or one that skipped a
    # new_group) would otherwise meet under the same prefix as groups of
    # different members. One meeting serves all of new_subgroups' groups.
    _C.agree_on_group(dist.PrefixStore(f"{parent._prefix}/sub{first}/agree", parent._store),
                      parent.rank(), list(range(parent.size())), request, call, limit)
    groups: List[Union[ProcessGroup, NonMemberGroup]] = []
    for index, members in enumerate(member_lists, first):
        if parent.rank() not in members:
            groups.append(NonMemberGroup(parent.rank(), members))
            continue
        prefix = f"{parent._prefix}/sub{index}"
        groups.append(ProcessGroup(kind, dist.PrefixStore(prefix, parent._store), prefix,
                                   members.index(parent.rank()), len(members), limit, opts,
                                   members))
    return groups
