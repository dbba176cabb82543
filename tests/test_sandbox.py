"""The HumanEval sandbox, tried as an attacker would, from a root and an unprivileged evaluator
(tests/sandbox_fixtures.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from string import Template

import pytest
from sandbox_evaluator import sandboxed_tasks
from sandbox_hostile import (
    ENV_SECRET,
    FILE_SECRET,
    FORGERIES,
    HOSTILE,
    KERNEL_HOG,
    NOBODY,
    PAGE_TABLE_HOG,
    PREAMBLE,
    SOCKET_HOG,
)

from tunelab.core.errors import UserError
from tunelab.evals.sandbox import contain, wire
from tunelab.evals.sandbox.contain import check_available, run_program

pytest_plugins = ("sandbox_fixtures",)  # the fixtures `arena` and `evaluator`
ROOT = os.geteuid() == 0
needs_sandbox = pytest.mark.skipif(check_available() is not None, reason=f"no kernel containment: {check_available()}")

# --------------------------------------------------------------------------- checks


def reset(arena) -> None:
    victim = arena["fields"]["victim"]
    victim.write_text("keep me")
    victim.chmod(0o666)
    if ROOT:
        os.chown(victim, NOBODY, NOBODY)


def assert_nothing_happened(arena, ev, answer) -> None:
    outside = arena["outside"]
    tail = answer["stderr_tail"]
    assert ENV_SECRET not in tail and FILE_SECRET not in tail, tail
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert (outside / "victim.txt").read_text() == "keep me"
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run", "/"):
        assert not os.path.exists(f"{folder}/tunelab-escape-{arena['tag']}"), folder
    assert answer["signals"] == 0 and answer["environ_same"]
    for s in arena["sockets"]:
        with pytest.raises(BlockingIOError):
            s.accept()
    # Every process of the program is gone by the time run_program returns: looked for by the
    # evaluator at once, and here again.
    assert answer["leftovers"] == []
    assert sandboxed_tasks(answer["host_uid"]) - ev.elsewhere == set()


# --------------------------------------------------------------------------- hostile programs


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_is_contained(name, evaluator, arena):
    reset(arena)
    hostile = HOSTILE[name]
    fields = {**arena["fields"], "evaluator_pid": evaluator.pid, "evaluator_pgid": evaluator.pgid}
    code = PREAMBLE + Template(hostile.source).substitute(fields)
    answer = evaluator.run(code, **{"timeout_s": 3.0, **hostile.limits})
    assert "error" not in answer, answer
    assert answer["status"] in hostile.expect, answer["stderr_tail"]
    assert_nothing_happened(arena, evaluator, answer)


@pytest.mark.parametrize("name", FORGERIES)
def test_a_program_cannot_make_failing_tests_pass(name, evaluator):
    """Every way we know to pass a task's tests without returning the right values: the
    tests run in the judge, which holds the only channel that says "passed"."""
    tests = "import secrets\nx = secrets.randbelow(10**9)\nassert triple(x) == 3 * x, x\n"
    answer = evaluator.run(PREAMBLE + FORGERIES[name], tests, calls=("triple",))
    assert "error" not in answer, answer
    assert answer["status"] == "failed", answer["stderr_tail"]
    assert answer["leftovers"] == []
    honest = evaluator.run("def triple(x):\n    return 3 * x\n", tests, calls=("triple",))
    assert honest["status"] == "passed", honest["stderr_tail"]


# --------------------------------------------------------------------------- honest programs


def test_passing_and_failing_programs(evaluator):
    ok = evaluator.run("import os, sys, math\nassert math.gcd(12, 18) == 6\nprint(os.getcwd(), file=sys.stderr)\n")
    assert ok["status"] == "passed" and ok["returncode"] == 0, ok
    assert ok["stderr_tail"].strip() == "/work"
    wrong = evaluator.run("def f():\n    return 1\nassert f() == 2, 'wrong answer'\n")
    assert wrong["status"] == "failed" and "AssertionError: wrong answer" in wrong["stderr_tail"]
    assert evaluator.run("def f(:\n")["status"] == "failed"
    assert evaluator.run("raise ValueError")["status"] == "failed"
    # if __name__ == "__main__" blocks run, as under `python program.py`
    assert evaluator.run("if __name__ == '__main__':\n    raise ValueError\n")["status"] == "failed"


def test_what_a_program_sees(evaluator):
    """The whole standard library works; of the host, only the Python installation is there."""
    code = (
        "import os, sys, subprocess, tempfile, json, threading\n"
        "import hashlib, sqlite3, ssl, ctypes, decimal, lzma, bz2, zlib, unicodedata, array, math, random\n"
        "import collections, itertools, functools, heapq, bisect, re, string, fractions, statistics, datetime\n"
        "import xml.etree.ElementTree as ET, uuid, zoneinfo, csv, pickle, struct, binascii, select, mmap\n"
        "assert ET.fromstring('<a><b/></a>')[0].tag == 'b'\n"
        "assert hashlib.sha256(b'x').hexdigest().startswith('2d711642')\n"
        "assert sqlite3.connect(':memory:').execute('select 1+1').fetchone() == (2,)\n"
        "assert ctypes.CDLL(None).abs(-3) == 3\n"
        "out = subprocess.run([sys.executable, '-c', 'print(6*7)'], capture_output=True, text=True).stdout\n"
        "assert out.strip() == '42', out\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "with tempfile.NamedTemporaryFile() as f:\n    assert f.name.startswith('/work/')\n"
        "open('scratch.txt', 'w').write('hi')\nassert open('scratch.txt').read() == 'hi'\n"
        "top = sorted(os.listdir('/'))\n"
        "assert set(top) <= {'bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32', 'usr', 'etc', 'dev', 'work', "
        "'root', 'opt', 'home', 'srv'}, top\n"
        "assert (os.listdir('/etc') if os.path.exists('/etc') else []) in (['ld.so.cache'], [])\n"
        "assert not os.path.exists('/proc/self') and not os.path.exists('/tmp') and not os.path.exists('/bin/sh')\n"
        "assert sorted(os.environ) == ['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE', 'PYTHONHASHSEED', "
        "'PYTHONUTF8', 'TMPDIR'], sorted(os.environ)\n"
        "assert os.environ['HOME'] == os.environ['PWD'] == os.getcwd() == '/work'\n"
        "assert sorted(os.listdir('/dev')) == ['full', 'null', 'random', 'urandom', 'zero'], os.listdir('/dev')\n"
        "import sysconfig\nsite = sysconfig.get_paths()['purelib']\n"
        "assert not os.path.exists(site) or os.listdir(site) == [], site\n"
        "import socket, asyncio\na, b = socket.socketpair()\na.send(b'x')\nassert b.recv(1) == b'x'\n"
        "asyncio.run(asyncio.sleep(0))  # an event loop: AF_UNIX socketpairs\n"
    )
    answer = evaluator.run(code, timeout_s=10.0)
    assert answer["status"] == "passed", answer["stderr_tail"]


def test_secrets_of_the_evaluator_never_reach_a_program(evaluator, arena):
    """Environment and files: the program looks everywhere it could and finds nothing."""
    fields = arena["fields"]
    code = (
        "import os, sys\n"
        "seen = {'env-' + 'secret': False, 'file-' + 'secret': False}  # not in this file as such\n"
        "def look(text):\n"
        "    for k in seen:\n"
        "        seen[k] = seen[k] or k in text\n"
        "look(' '.join(os.environ.values()))\n"
        "n = 0\n"
        f"paths = [{str(fields['netrc'])!r}, {str(fields['ssh_key'])!r}, {str(fields['public'])!r}, "
        "os.path.expanduser('~/.netrc'), '/proc/1/environ', '/proc/self/environ']\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if os.path.join(root, d) != '/dev']\n"
        "    paths += [os.path.join(root, name) for name in files if name != 'program.py']\n"
        "for path in paths:\n"
        "    try:\n        look(open(path, 'rb').read(1 << 16).decode('latin-1'))\n        n += 1\n"
        "    except OSError:\n        pass\n"
        "print(seen['env-secret'], seen['file-secret'], n, file=sys.stderr)\n"
    )
    answer = evaluator.run(code, timeout_s=30.0)
    assert answer["status"] == "passed", answer["stderr_tail"]
    env_found, file_found, n_files = answer["stderr_tail"].split()
    assert (env_found, file_found) == ("False", "False") and int(n_files) > 100  # it did read the stdlib


# --------------------------------------------------------------------------- bounds (issue 28)


def _report(evaluator, code: str) -> object:
    """Run a probe in the sandbox that prints what it found as JSON, last, on stderr."""
    answer = evaluator.run(PREAMBLE + "import json\n" + code, timeout_s=20.0)
    assert answer["status"] == "passed", answer["stderr_tail"]
    return json.loads(answer["stderr_tail"].strip().splitlines()[-1])


def test_only_unix_sockets_whatever_the_family(evaluator):
    """Every address family but AF_UNIX is refused by the filter (EPERM: a family the kernel lacks
    would say EAFNOSUPPORT), for every socket type, with socket() and socketpair()."""
    code = (
        "import json\nseen = {}\n"
        "for family in range(1, 64):\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):\n"
        "        for make in (socket.socket, socket.socketpair):\n"
        "            try:\n                made = make(family, kind)\n"
        "                seen[f'{family} {kind} {make.__name__}'] = 0\n"
        "                for s in made if isinstance(made, tuple) else [made]:\n                    s.close()\n"
        "            except OSError as e:\n                seen[f'{family} {kind} {make.__name__}'] = e.errno\n"
        "others = [v for k, v in seen.items() if int(k.split()[0]) != socket.AF_UNIX]\n"
        "unix = seen[f'{socket.AF_UNIX} {int(socket.SOCK_STREAM)} socketpair']\n"
        "print(json.dumps([len(others), sorted(set(others)), unix]), file=sys.stderr)\n"
    )
    assert _report(evaluator, code) == [62 * 4 * 2, [errno.EPERM], 0]


# What the watch (watch.py, no cgroup) can miss between two looks, on top of memory_mb: the processes' pages faulted in
# within one POLL_S, and the kernel's memory the watch does not read (VMAs, the constant of kernel objects above).
WATCH_SLACK = 64 << 20


def _held_together(evaluator, code: str, memory_mb: int) -> tuple[dict, int | None]:
    """Runs `code` -> (its answer, the memory its run held more than an idle program's, or None where the test cannot
    measure): as root, the program's own cgroup; as the unprivileged evaluator (no cgroup for its programs), a cgroup
    of the test's that only measures (sandbox_fixtures.charged)."""
    from sandbox_fixtures import charged  # here: a plugin of this module (pytest_plugins), imported once registered

    with charged(evaluator) as idle_charged:
        idle = evaluator.run(PREAMBLE + "time.sleep(0.5)\n", memory_mb=memory_mb, timeout_s=20.0)
    with charged(evaluator) as hog_charged:
        answer = evaluator.run(PREAMBLE + code, memory_mb=memory_mb, timeout_s=20.0)
    assert idle["status"] == "passed", idle["stderr_tail"]
    peaks = (idle_charged["peak"], hog_charged["peak"]) if ROOT and evaluator.uid != 0 else (
        idle["memory_peak"], answer["memory_peak"])  # fmt: skip
    return answer, None if None in peaks else peaks[1] - peaks[0]


