"""Tests of the soak's measurements and verdict (python -m pyddp.bench soak).

What a rank reads about itself is checked against resources this test makes
(a file descriptor, a thread, a mapped pyddp-named file), and the verdict
against hand-made series of samples. The soak itself runs in CI for a minute
(.ci/run), where its exit status is the proof.
"""

import mmap
import os
import threading

import pytest

from pyddp.bench.soak import RSS_TOLERANCE_BYTES, Resources, growth, read_resources


def test_read_resources_counts_what_this_process_opens_and_maps(tmp_path):
    before = read_resources(str(tmp_path))
    path = tmp_path / "pyddp-soak-test"
    path.write_bytes(b"\0" * (3 * mmap.PAGESIZE))
    unrelated = tmp_path / "other-segment"
    unrelated.write_bytes(b"\0" * mmap.PAGESIZE)
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        with open(path, "r+b") as f, open(unrelated, "r+b") as g:
            opened = read_resources(str(tmp_path))
            with mmap.mmap(f.fileno(), 0) as mapped, mmap.mmap(g.fileno(), 0):
                mapped[0] = 1
                during = read_resources(str(tmp_path))
    finally:
        release.set()
        thread.join(10)
    assert opened.fds == before.fds + 2
    assert during.threads == before.threads + 1
    assert during.shm_mapped_bytes == before.shm_mapped_bytes + 3 * mmap.PAGESIZE
    assert (before.shm_entries, during.shm_entries) == (0, 1)
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    assert abs(during.rss_bytes - resident_pages * os.sysconf("SC_PAGE_SIZE")) < 64 << 20


def _series(**changes) -> list:
    base = dict(rss_bytes=500 << 20, fds=40, threads=12, shm_mapped_bytes=1 << 20,
                shm_entries=0)
    return [Resources(**base)] + [Resources(**{**base, **changes})] * 2


def test_nothing_grew():
    assert growth([]) == []
    assert growth(_series()) == []
    assert growth(_series(rss_bytes=(500 << 20) + RSS_TOLERANCE_BYTES)) == []
    assert growth(_series(fds=39, threads=11)) == []


@pytest.mark.parametrize("field, value, text", [
    ("fds", 41, "fds grew from 40 to 41 (allowed: +0)"),
    ("threads", 13, "threads grew from 12 to 13"),
    ("shm_mapped_bytes", (1 << 20) + 4096, "shm_mapped_bytes grew from 1048576 to 1052672"),
    ("shm_entries", 1, "shm_entries grew from 0 to 1"),
    ("rss_bytes", (500 << 20) + RSS_TOLERANCE_BYTES + 1,
     f"rss_bytes grew from {500 << 20} to {(500 << 20) + RSS_TOLERANCE_BYTES + 1} "
     f"(allowed: +{RSS_TOLERANCE_BYTES})"),
])
def test_growth_names_what_grew(field, value, text):
    found = growth(_series(**{field: value}))
    assert len(found) == 1 and text in found[0], found


def test_growth_sees_a_rise_that_falls_back():
    series = _series()
    series.insert(1, Resources(**{**series[0].__dict__, "threads": 14}))
    assert growth(series) == ["threads grew from 12 to 14 (allowed: +0)"]
