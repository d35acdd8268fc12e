"""Rank 0's choice between reading a peer's tensor through the kernel (cross-memory
attach) and through the ring's slots (backend/cma_chooser.h), fed modelled times: it
must measure both paths, take the cheaper, keep exploring the other, and follow a change,
without being moved by cold calls, lucky samples or one slow call. No process is started;
the collectives that read through the kernel are in tests/collectives/test_cma.py.
"""

from __future__ import annotations

import pyddp
from harness import raises
from pyddp._C import _testing

ALWAYS, AUTO, NEVER = pyddp.CmaReads.ALWAYS, pyddp.CmaReads.AUTO, pyddp.CmaReads.NEVER
EVERY, RUN = _testing.CmaChooser.EXPLORE_EVERY, _testing.CmaChooser.EXPLORE_RUN
FIRST, WINDOW = _testing.CmaChooser.FIRST_EXPLORE, _testing.CmaChooser.WINDOW

# ns per byte per rank, from benchmarks/studies/single-copy-through-the-kernel.md:
# all_gather of 1 MiB, the slots near (about 200 us) and far (about
# 280 us), the kernel copy at about 180 us either way.
SLOTS_NEAR, SLOTS_FAR, KERNEL = 200e3 / (1 << 20), 280e3 / (1 << 20), 180e3 / (1 << 20)
SIZE = 1 << 20
KIND = "all_gather"


def _call(chooser, kernel_cost, slots_cost, size=SIZE, kind=KIND):
    """One collective as rank 0 runs it: the chooser's pick, then what the
    engine tells it (its time if it asked for one); returns whether it read
    through the kernel."""
    kernel, timed = chooser.peek(kind, size)
    ns = (kernel_cost if kernel else slots_cost) * size if timed else None
    chooser.record(kind, size, kernel, ns)
    return kernel


def _calls(chooser, kernel_cost, slots_cost, n, **kwargs):
    return [_call(chooser, kernel_cost, slots_cost, **kwargs) for _ in range(n)]


def test_forced_modes_are_kept_and_not_timed():
    for mode, kernel in ((ALWAYS, True), (NEVER, False)):
        chooser = _testing.CmaChooser(mode)
        assert all(_call(chooser, KERNEL, SLOTS_FAR) == kernel for _ in range(100))
        assert chooser.peek(KIND, SIZE) == (kernel, False)
        assert chooser.prefers_kernel("broadcast", SIZE) == kernel


def _exploring(first: int, last: int) -> list:
    """The calls from `first` to `last` (counted from 1) that explore: runs of
    RUN from FIRST and its doublings below EVERY, then from every EVERY-th."""
    starts = [FIRST << k for k in range(EVERY.bit_length()) if FIRST << k < EVERY]
    starts += range(EVERY, last + 1, EVERY)
    return [c for start in starts for c in range(start, start + RUN) if first <= c <= last]


def test_the_exploring_runs_start_at_16_32_and_64_then_every_128():
    assert (FIRST, EVERY, RUN) == (16, 128, 4)  # the schedule the tests below spell out
    assert _exploring(1, 400) == [c for s in (16, 32, 64, 128, 256, 384)
                                  for c in range(s, s + 4)]


def test_auto_measures_both_paths_then_takes_the_cheaper_and_explores_the_other():
    chooser = _testing.CmaChooser(AUTO)
    # a run through the kernel, a run through the slots, then the cheaper:
    # the kernel (far cores)
    picks = _calls(chooser, KERNEL, SLOTS_FAR, 3 * EVERY + RUN)
    assert picks[:2 * RUN] == [True] * RUN + [False] * RUN
    # a run of calls explores the slots from calls FIRST, 2 FIRST, ... and
    # each EVERY-th on
    assert [i + 1 for i, kernel in enumerate(picks) if not kernel] == \
        list(range(RUN + 1, 2 * RUN + 1)) + _exploring(2 * RUN + 1, 3 * EVERY + RUN)
    # The slots get cheaper (the cores moved near): the next exploration
    # measures them below the kernel, and they are taken from then on.
    chooser2 = _testing.CmaChooser(AUTO)
    _calls(chooser2, KERNEL, SLOTS_FAR, EVERY - 1)
    assert chooser2.prefers_kernel(KIND, SIZE)
    # the first, cold, is not timed; the next two are two of the three
    # samples whose median is the estimate
    _calls(chooser2, KERNEL, SLOTS_NEAR * 0.8, 2)
    assert chooser2.prefers_kernel(KIND, SIZE)
    _calls(chooser2, KERNEL, SLOTS_NEAR * 0.8, 1)
    assert not chooser2.prefers_kernel(KIND, SIZE)
    assert _calls(chooser2, KERNEL, SLOTS_NEAR * 0.8, EVERY - 2) == [False] * (EVERY - 3) + [True]