def _assert_held_to(evaluator, answer: dict, more: int | None, memory_mb: int) -> None:
    """Killed, saying so, and held to memory_mb: by the cgroup (its peak at most the limit), else by the watch
    (it saw them past the limit; measured where the test can, within the limit and WATCH_SLACK)."""
    assert answer["status"] == "failed", answer["stderr_tail"]
    assert "[sandbox] the program was killed: its processes held more than its memory limit" in answer["stderr_tail"]
    if evaluator.describe()["describe"]["cgroup"]:
        assert answer["memory_peak"] <= memory_mb << 20 and answer["watched_peak"] is None
    else:
        assert answer["memory_peak"] is None and answer["watched_peak"] > memory_mb << 20, answer
    if more is not None:
        print(f"held {more / 2**20:.1f} MiB more than an idle program (limit {memory_mb} MiB)")
        assert more <= (memory_mb << 20) + WATCH_SLACK


def test_memory_of_all_processes_together(evaluator):
    """Four processes of 150 MB each under a limit of 256 MB (each within it alone): ended, and the result says so,
    with a memory cgroup (the kernel's limit) and without one (the watch: issue 51)."""
    code = (
        "kids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        held = bytearray(150 << 20)\n        held[::4096] = b'x' * len(held[::4096])\n"
        "        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
        "assert all(os.waitpid(k, 0)[1] == 0 for k in kids), 'a process was killed'\n"
    )
    answer, more = _held_together(evaluator, code, 256)
    _assert_held_to(evaluator, answer, more, 256)


