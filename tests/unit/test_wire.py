"""The wire formats on their own: bootstrap blobs (common/blob.h) and the
collective descriptor (common/descriptor.h), whose one field table drives
equality, describe() and both mismatch reports (pairwise over shared memory,
by MAX-reduced words without it)."""

import pytest

import pyddp
from pyddp._C import _testing as t

KIND = {"all_reduce": 0, "all_gather": 1, "broadcast": 2}
DTYPE = {"float32": 0, "float64": 1}


def test_blob_round_trip_keeps_text_and_any_bytes():
    raw = bytes(range(256)) + b"\n=\x00"
    text = t.blob_write([("segment", "/pyddp-1f"), ("pid", "1234")], [("handle", raw)])
    assert t.blob_read(text, "segment", "str") == "/pyddp-1f"
    assert t.blob_read(text, "pid", "int") == 1234
    assert t.blob_read(text, "handle", "bytes") == raw


def test_a_blob_within_a_blob_survives():
    inner = t.blob_write([("segment", "/x"), ("bytes", "4096")], [])
    outer = t.blob_write([("token", "7")], [("control", inner.encode())])
    assert t.blob_read(t.blob_read(outer, "control", "bytes").decode(), "bytes", "uint") == 4096


@pytest.mark.parametrize("text, key, kind, message", [
    ("segment=/x\n", "pid", "int", "no field 'pid'"),
    ("pid=12x\n", "pid", "int", "is not a 64-bit integer"),
    ("pid=-1\n", "pid", "uint", "is not a non-negative 64-bit integer"),
    ("handle=0g\n", "handle", "bytes", "not hex"),
    ("handle=abc\n", "handle", "bytes", "odd-length hex"),
    ("no equals sign\n", "x", "str", "is not key=value"),
])
def test_malformed_blobs_are_refused_by_name(text, key, kind, message):
    with pytest.raises(RuntimeError, match=f"malformed a test blob.*{message}"):
        t.blob_read(text, key, kind)


def test_a_value_with_a_newline_is_refused():
    with pytest.raises(RuntimeError, match="holds a newline"):
        t.blob_write([("name", "two\nlines")], [])


def test_describe_shows_what_the_user_called():
    assert t.describe_desc({"kind": KIND["all_reduce"], "count": 4, "op": pyddp._C.RedOp.MAX,
                            "algo": pyddp.Algo.DIRECT}) == (
        "all_reduce(count=4, dtype=float32, op=MAX, algo=direct)")
    # No op for a broadcast, and its root is named src.
    assert t.describe_desc({"kind": KIND["broadcast"], "count": 3, "root": 1}) == (
        "broadcast(count=3, dtype=float32, src=1, algo=ring)")
    # A tensor in a registered buffer names it (none is not said).
    assert t.describe_desc({"kind": KIND["all_gather"], "count": 3, "window": 2}) == (
        "all_gather(count=3, dtype=float32, algo=ring, registered=buffer 2)")


@pytest.mark.parametrize("field, a, b, pairwise, ranged", [
    ("count", 10, 11, "count=11", "count from 10 to 11"),
    ("dtype", DTYPE["float32"], DTYPE["float64"], "dtype=float64",
     "dtype from float32 to float64"),
    ("kind", KIND["all_reduce"], KIND["all_gather"], "all_gather(",
     "kind from all_reduce to all_gather"),
    ("root", 0, 2, "src=2", "src from 0 to 2"),
    ("seq", 4, 5, "collective #4", "sequence number from 4 to 5"),
    ("algo", pyddp.Algo.RING, pyddp.Algo.DIRECT, "algo=direct", "algo from ring to direct"),
    ("window", 0, 2, "registered=buffer 2", "registered from none to buffer 2"),
])
def test_every_field_mismatch_is_reported_both_ways(field, a, b, pairwise, ranged):
    base = {"kind": KIND["broadcast"], "root": 0}
    descs = [{**base, field: a}, {**base, field: b}, {**base, field: a}]
    by_pairs, by_words = t.desc_mismatch(descs, 0)
    assert "differs between ranks: rank 0 called" in by_pairs and pairwise in by_pairs, by_pairs
    assert ranged in by_words, by_words
    # A rank that agrees with rank 0 but not rank 1 learns of it too.
    assert t.desc_mismatch(descs, 2)[1]


def test_agreeing_descriptors_pass_both_ways():
    same = {"kind": KIND["all_reduce"], "count": 7, "op": pyddp._C.RedOp.SUM}
    assert t.desc_mismatch([same, same, same], 1) == ("", "")


def test_an_absent_root_reads_as_none():
    descs = [{"kind": KIND["broadcast"], "root": 1}, {"kind": KIND["all_reduce"], "root": -1}]
    assert "src from none to 1" in t.desc_mismatch(descs, 0)[1]
