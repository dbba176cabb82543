import os
import re
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tunelab.evals.sandbox import run_program

# Every hostile program announces its pid first, so the test can look for leftovers
# of its process group afterwards.
PREAMBLE = "import os, sys\nprint('PID', os.getpid(), file=sys.stderr, flush=True)\n"
SECRET = "secret-do-not-leak-4711"

HOSTILE = {
    "infinite loop": ("while True:\n    pass\n", {"timeout_s": 1.0}),
    "fork bomb": ("while True:\n    os.fork()\n", {"max_procs": 8}),
    "subprocess": ("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi > {outside}/sh.txt'])\n", {}),
    "os.system": ("os.system('echo hi > {outside}/sh.txt')\n", {}),
    "memory bomb": ("x = bytearray(8 << 30)\n", {"memory_mb": 256}),
    "slow memory bomb": ("x = []\nwhile True:\n    x.append(bytearray(10 << 20))\n", {"memory_mb": 256}),
    "huge file": ("open('big', 'wb').write(b'0' * (32 << 20))\n", {"max_file_mb": 4}),
    "write outside": ("open('{outside}/escape.txt', 'w').write('x')\n", {}),
    "write to /tmp": ("open('/tmp/tunelab-escape-{tag}.txt', 'w').write('x')\n", {}),
    "delete outside": ("os.remove('{outside}/victim.txt')\n", {}),
    "rename outside": ("os.rename('{outside}/victim.txt', 'stolen.txt')\n", {}),
    "rmtree outside": ("import shutil\nshutil.rmtree('{outside}')\n", {}),
    "chdir and write": ("os.chdir('{outside}')\nopen('escape.txt', 'w').write('x')\n", {}),
    "symlink and write": ("os.symlink('{outside}/escape.txt', 'link')\nopen('link', 'w').write('x')\n", {}),
    "read env": (
        (
            "leak = os.environ.get('WANDB_API_KEY') or os.environ.get('HF_TOKEN')\n"
            "assert leak, 'no secret'\nprint(leak, file=sys.stderr)\n"
        ),
        {},
    ),
    "read parent env": ("print(open(f'/proc/{{os.getppid()}}/environ').read(), file=sys.stderr)\n", {}),
    "socket": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", {}),
    "kill parent": ("os.kill(os.getppid(), {sigusr1})\n", {}),
    "killpg parent": ("os.killpg(os.getpgid(os.getppid()), {sigusr1})\n", {}),
    "ctypes": ("import ctypes\nctypes.CDLL(None).fork()\n", {}),
    "exit early": ("def f():\n    sys.exit(0)\nf()\nassert False\n", {}),
    "os._exit early": ("os._exit(0)\nassert False\n", {}),
}

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the OS layer drops to a throwaway uid only as root"
)


@pytest.fixture
def arena(tmp_path, monkeypatch):
    """Things a hostile program may aim at, and the evaluator state it must not disturb."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep me")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    signals = []
    old_handler = signal.signal(signal.SIGUSR1, lambda *_: signals.append(1))
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    yield {
        "outside": outside,
        "signals": signals,
        "listener": listener,
        "tag": tag,
        "fmt": {
            "outside": outside,
            "port": listener.getsockname()[1],
            "tag": tag,
            "sigusr1": int(signal.SIGUSR1),
        },
    }
    listener.close()
    signal.signal(signal.SIGUSR1, old_handler)
    if os.path.exists(f"/tmp/tunelab-escape-{tag}.txt"):
        os.remove(f"/tmp/tunelab-escape-{tag}.txt")


def live_members(pgid: int) -> list[int]:
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            pids.append(int(name))
    return pids


def assert_evaluator_unharmed(arena, env_before, result):
    outside = arena["outside"]
    assert os.environ == env_before
    assert SECRET not in result.stderr_tail
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert (outside / "victim.txt").read_text() == "keep me"
    assert not os.path.exists(f"/tmp/tunelab-escape-{arena['tag']}.txt")
    assert arena["signals"] == []
    with pytest.raises(BlockingIOError):
        arena["listener"].accept()
    pid = re.search(r"PID (\d+)", result.stderr_tail)
    assert pid, result.stderr_tail
    assert live_members(int(pid.group(1))) == []


def test_passing_program_passes_fast_and_cleans_up():
    run_program("pass")  # warm the page cache
    start = time.monotonic()
    result = run_program(
        "import os, sys, math\nassert math.gcd(12, 18) == 6\nprint(os.getcwd(), file=sys.stderr)\n"
    )
    elapsed = time.monotonic() - start
    assert result.status == "passed" and result.passed and result.returncode == 0
    assert elapsed < 1.0, elapsed  # typically ~0.1 s
    work = result.stderr_tail.strip()
    assert "tunelab-sandbox-" in work and not os.path.exists(work)


def test_failures_are_failures():
    result = run_program("def f():\n    return 1\nassert f() == 2, 'wrong answer'\n")
    assert result.status == "failed" and not result.passed
    assert "AssertionError: wrong answer" in result.stderr_tail
    assert run_program("def f(:\n").status == "failed"
    assert run_program("raise ValueError").status == "failed"


def test_program_may_use_its_own_directory():
    code = "open('scratch.txt', 'w').write('hi')\nassert open('scratch.txt').read() == 'hi'\n"
    assert run_program(code).passed


def test_runs_in_parallel():
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run_program, ["assert True"] * 3 + ["assert False"]))
    assert [r.status for r in results] == ["passed"] * 3 + ["failed"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_is_contained(name, arena):
    code, limits = HOSTILE[name]
    env_before = dict(os.environ)
    result = run_program(PREAMBLE + code.format(**arena["fmt"]), **{"timeout_s": 3.0, **limits})
    assert not result.passed
    assert result.status == ("timeout" if name == "infinite loop" else "failed"), result.stderr_tail
    assert_evaluator_unharmed(arena, env_before, result)


# The interpreter guards can be bypassed by a determined program; these check that
# the operating-system layer holds without them.
OS_LAYER = {
    "fork bomb": ("while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "timeout"),
    "kill parent": ("os.kill(os.getppid(), {sigusr1})\n", "failed"),
    "read parent env": ("print(open(f'/proc/{{os.getppid()}}/environ').read(), file=sys.stderr)\n", "failed"),
    "write outside": ("open('{outside}/escape.txt', 'w').write('x')\n", "failed"),
    "delete outside": ("os.remove('{outside}/victim.txt')\n", "failed"),
    "socket": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", "failed"),
}


def can_unshare_net() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(["unshare", "-n", "true"], check=False).returncode == 0
    )


@needs_root
@pytest.mark.parametrize("name", OS_LAYER)
def test_os_layer_contains_without_guards(name, arena):
    if name == "socket" and not can_unshare_net():
        pytest.skip("no network namespaces here")
    code, status = OS_LAYER[name]
    env_before = dict(os.environ)
    result = run_program(
        PREAMBLE + code.format(**arena["fmt"]), timeout_s=1.0, max_procs=8, python_guards=False
    )
    assert result.status == status, result.stderr_tail
    assert_evaluator_unharmed(arena, env_before, result)
