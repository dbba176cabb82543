"""Run untrusted (model-generated) Python programs in a contained subprocess.

Containment is layered, because every layer alone is leaky:

1. Operating system. Each program gets its own session/process group, rlimits on
   CPU time, address space, file size, processes and core dumps, a fresh temporary
   working directory, an explicit environment (nothing inherited, so no secrets), and
   a private network namespace (no interfaces but a downed loopback) where the kernel
   allows one. When the evaluator runs as root the child also drops to a throwaway
   uid: root ignores RLIMIT_NPROC and file permissions and may signal anything, a
   throwaway uid is bound by all three.
2. Interpreter. An audit hook (which cannot be removed once installed) refuses
   fork/exec/kill, sockets, ctypes, writes outside the working directory and reads
   outside it and the standard library. This is the main write/kill barrier when we
   are not root; it stops careless programs, not a determined attacker.
3. Cleanup. The process group, and (as root) every process of the throwaway uid, is
   SIGKILLed when the run ends, and the working directory is removed.

"Passed" means the program ran to its end: exiting early (sys.exit(0) inside the
function under test, os._exit) is a failure, or such a completion would pass.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

STATUSES = ("passed", "failed", "timeout", "error")
_SETUP_FAILED = 121  # bootstrap exit code when the sandbox itself could not be set up
_TAIL_CHARS = 2000

# Throwaway uids for root runs, a fresh one per run (for a million runs), so that
# RLIMIT_NPROC and the final kill-by-uid only ever concern that run. The pid term
# keeps two evaluators on one machine apart.
_UID_BASE = 1_500_000_000
_run_counter = itertools.count()

# Runs inside the child, before the program. It imports little and drops ctypes
# again, because an already-imported module raises no "import" audit event.
_BOOTSTRAP = r"""
import os, sys, resource