def _priced(chooser, n, cost):
    """`n` collectives of SIZE as rank 0 runs them, the i-th through a path
    that costs cost(i, kernel, switched) ns per byte (switched: another path
    than the call before's), timed if the chooser asks; each (path, timed)."""
    calls = []
    for i in range(n):
        kernel, timed = chooser.peek(KIND, SIZE)
        switched = bool(calls) and kernel != calls[-1][0]
        chooser.record(KIND, SIZE, kernel, cost(i, kernel, switched) * SIZE if timed else None)
        calls.append((kernel, timed))
    return calls


def test_the_first_call_after_a_switch_is_not_timed():
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, SLOTS_FAR, EVERY - 1)
    # The slots, explored, are 1.1x dearer than the kernel; the kernel's
    # first call back costs 1.4x its own (cold caches): not a sample of
    # what it costs.
    calls = _priced(chooser, RUN + 2, lambda i, kernel, switched:
                    (KERNEL if kernel else KERNEL * 1.1) * (1.4 if switched else 1.0))
    assert calls == [(False, False)] + [(False, True)] * (RUN - 1) + [(True, False), (True, True)]
    assert chooser.prefers_kernel(KIND, SIZE)


def test_an_exploring_run_is_judged_by_its_warm_calls():
    # The first two calls of the slots after the kernel can both be cold (a
    # broadcast's); a lone explored call would have kept the kernel.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, SLOTS_FAR, EVERY - 1)
    calls = _priced(chooser, RUN + 2, lambda i, kernel, switched:
                    KERNEL if kernel else 2 * SLOTS_NEAR if i < 2 else SLOTS_NEAR * 0.8)
    assert [kernel for kernel, _ in calls] == [False] * (RUN + 2)
    assert not chooser.prefers_kernel(KIND, SIZE)


def test_a_first_pick_from_cold_calls_is_looked_at_again_within_a_few_calls():
    # The kernel's first calls cost 1.6x its later ones and as much as the
    # slots (all_reduce of 4 MiB per rank, far cores): the slots are picked
    # after the first runs, and the kernel is taken from its first
    # exploring run on, FIRST calls in.
    chooser = _testing.CmaChooser(AUTO)
    picks = _priced(chooser, FIRST + 2 * RUN, lambda i, kernel, switched:
                    (KERNEL * 1.6 if i < RUN else KERNEL) if kernel else KERNEL * 1.55)
    assert [kernel for kernel, _ in picks[2 * RUN:FIRST - 1]] == [False] * (FIRST - 1 - 2 * RUN)
    assert [kernel for kernel, _ in picks[FIRST - 1:]] == [True] * (2 * RUN + 1)
    assert chooser.prefers_kernel(KIND, SIZE)