def test_an_honest_program_of_many_processes_runs(evaluator):
    """Eight forked workers (pages shared after fork count in each process the watch reads, and their pipes and
    mappings: 120-140 MiB in all here) and a subprocess, under 256 MB: not killed, with a cgroup or the watch."""
    code = (
        "import subprocess\nkids = []\nfor _ in range(8):\n    pid = os.fork()\n    if pid == 0:\n"
        "        data = [j * j for j in range(200_000)]\n        os._exit(0 if sum(data) > 0 else 1)\n"
        "    kids.append(pid)\nassert all(os.waitpid(k, 0)[1] == 0 for k in kids)\n"
        "out = subprocess.run([sys.executable, '-c', 'print(45)'], capture_output=True, text=True).stdout\n"
        "assert out.strip() == '45', out\n"
    )
    answer = evaluator.run(PREAMBLE + code, memory_mb=256, timeout_s=20.0)
    assert answer["status"] == "passed", answer["stderr_tail"]


def test_page_tables_count_against_the_limit(evaluator):
    """Issue 51: 40,000 pages, each alone in a 2 MiB span (156 MiB of address space, within RLIMIT_AS), hold 156 MiB
    and as much again in page tables, which RLIMIT_AS does not count: past 256 MB, the program is ended, with a
    cgroup (it counts page tables) and without (the watch reads each process's VmPTE)."""
    answer, more = _held_together(evaluator, Template(PAGE_TABLE_HOG).substitute(pages=40_000), 256)
    assert "pages 5000" in answer["stderr_tail"]  # it ran, and mapped pages
    _assert_held_to(evaluator, answer, more, 256)


