"""The data that crosses between the sandboxed program and the judge (sandbox_wire.py)."""

import math
import os

import pytest

from tunelab.evals.sandbox_wire import MAX_FRAME, WireError, decode, encode, receive, send


def _through(value):
    r, w = os.pipe()
    try:
        send(w, encode(value))
        os.close(w)
        w = -1
        got = decode(receive(r))
        assert receive(r) is None  # a clean end after the frame
        return got
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


VALUES = [None, True, False, 0, -7, 3**200, 0.1, -0.0, 1e308, "", "héllo\n", b"\x00\xff", 2 + 3j,
          [1, [2, (3, 4)]], (), (1,), {"a": 1, 2: [3], (4, 5): None}, {1, 2}, frozenset({"x"}), [1.5, 1, True]]


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

    got = _through(Always("no"))
    assert type(got) is str and got != "yes"


def test_what_is_not_data_does_not_cross():
    with pytest.raises(TypeError, match="cannot leave the sandbox"):
        encode(object())
    with pytest.raises(TypeError, match="cannot leave the sandbox"):
        encode([1, lambda: 2])


@pytest.mark.parametrize(
    "forged", [1.5, {"eval": "3 * x"}, {"f": "not hex"}, {"t": [1], "s": [2]}, {"d": [[1]]}, {"i": 3}], ids=repr
)
def test_forged_frames_are_refused(forged):
    with pytest.raises(WireError):
        decode(forged)


def test_frames_that_are_not_ours():
    r, w = os.pipe()
    os.write(w, (MAX_FRAME + 1).to_bytes(4, "little"))
    os.close(w)
    with pytest.raises(WireError, match="frame of"):
        receive(r)
    os.close(r)
    r, w = os.pipe()
    os.write(w, (10).to_bytes(4, "little") + b'{"ok"')  # the writer ended inside the frame
    os.close(w)
    with pytest.raises(WireError, match="ended inside"):
        receive(r)
    os.close(r)
