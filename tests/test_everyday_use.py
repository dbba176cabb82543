"""Issue #48: everyday use of evaluation paths, local tasks, searches and tables, one test per item of the report,
each run as a user runs `exp` (in-process through the `cli` fixture, or a subprocess where a pipe or a signal
matters), on the tiny model and files the tests write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import write
from processes import run_exp, start_exp, wait_for

from tunelab.core.files import read_json
from tunelab.folders.cell import CellFolder

MATRIX = """name: m
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  optim: {lr: 1.0e-3}
  train: {steps: 2, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1, batch_size: 4}
  tracking: {wandb: false}
matrix:
  peft.method: [none, lora]
"""

SEARCH = """name: s
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 3, batch_size: 2}
  eval: {tasks: [val_loss], val_batches: 1, batch_size: 4}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 3
  pruner: halving
  min_steps: 1
"""

CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Peru", "Lima"), ("Norway", "Oslo"), ("Egypt", "Cairo")]


def capitals(folder: Path) -> Path:
    """A local lm-eval task whose YAML names its data beside it (`data_files: {test: capitals.jsonl}`): 8 items."""
    choices = [c for _, c in CAPITALS]
    rows = [{"country": k, "choices": choices, "label": choices.index(c)} for k, c in CAPITALS]
    write(folder / "capitals.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write(folder / "capitals.yaml", "task: capitals\ndataset_path: json\ndataset_kwargs: {data_files: {test: "
          "capitals.jsonl}}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: \"The capital of "
          "{{country}} is\"\ndoc_to_target: label\ndoc_to_choice: choices\nmetric_list:\n  - {metric: acc, "
          "aggregation: mean, higher_is_better: true}\nmetadata: {version: 1.0}\n")
    return folder


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A finished two-cell matrix, run twice: the second time with `--set optim.lr=...`, so each slug names two
    cell folders."""
    tmp = tmp_path_factory.mktemp("everyday")
    path = write(tmp / "m.yaml", MATRIX)
    for sets in ((), ("--set", "optim.lr=2.0e-3")):
        proc = run_exp("run", path, "--runs-dir", tmp / "runs", *sets, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, tmp / "runs" / "m"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return capitals(tmp_path_factory.mktemp("tasks") / "mytasks")


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """A search stopped by Ctrl-C in its second trial (what the user sees then), then run to its end."""
    tmp = tmp_path_factory.mktemp("search")
    path, runs = write(tmp / "s.yaml", SEARCH), tmp / "runs"
    proc = start_exp("run", path, "--runs-dir", runs, log=tmp / "first.log")

    def second_trial_runs():  # its process is up (its stop signals caught) and loading its model
        found = list((runs / "s").glob("s-t01-*"))
        return found and CellFolder(found[0]).status().get("state") == "running"

    wait_for(second_trial_runs, "the second trial to start", proc, poll=0.02)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
    assert proc.wait(timeout=300) == 130, (tmp / "first.log").read_text()[-3000:]
    stopped = {"log": (tmp / "first.log").read_text(), "tune": run_exp("tune", "status", runs / "s", "--json"),
               "status": run_exp("status", runs / "s", "--json"), "board": run_exp("leaderboard", runs / "s")}
    end = run_exp("run", path, "--runs-dir", runs, timeout=600)
    assert end.returncode == 0, end.stderr[-3000:]
    return tmp, runs / "s", stopped, end


def rows(proc: subprocess.CompletedProcess) -> list:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- 1. exp eval run takes a cell's folder, its final/, its name; a folder with no model is said -----------------


def test_eval_run_takes_a_cells_final_folder_and_its_name_and_names_a_folder_without_a_model(done, cli, tmp_path):
    tmp, mdir = done
    final = next(mdir.glob("lora-*")) / "final"
    relative = final.relative_to(tmp)  # runs/m/<cell>/final, as the user types it: no ./ in front
    code, out, err = cli("eval", "run", relative, "--tasks", "val_loss", "--out", tmp_path / "a", "--device", "cpu",
                         cwd=tmp)
    assert code == 0, err
    assert read_json(tmp_path / "a" / "results.json")["tasks"]["val_loss"]["n"] > 0  # the cell's validation set
    code, out, err = cli("eval", "run", f"m/{final.parent.name}", "--tasks", "val_loss", "--out", tmp_path / "b",
                         "--device", "cpu", cwd=tmp)
    assert code == 0, err
    assert read_json(tmp_path / "b" / "results.json")["cell"] == str(final.parent.resolve())
    (tmp_path / "empty").mkdir()
    code, out, err = cli("eval", "run", tmp_path / "empty", "--tasks", "val_loss")
    assert code == 2 and "holds no model" in err and "Traceback" not in err, err


# -- 2. a local task's data beside its YAML; a changed task is scored again ------------------------------------


def test_a_local_tasks_data_is_found_beside_its_yaml_and_a_changed_task_is_scored_again(cli, tmp_path):
    from tunelab.core.config import EvalCfg

    folder = capitals(tmp_path / "mytasks")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out, err = cli("eval", "run", "tiny-random-llama", "--tasks", "capitals", "--include-path", folder,
                         "--out", tmp_path / "o", "--device", "cpu", cwd=elsewhere)  # not where the data is
    assert code == 0, err + out
    res = read_json(tmp_path / "o" / "results.json")["tasks"]["capitals"]
    assert res["status"] == "ok" and res["n"] == len(CAPITALS), res
    before = EvalCfg(tasks=["capitals"], include_path=str(folder)).id()
    with (folder / "capitals.jsonl").open("a") as f:
        f.write(json.dumps({"country": "Chile", "choices": ["Santiago", "Lima"], "label": 0}) + "\n")
    assert EvalCfg(tasks=["capitals"], include_path=str(folder)).id() != before  # a new evaluation: scored again
    (folder / "capitals.jsonl").rename(folder / "moved.jsonl")
    plan = write(tmp_path / "p.yaml", MATRIX.replace("eval: {tasks: [val_loss]",
                                                     f"eval: {{tasks: [capitals], include_path: {folder}"))
    code, out, err = cli("plan", plan)
    said = " ".join(err.split())
    assert code == 2 and "'capitals.jsonl' is no file" in said and str(folder / "capitals.jsonl") in said, err


# -- 3. terminal tables: every value whole, the .md file's columns, compare not wrapped at 80 -------------------


def test_terminal_tables_show_every_value_whole_with_the_md_files_columns(done, cli):
    from rich.console import Console

    from tunelab.cli.common import print_wide
    from tunelab.report.leaderboard import frame, to_rich
    from tunelab.report.records import collect
    from tunelab.report.table import build

    tmp, mdir = done
    board = build(collect(mdir, every=True), by=["optim.lr", "peft.method"])
    table = to_rich(board, "m")
    assert [str(c.header) for c in table.columns] == list(frame(board).columns)  # the .md file's: keys, ± too
    assert "optim.lr" in [str(c.header) for c in table.columns]
    term = Console(width=70, force_terminal=True, color_system=None, record=True)
    print_wide(table, term)
    shown = term.export_text()
    assert "…" not in shown and max(len(line) for line in shown.splitlines()) <= 70
    for label in (r["cell"] for r in board.rows):  # optim.lr=0.002, peft.method=lora: may wrap at its space only
        assert all(part in shown for part in label.split(", ")), label
    code, out, err = cli("compare", f"m/{next(mdir.glob('none-*')).name}", f"m/{next(mdir.glob('lora-*')).name}",
                         "--runs-dir", tmp / "runs")
    assert code == 0, err
    assert "no test: no per-item results" in out  # a pipe: the table at its own width, no line cut at 80


# -- 4. a search stopped mid-rung says where it stands --------------------------------------------------------


def test_a_search_stopped_mid_rung_says_where_it_stands(search):
    _, mdir, stopped, _ = search
    (study,) = rows(stopped["tune"])
    assert len(study["trials"]) == 3 and study["planned_steps"] is not None and study["steps"] >= 1
    assert study["complete"] == 0 and study["stopped"] == 1 and all(t["params"] for t in study["trials"])
    assert sorted(r["cell"] for r in rows(stopped["status"])) == ["s-t00", "s-t01", "s-t02"]  # not only the started
    assert "no results yet" in stopped["board"].stdout
    assert "1/3 cell(s) finished" in stopped["log"] and "2/3 cell(s) finished" not in stopped["log"]
    states = {r["cell"]: r["state"] for r in rows(run_exp("status", mdir, "--json"))}
    assert sorted(states.values()).count("pruned") == 2  # once decided: pruned, not "pending"


# -- 5. cells that share a slug are told apart; the leaderboard's names work everywhere ----------------------


def test_cells_that_share_a_slug_are_told_apart_and_leaderboard_names_are_taken(done, search, cli):
    tmp, mdir = done
    shown = [r["cell"] for r in rows(run_exp("status", mdir, "--json"))]
    assert len(shown) == 4 and len(set(shown)) == 4 and all(re.fullmatch(r"(none|lora)-\w{10}", s) for s in shown)
    code, out, err = cli("compare", "none", "lora", "--runs-dir", tmp / "runs")
    said = " ".join(err.split())
    assert code == 2 and all(f"m/{n}" in said for n in shown if n.startswith("none")), err
    assert "Not in this table: 2 cell folder(s)" in (mdir / "leaderboard.md").read_text()
    code, out, err = cli("leaderboard", mdir, "--all", "--format", "json")
    assert code == 0 and len(json.loads(out)["rows"]) == 4, err
    stmp, _, _, _ = search
    code, out, err = cli("compare", "s-tuned", "s-t01", "--runs-dir", stmp / "runs", "--json")  # as printed
    assert code == 0, err


# -- 6. the subset mark: only when items were cut; eval run takes no suite's limit silently, shows n -----------


def test_subset_only_when_items_were_cut_and_eval_run_shows_n(tasks, tmp_path):
    whole = run_exp("eval", "run", "tiny-random-llama", "--tasks", "capitals", "--include-path", tasks, "--out",
                    tmp_path / "w", "--device", "cpu")
    assert whole.returncode == 0, whole.stderr
    assert re.search(r"capitals\s+acc\s+[\d.]+ ± [\d.]+\s+n=8$", whole.stdout, re.M), whole.stdout  # no suite limit
    for limit, subset in ((8, False), (4, True)):
        got = run_exp("eval", "run", "tiny-random-llama", "--tasks", "capitals", "--include-path", tasks,
                      "--limit", str(limit), "--out", tmp_path / str(limit), "--device", "cpu")
        res = read_json(tmp_path / str(limit) / "results.json")["tasks"]["capitals"]
        assert got.returncode == 0 and res["subset"] is subset and res["n"] == limit, got.stderr
        assert (f"n={limit}" in got.stdout) and (("*" in got.stdout) is subset), got.stdout


# -- 7. exp eval run prints no third-party noise ---------------------------------------------------------------


def test_eval_run_prints_no_third_party_noise(tasks, tmp_path):
    got = run_exp("eval", "run", "tiny-random-llama", "--tasks", "capitals", "--include-path", tasks, "--out",
                  tmp_path / "o", "--device", "cpu")
    assert got.returncode == 0, got.stderr
    said = got.stdout + got.stderr
    for noise in ("model kwarg is not of type", "not a git repository", "Warning", "it/s]", "Tokenizing"):
        assert noise not in said, said
    assert "not of type" in (tmp_path / "o" / "eval.log").read_text()  # kept, beside the results


# -- 8. exp ls: tasks of a folder, a filter, lines not a box, what -h names -------------------------------------


def test_ls_lists_a_task_folder_filters_and_names_every_kind(tasks, cli, monkeypatch):
    from tunelab.plan import lmtasks

    code, out, err = cli("ls", "-h")
    assert code == 0 and all(k in " ".join(out.split()) for k in ("samplers", "pruners", "intermediates"))
    code, out, err = cli("ls", "tasks", "--include-path", tasks)
    assert code == 0 and "capitals" in out and "task, multiple_choice" in out, err
    lmtasks.builtin()  # indexed (once per lm-eval version; the suite's other tests index it too)
    monkeypatch.setattr(lmtasks, "index_file", lambda: tasks / "no-index-yet.json")
    code, out, err = cli("ls", "tasks", "--all", "--filter", "arc_challenge")
    assert code == 0 and "indexing lm-eval's" in err and "arc_challenge" in out and len(out.splitlines()) < 60
    code, out, err = cli("ls", "tasks", "--all")
    assert code == 0 and len(out.splitlines()) > 1000 and "│" not in out and ", ?" not in out


# -- 9. wording: a checkpoint's step, Ctrl-C once, no empty batch, --best, the plan's words --------------------


def test_wording_says_what_happened_once_and_plainly(search, done, cli, tmp_path):
    from tunelab.core.events import EvalTask
    from tunelab.run.progress import shown

    assert shown(EvalTask("val_loss", 4))["info"] == "eval val_loss of the checkpoint of step 4"
    _, _, stopped, end = search
    (line,) = [x for x in stopped["log"].splitlines() if "stopped by" in x and "s-t01" in x]
    assert "Ctrl-C" in line and "SIGTERM" not in line and line.count("resume") == 1, line
    assert "s: 0 cell(s)" not in end.stderr and "0 cell(s)" not in end.stdout
    _, mdir = done
    code, out, err = cli("leaderboard", mdir, "--best")
    assert code == 2 and "no cell of this matrix has scores of its checkpoints" in " ".join(err.split())
    code, out, err = cli("plan", write(tmp_path / "t.yaml", SEARCH + "include:\n  - {optim.lr: 3.0e-3}\n"))
    assert code == 0 and "include[0].optim.lr = 0.003: searched by tune.space, so this value never runs" in \
        " ".join(err.split()), err


# -- 10. every error of a file at once, and said where it is ----------------------------------------------------


def test_every_error_of_a_file_is_said_at_once(cli, tmp_path):
    bad = write(tmp_path / "bad.yaml", SEARCH.replace("train:", "optim: {name: adamww}\n  train:")
                .replace("[val_loss]", "[val_los]").replace("pruner: halving", "pruner: halving\n  sampler: qcm")
                + "matrix:\n  peft.method: [none, lroa]\n")
    code, out, err = cli("plan", bad)
    said = " ".join(err.split())
    assert code == 2 and "4 problems" in said, err
    for key in ("tune.sampler", "base.optim.name", "base.eval.tasks", "matrix.peft.method[1]"):
        assert key in said, key
    write(tmp_path / "inc.yaml", MATRIX.replace("[val_loss]", "[val_loss], include_path: nothere"))
    code, out, err = cli("plan", tmp_path / "inc.yaml", cwd=tmp_path)
    assert code == 2 and str(tmp_path / "nothere") in err and "relative to the folder exp runs in" in err
    code, out, err = cli("eval", "run", "tiny-random-llama", "--include-path", "nothere", "--tasks", "x")
    assert code == 2 and "--include-path: no such folder" in err and "--include_path:" not in err, err
    if Path("/proc/self").is_dir():  # a folder that exists yet takes no new folder (Linux)
        code, out, err = cli("run", write(tmp_path / "ok.yaml", MATRIX), "--runs-dir", "/proc/runs")
        assert code == 2 and "/proc exists but takes no new folders" in " ".join(err.split()), err


# -- 11. plan-time warnings: shown, exit 0, in --json ----------------------------------------------------------


def test_plan_warns_of_a_relative_step_optimizer_on_zero_initialised_adapters(cli, tmp_path):
    path = write(tmp_path / "a.yaml", MATRIX.replace("matrix:\n", "matrix:\n  optim.name: [adamw, adalomo]\n"))
    code, out, err = cli("plan", path)
    said = " ".join(err.split())
    assert code == 0 and "warning:" in said and "adalomo-lora: optim.name adalomo scales each update" in said, err
    assert "adamw-lora:" not in said and "adalomo-none:" not in said
    code, out, err = cli("plan", path, "--json")
    warned = {c["slug"]: c["warnings"] for c in json.loads(out)}
    assert code == 0 and [s for s, w in warned.items() if w] == ["adalomo-lora"], warned
    assert "zero" in warned["adalomo-lora"][0]
