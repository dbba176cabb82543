"""How values cross between the judge (the tests) and the sandboxed program: plain data only.

The program's functions are called from the judge's process (`judge.py`), so what
a function returns must leave the sandbox as data: frames of a small binary format that
decode into builtin values (None, bool, int, float, complex, str, bytes, list, tuple, dict,
set, frozenset; an iterator or generator arrives as an iterator over its items). Whatever
the program sends, the judge gets builtins whose `==` is Python's own, never an object of
the program's making (a str subclass whose `__eq__` says True arrives as a plain str).

The judge decodes frames the program wrote, so decoding is bounded: a frame holds at most
MAX_FRAME bytes, containers nest at most MAX_DEPTH deep, and a frame of n bytes may build at
most COST_FACTOR * n + COST_SLACK bytes of objects (counted as they are built, from upper
bounds of CPython's object sizes); past that it is refused. No step is worse than linear in
the frame (ints are binary, not decimal text).

Stdlib only, no imports of tunelab: `contain.py` prepends this file's text to the boot
and judge scripts, which run with `python -I -S`.
"""

from __future__ import annotations  # first in the boot's and the judge's text too: no annotation runs

import os
import select
import struct
import time

TYPE_CHECKING = False  # typing costs the boot and the judge milliseconds each to import
if TYPE_CHECKING:
    from typing import Any

MAX_FRAME = 16 << 20  # one message: a call's arguments or one answer
MAX_DEPTH = 100  # containers inside containers
MAX_ITEMS = 1 << 20  # items taken from an iterator the program returns
COST_FACTOR = 8  # bytes of decoded objects per byte of frame, at most ...
COST_SLACK = 4 << 20  # ... plus this, so that small answers are never refused

_U32 = struct.Struct("<I")
_F64 = struct.Struct("<d")
_C128 = struct.Struct("<dd")
_TAGS = ((list, b"l"), (tuple, b"t"), (dict, b"d"), (frozenset, b"Z"), (set, b"S"))
_CONTAINERS = {tag[0]: kind for kind, tag in _TAGS} | {b"I"[0]: iter}
# Costs, at most, in bytes of 64-bit CPython's allocator (its blocks, GC headers included),
# checked against a process's peak memory by tests/test_sandbox_wire.py. An item in its
# container: a list slot with its over-allocation, and the list a tuple or frozenset is
# made from; a set or dict entry with the free space of its table right after a resize and
# the old table during one. An empty container: its object (an iterator is a list and one).
_ITEM_COST = {list: 10, tuple: 16, iter: 10, set: 160, frozenset: 176, dict: 160}
_EMPTY_COST = {list: 72, tuple: 56, iter: 128, set: 232, frozenset: 232, dict: 80}


class WireError(Exception):
    """A frame that is not one this module wrote: the program ended early or forged it."""


def encode(value: object) -> bytes:
    # Runs in the program's process too, where it defends nothing: `decode`, in the judge's,
    # does. A subclass of a builtin is sent as its base type's value.
    out = bytearray()
    _put(out, value, 0)
    return bytes(out)


def _put(out: bytearray, value: Any, depth: int) -> None:
    if value is None or value is True or value is False:
        out += b"N" if value is None else b"T" if value else b"F"
    elif isinstance(value, int):
        v = int.__int__(value)
        n = (v.bit_length() + 8) // 8  # room for the sign bit
        out += b"i" + _U32.pack(n) + v.to_bytes(n, "little", signed=True)
    elif isinstance(value, float):
        out += b"f" + _F64.pack(value)  # exact, nan and inf included
    elif isinstance(value, complex):
        out += b"c" + _C128.pack(value.real, value.imag)
    elif isinstance(value, str):
        data = str.encode(value, "utf-8", "surrogatepass")
        out += b"s" + _U32.pack(len(data)) + data
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + _U32.pack(len(value)) + bytes(value)
    else:
        _put_container(out, value, depth + 1)


