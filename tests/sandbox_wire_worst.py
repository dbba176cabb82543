"""Frames built to get the most objects out of the fewest bytes, for tests/test_sandbox_wire.py.

Each entry builds its frame when called (so that a process that decodes one builds only that).
"""

import struct

_U32 = struct.Struct("<I").pack
N = 200_000


def _list(items: list[bytes], tag: bytes = b"l") -> bytes:
    return tag + _U32(len(items)) + b"".join(items)


def _int(v: int) -> bytes:
    n = (v.bit_length() + 8) // 8
    return b"i" + _U32(n) + v.to_bytes(n, "little", signed=True)


WORST = {
    "empty lists": lambda: _list([b"l" + _U32(0)] * N),
    "empty dicts": lambda: _list([b"d" + _U32(0)] * N),
    "empty sets": lambda: _list([b"S" + _U32(0)] * N),
    "iterators": lambda: _list([b"I" + _U32(0)] * N),
    "tuples of one": lambda: _list([b"t" + _U32(1) + b"N"] * N, b"t"),
    "ints": lambda: _list([_int(v << 20) for v in range(N)]),
    "a set of ints": lambda: _list([_int(v) for v in range(N)], b"S"),
    "a frozenset of ints": lambda: _list([_int(v) for v in range(N)], b"Z"),
    "a dict of ints": lambda: b"d" + _U32(N) + b"".join(_int(v) + b"N" for v in range(N)),
    "one-character strs": lambda: _list([b"s" + _U32(2) + chr(0x100 + v % 1000).encode() for v in range(N)]),
    "4-byte characters": lambda: b"s" + _U32(4 * N) + "\U0001f600".encode() * N,
    "floats": lambda: _list([b"f" + struct.pack("<d", v + 0.5) for v in range(N)]),
}
