"""pyddp's shared-memory segments: private (mode 0600), named unguessably, removed once
made, and a peer's segment refused unless it is this user's, private and of the size
its geometry makes. No process is started.
"""

from __future__ import annotations

import os
import re
import stat

import pyddp
from harness import pyddp_segments


def test_segments_are_private_unguessable_and_removed():
    before = set(pyddp_segments())
    names = set()
    for _ in range(3):
        name, mode = pyddp._C._testing.probe_shm_segment()
        assert mode == 0o600, oct(mode)
        assert re.fullmatch(r"/pyddp-[0-9a-f]{16,}", name), name
        names.add(name)
    assert len(names) == 3
    assert set(pyddp_segments()) == before


def test_segment_checks():
    problem = pyddp._C._testing.shm_segment_problem
    me = os.geteuid()
    assert problem(me, stat.S_IFREG | 0o600, 4096, 4096, me) == ""
    assert problem(me + 1, stat.S_IFREG | 0o600, 4096, 4096, me) == (
        f"it belongs to uid {me + 1}, not to this process's uid {me}")
    assert problem(me, stat.S_IFREG | 0o640, 4096, 4096, me) == "its mode is 0640, not 0600"
    assert problem(me, stat.S_IFREG | 0o4600, 4096, 4096, me) == "its mode is 04600, not 0600"
    assert problem(me, stat.S_IFREG | 0o600, 4095, 4096, me) == (
        "it has 4095 bytes, and this geometry makes 4096")
    name = pyddp._C._testing.is_segment_name
    assert name("/pyddp-0123abcdef") and not name("/pyddp-") and not name("/pyddp-x1")
    assert not name("/other-01") and not name("/pyddp-01/../x")
