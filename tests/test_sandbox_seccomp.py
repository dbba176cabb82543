"""The seccomp filter's decisions (seccomp.py), read by a small interpreter of classic
BPF, for both architectures it has tables for: every refused call, and the calls refused for
some arguments only. The kernel's reading of the same filter is tried by the hostile programs
of tests/test_sandbox.py."""

import errno
import struct

import pytest

from tunelab.evals.sandbox import seccomp

ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


def decide(machine: str, name: str, *args: int) -> str:
    """What the filter returns for the call `name` with `args`: ALLOW, KILL or an errno name."""
    arch, table = seccomp._TABLES[machine]
    prog = seccomp.program(machine)
    ops = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    nr = table[name] if isinstance(name, str) else name
    data = struct.pack("<iIQ", nr, arch, 0) + b"".join(struct.pack("<Q", a) for a in [*args, 0, 0, 0, 0, 0, 0][:6])
    pc, acc = 0, 0
    for _ in range(len(ops)):  # no loops in classic BPF: every jump goes forward
        code, jt, jf, k = ops[pc]
        if code == 0x20:  # ld [k]
            acc, pc = struct.unpack_from("<I", data, k)[0], pc + 1
        elif code in (0x15, 0x45, 0x35):  # jeq, jset, jge
            hit = acc == k if code == 0x15 else bool(acc & k) if code == 0x45 else acc >= k
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:  # ret
            return {0x7FFF0000: "ALLOW", 0x80000000: "KILL"}.get(k) or errno.errorcode[k & 0xFFFF]
    raise AssertionError("ran off the end of the filter")


@pytest.mark.parametrize("machine", ARCHES)
def test_every_refused_call_is_refused(machine):
    table = seccomp._TABLES[machine][1]
    refused = [n for n in seccomp._DENIED if n in table]
    assert {n: decide(machine, n) for n in refused} == {n: "EPERM" for n in refused}
    assert decide(machine, "clone3") == "ENOSYS"  # glibc falls back to clone, whose flags are checked
    assert {"memfd_create", "shmget", "msgget", "semget", "mq_open", "preadv2", "cachestat", "mincore"} <= set(refused)
    # issue 51: no names for sockets (so no listener backlog), no pages lent to pipes, no inotify, no pidfds
    assert {"bind", "connect", "listen", "vmsplice", "splice", "tee", "inotify_init1", "inotify_add_watch",
            "pidfd_open"} <= set(refused)  # fmt: skip


@pytest.mark.parametrize("machine", ARCHES)
def test_calls_refused_for_some_arguments_only(machine):
    AF_UNIX, AF_INET, AF_NETLINK, AF_PACKET, AF_VSOCK = 1, 2, 16, 17, 40
    for family in (AF_INET, AF_NETLINK, AF_PACKET, AF_VSOCK, 63):
        assert decide(machine, "socket", family, 1, 0) == decide(machine, "socketpair", family, 1, 0) == "EPERM"
    assert decide(machine, "socket", AF_UNIX, 1, 0) == decide(machine, "socketpair", AF_UNIX, 1, 0) == "ALLOW"
    assert decide(machine, "clone", 0x3D0F00) == "ALLOW"  # glibc's pthread_create
    assert decide(machine, "clone", 0x01200011) == "ALLOW"  # fork
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000, 0x08000000):  # NEWUSER, NEWPID, NEWNET, NEWNS, NEWIPC
        assert decide(machine, "clone", 0x01200011 | flag) == "EPERM"
    for option in (7, 8, 32, 33):  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
        assert decide(machine, "setsockopt", 3, 1, option) == "EPERM"
    for option in (16, 34, 76):  # SO_PASSCRED, SO_PASSSEC, SO_PASSPIDFD: each would bind a name as the socket sends
        assert decide(machine, "setsockopt", 3, 1, option) == "EPERM"
    assert decide(machine, "setsockopt", 3, 1, 2) == "ALLOW"  # SO_REUSEADDR
    assert decide(machine, "setsockopt", 3, 6, 7) == "ALLOW"  # another level's option 7 (TCP_MAXSEG's level, say)
    for option in (57, 71, 77):  # SO_COOKIE, SO_NETNS_COOKIE, SO_PEERPIDFD: counters kept between runs
        assert decide(machine, "getsockopt", 3, 1, option) == "EPERM"
    for option in (3, 4, 7, 17):  # SO_TYPE, SO_ERROR, SO_SNDBUF, SO_PEERCRED
        assert decide(machine, "getsockopt", 3, 1, option) == "ALLOW"
    assert decide(machine, "clone", 0x01200011 | 0x1000) == "EPERM"  # CLONE_PIDFD
    assert decide(machine, "fcntl", 3, 1031, 1 << 20) == "EPERM"  # F_SETPIPE_SZ
    for command in (6, 7, 37, 38):  # F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW: record locks
        assert decide(machine, "fcntl", 3, command) == "EPERM"
    assert decide(machine, "fcntl", 3, 3) == decide(machine, "fcntl", 3, 1032) == "ALLOW"  # F_GETFL, F_GETPIPE_SZ
    assert decide(machine, "fcntl", 3, 5) == "ALLOW"  # F_GETLK


def test_other_calls_are_allowed_and_other_abis_refused():
    assert decide("x86_64", 0) == decide("x86_64", 1) == "ALLOW"  # read, write
    assert decide("x86_64", 0x40000000) == "EPERM"  # the x32 ABI
    arch, _ = seccomp._TABLES["x86_64"]
    prog = seccomp.program("x86_64")
    assert struct.unpack_from("<HBBI", prog, 8)[3] == arch  # the first check is the architecture's
    assert seccomp.program("riscv64") is None
