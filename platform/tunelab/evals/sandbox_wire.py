"""How values cross between the judge (the tests) and the sandboxed program: plain data only.

The program's functions are called from the judge's process (`sandbox_judge.py`), so what
a function returns must leave the sandbox as data: tagged JSON frames that decode into
builtin values (None, bool, int, float, complex, str, bytes, list, tuple, dict, set,
frozenset; an iterator or generator arrives as an iterator over its items). Whatever the
program sends, the judge gets builtins whose `==` is Python's own, never an object of the
program's making (a str subclass whose `__eq__` says True arrives as a plain str).

Stdlib only, no imports of tunelab: `sandbox.py` prepends this file's text to the boot
and judge scripts, which run with `python -I -S`.
"""

import json
import os
import struct
import sys

_FRAME = struct.Struct("<I")
MAX_FRAME = 64 << 20  # one call's arguments or one answer
MAX_ITEMS = 1 << 20  # items taken from an iterator the program returns


def open_wire() -> None:
    """Called first by the boot and the judge (not on import: it changes the interpreter)."""
    sys.set_int_max_str_digits(0)  # a big int is a value like any other


class WireError(Exception):
    """A frame that is not one this module wrote: the program ended early or forged it."""


def encode(value):
    # Runs in the program's process, so it defends nothing: `decode`, in the judge's, does.
    # A subclass of a builtin is sent as its base type's value.
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"f": float(value).hex()}  # exact, nan and inf included
    if isinstance(value, complex):
        return {"c": [value.real.hex(), value.imag.hex()]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"t": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, (set, frozenset)):
        return {"fs" if isinstance(value, frozenset) else "s": [encode(v) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if hasattr(type(value), "__next__") and hasattr(type(value), "__iter__"):
        items = []
        for item in value:
            if len(items) == MAX_ITEMS:
                raise TypeError(f"an iterator of more than {MAX_ITEMS} items cannot leave the sandbox")
            items.append(encode(item))
        return {"i": items}
    raise TypeError(f"a {type(value).__name__} cannot leave the sandbox (plain data only)")


_DECODERS = {
    "f": float.fromhex,
    "c": lambda v: complex(float.fromhex(v[0]), float.fromhex(v[1])),
    "t": lambda v: tuple(decode(x) for x in v),
    "d": lambda v: {decode(k): decode(x) for k, x in v},
    "s": lambda v: {decode(x) for x in v},
    "fs": lambda v: frozenset(decode(x) for x in v),
    "b": bytes.fromhex,
    "i": lambda v: iter([decode(x) for x in v]),
}


def decode(data):
    if data is None or isinstance(data, (bool, int, str)):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict) and len(data) == 1:
        (tag, v), = data.items()
        if tag in _DECODERS:
            try:
                return _DECODERS[tag](v)
            except (TypeError, ValueError) as e:
                raise WireError(f"bad {tag!r} value: {e}") from None
    raise WireError(f"not a value this wire encodes: {str(data)[:80]}")


def send(fd, message) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise TypeError(f"a value of {len(data)} bytes cannot leave the sandbox (at most {MAX_FRAME})")
    data = _FRAME.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def receive(fd):
    """The next message on `fd`, or None at a clean end of the stream (the writer closed it)."""
    head = _read_exactly(fd, _FRAME.size, eof_ok=True)
    if head is None:
        return None
    (size,) = _FRAME.unpack(head)
    if size > MAX_FRAME:
        raise WireError(f"a frame of {size} bytes")
    try:
        return json.loads(_read_exactly(fd, size, eof_ok=False))
    except (ValueError, RecursionError) as e:
        raise WireError(f"not JSON: {e}") from None


def _read_exactly(fd, size, eof_ok):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if eof_ok and left == size:
                return None
            raise WireError("the stream ended inside a frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