def _main():
    cpu_s, mem, nproc, fsize, uid, guards = map(int, sys.argv[1:7])
    sys.argv = ["program.py"]
    _exit, work = os._exit, os.path.realpath(os.getcwd())
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for res, soft, hard in ((resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, mem, mem),
                                (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                                (resource.RLIMIT_CORE, 0, 0)):
            resource.setrlimit(res, (soft, hard))
        netns = False
        if uid >= 0:
            netns = libc.unshare(0x40000000) == 0  # CLONE_NEWNET
            # The interpreter may live where the throwaway uid cannot read (/root/.pyenv):
            # load the stdlib that HumanEval-style programs use while we still can.
            for m in ("math", "re", "string", "collections", "itertools", "functools", "typing", "heapq",
                      "bisect", "copy", "operator", "random", "hashlib", "fractions", "decimal", "statistics",
                      "datetime", "json", "socket", "encodings.idna", "shutil", "signal"):
                __import__(m)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if not netns:  # unprivileged: a user namespace buys a network namespace, where allowed
            libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG=SIGKILL (after setuid, which clears it)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binaries
        del libc, ctypes
        for m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
            del sys.modules[m]
        with open("program.py", encoding="utf-8") as f:
            source = f.read()
        if guards:
            _install_guards(work)
        main = type(sys)("__main__")
        sys.modules["__main__"] = main
    except BaseException as e:
        sys.excepthook(type(e), e, e.__traceback__)
        _exit(121)
    try:
        exec(compile(source, "program.py", "exec"), main.__dict__)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException as e:  # SystemExit too: see the module docstring
        try:
            sys.excepthook(type(e), e, e.__traceback__)
        finally:
            _exit(1)
    _exit(0)

def _install_guards(work):
    prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    readable = tuple({os.path.realpath(p) for p in (work, *prefixes)})
    devices = ("/dev/null", "/dev/urandom", "/dev/zero")
    deny = {"os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
            "os.kill", "os.killpg", "pty.spawn"}
    deny_modules = {"_ctypes", "_posixsubprocess", "_socket"}  # C entry points around audited APIs
    writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
              "os.symlink", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "os.chflags",
              "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
              "shutil.chown"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def under(path, roots):
        p = os.path.realpath(os.fsdecode(path))
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event, args):
        if event in deny or event.startswith(("socket.", "ctypes.")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in deny_modules:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            writing = bool(mode and set(mode) & set("wax+")) or bool(flags & write_flags)
            if writing and not under(path, (work,)):
                raise PermissionError(f"sandbox: no writing outside the working directory: {path}")
            if not writing and not under(path, readable) and os.fsdecode(path) not in devices:
                raise PermissionError(f"sandbox: no reading outside the working directory and stdlib: {path}")
            # A directory fd would let os.open(..., dir_fd=) escape the path check above.
            if os.path.isdir(path) and not under(path, (work,)):
                raise PermissionError(f"sandbox: no opening directories outside the working dir: {path}")
        elif event in ("os.listdir", "os.scandir"):
            if isinstance(args[0], (str, bytes, os.PathLike)) and not under(args[0], readable):
                raise PermissionError(f"sandbox: no listing outside the working directory: {args[0]}")
        elif event in writes:
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not under(a, (work,)):
                    raise PermissionError(f"sandbox: {event} outside the working directory: {a}")

    sys.addaudithook(hook)

    def refuse_exit(code=0):
        raise SystemExit(f"sandbox: os._exit({code}) is not allowed")

    os._exit = refuse_exit

_main()
"""


@dataclass(frozen=True)
class SandboxResult:
    status: str  # one of STATUSES
    returncode: int | None
    stderr_tail: str = ""
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 32,
    max_file_mb: int = 16,
    python_guards: bool = True,
) -> SandboxResult:
    """Run `code` as a Python program in a sandbox; see the module docstring.

    `max_procs` counts threads too. `python_guards=False` leaves out the interpreter
    layer (tests use it to check that the operating-system layer holds on its own).
    """
    work = tempfile.mkdtemp(prefix="tunelab-sandbox-")
    uid = _throwaway_uid() if os.geteuid() == 0 else -1
    # Unprivileged, RLIMIT_NPROC counts all of our user's threads.
    nproc = max_procs if uid >= 0 else sum(_tasks_of_uid(os.getuid()).values()) + max_procs
    limits = (math.ceil(timeout_s) + 1, memory_mb << 20, nproc, max_file_mb << 20, uid, int(python_guards))
    start = time.monotonic()
    try:
        with open(os.path.join(work, "program.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid >= 0:
            os.chown(work, uid, uid)
        with tempfile.TemporaryFile() as err:  # unlinked: the program cannot reach it by path
            try:
                proc = subprocess.Popen(
                    # -P: no cwd on sys.path; no -E/-I, so the env below (PYTHONHASHSEED) applies.
                    [sys.executable, "-S", "-P", "-c", _BOOTSTRAP, *map(str, limits)],
                    cwd=work,
                    env=_child_env(work),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as e:
                return SandboxResult("error", None, f"could not start the sandbox: {e}")
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_everything(proc.pid, uid)
                proc.wait()
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - 4 * _TAIL_CHARS))
            tail = err.read().decode("utf-8", "replace")[-_TAIL_CHARS:]
    finally:
        _remove_tree(work)
    rc = proc.returncode
    if timed_out or rc == -signal.SIGXCPU:
        status = "timeout"
    elif rc == 0:
        status = "passed"
    elif rc == _SETUP_FAILED:
        status = "error"
    else:
        status = "failed"
    return SandboxResult(status, rc, tail, time.monotonic() - start)


def _throwaway_uid() -> int:
    return _UID_BASE + (os.getpid() % 1000) * 1_000_000 + next(_run_counter) % 1_000_000


def _child_env(work: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONUTF8": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _tasks_of_uid(uid: int) -> dict[int, int]:
    """{pid: thread count} of live (non-zombie) processes whose real uid is `uid`. Read from
    /proc/PID/status: /proc/PID is owned by root for processes that changed uid."""
    tasks = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # it exited meanwhile
            continue
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
            tasks[int(name)] = int(fields["Threads"])
    return tasks


def _kill_everything(pgid: int, uid: int) -> None:
    # killpg is atomic against concurrent forks within the group; processes that
    # escaped the group with setsid() still carry the throwaway uid.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid < 0:
        return
    for _ in range(100):
        pids = _tasks_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def _remove_tree(path: str) -> None:
    # Unprivileged, directories the program chmod-ed shut would resist rmtree. The
    # program is dead by now; still, never chmod through its symlinks.
    if os.geteuid() != 0:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                if not os.path.islink(os.path.join(root, d)):
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(root, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)
