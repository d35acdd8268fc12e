"""Every PYDDP_* variable pyddp reads, walked with garbage, negative, zero, huge and
boundary values: a value is range-checked as written (never wrapped into range first),
refusals quote the text as the user wrote it, and "not an integer" is said only of text
that is not one. The variables are found by reading pyddp's sources, so a new one cannot
be left out of this table. No process is started.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from typing import Dict, Optional, Tuple

import pytest
import torch.distributed as dist

import pyddp
from paths import REPO as ROOT
from pyddp import _C

# Integer variables: (GroupOptions field, min, max, step), as the README's settings
# table documents them.
INT64_MAX = 2**63 - 1
INTEGERS: Dict[str, Tuple[str, int, int, int]] = {
    "PYDDP_SLOT_BYTES": ("slot_bytes", 64, 2**30, 64),
    "PYDDP_NUM_SLOTS": ("num_slots", 2, 1024, 1),
    "PYDDP_DIRECT_MAX_BYTES": ("direct_max_bytes", 0, 2**30, 1),
    "PYDDP_TWO_SHOT_MAX_BYTES": ("two_shot_max_bytes", 0, 2**30, 1),
    "PYDDP_P2P_BUFFER_BYTES": ("p2p_buffer_bytes", 0, INT64_MAX, 1),
    "PYDDP_CMA_MIN_BYTES": ("cma_min_bytes", 0, INT64_MAX, 1),
}
# Choice variables: (GroupOptions field, {text: value}).
CHOICES = {
    "PYDDP_ALGO": ("algo", {"auto": pyddp.Algo.AUTO, "ring": pyddp.Algo.RING,
                            "direct": pyddp.Algo.DIRECT, "two_shot": pyddp.Algo.TWO_SHOT}),
    "PYDDP_SLOT_STORES": ("slot_stores", {"auto": pyddp.SlotStores.AUTO,
                                          "cached": pyddp.SlotStores.CACHED,
                                          "streaming": pyddp.SlotStores.STREAMING}),
    "PYDDP_CMA": ("cma", {"auto": pyddp.CmaReads.AUTO, "always": pyddp.CmaReads.ALWAYS,
                          "never": pyddp.CmaReads.NEVER}),
}
# Free text: a logging level, a host identity.
TEXTS = ("PYDDP_DEBUG", "PYDDP_HOSTID")

NOT_INTEGERS = ("lots", "1M", "0x10", "1.5", "--1", "+", "1 2", "１２")


def variables_in_sources() -> set:
    """Every "PYDDP_..." string literal of the library's C++ and Python sources."""
    names = set()
    for top in ("csrc", "pyddp"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".cpp", ".h", ".cu", ".py")):
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        names.update(re.findall(r"\"(PYDDP_[A-Z0-9_]+)\"", f.read()))
    return names


@pytest.fixture
def env(monkeypatch):
    for name in _C.settings():
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def options_with(env, name: str, text: str) -> Optional[_C.GroupOptions]:
    env.setenv(name, text)
    return pyddp.GroupOptions()


def test_every_variable_read_is_in_this_table():
    known = set(INTEGERS) | set(CHOICES) | set(TEXTS)
    assert variables_in_sources() == known
    assert set(_C.settings()) == known


