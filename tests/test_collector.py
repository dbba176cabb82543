"""The garbage-collector policy of tunelab's processes (machine/collector.py): collections rare while a process
builds itself, Python's defaults once it settles, and a quick exit that still saves what Python's own exit saves."""

import subprocess
import sys
import textwrap

# What a program may leave for its exit: a finalizer of cyclic garbage that writes a file, an open file in the
# globals of a module nobody else holds (its dict in a cycle through its function), one in an object that a module
# global holds, a thread the exit waits for that writes one. The policy's state is printed by an exit handler that
# runs after the policy's own.
PROGRAM = textwrap.dedent("""
    import atexit, gc, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    atexit.register(lambda: print("frozen at exit", gc.get_freeze_count() > 0, flush=True))
    from tunelab.machine import collector

    start = gc.get_threshold()
    collector.pause()
    paused = gc.get_threshold()

    class Note:  # in a reference cycle when it is dropped: only a collection finalizes it
        def __init__(self):
            self.me = self

        def __del__(self):
            with open(sys.argv[1] + "/cyclic.txt", "w") as f:
                f.write("cyclic")

    import lonely  # noqa: F401 - only sys.modules holds it after the next line
    del lonely
    import holder  # noqa: F401
    del holder

    def late():
        time.sleep(0.3)
        with open(sys.argv[1] + "/thread.txt", "w") as f:
            f.write("thread")

    threading.Thread(target=late).start()
    collector.settle()
    Note()  # after the collection settle makes
    print("paused", paused[0], "settled back", gc.get_threshold() == start, flush=True)
""")
LONELY = "def kept():\n    pass\n\nF = open(__file__[:-9] + 'lonely.txt', 'w')\nF.write('lonely')\n"
HOLDER = ("class Box:\n    def __init__(self, f):\n        self.f, self.me = f, self\n\n"
          "BOX = Box(open(__file__[:-9] + 'held.txt', 'w'))\nBOX.f.write('held')\n")


def _run(tmp_path, gc_env: str) -> str:
    (tmp_path / "lonely.py").write_text(LONELY)
    (tmp_path / "holder.py").write_text(HOLDER)
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], check=False, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "TUNELAB_GC": gc_env}, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_quick_exit_saves_every_file_a_plain_exit_saves(tmp_path):
    from tunelab.machine.collector import QUIET

    out = _run(tmp_path, "default")
    assert f"paused {QUIET} settled back True" in out
    assert "frozen at exit True" in out  # the teardown did not walk the heap
    for name in ("cyclic", "lonely", "thread"):
        assert (tmp_path / f"{name}.txt").read_text() == name, name


def test_plain_leaves_python_alone_and_its_exit_saves_the_same_files(tmp_path):
    out = _run(tmp_path, "plain")
    assert "settled back True" in out and "frozen at exit False" in out
    assert "paused 700" in out  # Python's default threshold, untouched
    for name in ("cyclic", "lonely", "thread", "held"):
        assert (tmp_path / f"{name}.txt").read_text() == name, name


def test_a_torch_process_of_tunelab_starts_paused():
    code = ("import gc; from tunelab.machine.threads import start_process; start_process(1); "
            "print(gc.get_threshold()[0])")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    from tunelab.machine.collector import QUIET

    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(QUIET)