def test_socket_buffers_of_many_processes_count_against_the_limit(evaluator):
    """Issue 51: 16 processes, each with 10 MiB of its own and 12 socketpairs whose queues it fills (about 160 MiB of
    socket buffers in all, in no /proc count of memory): past 256 MB, ended, with a cgroup (it counts them) and
    without (the watch charges each socket descriptor the most its queue can hold: test_the_watch_charges_descriptors;
    here its per-process count of the interpreter's own files alone would also end it)."""
    answer, more = _held_together(evaluator, Template(SOCKET_HOG).substitute(procs=16, pairs=12, mb=10), 256)
    _assert_held_to(evaluator, answer, more, 256)


def test_the_watch_charges_descriptors():
    """Without a cgroup the watch charges every socket descriptor the most its queue can hold and every pipe end 16
    pages, whatever they hold now (watch.py): opening 3 socketpairs and 2 pipes adds exactly that."""
    from tunelab.evals.sandbox import watch

    before = watch.buffers(os.getpid())
    pairs, pipes = [socket.socketpair() for _ in range(3)], [os.pipe() for _ in range(2)]
    try:
        added = watch.buffers(os.getpid()) - before
    finally:
        for a, b in pairs:
            a.close()
            b.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)
    wmem = int(open("/proc/sys/net/core/wmem_default").read())
    assert added == 6 * (2 * wmem + 8192) + 4 * 16 * 4096
    assert watch.held(os.getpid()) > watch.buffers(os.getpid()) > 0


def test_a_counter_does_not_cross_from_one_run_to_the_next(evaluator):
    """Issue 51: the socket cookie is a global counter (the next run read the previous value + 1, in
    11 runs of 11) and pidfds' inode numbers count every process the machine starts: one run could
    advance them and the next read them. Both are refused, in every run; the counters that remain
    are listed in docs/RELIABILITY.md with what each carries."""
    code = (
        "import struct\nseen = {}\na, b = socket.socketpair()\n"
        "for name, read in (('SO_COOKIE', lambda: struct.unpack('Q', a.getsockopt(socket.SOL_SOCKET, 57, 8))[0]),\n"
        "                   ('pidfd', lambda: os.fstat(os.pidfd_open(os.getpid())).st_ino)):\n"
        "    try:\n        seen[name] = read()\n    except OSError as e:\n        seen[name] = -e.errno\n"
        "print(json.dumps(seen), file=sys.stderr)\n"
    )
    runs = [_report(evaluator, code) for _ in range(2)]
    assert runs == [{"SO_COOKIE": -errno.EPERM, "pidfd": -errno.EPERM}] * 2, runs