@pytest.mark.parametrize("name", sorted(INTEGERS))
def test_integer_variables(env, name):
    field, low, high, step = INTEGERS[name]
    default = getattr(pyddp.GroupOptions(), field)
    assert getattr(options_with(env, name, ""), field) == default, "empty is unset"
    candidates = {low, high, low + step, high - step, low - 1, high + 1, low - step,
                  high + step, 0, -1, -2**32 + 2, 2**32 + 2, 2**64 - 64, 2**64, 10**20,
                  -10**20, low + step // 2}
    fits = {v for v in candidates if low <= v <= high and v % step == 0}
    refused = candidates - fits
    assert fits and refused
    for value in fits | {f" {high}\t", f"+{low}"}:
        assert getattr(options_with(env, name, str(value)), field) == int(str(value).strip())
    for value in refused:
        text = str(value)
        with pytest.raises(ValueError) as error:
            options_with(env, name, text)
        message = str(error.value)
        assert f"{name}='{text}' must be" in message, message
        assert f"[{low}, {high}]" in message, message
        assert "not an integer" not in message
    for text in NOT_INTEGERS:
        with pytest.raises(ValueError, match=re.escape(f"{name}='{text}' is not an integer")):
            options_with(env, name, text)


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_choice_variables(env, name):
    field, values = CHOICES[name]
    for text, value in values.items():
        assert getattr(options_with(env, name, text), field) == value
    for text in ("fastest", "AUTO", "1", "-1", str(2**64), " auto"):
        with pytest.raises(ValueError, match=re.escape(f"{name}='{text}' is not one of "
                                                       + ", ".join(values))):
            options_with(env, name, text)


def test_options_set_in_python_are_checked_as_set():
    options = pyddp.GroupOptions()
    for field, value in (("slot_bytes", 2**64 - 64), ("num_slots", 1), ("num_slots", 1025),
                         ("direct_max_bytes", 2**30 + 1), ("cma_min_bytes", 2**63)):
        changed = pyddp.GroupOptions(options)
        setattr(changed, field, value)
        with pytest.raises(ValueError, match=rf"{field} \(PYDDP_\w+\) must be .*got {value}$"):
            changed.validate()


def test_debug_level():
    configure = pyddp._configure_logging
    log = logging.getLogger("pyddp")
    saved = log.level, list(log.handlers)
    try:
        for text, level in (("INFO", logging.INFO), ("debug", logging.DEBUG), ("0", 0),
                            ("30", 30)):
            configure(text)
            assert log.level == level
        for text in ("loud", "-1", "1.5", "INFO2"):
            with pytest.raises(ValueError, match=re.escape(f"PYDDP_DEBUG={text!r} is not a "
                                                           "logging level")):
                configure(text)
    finally:
        log.setLevel(saved[0])
        log.handlers[:] = saved[1]


def test_host_id_is_any_text(env):
    for text in ("left", "-1", "1" * 300, "a b/c"):
        env.setenv("PYDDP_HOSTID", text)
        assert _C.settings()["PYDDP_HOSTID"] == text
        group = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        try:
            assert text in group.layout()
        finally:
            pyddp.destroy_process_group(group)


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYDDP_SLOT_BYTES", "4096")
    monkeypatch.setenv("PYDDP_NUM_SLOTS", "3")
    monkeypatch.setenv("PYDDP_DIRECT_MAX_BYTES", "0")
    monkeypatch.setenv("PYDDP_ALGO", "ring")
    monkeypatch.setenv("PYDDP_SLOT_STORES", "streaming")
    options = pyddp.GroupOptions()
    assert (options.slot_bytes, options.num_slots, options.direct_max_bytes, options.algo,
            options.slot_stores) == (4096, 3, 0, pyddp.Algo.RING, pyddp.SlotStores.STREAMING)
    pg = pyddp.new_group("shm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert pg.options.slot_bytes == 4096 and pg.options.algo == pyddp.Algo.RING
        assert pg.options.slot_stores == pyddp.SlotStores.STREAMING
    finally:
        pg.shutdown()
    assert pyddp._C.settings()["PYDDP_ALGO"] == "ring"
    assert pyddp._C.settings()["PYDDP_SLOT_STORES"] == "streaming"
    for text, kind in (("cached", pyddp.SlotStores.CACHED), ("auto", pyddp.SlotStores.AUTO)):
        monkeypatch.setenv("PYDDP_SLOT_STORES", text)
        assert pyddp.GroupOptions().slot_stores == kind
    monkeypatch.delenv("PYDDP_SLOT_STORES")
    assert pyddp.GroupOptions().slot_stores == pyddp.SlotStores.AUTO
    options = pyddp.GroupOptions()
    assert (options.cma, options.cma_min_bytes) == (pyddp.CmaReads.AUTO, 64 * 1024)
    monkeypatch.setenv("PYDDP_CMA_MIN_BYTES", "1048576")
    monkeypatch.setenv("PYDDP_CMA", "never")
    options = pyddp.GroupOptions()
    assert (options.cma, options.cma_min_bytes) == (pyddp.CmaReads.NEVER, 1 << 20)
    monkeypatch.setenv("PYDDP_CMA", "always")
    assert pyddp.GroupOptions().cma == pyddp.CmaReads.ALWAYS
