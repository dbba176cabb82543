"""Scores along training (#23): checkpoints scored beside training by an evaluator process of their own, a kill of
that evaluator survived, the best checkpoint by a validation metric made final/ (a test set refused), curves and
the leaderboard at a step. One real `exp run` is shared by the tests that read its result."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import write

from tunelab.core.files import read_json, read_jsonl

STEPS, ASKED = 40, [2, 4, 6]
MATRIX = f"""name: along
base:
  model: {{name: tiny-random-llama}}
  data: {{recipe: arithmetic, max_length: 64}}
  optim: {{lr: 1.0e-2}}
  peft: {{method: lora}}
  train: {{steps: {STEPS}, batch_size: 2, select: {{metric: val_loss}}}}
  eval:
    tasks: [val_loss]
    val_batches: 2
    limit: 1
    max_new_tokens: 4
    checkpoints: {{at: {ASKED}, tasks: [val_loss, humaneval], workers: 1}}
  tracking: {{wandb: false}}
"""
WAIT_S = 300


def _procs() -> dict[int, str]:
    out = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _until(what: str, check, proc: subprocess.Popen):
    t0 = time.monotonic()
    while time.monotonic() - t0 < WAIT_S:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"exp run ended ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {WAIT_S} s")


def _evaluator(cell: Path) -> int | None:
    return next((pid for pid, cmd in _procs().items()
                 if "tunelab.checkpoint_scores.evaluate" in cmd and str(cell) in cmd), None)


@pytest.fixture(scope="module")
def along(tmp_path_factory):
    """`exp run` of one LoRA cell that scores the checkpoints of steps 2, 4, 6 beside training. Once step 2's
    checkpoint is saved the test pauses the training process (SIGSTOP) until the evaluator has scored step 2, so
    that step is scored beside training whatever the machine's speed; once step 4's is saved it pauses training
    again, kills the evaluator (SIGKILL) in the middle of step 4's evaluation, lets training go on (SIGCONT), and
    the cell starts the evaluator again."""
    tmp = tmp_path_factory.mktemp("along")
    path = write(tmp / "along.yaml", MATRIX)
    proc = subprocess.Popen([sys.executable, "-m", "tunelab.cli", "run", str(path), "--runs-dir", str(tmp / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: dict = {}
    try:
        mdir = tmp / "runs" / "along"
        cell = _until("cell folder", lambda: next((p for p in mdir.glob("*") if (p / "cell.json").is_file()), None),
                      proc)
        evaluator = _until("evaluator", lambda: _evaluator(cell), proc)  # started before training
        trainer = _parent(evaluator)
        trained = lambda: max(r["step"] for r in read_jsonl(cell / "train" / "metrics.jsonl"))  # noqa: E731
        _until("checkpoint of step 2", (cell / "checkpoints" / "step-2").is_dir, proc)
        os.kill(trainer, signal.SIGSTOP)  # within a poll (20 ms) of step 2: training is far from step 40
        seen["trained_when_paused"] = [trained()]
        # Training waits for step 2's score: only the evaluator beside it can give it.
        seen["scored_while_paused"] = read_json(_until(
            "step 2 scored", lambda: next((cell / "eval").glob("*/step-2/results.json"), None), proc))
        os.kill(trainer, signal.SIGCONT)
        _until("checkpoint of step 4", (cell / "checkpoints" / "step-4").is_dir, proc)
        os.kill(trainer, signal.SIGSTOP)
        seen["trained_when_paused"].append(trained())
        half = _until("step 4 being evaluated", lambda: next((cell / "eval").glob("*/.step-4-*"), None), proc)
        os.kill(evaluator, signal.SIGKILL)
        seen["killed"], seen["half"] = evaluator, half
        os.kill(trainer, signal.SIGCONT)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return {"cell": cell, "mdir": mdir, "path": path, "code": proc.returncode, "err": err, "out": out, **seen}


def _steps(cell: Path) -> dict[int, dict]:
    (ck,) = [p for p in (cell / "eval").iterdir() if (p / "step-2").is_dir()]
    return {int(p.name.removeprefix("step-")): read_json(p / "results.json") for p in ck.glob("step-*")}


def test_checkpoints_are_scored_beside_training_and_a_killed_evaluator_loses_nothing(along):
    assert along["code"] == 0, along["err"][-3000:]
    cell = along["cell"]
    # Training was unfinished while the evaluator scored step 2 and worked on step 4: paused there, not waited for.
    assert max(along["trained_when_paused"]) < STEPS
    log = (cell / "cell.log").read_text()
    assert f"checkpoint evaluator pid {along['killed']} ended (-9) while training goes on: starting it again" in log
    steps = _steps(cell)
    assert sorted(steps) == ASKED
    for step, res in steps.items():
        assert res["complete"] and res["step"] == step and res["checkpoint"] == f"checkpoints/step-{step}"
        assert res["evaluated_by"] in ("beside training", "the cell, after training")  # steps 4 and 6: either
        assert res["tasks"]["val_loss"]["value"] > 0
        he = res["tasks"]["humaneval"]
        assert he["n"] == 1 and he["subset"], he  # 1 of 164 problems: marked as a subset
        assert res["versions"]["tunelab"] and res["config"]["tasks"] == ["val_loss", "humaneval"]  # provenance
        assert (along["half"].parent / f"step-{step}" / "samples.jsonl").is_file()
    # Step 2 was scored beside training by the first evaluator while training was paused, and kept.
    assert steps[2]["evaluated_by"] == "beside training" and steps[2]["pid"] == along["killed"]
    assert steps[2] == along["scored_while_paused"]
    assert steps[4]["pid"] != along["killed"]  # step 4 was evaluated again, by another process
    assert not list(along["half"].parent.glob(".step-*-*")), "a killed evaluation left its half-written folder"
    assert max(r["step"] for r in read_jsonl(cell / "train" / "metrics.jsonl")) == STEPS


def test_final_weights_are_the_checkpoint_best_on_the_validation_metric(along):
    cell = along["cell"]
    losses = {s: r["tasks"]["val_loss"]["value"] for s, r in _steps(cell).items()}
    best = min(losses, key=lambda s: (losses[s], s))
    selection = read_json(cell / "train" / "selection.json")
    assert selection["step"] == best and selection["last_step"] == STEPS and selection["mode"] == "min"
    assert {int(k): v for k, v in selection["scores"].items()} == losses
    # final/'s evaluation measured the chosen checkpoint's weights: its val_loss is that checkpoint's.
    (final_eval,) = [read_json(p / "results.json") for p in (cell / "eval").iterdir() if (p / "results.json").is_file()]
    assert final_eval["tasks"]["val_loss"]["value"] == pytest.approx(losses[best], rel=1e-5)
    (row,) = csv.DictReader((along["mdir"] / "leaderboard.csv").open())
    assert float(row["final/ from step"]) == best


def test_curve_data_equals_each_checkpoint_evaluated_alone(along, cli, tmp_path):
    cell = along["cell"]
    from tunelab.checkpoint_scores.steps import score_at
    from tunelab.report.records import collect

    (record,) = collect(along["mdir"])
    for step in ASKED:
        code, out, err = cli("eval", "run", cell / "checkpoints" / f"step-{step}", "--out", tmp_path / f"s{step}",
                             "--device", "cpu")
        assert code == 0, err
        alone = read_json(tmp_path / f"s{step}" / "results.json")
        assert alone["step"] == step
        for task in ("val_loss", "humaneval"):
            assert record.curve[step][task].value == alone["tasks"][task]["value"], (step, task)
        # what a search (tune) reads as a trial's intermediate value
        assert score_at(cell, step, "val_loss") == alone["tasks"]["val_loss"]["value"]
    assert score_at(cell, 5, "val_loss") is None  # no checkpoint of step 5 was scored


def test_leaderboard_at_a_step_and_at_the_selected_checkpoint(along, cli):
    mdir = along["mdir"]
    losses = {s: r["tasks"]["val_loss"]["value"] for s, r in _steps(along["cell"]).items()}
    code, out, err = cli("leaderboard", mdir, "--at-step", "4", "--format", "csv")
    assert code == 0, err
    (row,) = csv.DictReader(io.StringIO(out))
    assert float(row["scored at step"]) == 4 and float(row["val_loss"]) == pytest.approx(losses[4])
    code, out, err = cli("leaderboard", mdir, "--best", "--format", "csv")
    assert code == 0, err
    best = read_json(along["cell"] / "train" / "selection.json")["step"]
    (row,) = csv.DictReader(io.StringIO(out))
    assert float(row["scored at step"]) == best and float(row["val_loss"]) == pytest.approx(losses[best])
    code, _, err = cli("leaderboard", mdir, "--at-step", "5")
    assert code == 2 and "scored steps: 2, 4, 6" in err
    code, _, err = cli("leaderboard", mdir, "--at-step", "4", "--best")
    assert code == 2 and "give one of them" in err


def test_report_shows_the_score_curve(along, cli):
    code, _, err = cli("report", along["mdir"])
    assert code == 0, err
    html = (along["mdir"] / "report.html").read_text()
    section = html.split("<h2>Scores along training</h2>", 1)[1].split("<h2>", 1)[0]
    assert "data:image/png;base64," in section and "no checkpoint has been scored" not in section


def test_a_test_set_metric_cannot_choose_the_checkpoint(cli, tmp_path):
    path = write(tmp_path / "m.yaml", MATRIX.replace("select: {metric: val_loss}", "select: {metric: humaneval}"))
    code, out, err = cli("plan", path)
    assert code == 2
    assert "train.select.metric" in err and "test set" in err and "Traceback" not in err
    path = write(tmp_path / "m.yaml", MATRIX.replace("checkpoints: {at: [2, 4, 6], tasks: [val_loss, humaneval], "
                                                     "workers: 1}", ""))
    code, out, err = cli("plan", path)
    assert code == 2 and "eval.checkpoints" in err and "Traceback" not in err


@pytest.mark.parametrize("change, says", [
    ("workers: 1", "every: 2, workers: 1"),  # every and at: one of them
    ("at: [2, 4, 6]", "at: [2, 4, 60]"),  # a step after the last
    ("select: {metric: val_loss}", "select: {metric: val_loss}, keep_best: 0"),
])
def test_bad_checkpoint_settings_are_refused_at_plan_time(cli, tmp_path, change, says):
    path = write(tmp_path / "m.yaml", MATRIX.replace(change, says))
    code, out, err = cli("plan", path)
    assert code == 2 and str(path) in err and "Traceback" not in err, err
    assert ("eval.checkpoints" in err) or ("train.keep_best" in err), err


def test_the_plan_says_where_checkpoints_are_scored(cli, tmp_path):
    path = write(tmp_path / "m.yaml", MATRIX.replace(", workers: 1", ""))
    code, out, err = cli("plan", path, "--json")
    assert code == 0, err
    (cell,) = json.loads(out)
    assert cell["checkpoints"]["steps"] == ASKED
    import torch

    # what this machine will do, not a hedge over every machine (issue 48)
    assert ("beside training (1 process)" if torch.cuda.is_available() else "after training, in the cell's process "
            "(no CUDA device here: evaluators would slow training)") in cell["checkpoints"]["mode"]
    assert "on CUDA" not in cell["checkpoints"]["mode"] and "on CPU" not in cell["checkpoints"]["mode"]


LATER = """name: later
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  peft: {method: lora}
  train: {steps: 4, batch_size: 2, save_every: 2, keep_checkpoints: 2}
  eval: {tasks: [val_loss], val_batches: 2CHECKPOINTS}
  tracking: {wandb: false}