def test_kernel_memory_is_bounded_without_a_cgroup(evaluator):
    """Issue 51: kernel memory that RLIMIT_AS does not count, held without a descriptor, stays within
    a constant per process: no listener (its backlog kept the buffers of clients that closed: 1.2 GB
    with `memory_mb: 256`), sockets only in socketpairs at their default buffers, as many as
    RLIMIT_NOFILE and twice that in flight, POSIX timers within RLIMIT_SIGPENDING. Measured where
    the test can: the memory charged to the unprivileged evaluator's runs (a cgroup of the test's
    that only measures), or the program's own cgroup as root; the hog's peak less an idle program's."""
    wmem = int(open("/proc/sys/net/core/wmem_default").read())
    bound = 3 * contain._MAX_OPEN_FILES * (2 * wmem + 8192)  # docs/RELIABILITY.md: kernel memory without a cgroup
    answer, more = _held_together(evaluator, Template(KERNEL_HOG).substitute(hold=1, bound=bound), 256)
    assert answer["status"] == "failed", answer["stderr_tail"]
    report = json.loads(next(line for line in answer["stderr_tail"].splitlines() if line.startswith('{"listen"')))
    assert report["listen"] == errno.EPERM and report["refused in flight"] == errno.ETOOMANYREFS, report
    assert report["timers"] <= 64 and 0 < report["queued"] <= bound, report
    if more is not None:
        print(f"kernel memory: the hog held {more / 2**20:.1f} MiB more than an idle program "
              f"(bound {bound / 2**20:.1f} MiB, queued {report['queued'] / 2**20:.1f} MiB)")  # fmt: skip
        assert more <= bound + (16 << 20)  # and the hog's own Python objects, a few MiB


_PUSH = """
import fcntl, select, stat, struct
def push(payload):
    # to every pipe this process may write (the answers' pipe among them), as long as it is read
    for fd in range(3, 64):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY:
                continue
            os.set_blocking(fd, False)
            left = memoryview(payload)
            while left and select.select([], [fd], [], 1.0)[1]:
                try:
                    left = left[os.write(fd, left):]
                except BlockingIOError:
                    pass
        except OSError:
            pass
def triple(x):
    push(PAYLOAD)
    os._exit(0)
"""
_LISTS = 4 << 20  # bytes of empty lists in one answer: a frame as costly to decode as any of its size
FRAME_BOMBS = {
    "a frame that says it holds 64 MiB": "PAYLOAD = struct.pack('<I', 64 << 20) + b'x' * (1 << 20)\n",
    "4 MiB of empty lists": (
        f"n = {_LISTS // 5}\nbody = b't' + struct.pack('<I', 2) + b's' + struct.pack('<I', 2) + b'ok'"
        " + b'l' + struct.pack('<I', n) + b'l\\0\\0\\0\\0' * n\n"
        "PAYLOAD = struct.pack('<I', len(body)) + body\n"
    ),
}


@pytest.mark.parametrize("bomb", FRAME_BOMBS)
def test_the_judge_does_not_amplify_a_forged_answer(bomb, evaluator):
    """The judge (outside the sandbox) reads frames the program wrote: one larger than MAX_FRAME
    is refused at its header; one built to decode into the most objects is refused once they
    would pass COST_FACTOR x its size + COST_SLACK. The judge's peak memory stays within that
    (plus the frame itself, kept and read in chunks) of an honest run's."""
    tests = "assert triple(1) == 3\n"
    honest = evaluator.run("def triple(x):\n    return 3 * x\n", tests, calls=("triple",))
    answer = evaluator.run(PREAMBLE + _PUSH + FRAME_BOMBS[bomb], tests, calls=("triple",), timeout_s=10.0)
    assert honest["status"] == "passed" and answer["status"] == "failed", answer["stderr_tail"]
    bound_kb = (wire.COST_FACTOR * _LISTS + wire.COST_SLACK + 3 * _LISTS) // 1024
    assert answer["judge_peak_kb"] - honest["judge_peak_kb"] <= bound_kb, (answer["judge_peak_kb"], honest)


