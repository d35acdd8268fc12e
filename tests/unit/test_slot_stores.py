"""How a rank writes its ring slots and staging buffers (csrc/transport/slot_stores.h),
without processes.

The chooser is fed times from a model of the two cases it tells apart (near
cores: cached stores cheaper for the writer; far cores: streaming stores
several times cheaper) and must pick what the model says, keep measuring the
kind it does not use, and follow a change of case. The streaming copy is
checked byte for byte against the source at every alignment and length that
its head, body and tail take. The collectives with streaming slot stores run
in tests/collectives/test_collectives.py (group ``streaming``), and with streaming staging
stores (group ``direct``).
"""

from __future__ import annotations

import pytest
import torch

import pyddp
from pyddp._C import _testing as t

Chooser = t.SlotStoreChooser
PIECE = 64 * 1024

# ns per byte of the writer's copy into a slot, from the table in slot_stores.h
# (2-rank handoff on the AMD EPYC VM): near cores 22-24 GB/s cached, 11-14 GB/s
# streaming; far cores 3.7 GB/s cached, 17 GB/s streaming.
NEAR = {False: 1 / 23, True: 1 / 12}
FAR = {False: 1 / 3.7, True: 1 / 17}
# The same for 4 KiB staged by a direct all_reduce of 2 ranks (the ends of the
# ranges in slot_stores.h, kStagedStreamingAdvantage): on near cores the
# writer gains up to 4.7x from streaming stores, which still make the whole
# call slower; on far cores 7.5x or more.
STAGED = 4096
NEAR_STAGED = {False: 0.103, True: 0.022}
FAR_STAGED = {False: 0.29, True: 0.039}


def _write(chooser, cost, bytes_=PIECE, local=True):
    """One slot write as the transport makes it; returns (streaming, timed)."""
    streaming, timed = chooser.next(bytes_, local)
    if timed:
        chooser.observe(streaming, bytes_, cost[streaming] * bytes_)
    return streaming, timed


def _writes(chooser, cost, n):
    return [_write(chooser, cost) for _ in range(n)]


def _staging_chooser():
    """The chooser a transport keeps for its staging buffers."""
    return Chooser(pyddp.SlotStores.AUTO, t.SlotStoreChooser.MIN_CHOSEN_STAGED_BYTES,
                   t.SlotStoreChooser.STAGED_STREAMING_ADVANTAGE)


def _warm(chooser, cost):
    """Past the warm-up and both first measurements: what every test below starts from."""
    warmup = _writes(chooser, cost, t.SlotStoreChooser.WARMUP_WRITES)
    assert warmup == [(False, False)] * t.SlotStoreChooser.WARMUP_WRITES
    return _writes(chooser, cost, 2)


def test_forced_kinds_are_kept_and_not_timed():
    cached = Chooser(pyddp.SlotStores.CACHED)
    assert all(pick == (False, False) for pick in _writes(cached, FAR, 200))
    assert not cached.prefers_streaming()
    streaming = Chooser(pyddp.SlotStores.STREAMING)
    expected = (t.has_streaming_stores, False)
    assert all(pick == expected for pick in _writes(streaming, NEAR, 200))
    # Forced streaming holds for pieces of any size (tests run it on
    # 320-byte slots) and from any source.
    assert streaming.next(16, True) == expected and streaming.next(PIECE, False) == expected


