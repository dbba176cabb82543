"""The data that crosses between the sandboxed program and the judge (evals/sandbox/wire.py)."""

import json
import math
import os
import struct
import subprocess
import sys
import threading

import pytest
from sandbox_wire_worst import WORST

from tunelab.evals.sandbox.wire import (
    COST_FACTOR,
    COST_SLACK,
    MAX_DEPTH,
    MAX_FRAME,
    WireError,
    decode,
    encode,
    receive,
    send,
)

U32 = struct.Struct("<I").pack


def _through(value):
    """`value` sent through a pipe by a writer thread (a frame can be larger than the pipe) and decoded."""
    r, w = os.pipe()

    def write() -> None:
        try:
            send(w, encode(value))
        finally:
            os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = decode(receive(r))
        assert receive(r) is None  # a clean end after the frame
        return got
    finally:
        writer.join()
        os.close(r)


VALUES = [None, True, False, 0, -7, 127, 128, -128, -129, 3**200, -(3**200), 0.1, -0.0, 1e308, "", "héllo\n",
          "\ud800 lone surrogate", b"\x00\xff", 2 + 3j, [1, [2, (3, 4)]], (), (1,), {"a": 1, 2: [3], (4, 5): None},
          {1, 2}, frozenset({"x"}), [1.5, 1, True], [[], {}, set(), ()]]  # fmt: skip


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_cross_unchanged_with_their_types(value):
    got = _through(value)
    assert got == value and type(got) is type(value)
    assert repr(got) == repr(value)  # int stays int, 1.0 float, True bool, tuple tuple, key order kept


def test_nan_and_infinities_cross():
    got = _through([math.nan, math.inf, -math.inf])
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf]


def test_an_iterator_arrives_as_an_iterator_over_its_items():
    got = _through(i * i for i in range(4))
    assert not isinstance(got, list) and list(got) == [0, 1, 4, 9]
    assert list(_through(map(str, [1, 2]))) == ["1", "2"]


def test_subclasses_arrive_as_their_builtin_base():
    class Always(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    class Big(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    got = _through([Always("no"), Big(5)])
    assert type(got[0]) is str and got[0] != "yes"
    assert type(got[1]) is int and got[1] == 5 and got[1] != 6


def test_what_is_not_data_does_not_cross():
    with pytest.raises(TypeError, match="cannot leave the sandbox"):
        encode(object())
    with pytest.raises(TypeError, match="cannot leave the sandbox"):
        encode([1, lambda: 2])
    deep: list = []
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(TypeError, match="nested deeper"):
        encode(deep)
    loop: list = []
    loop.append(loop)
    with pytest.raises(TypeError, match="nested deeper"):
        encode(loop)


@pytest.mark.parametrize(
    "forged",
    [b"", b"x", b"i" + U32(8) + b"\x01", b"s" + U32(2) + b"\xff\xfe", b"l" + U32(2) + b"N", b"NN",
     b"d" + U32(1) + b"l" + U32(0) + b"N", b"S" + U32(1) + b"l" + U32(0), b"f\x00\x00", b"l" + U32(1)],
    ids=["empty", "unknown tag", "short int", "bad utf-8", "short list", "trailing bytes", "unhashable key",
         "unhashable element", "short float", "open container"],
)  # fmt: skip
def test_forged_frames_are_refused(forged):
    with pytest.raises(WireError):
        decode(forged)


def test_nesting_past_the_limit_is_refused_without_recursion():
    frame = b"l" + U32(1)
    assert decode(frame * MAX_DEPTH + b"N") is not None
    with pytest.raises(WireError, match="nested deeper"):
        decode(frame * (MAX_DEPTH + 1) + b"N")
    with pytest.raises(WireError):
        decode(frame * 100_000 + b"N")  # far past any recursion limit


def test_frames_that_are_not_ours():
    r, w = os.pipe()
    os.write(w, U32(MAX_FRAME + 1))
    os.close(w)
    with pytest.raises(WireError, match="frame of"):
        receive(r)
    os.close(r)
    r, w = os.pipe()
    os.write(w, U32(10) + b"l\x01")  # the writer ended inside the frame
    os.close(w)
    with pytest.raises(WireError, match="ended inside"):
        receive(r)
    os.close(r)


def test_a_slow_reader_or_writer_times_out_at_the_deadline():
    import time

    r, w = os.pipe()
    os.set_blocking(r, False)
    with pytest.raises(TimeoutError):
        receive(r, time.monotonic() + 0.05)
    os.set_blocking(w, False)
    with pytest.raises(TimeoutError):  # nobody reads: the pipe fills
        send(w, b"x" * (1 << 20), time.monotonic() + 0.05)
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("shape", WORST)
def test_decoding_never_amplifies_past_its_budget(shape):
    """What decoding a frame costs stays within COST_FACTOR x its size + COST_SLACK: it either
    decodes within that or is refused once its count passes it. Measured as the rise of the
    peak resident memory of a process of its own, which decodes nothing else."""
    here = os.path.dirname(os.path.abspath(__file__))  # python -c imports sandbox_wire_worst from here
    argv = [sys.executable, "-c", _DECODE_ONE, shape]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=here)
    got = json.loads(out.stdout)
    assert got["peak_kb"] - got["before_kb"] <= (COST_FACTOR * got["frame"] + COST_SLACK) / 1024, (shape, got)
    # Most are refused: their objects cost more than COST_FACTOR per byte. The others show that a frame
    # within its budget decodes.
    assert got["refused"] == (shape in REFUSED), got


REFUSED = ("empty lists", "empty dicts", "empty sets", "iterators", "a set of ints", "a frozenset of ints",
           "a dict of ints", "one-character strs", "tuples of one")  # fmt: skip
_DECODE_ONE = """
import json, sys
from sandbox_wire_worst import WORST
from tunelab.evals.sandbox.wire import WireError, decode

def kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

frame = WORST[sys.argv[1]]()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (building the frame) is forgotten: VmHWM restarts from VmRSS
before = kb("VmRSS")
try:
    decode(frame)
    refused = False
except WireError:
    refused = True
print(json.dumps({"frame": len(frame), "before_kb": before, "peak_kb": kb("VmHWM"), "refused": refused}))
"""


def test_ordinary_answers_are_not_refused():
    assert _through(list(range(200_000))) == list(range(200_000))
    assert _through({str(i): [i, float(i)] for i in range(5_000)})["7"] == [7, 7.0]
    assert len(_through("x" * (8 << 20))) == 8 << 20