def _put_container(out: bytearray, value: Any, depth: int) -> None:
    tag = next((t for kind, t in _TAGS if isinstance(value, kind)), None)
    items = [x for kv in value.items() for x in kv] if tag == b"d" else value
    if tag is None and hasattr(type(value), "__next__") and hasattr(type(value), "__iter__"):
        tag = b"I"
    if tag is None:
        raise TypeError(f"a {type(value).__name__} cannot leave the sandbox (plain data only)")
    if depth > MAX_DEPTH:
        raise TypeError(f"a value nested deeper than {MAX_DEPTH} cannot leave the sandbox")
    head, count = len(out), 0
    out += tag + b"\0\0\0\0"
    for item in items:
        if tag == b"I" and count == MAX_ITEMS:
            raise TypeError(f"an iterator of more than {MAX_ITEMS} items cannot leave the sandbox")
        _put(out, item, depth)
        count += 1
    if tag == b"d":
        count //= 2
    out[head + 1 : head + 5] = _U32.pack(count)


class Budget:
    """Bytes of objects decoding may still build: COST_FACTOR x the bytes received + COST_SLACK.
    The judge holds one for a run, so that answers the tests keep cannot add up past it."""

    def __init__(self, received: int = 0) -> None:
        self.left = COST_SLACK + COST_FACTOR * received
        self.total = self.left


def decode(data: bytes, budget: Budget | None = None) -> Any:
    """The value in one frame; WireError for anything `encode` did not write, for nesting
    deeper than MAX_DEPTH and for a value that would cost more than `budget` (by default,
    the frame's own: COST_FACTOR x its size + COST_SLACK)."""
    return _Decoder(data, budget or Budget(len(data))).value()


class _Decoder:
    """Iterative (no recursion to exhaust), charging every object as it is built. The loop is
    written out in one piece, with the budget in a local: frames of millions of items happen."""

    def __init__(self, data: bytes, budget: Budget) -> None:
        self.data = memoryview(data)  # slices of a memoryview copy nothing
        self.budget = budget

    def value(self) -> Any:
        try:
            return self._value()
        finally:
            self.budget.left = self.left

    def _value(self) -> Any:
        data, size, pos, unpack = self.data, len(self.data), 0, _U32.unpack_from
        self.left = left = self.budget.left
        stack: list[list] = []  # per open container: [kind, items still to come, items, set or dict, key]
        while True:
            tag = data[pos] if pos < size else -1
            if tag in _BULK:  # an int, str or bytes of n bytes
                if pos + 5 > size or pos + 5 + unpack(data, pos + 1)[0] > size:
                    raise WireError("the frame ends inside a value")
                n = unpack(data, pos + 1)[0]
                raw, pos = data[pos + 5 : pos + 5 + n], pos + 5 + n
                left -= _bulk_cost(tag, raw)
                value = _bulk(tag, raw) if left >= 0 else None
            elif tag in _CONTAINERS:
                if len(stack) == MAX_DEPTH or pos + 5 > size:
                    raise WireError(f"nested deeper than {MAX_DEPTH}" if pos + 5 <= size else "the frame ends early")
                kind, count = _CONTAINERS[tag], unpack(data, pos + 1)[0]
                pos, left = pos + 5, left - _EMPTY_COST[kind]
                made: set | dict | None = kind() if kind in (set, dict) else None
                stack.append([kind, count * (2 if kind is dict else 1), [], made, None])
                if count:
                    continue
                value = _close(stack.pop())
            else:
                value, pos = _fixed(data, tag, pos)
                left -= 0 if value is None or value is True or value is False else 48
            while left >= 0:  # hand the value to its container, closing each one it completes
                if not stack:
                    self.left = left
                    if pos != size:
                        raise WireError("bytes after the value")
                    return value
                frame = stack[-1]
                left -= _ITEM_COST[frame[0]]
                _add(frame, value)
                frame[1] -= 1
                if frame[1]:
                    break
                value = _close(stack.pop())
            if left < 0:
                self.left = left
                raise WireError(f"a frame of {size} bytes that would take decoded objects past "
                                f"{self.budget.total} bytes")  # fmt: skip


