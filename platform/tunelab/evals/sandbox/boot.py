"""The first code to run inside the sandbox; `contain.py` passes `wire.py` and then
this file's text to `python -c`.

Before the program runs, while this process still holds the privileges bwrap left it
(root without a user namespace; CAP_SYS_ADMIN in its own user namespace otherwise), it:
mounts /work, a tmpfs bounded in bytes *and* in files (bwrap's --tmpfs takes no inode
limit, and a flood of empty files would otherwise cost the host kernel memory), writes
program.py there, sets the resource limits, gives up every privilege (the throwaway uid
of a root evaluator; no capabilities at all in a user namespace) and installs the
seccomp filter (`seccomp.py`). Then it runs program.py as `__main__` and serves
calls: the judge (`judge.py`, another process, outside the sandbox) sends a
function's name and arguments, and gets back the value it returned or the exception it
raised, as plain data (`wire.py`). Nothing this process writes decides whether the
tests passed: the judge runs them, on its side.

Argument order: uid cpu_s mem nproc fsize nofile disk files source_fd seccomp_fd ready_fd
call_fd answer_fd. uid -1 keeps the uid (a user namespace); disk -1 mounts nothing and
installs no filter (the unsandboxed fallback, which runs in a folder of its own); -1
leaves a limit unset. Exit 121 means the sandbox itself could not be set up.
"""

import os
import resource
import sys

if TYPE_CHECKING:  # noqa: F821 (wire.py, prepended)
    import ctypes

_WORK = "/work"
# Signals queued to the program's processes together, and (each holds one queued signal) its POSIX
# timers: kernel memory no descriptor bounds. The kernel's own signals (SIGCHLD, SIGSEGV, ...) are
# queued past it.
_SIGPENDING = 64


def main() -> None:
    uid, cpu_s, mem, nproc, fsize, nofile, disk, files = map(int, sys.argv[1:9])
    source_fd, seccomp_fd, ready_fd, call_fd, answer_fd = map(int, sys.argv[9:14])
    sys.argv = ["program.py"]
    sys.path[:] = [p for p in sys.path if p]  # python -c puts the working directory first
    # Taken before the program runs: it may replace these names in their modules.
    write, exit_now, getpid = os.write, os._exit, os.getpid
    stdout, stderr, excepthook = sys.stdout, sys.stderr, sys.excepthook
    try:
        source = _read(source_fd)
        if disk >= 0:
            _mount_work(uid, disk, files, source)
        limits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, mem, mem),
                  (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                  (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0),
                  (resource.RLIMIT_MSGQUEUE, 0, 0), (resource.RLIMIT_MEMLOCK, 0, 0),
                  (resource.RLIMIT_SIGPENDING, _SIGPENDING, _SIGPENDING)]  # fmt: skip
        for res, soft, hard in limits:
            if soft >= 0:
                resource.setrlimit(res, (soft, hard))
        if disk >= 0:
            _give_up_privileges(uid)
            if seccomp_fd >= 0:
                _install_filter(_read(seccomp_fd))
        main_module = type(sys)("__main__")
        main_module.__file__ = "program.py"
        sys.modules["__main__"] = main_module
        me = getpid()
        write(ready_fd, b"R")  # set up; what follows is the program's
    except BaseException as e:
        excepthook(type(e), e, e.__traceback__)
        exit_now(121)
    try:
        exec(compile(source, "program.py", "exec"), main_module.__dict__)
    except BaseException as e:  # SystemExit too, whatever its code
        try:
            excepthook(type(e), e, e.__traceback__)
        finally:
            exit_now(1)
    if getpid() != me:  # a forked child that ran on to here is not the program
        exit_now(0)
    serve(main_module.__dict__, call_fd, answer_fd)
    stdout.flush()
    stderr.flush()
    exit_now(0)


def _read(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _libc() -> ctypes.CDLL:  # noqa: F821 (ctypes is imported to set the sandbox up, not for the plain fallback)
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount_work(uid: int, disk: int, files: int, source: bytes) -> None:
    libc = _libc()
    owner = uid if uid >= 0 else os.getuid()
    # huge=never: a page of a file here lent to a socket (sendfile) keeps 4 KiB alive, not a huge page's 2 MiB
    options = f"size={disk},nr_inodes={files},mode=0700,uid={owner},gid={owner},huge=never"
    _check(libc.mount(b"tmpfs", _WORK.encode(), b"tmpfs", 0x2 | 0x4, options.encode()), "mount /work")  # nosuid, nodev
    os.chdir(_WORK)  # bwrap left us in /, above the folder this mount now covers
    os.environ["PWD"] = _WORK
    with open("program.py", "wb") as f:
        f.write(source)
    if uid >= 0:
        os.chown("program.py", uid, uid)


def _give_up_privileges(uid: int) -> None:
    """Root evaluator: become the throwaway uid, which drops every capability. User namespace:
    the uid stays, and the capabilities bwrap left for the mount go (ambient ones too)."""
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        return
    import ctypes

    libc = _libc()
    ambient_clear_all = map(ctypes.c_ulong, (47, 4, 0, 0, 0))  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    _check(libc.prctl(*ambient_clear_all), "clear the ambient capabilities")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "drop the capabilities")


def _install_filter(program: bytes) -> None:
    import ctypes

    libc = _libc()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = SockFprog(len(program) // 8, program)
    ulong = ctypes.c_ulong
    _check(libc.prctl(ulong(38), ulong(1), ulong(0), ulong(0), ulong(0)), "no new privileges")  # PR_SET_NO_NEW_PRIVS
    _check(libc.prctl(ulong(22), ulong(2), ctypes.byref(fprog), ulong(0), ulong(0)), "install the seccomp filter")


def serve(namespace: dict, call_fd: int, answer_fd: int) -> None:
    """Answer the judge's calls until it closes its end."""
    while True:
        request = receive(call_fd)  # noqa: F821 (wire.py, prepended)
        if request is None:
            return
        try:
            name, args, kwargs = decode(request)  # noqa: F821
            answer = encode(("ok", namespace[name](*args, **kwargs)))  # noqa: F821
            if len(answer) > MAX_FRAME:  # noqa: F821
                raise TypeError(f"a value of {len(answer)} bytes cannot leave the sandbox (at most {MAX_FRAME})")  # noqa: F821
        except BaseException as e:  # SystemExit too: the judge decides what it means
            answer = encode(("raise", type(e).__name__, _text(e)))  # noqa: F821
        send(answer_fd, answer)  # noqa: F821


def _text(e: BaseException) -> str:
    try:
        return str(e)[:2000]
    except BaseException:  # a __str__ of the program's that raises
        return "<unprintable>"


if __name__ == "__main__":
    main()