@pytest.mark.parametrize("staging", [False, True], ids=["slots", "staging"])
def test_small_writes_are_cached_and_not_timed(staging):
    chooser = _staging_chooser() if staging else Chooser(pyddp.SlotStores.AUTO)
    minimum = (t.SlotStoreChooser.MIN_CHOSEN_STAGED_BYTES if staging
               else t.SlotStoreChooser.MIN_CHOSEN_BYTES)
    assert all(_write(chooser, FAR, minimum - 1) == (False, False) for _ in range(200))
    assert chooser.cached_ns_per_byte() == 0 and chooser.streaming_ns_per_byte() == 0
    # From the minimum on, writes are chosen: past the warm-up, both kinds are timed.
    _writes(chooser, FAR, t.SlotStoreChooser.WARMUP_WRITES)
    if t.has_streaming_stores:
        assert [_write(chooser, FAR, minimum) for _ in range(2)] == [(False, True), (True, True)]


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
def test_each_kind_is_measured_after_the_warmup_before_either_is_preferred():
    chooser = Chooser(pyddp.SlotStores.AUTO)
    assert _warm(chooser, FAR) == [(False, True), (True, True)]
    assert chooser.cached_ns_per_byte() == pytest.approx(FAR[False])
    assert chooser.streaming_ns_per_byte() == pytest.approx(FAR[True])
    assert chooser.prefers_streaming()


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
@pytest.mark.parametrize("case,prefers", [(NEAR, False), (FAR, True)], ids=["near", "far"])
def test_picks_the_preferred_kind_samples_it_and_explores_the_other(case, prefers):
    chooser = Chooser(pyddp.SlotStores.AUTO)
    _warm(chooser, case)
    picks = _writes(chooser, case, 64 * t.SlotStoreChooser.EXPLORE_EVERY)
    others = [i for i, (streaming, _) in enumerate(picks) if streaming != prefers]
    # Writes are counted from the first local one, the warm-up's too: the
    # explorations fall on every EXPLORE_EVERY-th, each timed.
    every, sample = t.SlotStoreChooser.EXPLORE_EVERY, t.SlotStoreChooser.SAMPLE_EVERY
    first = t.SlotStoreChooser.WARMUP_WRITES + 3  # the count of picks[0]
    assert others == [i for i in range(len(picks)) if (i + first) % every == 0]
    assert all(picks[i][1] for i in others)
    timed = [i for i, (_, was_timed) in enumerate(picks) if was_timed and i not in others]
    assert timed == [i for i in range(len(picks)) if (i + first) % sample == 0 and i not in others]
    assert chooser.prefers_streaming() == prefers


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
@pytest.mark.parametrize("staging", [False, True], ids=["slots", "staging"])
def test_streaming_must_be_clearly_faster_for_the_writer(staging):
    # The reader pays for streaming stores (it reads from memory), so the
    # writer's gain must exceed STREAMING_ADVANTAGE (STAGED_STREAMING_ADVANTAGE
    # for the chooser of the staging buffers).
    advantage = (t.SlotStoreChooser.STAGED_STREAMING_ADVANTAGE if staging
                 else t.SlotStoreChooser.STREAMING_ADVANTAGE)
    for factor, prefers in ((advantage * 0.9, False), (advantage * 1.1, True)):
        chooser = _staging_chooser() if staging else Chooser(pyddp.SlotStores.AUTO)
        _warm(chooser, {False: factor * 0.1, True: 0.1})
        assert chooser.prefers_streaming() == prefers, factor


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
def test_staging_tells_near_from_far_where_the_slots_ratio_would_not():
    for case, prefers in ((NEAR_STAGED, False), (FAR_STAGED, True)):
        chooser = _staging_chooser()
        for _ in range(t.SlotStoreChooser.WARMUP_WRITES + 2 + 8 * t.SlotStoreChooser.EXPLORE_EVERY):
            _write(chooser, case, STAGED)
        assert chooser.prefers_streaming() == prefers
    # The slots' ratio would stream on near cores too, where that is slower.
    slots = Chooser(pyddp.SlotStores.AUTO)
    _warm(slots, NEAR_STAGED)
    assert slots.prefers_streaming()


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
def test_follows_the_host_moving_the_cores_apart_and_back():
    every = t.SlotStoreChooser.EXPLORE_EVERY
    chooser = Chooser(pyddp.SlotStores.AUTO)
    _warm(chooser, NEAR)
    _writes(chooser, NEAR, 4 * every)
    assert not chooser.prefers_streaming()
    # Far: the cached writes it keeps sampling slow down, and it switches
    # within a few samples.
    picks = _writes(chooser, FAR, 4 * every)
    assert chooser.prefers_streaming()
    first_streamed = next(i for i, (streaming, _) in enumerate(picks) if streaming)
    assert first_streamed <= 5 * t.SlotStoreChooser.SAMPLE_EVERY
    # Near again: only the explorations measure cached stores now, so the
    # way back takes a few of them.
    picks = _writes(chooser, NEAR, 8 * every)
    assert not chooser.prefers_streaming()
    back = next(i for i in range(len(picks)) if all(not s for s, _ in picks[i:i + every - 1]))
    assert back < 4 * every
    # And one odd sample (a copy that was preempted for a time slice) does
    # not flip it.
    chooser.observe(False, PIECE, 1000 * NEAR[False] * PIECE)
    assert not chooser.prefers_streaming()


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
def test_noise_above_the_floor_does_not_flip_the_choice():
    # Near cores, and every other timed write preempted for a time slice (or
    # slowed by another thread's use of the cache): the kind sampled most,
    # the preferred one, must not come to look the slower.
    chooser = Chooser(pyddp.SlotStores.AUTO)
    _warm(chooser, NEAR)
    timed_writes = 0
    for i in range(16 * t.SlotStoreChooser.EXPLORE_EVERY):
        streaming, timed = chooser.next(PIECE, True)
        if timed:
            timed_writes += 1
            slowdown = 1000 if timed_writes % 2 else 1
            chooser.observe(streaming, PIECE, slowdown * NEAR[streaming] * PIECE)
        assert not chooser.prefers_streaming(), i