def test_files_a_program_reads_hold_no_cache_state(evaluator):
    """Every file a program can open is on a tmpfs (the private copy of the Python installation,
    /work): always in memory, so no run can leave a trace in the page cache for the next."""
    if evaluator.describe()["describe"]["view"] != "tmpfs copy":
        pytest.skip("no tmpfs for the view here: the host's files are bound (docs/RELIABILITY.md)")
    code = (
        "import ctypes, json\nlibc = ctypes.CDLL(None, use_errno=True)\nbuf = ctypes.create_string_buffer(512)\n"
        "kinds, n = {}, 0\nopen('mine.txt', 'w').write('x')\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if os.path.join(root, d) != '/dev']\n"
        "    for name in files:\n"
        "        path = os.path.join(root, name)\n"
        "        if os.path.islink(path):\n            continue  # /sbin and the like lead nowhere here\n"
        "        n += 1\n"
        "        assert libc.statfs(path.encode(), buf) == 0, path\n"
        "        kinds.setdefault(hex(int.from_bytes(buf.raw[:8], 'little')), path)\n"
        "print(json.dumps([n, kinds]), file=sys.stderr)\n"
    )
    n, kinds = _report(evaluator, code)
    assert n > 1000 and set(kinds) == {hex(0x01021994)}, kinds  # TMPFS_MAGIC


@needs_sandbox
def test_without_a_usable_tmpfs_the_hosts_files_are_shown_without_site_packages(monkeypatch):
    from tunelab.evals.sandbox.view import python_view

    monkeypatch.setenv("TUNELAB_SANDBOX_VIEW_DIR", "/nonexistent")
    python_view.cache_clear()
    try:
        assert python_view(sys.executable).kind == "host files"
        code = PREAMBLE + Template(HOSTILE["import from a site-packages"].source).substitute()
        answer = run_program(code)
        assert answer.status == "failed", answer.stderr_tail
        assert run_program("import json, sqlite3, decimal\nassert json.loads('[1]') == [1]\n").status == "passed"
    finally:
        python_view.cache_clear()


def test_describe_says_which_containment_ran(evaluator):
    answer = evaluator.describe()
    assert answer["available"] is None
    d = answer["describe"]
    assert d["kind"] == "bubblewrap" and d["unsandboxed"] is False and d["version"]
    assert d["mode"] == ("throwaway uid (root evaluator)" if evaluator.uid == 0 else "user namespace")
    assert d["view"] in ("tmpfs copy", "host files") and d["cgroup"] in (None, "v1 memory", "v2 memory")
    assert d["memory_total"] == ("cgroup" if d["cgroup"] else "watched every 10 ms")


@needs_sandbox
def test_runs_in_parallel_and_leave_nothing():
    def ours():
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("tunelab-")}

    before = ours()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run_program, ["assert True"] * 6 + ["assert False"] * 2))
    assert [r.status for r in results] == ["passed"] * 6 + ["failed"] * 2
    assert ours() - before == set()
    assert len({r.host_uid for r in results}) == (8 if ROOT else 1)  # a throwaway uid per run as root


# --------------------------------------------------------------------------- no containment


@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setenv("TUNELAB_BWRAP", "/nonexistent/bwrap")


def test_without_containment_it_refuses_unless_allowed(no_bwrap):
    reason = check_available()
    assert reason is not None and "/nonexistent/bwrap" in reason
    with pytest.raises(UserError, match=r"eval\.allow_unsandboxed"):
        run_program("assert True")
    assert contain.describe() == {"kind": "none", "version": None, "unsandboxed": False, "reason": reason}
    assert contain.describe(allow_unsandboxed=True)["unsandboxed"] is True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_program("assert True", allow_unsandboxed=True).status == "passed"
        assert run_program("import os\nos._exit(0)\nassert False\n", allow_unsandboxed=True).status == "failed"
        assert run_program("while True:\n    pass\n", timeout_s=1.0, allow_unsandboxed=True).status == "timeout"
    assert any("WITHOUT a sandbox" in str(w.message) for w in caught)


def test_a_sandbox_that_runs_nothing_is_unavailable_not_a_score_of_zero(monkeypatch):
    """Were the interpreter to refuse the sandbox's flags (as Python 3.10 refused -P), or bwrap
    to fail, every program would fail: the canary run by check_available turns that into a
    refusal to score."""
    monkeypatch.setenv("TUNELAB_BWRAP", shutil.which("false") or "/bin/false")
    reason = check_available()
    assert reason is not None and reason.startswith("bwrap could not run a program here")
    with pytest.raises(UserError):
        run_program("assert True")
