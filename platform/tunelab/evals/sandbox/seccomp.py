"""The seccomp filter of the sandbox: kernel interfaces a HumanEval program never needs.

The namespaces of `contain.py` decide what a program can *see*; this filter narrows which
kernel code it can *reach*, as container runtimes do. `boot.py` installs it just
before the program runs. It refuses (EPERM):

- new namespaces (unshare, setns, clone with a CLONE_NEW* flag) and mounting: a nested
  user namespace would hand the program capabilities over its own namespaces, the usual
  first step of a kernel exploit;
- kernel keyrings (keyctl, add_key, request_key): keyrings are not namespaced, and a
  process possesses its parent's session keyring, where logins keep credentials;
- debugging and memory access to other processes (ptrace, process_vm_*, pidfd_getfd);
- large, rarely needed kernel surfaces (bpf, perf_event_open, userfaultfd, io_uring,
  fanotify), file handles (open_by_handle_at), and administration calls that need
  capabilities anyway (modules, kexec, reboot, swap, quotas, acct, syslog);
- memory that RLIMIT_AS does not count: memfd_create, memfd_secret, System V shared memory,
  semaphores and message queues, POSIX message queues;
- ways to read or change the page cache's state of a file (mincore, cachestat,
  posix_fadvise, readahead, preadv2/pwritev2 with RWF_NOWAIT, process_madvise), which
  would make shared read-only files a memory that outlives a run;
- sockets of any address family but AF_UNIX (socket and socketpair): no AF_VSOCK, whose
  port space is the host's, no netlink, packet or anything else;
- names for sockets: bind, connect and listen, and the options that bind a socket to a name
  of the kernel's choosing as it sends (SO_PASSCRED, SO_PASSPIDFD, SO_PASSSEC). Sockets come
  in socketpairs: each can receive from its peer only, so what waits in its queue is at most
  one peer's send buffer, and no listener's backlog can hold the buffers of connections whose
  clients closed (1.2 GB with no descriptor held, issue 51);
- larger socket or pipe buffers (SO_SNDBUF, SO_RCVBUF and their FORCE forms, F_SETPIPE_SZ),
  and pages lent to pipes (vmsplice, splice, tee: a pipe buffer holding one page of a huge
  page or of a deleted file keeps all of it): kernel memory that, with RLIMIT_NOFILE, bounds
  what a process can hold in buffers;
- kernel objects no descriptor bounds: POSIX record locks (F_SETLK, F_SETLKW and their OFD
  forms: one per byte range, without limit) and inotify (its event queues and watches are
  bounded per user, far above a program's share);
- counters that the kernel shares between runs and a program can advance and read: the socket
  cookie (SO_COOKIE, a global counter: the next run read the previous value + 1), the network
  namespace's cookie (SO_NETNS_COOKIE), and pidfds (pidfd_open, CLONE_PIDFD, SO_PEERPIDFD),
  whose inode numbers count every process the machine starts.

clone3 answers ENOSYS: its flags sit in memory that a filter cannot read, and glibc then
falls back to clone, whose flags it can. Everything else is allowed. The filter is raw
classic BPF (what prctl(PR_SET_SECCOMP) takes), built here so that no libseccomp is needed.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: nr at 0, arch at 4, args[6] (u64 each) from 16; little-endian here.
_NR, _ARCH, _ARG0_LOW = 0, 4, 16
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000


def _errno(code: int) -> int:
    return 0x00050000 | code


# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET; NEWTIME is 0x80 (also CSIGNAL's bits)
_CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_CLONE_PIDFD = 0x00001000

_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "keyctl", "add_key", "request_key",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "name_to_handle_at", "acct", "reboot", "syslog", "swapon", "swapoff", "quotactl",
    "lookup_dcookie", "modify_ldt", "uselib", "iopl", "ioperm", "fanotify_init",
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
    "mq_getsetattr",
    "mincore", "cachestat", "fadvise64", "readahead", "preadv2", "pwritev2", "process_madvise",
    "bind", "connect", "listen", "vmsplice", "splice", "tee", "inotify_init", "inotify_init1", "inotify_add_watch",
    "pidfd_open",
)  # fmt: skip
_AF_UNIX = 1

# Numbers from the kernel's unistd headers, (x86_64, aarch64); None where an architecture lacks the call.
_NUMBERS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "pidfd_getfd": (438, 438),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "unshare": (272, 97),
    "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442), "bpf": (321, 280),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "acct": (163, 89),
    "reboot": (169, 142), "syslog": (103, 116), "swapon": (167, 224), "swapoff": (168, 225), "quotactl": (179, 60),
    "lookup_dcookie": (212, 18), "modify_ldt": (154, None), "uselib": (134, None), "iopl": (172, None),
    "ioperm": (173, None), "fanotify_init": (300, 262), "clone": (56, 220), "clone3": (435, 435),
    "socket": (41, 198), "socketpair": (53, 199), "setsockopt": (54, 208), "fcntl": (72, 25),
    "memfd_create": (319, 279), "memfd_secret": (447, 447), "shmget": (29, 194), "shmat": (30, 196),
    "shmctl": (31, 195), "shmdt": (67, 197), "semget": (64, 190), "semop": (65, 193), "semctl": (66, 191),
    "semtimedop": (220, 192), "msgget": (68, 186), "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187),
    "mq_open": (240, 180), "mq_unlink": (241, 181), "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183),
    "mq_notify": (244, 184), "mq_getsetattr": (245, 185), "mincore": (27, 232), "cachestat": (451, 451),
    "fadvise64": (221, 223), "readahead": (187, 213), "preadv2": (327, 286), "pwritev2": (328, 287),
    "process_madvise": (440, 440), "bind": (49, 200), "connect": (42, 203), "listen": (50, 201),
    "getsockopt": (55, 209), "vmsplice": (278, 75), "splice": (275, 76), "tee": (276, 77), "inotify_init": (253, None),
    "inotify_init1": (294, 26), "inotify_add_watch": (254, 27), "pidfd_open": (434, 434),
}  # fmt: skip
_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}  # audit arch, column of _NUMBERS
_TABLES: dict[str, tuple[int, dict[str, int]]] = {
    machine: (audit, {n: nr for n, nums in _NUMBERS.items() if (nr := nums[col]) is not None})
    for machine, (audit, col) in _ARCHES.items()}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


_SOL_SOCKET = 1
# setsockopt: SO_SNDBUF, SO_RCVBUF and their FORCE forms; SO_PASSCRED, SO_PASSSEC, SO_PASSPIDFD (a name as it sends)
_SETSOCKOPT_REFUSED = (7, 8, 32, 33, 16, 34, 76)
_GETSOCKOPT_REFUSED = (57, 71, 77)  # SO_COOKIE, SO_NETNS_COOKIE, SO_PEERPIDFD
# fcntl: F_SETPIPE_SZ; F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW
_FCNTL_REFUSED = (1031, 6, 7, 37, 38)


def program(machine: str | None = None) -> bytes | None:
    """The filter as bytes of `struct sock_filter`, or None for an architecture without a table."""
    table = _TABLES.get(machine or platform.machine())
    if table is None:
        return None
    arch, nr = table
    eperm = _errno(errno.EPERM)
    ops = [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, 1, 0), _op(_RET_K, _KILL_PROCESS), _op(_LD_W_ABS, _NR)]
    if arch == 0xC000003E:  # the x32 ABI reaches the same kernel under other numbers
        ops += [_op(_JGE_K, 0x40000000, 0, 1), _op(_RET_K, eperm)]
    for name in _DENIED:
        if name in nr:
            ops += [_op(_JEQ_K, nr[name], 0, 1), _op(_RET_K, eperm)]
    ops += [_op(_JEQ_K, nr["clone3"], 0, 1), _op(_RET_K, _errno(errno.ENOSYS))]
    return b"".join(ops + _argument_checks(nr, eperm))


def _argument_checks(nr: dict, eperm: int) -> list[bytes]:
    """Calls refused for some arguments only. Last, because loading an argument replaces the
    syscall number in the accumulator: a jump per call to its block of checks, then the blocks."""
    allow, refuse = _op(_RET_K, _ALLOW), _op(_RET_K, eperm)
    arg = [_ARG0_LOW + 8 * i for i in range(3)]  # the low 32 bits of the first three arguments

    def one_of(values: tuple[int, ...]) -> list[bytes]:  # the loaded value among `values`: refused
        return [*(_op(_JEQ_K, v, len(values) - i, 0) for i, v in enumerate(values)), allow, refuse]

    blocks = [
        # family: AF_UNIX only (no AF_VSOCK, whose port space is the host's, no netlink, no packet)
        (("socket", "socketpair"), [_op(_LD_W_ABS, arg[0]), _op(_JEQ_K, _AF_UNIX, 0, 1), allow, refuse]),
        # flags: no new namespaces, no pidfd
        (("clone",), [_op(_LD_W_ABS, arg[0]), _op(_JSET_K, _CLONE_NEW_FLAGS | _CLONE_PIDFD, 0, 1), refuse, allow]),
        # level, option: socket buffers stay at their default size (each is kernel memory), no names, no counters
        (("setsockopt",), [_op(_LD_W_ABS, arg[1]), _op(_JEQ_K, _SOL_SOCKET, 1, 0), allow, _op(_LD_W_ABS, arg[2]),
                           *one_of(_SETSOCKOPT_REFUSED)]),  # fmt: skip
        (("getsockopt",), [_op(_LD_W_ABS, arg[1]), _op(_JEQ_K, _SOL_SOCKET, 1, 0), allow, _op(_LD_W_ABS, arg[2]),
                           *one_of(_GETSOCKOPT_REFUSED)]),  # fmt: skip
        # command: pipe buffers, record locks
        (("fcntl",), [_op(_LD_W_ABS, arg[1]), *one_of(_FCNTL_REFUSED)]),
    ]
    dispatch = [(name, b) for b, (names, _) in enumerate(blocks) for name in names]
    starts, at = [], len(dispatch) + 1  # after the jumps and the allow between them and the blocks
    for _, ops in blocks:
        starts.append(at)
        at += len(ops)
    jumps = [_op(_JEQ_K, nr[name], starts[b] - (j + 1), 0) for j, (name, b) in enumerate(dispatch)]
    return [*jumps, allow, *(op for _, ops in blocks for op in ops)]