_BULK = frozenset(b"isb")


def _bulk_cost(tag: int, raw: memoryview) -> int:
    n = len(raw)
    if tag == 0x73:  # "s": ASCII takes a byte a character; other utf-8 at most 4 bytes a character
        return 64 + n if bytes(raw[:4096]).isascii() and (n <= 4096 or bytes(raw).isascii()) else 80 + 4 * n
    return 48 + 2 * n  # an int's 30-bit digits in 4 bytes each; bytes: n


def _bulk(tag: int, raw: memoryview) -> object:
    if tag == 0x73:  # "s"
        try:
            return str(raw, "utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise WireError(f"bad str: {e}") from None
    return int.from_bytes(raw, "little", signed=True) if tag == 0x69 else bytes(raw)


def _fixed(data: memoryview, tag: int, pos: int) -> tuple:
    """None, a bool, a float or a complex at `pos`, and the position after it."""
    if tag < 0:
        raise WireError("the frame ends inside a value")
    if tag in b"NTF":
        return (None if tag == 0x4E else tag == 0x54), pos + 1
    if tag == 0x66 and pos + 9 <= len(data):  # "f"
        return _F64.unpack_from(data, pos + 1)[0], pos + 9
    if tag == 0x63 and pos + 17 <= len(data):  # "c"
        return complex(*_C128.unpack_from(data, pos + 1)), pos + 17
    raise WireError("the frame ends inside a value" if tag in b"fc" else f"not a value this wire encodes (tag {tag})")


def _add(frame: list, value: object) -> None:
    kind = frame[0]
    try:
        if kind is list or kind is tuple or kind is iter or kind is frozenset:
            frame[2].append(value)
        elif kind is set:
            frame[3].add(value)
        elif frame[1] % 2 == 0:  # a dict's key; its value comes next
            hash(value)
            frame[4] = value
        else:
            frame[3][frame[4]] = value
    except TypeError as e:  # an unhashable key or element
        raise WireError(str(e)) from None


def _close(frame: list) -> object:
    kind = frame[0]
    return frame[3] if kind is set or kind is dict else frame[2] if kind is list else kind(frame[2])


def send(fd: int, payload: bytes, deadline: float | None = None) -> None:
    """Write one frame; on a non-blocking `fd`, TimeoutError once `deadline` (time.monotonic) passes."""
    if len(payload) > MAX_FRAME:
        raise TypeError(f"a value of {len(payload)} bytes cannot leave the sandbox (at most {MAX_FRAME})")
    data = memoryview(_U32.pack(len(payload)) + payload)
    while data:
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            _wait(fd, deadline, write=True)


def receive(fd: int, deadline: float | None = None) -> bytes | None:
    """The next frame's payload on `fd`, or None at a clean end of the stream (the writer closed it)."""
    head = _read_exactly(fd, _U32.size, deadline, eof_ok=True)
    if head is None:
        return None
    (size,) = _U32.unpack(head)
    if size > MAX_FRAME:
        raise WireError(f"a frame of {size} bytes")
    return _read_exactly(fd, size, deadline, eof_ok=False)


def _read_exactly(fd: int, size: int, deadline: float | None, eof_ok: bool) -> bytes | None:
    chunks, left = [], size
    while left:
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except BlockingIOError:
            _wait(fd, deadline, write=False)
            continue
        if not chunk:
            if eof_ok and left == size:
                return None
            raise WireError("the stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, deadline: float | None, write: bool) -> None:
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise TimeoutError
    ready = select.select([], [fd], [], left) if write else select.select([fd], [], [], left)
    if not any(ready):
        raise TimeoutError