@pytest.mark.skipif(not t.has_streaming_stores, reason="this CPU has no streaming stores")
def test_forwarded_pieces_follow_the_choice_untimed():
    # A forwarded piece's copy reads a peer's slot: its time is not the
    # writer's alone, so it is neither timed nor counted, and takes the
    # preferred kind even when a local write in its place would explore.
    chooser = Chooser(pyddp.SlotStores.AUTO)
    small = t.SlotStoreChooser.MIN_CHOSEN_BYTES - 1
    assert chooser.next(PIECE, False) == (False, False)
    _warm(chooser, FAR)
    every = t.SlotStoreChooser.EXPLORE_EVERY
    for _ in range(3 * every):
        assert _write(chooser, FAR, local=False) == (True, False)
        assert _write(chooser, FAR, small, local=False) == (False, False)
    # The local writes are counted as if the forwarded ones were not there.
    local = _writes(chooser, FAR, every)
    first = t.SlotStoreChooser.WARMUP_WRITES + 3
    assert [i for i, (s, _) in enumerate(local) if not s] == \
        [i for i in range(every) if (i + first) % every == 0]


def test_samples_that_are_not_times_are_ignored():
    chooser = Chooser(pyddp.SlotStores.AUTO)
    _warm(chooser, NEAR)
    before = (chooser.cached_ns_per_byte(), chooser.streaming_ns_per_byte())
    for bytes_, ns in ((0, 100.0), (PIECE, float("nan")), (PIECE, float("inf")), (PIECE, -1.0)):
        chooser.observe(False, bytes_, ns)
        chooser.observe(True, bytes_, ns)
    assert (chooser.cached_ns_per_byte(), chooser.streaming_ns_per_byte()) == before


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 63, 64, 65, 127, 1000, 4096, 65536 + 5])
def test_streaming_copy_matches_the_source_at_every_alignment(length):
    gen = torch.Generator().manual_seed(length)
    src = torch.randint(0, 256, (length + 64,), dtype=torch.uint8, generator=gen)
    for dst_offset in range(16):
        for src_offset in (0, 1, 7, 16, 33):
            dst = torch.zeros(length + 64, dtype=torch.uint8)
            t.streaming_copy(dst, src, dst_offset, src_offset, length)
            assert torch.equal(dst[dst_offset:dst_offset + length],
                               src[src_offset:src_offset + length])
            # Nothing outside the range is written.
            assert not dst[:dst_offset].any() and not dst[dst_offset + length:].any()
