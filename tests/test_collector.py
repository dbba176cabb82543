"""The garbage-collector policy of tunelab's processes (machine/collector.py): collections rare while a process
builds itself, Python's defaults once it settles, and a quick exit that still does what its docstring promises of
Python's own exit."""

import os
import subprocess
import sys
import textwrap

# What a program may leave for its exit: a finalizer of cyclic garbage that writes a file, an open file in the
# globals of a module nobody else holds (its dict in a cycle through its function), one in an object that a module
# global holds (the case the quick exit leaves, as its docstring says). The policy's state is printed by an exit
# handler that runs after the policy's own.
PROGRAM = textwrap.dedent("""
    import atexit, gc, sys
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


def test_a_quick_exit_finalizes_garbage_and_flushes_module_globals_files(tmp_path):
    from tunelab.machine.collector import QUIET

    out = _run(tmp_path, "default")
    assert f"paused {QUIET} settled back True" in out
    assert "frozen at exit True" in out  # the teardown did not walk the heap
    for name in ("cyclic", "lonely"):
        assert (tmp_path / f"{name}.txt").read_text() == name, name


def test_plain_leaves_python_alone_and_its_exit_saves_the_same_files(tmp_path):
    out = _run(tmp_path, "plain")
    assert "settled back True" in out and "frozen at exit False" in out
    assert "paused 700" in out  # Python's default threshold, untouched
    for name in ("cyclic", "lonely", "held"):
        assert (tmp_path / f"{name}.txt").read_text() == name, name


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TUNELAB_GC"}
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_torch_process_of_tunelab_starts_paused_and_runs_fewer_full_collections_while_it_imports():
    from tunelab.machine.collector import QUIET

    count = ("import gc, sys; {}; import torch, transformers.modeling_utils; "
             "print(gc.get_threshold()[0], gc.get_stats()[2]['collections'])")
    paused = _python(count.format("from tunelab.machine.threads import start_process; start_process(1)")).split()
    plain = _python(count.format("pass")).split()
    assert paused[0] == str(QUIET) and plain[0] == "700"
    assert int(paused[1]) < int(plain[1])  # 0-1 against several: each a walk of the whole heap


def test_every_exp_command_exits_without_the_teardowns_walk_and_keeps_pythons_thresholds():
    out = _python("import atexit, gc, sys; "
                  "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, gc.get_threshold()[0])); "
                  "sys.argv = ['exp', '--help']; from tunelab.cli import main; main()")
    assert out.rstrip().endswith("frozen True 700")
