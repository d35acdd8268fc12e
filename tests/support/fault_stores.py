"""Stores that let a test see and disturb a group's bootstrap.

``Recording`` wraps a torch store and keeps every value it sets or reads,
so a test can learn what a rank's transport reserved (its shm segment name)
and check that nothing of it is left. ``Sabotage`` also kills this process
around one key (SIGKILL: no cleanup of its own), or rewrites a value it
reads (a forged store value), or sleeps before reading one.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

import pyddp

_blob_read = pyddp._C._testing.blob_read
_blob_write = pyddp._C._testing.blob_write


class Recording(dist.Store):
    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self._inner = inner
        self.values: Dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.values[key] = bytes(value)
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._inner.get(key)
        self.values[key] = bytes(value)
        return value

    def check(self, keys: List[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def reservation(self, rank: int) -> str:
        """The shm segment name rank `rank` announced in its hello (read or set here)."""
        for key, value in self.values.items():
            if key.endswith(f"/hello/{rank}"):
                return _blob_read(value.decode(), "reservation", "bytes").decode()
        raise KeyError(f"no hello of rank {rank} went through this store")


class Sabotage(Recording):
    """Recording, plus: SIGKILL this process just before setting a key ending in
    `kill_before` or just after setting one ending in `kill_after`; pass the
    value of a key ending in `forge` through `forger` when reading it; sleep
    `delay` seconds before reading a key ending in `slow`."""

    def __init__(self, inner: dist.Store, kill_before: str = "", kill_after: str = "",
                 forge: str = "", forger: Optional[Callable[[bytes], bytes]] = None,
                 slow: str = "", delay: float = 0.0) -> None:
        super().__init__(inner)
        self._kill_before, self._kill_after = kill_before, kill_after
        self._forge, self._forger = forge, forger
        self._slow, self._delay = slow, delay

    def set(self, key: str, value) -> None:
        if self._kill_before and key.endswith(self._kill_before):
            os.kill(os.getpid(), signal.SIGKILL)
        super().set(key, value)
        if self._kill_after and key.endswith(self._kill_after):
            os.kill(os.getpid(), signal.SIGKILL)

    def get(self, key: str) -> bytes:
        if self._slow and key.endswith(self._slow):
            time.sleep(self._delay)
        value = super().get(key)
        if self._forge and key.endswith(self._forge):
            return self._forger(bytes(value))
        return value


def forge_shm_blob(outcome: bytes, **changes: str) -> bytes:
    """A bootstrap outcome ("ok" = an shm blob) with some of the blob's fields replaced."""
    blob = _blob_read(outcome.decode(), "ok", "bytes").decode()
    fields = [line.split("=", 1) for line in blob.splitlines()]
    forged = "".join(f"{key}={changes.get(key, value)}\n" for key, value in fields)
    return _blob_write([], [("ok", forged.encode())]).encode()


def shm_blob_field(outcome: bytes, field: str) -> str:
    blob = _blob_read(outcome.decode(), "ok", "bytes").decode()
    return _blob_read(blob, field, "str")