def test_a_preferred_path_that_gets_dearer_is_left_within_a_window_of_calls():
    chooser = _testing.CmaChooser(AUTO)
    # past the exploring run from call EVERY // 2, the last before call
    # EVERY, and the first call back (not timed)
    _calls(chooser, KERNEL, SLOTS_NEAR * 1.2, EVERY // 2 + RUN)
    assert chooser.prefers_kernel(KIND, SIZE)
    # The kernel copy gets 2x dearer (the machine's other jobs): its estimate
    # is the median of its last WINDOW samples, so it stays while most of
    # them are the cheaper ones, and the slots win at the next call.
    picks = _calls(chooser, 2 * KERNEL, SLOTS_NEAR * 1.2, WINDOW // 2 + 2)
    assert picks == [True] * (WINDOW // 2 + 1) + [False]
    assert not chooser.prefers_kernel(KIND, SIZE)


def test_a_path_is_ranked_by_the_median_of_its_recent_samples():
    # Samples that spread up to 1.4x above each path's cost, the slots' 1.4x
    # the kernel's: ranked by their latest sample, the two swapped places
    # now and then; by the median of the window, the kernel is kept.
    chooser = _testing.CmaChooser(AUTO)
    spread = [1.1, 1.0, 1.4, 1.3, 1.05, 1.2]
    picks = _priced(chooser, 3 * EVERY, lambda i, kernel, switched:
                    (KERNEL if kernel else KERNEL * 1.4) * spread[i % len(spread)])
    slots = [i + 1 for i, (kernel, _) in enumerate(picks) if not kernel]
    assert slots[RUN:] == _exploring(2 * RUN + 1, 3 * EVERY)


def test_a_lucky_low_sample_of_the_other_path_does_not_move_the_choice():
    # The slots cost 1.3x the kernel, but the first timed call of an
    # exploring run of them took 0.9x (measured: the slots' first timed
    # calls after the kernel's, 46-51 us against 52-60 later): a floor of
    # the window would take the slots for a window of calls.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, KERNEL * 1.3, EVERY - 1)
    picks = _priced(chooser, RUN + WINDOW, lambda i, kernel, switched:
                    KERNEL if kernel else KERNEL * (0.9 if i == 1 else 1.3))
    assert [kernel for kernel, _ in picks] == [False] * RUN + [True] * WINDOW
    assert chooser.prefers_kernel(KIND, SIZE)


def test_one_slow_call_does_not_move_the_choice():
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, 2 * KERNEL, 10)
    chooser.observe(KIND, SIZE, True, 1000 * KERNEL * SIZE)  # preempted for a time slice
    assert chooser.prefers_kernel(KIND, SIZE)


def test_a_near_tie_keeps_the_slots():
    advantage = _testing.CmaChooser.KERNEL_ADVANTAGE
    chooser = _testing.CmaChooser(AUTO)
    n = EVERY + RUN + 3
    picks = _calls(chooser, KERNEL, KERNEL * advantage * 0.99, n)
    # the kernel only where a run explores it
    explored = _exploring(2 * RUN + 1, n)
    assert [i + 1 for i, kernel in enumerate(picks) if kernel and i >= 2 * RUN] == explored
    chooser2 = _testing.CmaChooser(AUTO)
    _calls(chooser2, KERNEL, KERNEL * advantage * 1.05, 2 * RUN)
    assert chooser2.prefers_kernel(KIND, SIZE)


def test_the_kernel_once_taken_is_kept_while_it_is_cheaper_at_all():
    # With one threshold, two paths near it swapped places with their noise.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, SLOTS_FAR, 10)
    assert chooser.prefers_kernel(KIND, SIZE)
    # the slots get within 1.1x of the kernel: explored, never taken
    assert _calls(chooser, KERNEL, KERNEL * 1.1, 2 * EVERY).count(False) == \
        len(_exploring(11, 2 * EVERY + 10))
    assert chooser.prefers_kernel(KIND, SIZE)
    # the slots get cheaper: taken from their next exploration on (call
    # 3 * EVERY; these are calls 2 * EVERY + 11 on)
    picks = _calls(chooser, KERNEL, KERNEL * 0.95, EVERY)
    assert picks.index(False) == EVERY - 11 and picks[EVERY - 11:] == [False] * 11


KINDS = ("all_gather", "broadcast", "all_reduce", "reduce_scatter")


def test_each_kind_and_power_of_two_is_chosen_for_alone():
    chooser = _testing.CmaChooser(AUTO)
    # 1 MiB: the kernel for every other kind, beginning with all_gather
    for i, kind in enumerate(KINDS):
        _calls(chooser, KERNEL, SLOTS_FAR if i % 2 == 0 else SLOTS_NEAR * 0.5, 10, kind=kind)
    _calls(chooser, KERNEL, SLOTS_NEAR * 0.5, 10, size=4 * SIZE)  # all_gather of 4 MiB: the slots
    assert [chooser.prefers_kernel(kind, SIZE) for kind in KINDS] == [True, False, True, False]
    assert chooser.prefers_kernel(KIND, 2 * SIZE - 1)
    assert not chooser.prefers_kernel(KIND, 4 * SIZE)
    # not measured yet: the kernel is tried first, its first call (cold) not timed
    assert chooser.peek(KIND, 16 * SIZE) == (True, False)


def test_the_four_collectives_with_a_kernel_path_are_chosen_for_and_no_other():
    assert [_testing.reads_in_place(k) for k in KINDS] == [True] * 4
    for kind in ("barrier", "reduce", "gather", "scatter", "all_to_all", "send"):
        assert not _testing.reads_in_place(kind)
        raises(RuntimeError, "does not read through the kernel",
               _testing.CmaChooser(AUTO).peek, kind, SIZE)
        raises(RuntimeError, "does not read through the kernel",
               _testing.CmaChooser(AUTO).record, kind, SIZE, True)


def test_a_pick_is_only_read_until_the_call_is_recorded():
    # The engine reads the pick when the collective runs and records the
    # call after it: reading it again before changes nothing.
    chooser = _testing.CmaChooser(AUTO)
    picks = []
    for _ in range(2 * RUN + 1):
        pick = chooser.peek(KIND, SIZE)
        assert chooser.peek(KIND, SIZE) == pick
        picks.append(pick)
        chooser.record(KIND, SIZE, pick[0], KERNEL * SIZE if pick[1] else None)
    assert picks == [(True, False)] + [(True, True)] * (RUN - 1) + \
        [(False, False)] + [(False, True)] * (RUN - 1) + [(False, True)]


def test_samples_that_are_not_times_are_ignored():
    # A near tie keeps the slots; a kernel sample taken as a time (NaN
    # counts as the smallest, a negative one is below any) would make the
    # kernel look cheaper.
    chooser = _testing.CmaChooser(AUTO)
    _calls(chooser, KERNEL, KERNEL, 10)
    for bad in (float("nan"), -1.0, float("inf")):
        chooser.observe(KIND, SIZE, True, bad)
        assert not chooser.prefers_kernel(KIND, SIZE), bad