"""


def test_checkpoint_scores_added_to_a_finished_matrix_train_nothing(cli, tmp_path):
    runs = tmp_path / "runs"
    code, _, err = cli("run", write(tmp_path / "later.yaml", LATER.replace("CHECKPOINTS", "")), "--runs-dir", runs)
    assert code == 0, err
    (cell,) = [p for p in (runs / "later").iterdir() if p.is_dir()]
    trained = {p: p.stat().st_mtime_ns for p in [cell / "train" / "metrics.jsonl", *(cell / "final").iterdir()]}
    (final_eval,) = list((cell / "eval").iterdir())
    path = write(tmp_path / "later.yaml", LATER.replace("CHECKPOINTS", ", checkpoints: {at: [1, 2, 4]}"))
    code, _, err = cli("run", path, "--runs-dir", runs)
    assert code == 0, err
    assert trained == {p: p.stat().st_mtime_ns for p in trained}  # nothing trained, no weights rewritten
    status = read_json(cell / "status.json")
    assert status["state"] == "done" and status["evaluating_only"] is True
    steps = {int(p.name.removeprefix("step-")): read_json(p / "results.json")
             for p in (cell / "eval").glob("*/step-*")}
    assert sorted(steps) == [1, 2, 4] and all(r["complete"] for r in steps.values())
    assert steps[2]["tasks"]["val_loss"]["value"] > 0 and steps[4]["evaluated_by"] == "the cell, after training"
    one = steps[1]["tasks"]["val_loss"]  # never saved: said unavailable, with why, never a number
    assert one["status"] == "unavailable" and "no checkpoint of step 1" in one["reason"] and one["value"] is None
    # the same settings as the final evaluation: the same eval id, its steps beside its results.json
    assert list((cell / "eval").iterdir()) == [final_eval] and (final_eval / "results.json").is_file()
    code, _, err = cli("run", path, "--runs-dir", runs)
    assert code == 0 and "done, skipped" in err


def test_keep_best_keeps_the_best_k_scored_checkpoints_and_those_not_yet_scored(tmp_path):
    from tunelab import plan
    from tunelab.checkpoint_scores.steps import StepScores
    from tunelab.core.files import write_yaml
    from tunelab.folders.cell import CellFolder
    from tunelab.train.checkpoint import prune

    raw = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
           "train": {"steps": 8, "select": {"metric": "val_loss"}, "keep_best": 2},
           "eval": {"tasks": ["val_loss"], "checkpoints": {"every": 2}}}
    cfg = plan.cell_config(raw)
    folder = CellFolder(tmp_path)
    write_yaml(folder.config_file, cfg.model_dump(mode="json"))
    losses = {2: 3.0, 4: 1.0, 6: 2.0}  # step 8 not scored yet
    for step in (2, 4, 6, 8):
        folder.checkpoint_dir(step).mkdir(parents=True)
    for step, loss in losses.items():
        write(folder.step_dir(cfg.checkpoint_eval_id(), step) / "results.json",
              json.dumps({"complete": True, "tasks": {"val_loss": {"value": loss, "status": "ok"}}}))
    scores = StepScores(folder, cfg)
    assert scores.ranked() == [4, 6, 2] and scores.best() == 4 and scores.pending() == [8]
    prune(folder.checkpoints, 1, scores.protected())
    assert folder.checkpoint_steps() == [4, 6, 8]


def _history(wandb_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file (records in the LevelDB log format, each a protobuf Record)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, rows, block = wandb_file.read_bytes(), 7, [], [], 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            if record.HasField("history"):
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_gets_each_checkpoint_score_against_its_step(tmp_path, monkeypatch):
    from tunelab.core.config import CellConfig
    from tunelab.core.events import CheckpointScores
    from tunelab.report.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}})
    tracker = Tracker(cfg, tmp_path, group="g", name="n", config={}, tags=[])
    for step, loss in ((2, 1.5), (4, 1.25)):
        tracker.on_event(CheckpointScores(step, {"checkpoint/val_loss": loss, "checkpoint/humaneval": "unavailable"}))
    tracker.finish()
    import wandb
    wandb.teardown()  # run.finish() returns before wandb-core has flushed the run file; teardown waits for it
    (run,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = [(r["checkpoint/step"], r["checkpoint/val_loss"]) for r in _history(run) if "checkpoint/step" in r]
    assert rows == [(2, 1.5), (4, 1.25)]


def test_score_curves_fold_seeds_into_a_band():
    from tunelab.report.plots import _band, score_curves
    from tunelab.report.records import Record
    from tunelab.report.scores import Score

    def rec(seed: int, losses: dict[int, float]) -> Record:
        curve = {s: {"val_loss": Score.of("val_loss", {"value": v, "n": 2})} for s, v in losses.items()}
        return Record(dir=Path("."), slug=f"a-s{seed}", id=str(seed), eval_id=None, varying={"seed": seed},
                      config={"seed": seed}, state="done", curve=curve)

    runs = [rec(0, {2: 3.0, 4: 2.0}), rec(1, {2: 1.0, 4: 2.0})]
    assert _band(runs, "val_loss") == ([2, 4], [2.0, 2.0], [pytest.approx(2 ** 0.5), 0.0])
    assert score_curves(runs)[:8] == b"\x89PNG\r\n\x1a\n"
    assert score_curves([rec(0, {})]) is None


def test_a_smaller_suite_for_the_checkpoints_leaves_the_final_evaluation_alone():
    from tunelab import plan

    raw = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}, "train": {"steps": 4},
           "eval": {"tasks": ["val_loss"], "checkpoints": {"every": 2, "suite": "quick", "limit": 2}}}
    cfg = plan.cell_config(raw)
    at = cfg.eval.at_checkpoints()
    assert at is not None and at.tasks[:2] == ["val_loss", "mmlu"] and at.limit == 2 and at.limits == {}
    assert at.max_new_tokens == 128  # the quick suite's
    assert cfg.eval.tasks == ["val_loss"] and cfg.checkpoint_steps() == (2, 4)
    without = plan.cell_config({**raw, "eval": {"tasks": ["val_loss"]}})
    assert without.eval.id() == cfg.eval.id() and without.id() == cfg.id()  # nothing trains or evaluates again
