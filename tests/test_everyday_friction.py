"""Issue #26's everyday friction, each item shown by running `exp` as a user does (a subprocess, output piped):
mistakes caught at plan time, never silent, Ctrl-C that checkpoints, progress in a log, output a person (and
a program) can read."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write

TINY = """name: {name}
base:
  model: {{name: tiny-random-llama}}
  data: {{recipe: {recipe}, max_length: 64}}
  optim: {{lr: 1.0e-3}}
  train: {{steps: {steps}, batch_size: 2}}
  eval: {{tasks: [val_loss], val_batches: 1, batch_size: 4}}
  tracking: {{wandb: false}}
matrix:
  optim.lr: {lrs}
"""


def exp(*args, env: dict | None = None, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *map(str, args)], check=False, capture_output=True,
                          text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, stdin=subprocess.DEVNULL, **kw)


def matrix(tmp: Path, name: str = "m", recipe: str = "arithmetic", steps: int = 3, lrs: str = "[1.0e-3, 2.0e-3]"):
    return write(tmp / f"{name}.yaml", TINY.format(name=name, recipe=recipe, steps=steps, lrs=lrs))


def files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """One finished two-cell run, shared by the read-only checks."""
    tmp = tmp_path_factory.mktemp("friction")
    path = matrix(tmp)
    proc = exp("run", path, "--runs-dir", tmp / "runs", env={"TUNELAB_PROGRESS_EVERY": "0"})
    assert proc.returncode == 0, proc.stderr
    return tmp, tmp / "runs" / "m", proc


# -- 1. exp plan catches what it can know ---------------------------------------------------------------------


def test_plan_refuses_a_recipe_whose_local_file_is_missing_and_a_chat_template_the_tokenizer_lacks(tmp_path):
    write(tmp_path / "data_recipes" / "mine.yaml", "template: alpaca\nsources:\n  - path: rows.jsonl\n")
    p = exp("plan", matrix(tmp_path, recipe="mine"), cwd=tmp_path)
    assert p.returncode == 2 and "sources[0].path" in p.stderr and "does not exist" in p.stderr
    assert "Traceback" not in p.stderr
    write(tmp_path / "data_recipes" / "chatty.yaml", "template: chat\nsources:\n  - {generator: arithmetic}\n")
    p = exp("plan", matrix(tmp_path, recipe="chatty"), cwd=tmp_path)
    assert p.returncode == 2 and "without a chat template" in p.stderr and "model.name" in p.stderr
    assert "smollm2-135m-instruct" in p.stderr  # the aliases whose tokenizer has one


def test_a_hub_model_offline_is_said_at_plan_and_refused_at_run(tmp_path):
    path = write(tmp_path / "hub.yaml", TINY.format(name="hub", recipe="arithmetic", steps=1, lrs="[1.0e-3]")
                 .replace("tiny-random-llama", "someorg/not-cached-model"))
    p = exp("plan", path, env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0 and "cannot run on this machine" in p.stderr and "HF_HUB_OFFLINE" in p.stderr
    assert "tiny-random-llama" in p.stderr and "internet" not in p.stderr  # the aliases, no network advice
    assert "checked when the cells run" in p.stdout  # what only the run can know, said now
    p = exp("run", path, "--runs-dir", tmp_path / "runs", env={"HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2 and "not in the Hugging Face cache" in p.stderr and not (tmp_path / "runs").exists()


def test_names_get_did_you_mean(tmp_path):
    cases = {"model.name: tiny-random-lama": "did you mean 'tiny-random-llama'",
             "optim.name: adamww": "did you mean 'adamw'", "data.recipe: arithmetc": "did you mean 'arithmetic'",
             "optim.lrr: 0.1": "did you mean 'lr'"}
    for i, (line, hint) in enumerate(cases.items()):
        key, value = line.split(": ")
        section, leaf = key.split(".")
        path = write(tmp_path / f"n{i}.yaml", f"name: n\nbase:\n  model: {{name: tiny-random-llama}}\n"
                     f"  data: {{recipe: arithmetic}}\n  {section}: {{{leaf}: {value}}}\n")
        p = exp("plan", path)
        assert p.returncode == 2 and hint in p.stderr, (line, p.stderr)


def test_a_cell_that_failed_for_bad_input_runs_again_once_its_input_changed(tmp_path):
    rows = tmp_path / "data_recipes" / "rows.jsonl"
    write(tmp_path / "data_recipes" / "mine.yaml", "template: alpaca\nsources:\n  - path: rows.jsonl\n")
    write(rows, '{"instruction": "say a", "output": ""}\n' * 4)  # every reply empty: nothing left to train on
    path = matrix(tmp_path, recipe="mine", lrs="[1.0e-3]")
    first = exp("run", path, "--runs-dir", "runs", cwd=tmp_path)
    assert first.returncode == 1 and "failed" in first.stderr
    again = exp("run", path, "--runs-dir", "runs", cwd=tmp_path)
    assert again.returncode == 1 and "failed, skipped" in again.stderr  # unchanged input: not retried
    write(rows, "".join(json.dumps({"instruction": f"say {i}", "output": str(i)}) + "\n" for i in range(40)))
    fixed = exp("run", path, "--runs-dir", "runs", cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr  # retried without --rerun-failed: its input changed


# -- 2. never silent --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "needle"), [
    (("--where", "optim.lrr=0.001"), "--where 'optim.lrr': no such config key (did you mean 'optim.lr'?)"),
    (("--by", "peft.methd"), "--by 'peft.methd': no such config key (did you mean 'peft.method'?)"),
    (("--sort", "val_los"), "--sort 'val_los': no such column (did you mean 'val_loss'?)"),
    (("--where", "optim.lr=0.5"), "matches no cell; optim.lr takes 0.001, 0.002"),
])
def test_leaderboard_options_that_match_nothing_say_so(done, args, needle):
    _, mdir, _ = done
    before = {p: p.stat().st_mtime_ns for p in files(mdir)}
    p = exp("leaderboard", mdir, *args)
    assert p.returncode == 2 and needle in " ".join(p.stderr.split()), p.stderr
    assert {p: p.stat().st_mtime_ns for p in files(mdir)} == before  # nothing written


@pytest.mark.parametrize("command", ["leaderboard", "status", "report"])
def test_a_folder_that_is_not_a_matrix_is_named(done, command):
    tmp, mdir, _ = done
    cell = next(p for p in mdir.iterdir() if (p / "cell.json").is_file())
    before = files(tmp)
    for target, needle in ((mdir.parent, "it holds the run folders of m"), (cell, "this is a cell folder")):
        p = exp(command, target)
        assert p.returncode == 2 and needle in " ".join(p.stderr.split()), p.stderr
    assert files(tmp) == before


def test_compare_export_and_chat_take_the_names_the_leaderboard_prints(done):
    tmp, mdir, _ = done
    board = json.loads(exp("leaderboard", mdir, "--json").stdout)["rows"]
    names = [r["cell"] for r in board]
    p = exp("compare", *names, "--json", "--resamples", "100", cwd=tmp)
    assert p.returncode == 0, p.stderr
    assert {Path(json.loads(p.stdout)[0][k]).name.split("-")[0] for k in ("a", "b")} == {n.split("-")[0]
                                                                                        for n in names}
    p = exp("export", "lr", "--out", tmp / "x", cwd=tmp)  # no such cell: the candidates
    assert p.returncode == 2 and all(n in p.stderr for n in names)
    p = exp("export", "lr0.0001", "--out", tmp / "x", cwd=tmp)
    assert p.returncode == 2 and "did you mean 'lr0.001'" in p.stderr and not (tmp / "x").exists()
    ident = json.loads((mdir / "cells.json").read_text())[0]["id"]
    p = exp("chat", ident[:6], "--prompt", "1+1=", "--max-new-tokens", "2", cwd=tmp)
    assert p.returncode == 0 and "the template this model was trained with" in p.stderr, p.stderr  # the cell


# -- 3. Ctrl-C ---------------------------------------------------------------------------------------------------


def test_ctrl_c_checkpoints_each_running_cell_and_a_rerun_resumes(tmp_path):
    path = matrix(tmp_path, steps=400, lrs="[1.0e-3, 2.0e-3]")
    proc = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "run", path, "--runs-dir", tmp_path / "runs"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TUNELAB_PROGRESS_EVERY": "0"})
    lines = []
    for line in proc.stderr:  # a line per step (progress every 0 s): interrupt once training runs
        lines.append(line)
        if " step 5/400" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.communicate(timeout=300)[1]
    assert proc.returncode == 130, rest
    said = " ".join(rest.split())
    # the runner got the Ctrl-C and passed it on as SIGTERM: said as Ctrl-C, and that a run resumes it once
    assert "stopped by Ctrl-C after step " in said and "(checkpoint written)" in said and "SIGTERM" not in said
    (line,) = [x for x in rest.splitlines() if "stopped by Ctrl-C" in x]
    assert line.count("resume") == 1 and "1 cell(s) not started" in said  # the second never began
    status = json.loads(exp("status", tmp_path / "runs" / "m", "--json").stdout)
    assert sorted(r["state"] for r in status) == ["pending", "pending"]
    stopped = next(r for r in status if r["dir"])
    assert list((Path(stopped["dir"]) / "checkpoints").glob("step-*"))
    resumed = exp("run", path, "--runs-dir", tmp_path / "runs", env={"TUNELAB_PROGRESS_EVERY": "0"})
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step-" in resumed.stderr
    status = json.loads(exp("status", tmp_path / "runs" / "m", "--json").stdout)
    assert [r["state"] for r in status] == ["done", "done"] and not any(r["note"] for r in status)


def test_a_second_ctrl_c_stops_the_cell_at_once(tmp_path):
    """The runner's side, with a real child standing in for a cell that is slow to reach its step boundary:
    the first signal asks it to checkpoint (SIGTERM), the second to stop now (SIGINT)."""
    from tunelab.run.runner import Interrupts

    log = tmp_path / "got"
    child = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        f"log = open({str(log)!r}, 'a', buffering=1)\n"
        "signal.signal(signal.SIGTERM, lambda s, f: (log.write('TERM\\n'), print('TERM', flush=True)))\n"
        "signal.signal(signal.SIGINT, lambda s, f: (log.write('INT\\n'), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.05)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    stop = Interrupts(proc=child)
    stop._handle(signal.SIGINT, None)
    assert child.stdout.readline().strip() == "TERM"  # the first signal handled (read, not waited for by a clock)
    assert log.read_text() == "TERM\n" and child.poll() is None and stop.stopping
    stop._handle(signal.SIGINT, None)
    assert child.wait(timeout=30) == 0 and log.read_text() == "TERM\nINT\n"


# -- 4. progress without a terminal ------------------------------------------------------------------------------


def test_a_log_gets_a_line_per_cell_event_and_periodic_progress(done):
    _, _, proc = done
    text = proc.stderr
    assert "m: 2 cell(s)" in text and "lr0.001: started" in text and "lr0.001: data" in text
    assert "lr0.001: step 3/3, loss" in text and "tokens/s" in text and "lr0.001: done after" in text
    assert "2/2 cell(s) finished" in text and "\x1b[" not in text  # no colour codes, no cursor movement


# -- 5. output a person and a program can read ---------------------------------------------------------------------


def test_csv_numbers_are_numbers_and_latex_numbers_are_right_aligned(done):
    _, mdir, _ = done
    rows = list(csv.DictReader(io.StringIO(exp("leaderboard", mdir, "--format", "csv").stdout)))
    assert all(float(r["val_loss"]) > 0 and float(r["peak MB"]) > 0 for r in rows)
    assert {r["val_loss marks"] for r in rows} == {"subset", "subset best"}  # val_batches 1: a part of the set
    tex = exp("leaderboard", mdir, "--format", "latex").stdout
    spec = tex[tex.index("\\begin{tabular}{") + 16:].split("}")[0]
    assert spec.startswith("ll") and spec.endswith("r") and "r" in spec
    md = (mdir / "leaderboard.md").read_text()
    assert "predicted MB: `exp memory`'s model of the tensors alone" in md and "peak MB: measured" in md


def test_help_has_no_type_noise_and_shows_examples():
    for verb in ("run", "leaderboard", "compare"):
        p = exp(verb, "-h")
        assert p.returncode == 0 and "Example: exp " + verb in " ".join(p.stdout.split())
        assert "<bool>" not in p.stdout
    zsh = exp("--show-completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef")
    assert exp("--show-completion", "tcsh").returncode == 2


def test_memory_speaks_json():
    p = exp("memory", "--model", "llama-7b", "--optim", "adamw", "--json")
    data = json.loads(p.stdout)
    assert p.returncode == 0 and data["estimate_bytes"]["peak"] > data["estimate_bytes"]["params"] > 0
    assert data["setup"]["optim"] == "adamw" and isinstance(data["fits"], bool)


def test_export_and_chat_print_no_third_party_warnings(done):
    tmp, mdir, _ = done
    cell = next(p for p in mdir.iterdir() if (p / "cell.json").is_file())
    p = exp("export", cell, "--out", tmp / "exported")
    assert p.returncode == 0 and "Warning" not in p.stderr and "warn" not in p.stderr.lower(), p.stderr
    p = exp("chat", tmp / "exported", "--prompt", "1+1=", "--max-new-tokens", "2")
    assert p.returncode == 0 and "Warning" not in p.stderr and "warn" not in p.stderr.lower(), p.stderr
