"""`exp eval ...` and `exp chat`: run an evaluation suite on any model, fetch what can be had offline, talk to a
model.

A typer group cannot take a positional MODEL and subcommands at once, hence `exp eval run MODEL`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from tunelab.cli.common import EVALUATE, RunsDir, Threads, app, err, interruptible, libraries_to, quiet_libraries
from tunelab.core.errors import UserError
from tunelab.folders.cell import EvalFolder

eval_app = typer.Typer(no_args_is_help=True)
app.add_typer(eval_app, name="eval", help="Evaluate any model on a suite; fetch offline eval data.",
              rich_help_panel=EVALUATE)


@eval_app.command("run")
def run_cmd(
    model: Annotated[str, typer.Argument(help="what to evaluate: a catalog alias, a cell (its folder, its final/, or "
                                              "its name as the leaderboard prints it), a cell's checkpoint "
                                              "(CELL/checkpoints/step-N), a folder with a model, or a hub id")],
    cells: Annotated[list[str] | None, typer.Argument(help="with --adapters: the LoRA/DoRA/IA3 cells of MODEL to "
                                                           "evaluate together (read as MODEL's cell is)",
                                                      show_default=False)] = None,
    adapters: Annotated[bool, typer.Option("--adapters", help="MODEL is a base; evaluate the final/ adapters of the "
                                           "CELLS after it over one load of it, in shared passes, each into its "
                                           "cell's eval/<eval-id>/ (its own eval section unless --suite/--tasks)")
                        ] = False,
    suite: Annotated[str | None, typer.Option(help="suite in evals/ (paper, quick, full) or a suite YAML; default: "
                                              "quick, or with --tasks no suite (every item of each task); a cell "
                                              "or checkpoint: its own eval settings")] = None,
    out: Annotated[Path | None, typer.Option(help="folder for results.json and samples.jsonl  [default: eval-out]",
                                             show_default=False)] = None,
    tasks: Annotated[str | None, typer.Option(help="comma-separated tasks (tunelab's, lm-eval's, include-path's), "
                                              "replacing the suite's")] = None,
    limit: Annotated[int | None, typer.Option(help="examples per task (per subject), replacing the suite's")] = None,
    data_dir: Annotated[str | None, typer.Option(help="local benchmark data instead of the hub")] = None,
    include_path: Annotated[str | None, typer.Option(help="a folder of lm-eval task YAMLs whose tasks --tasks "
                                                     "may name")] = None,
    batch_size: Annotated[int | None, typer.Option(help="batch size, replacing the suite's")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    threads: Threads = None,
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Evaluate MODEL on a suite; writes OUT/results.json and OUT/samples.jsonl. With --adapters: evaluate the
    CELLS' adapters over the base MODEL together."""
    from tunelab.machine.threads import start_process

    start_process(threads)  # first: before torch loads (its waiting policy, its threads: machine/threads.py)
    from rich.console import Console

    from tunelab.core.errors import UserError
    from tunelab.folders.targets import resolve

    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device!r}: allowed are auto, cpu, cuda")
    # With --adapters MODEL is the cells' base, checked against their model section (tools/evaluate_adapters.py)
    target = None if adapters else resolve(model, "eval run", ("alias", "cell", "checkpoint", "model", "hub"), runs_dir)
    given = {"limit": limit, "data_dir": data_dir, "batch_size": batch_size, "include_path": include_path}
    if bool(cells) != adapters:
        usage = "several cells' adapters over one base: exp eval run BASE --adapters CELL..."
        raise UserError(f"unexpected argument(s) after MODEL: {' '.join(map(str, cells or []))} ({usage})" if cells
                        else f"--adapters needs the cells to evaluate ({usage})")
    if adapters and out is not None:
        raise UserError("--out: with --adapters each cell's results go to its own eval/<eval-id>/")
    model_cfg, cfg = _configs(target, suite, tasks, given)
    quiet_libraries()
    console = Console()
    if adapters:  # each cell's own eval section unless the command line sets one
        own = suite is None and tasks is None and all(v is None for v in given.values())
        _adapters(model, cells or [], runs_dir, None if own else cfg, device, console)
        return
    out = Path("eval-out") if out is None else out
    with interruptible(f"nothing was scored; {out} holds what was written so far"), \
            libraries_to(EvalFolder(out).log_file):
        result = _evaluate(target, model_cfg, cfg, out, device, console)
    _show(result, out, console)


def _configs(target: Any, suite: str | None, tasks: str | None, given: dict) -> tuple[Any, Any]:
    """The model section (a model named, not a cell) and the eval section the command line asks for."""
    from tunelab import plan
    from tunelab.core.config import EvalCfg
    from tunelab.core.errors import explain

    raw: dict[str, object] = {**_settings_of(target, suite, bool(tasks)),
                              **{k: v for k, v in given.items() if v is not None}}
    if given.get("limit") is not None:
        raw["limits"] = {}  # the suite's per-task limits too: --limit is the one limit
    if tasks:
        raw["tasks"] = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        model_cfg = plan.section_config("model", {"name": target.model_name}) if target is not None and \
            target.kind in ("alias", "model", "hub") else None
        return model_cfg, plan.eval_config(raw)
    except plan.Invalid as e:
        where = lambda loc: "--" + (".".join(map(str, loc)).replace("_", "-") or "suite")  # noqa: E731
        raise explain(e, EvalCfg, file="command line", where=where) from None


def _evaluate(target: Any, model_cfg: Any, cfg: Any, out: Path, device: str, console: Any) -> dict:
    """A cell's checkpoint as its cell scores one, a cell's final/ weights as its cell evaluates them
    (checkpoint_scores.evaluate), or any model by its name."""
    from tunelab import evals
    from tunelab.checkpoint_scores.evaluate import evaluate_checkpoint, evaluate_final
    from tunelab.machine.runtime import device_of
    from tunelab.models import loading

    if target.kind == "checkpoint":
        with _bars(console) as emit:
            return evaluate_checkpoint(target.cell, target.step, cfg, out, device, emit)
    if target.kind == "cell":
        with _bars(console) as emit:
            return evaluate_final(target.cell, cfg, out, device, emit)
    try:
        lm, tok = loading.load(model_cfg, device_of(device))
    except (OSError, ValueError) as e:  # a folder whose files transformers cannot read as a model
        raise UserError(f"cannot load a model from it: {e}", file=target.given) from None
    with _bars(console) as emit:
        return evals.run(lm, tok, cfg, evals.Context(out_dir=out, model_note=loading.source_note(model_cfg.name)), emit)


def _adapters(base: str, cells: list[str], runs_dir: Path, ecfg: Any, device: str, console: Any) -> None:
    from tunelab.folders.targets import resolve
    from tunelab.tools import evaluate_adapters

    # each CELL read as everywhere: its folder, its final/, or its name as the leaderboard prints it
    folders = [resolve(c, "eval run --adapters", ("cell",), runs_dir).cell.path for c in cells]
    with _bars(console) as emit:
        done = evaluate_adapters.evaluate(base, folders, ecfg, device, emit)
    for folder, out, result in done:
        console.print(f"{folder.label}:", highlight=False)
        _show(result, out, console)


def _show(result: dict, out: Path, console: Any) -> None:
    from tunelab.core.errors import UserError
    from tunelab.report.scores import Score, marked

    shown = [Score.of(name, r) for name, r in result["tasks"].items()]
    for s in shown:
        if not s.ok:
            text = f"unavailable: {s.reason}"
        else:
            text = marked(s.value, s.subset) + (f" ± {s.stderr:.3g}" if s.stderr is not None else "") + f"  n={s.n}"
        console.print(f"{s.task:12s} {s.metric or '':28s} {text}", highlight=False, soft_wrap=True)
    limits = [f"{s.task} {lim}" for s in shown if (lim := result["tasks"][s.task].get("limit")) is not None]
    if any(s.subset for s in shown):
        console.print("*: a subset of the task (fewer items than its test set; see n)"
                      + (f"; items per task at most: {', '.join(limits)}" if limits else ""), highlight=False,
                      soft_wrap=True)
    console.print(f"wrote {EvalFolder(out).results_file}")
    if result.get("model_note"):
        console.print(f"note: the model's weights are {result['model_note']}", highlight=False, soft_wrap=True)
    if all(r.get("status", "ok") != "ok" for r in result["tasks"].values()):
        # Nothing was scored: a script must not read this as a result.
        raise UserError(f"every requested task was unavailable ({', '.join(result['tasks'])}); see the reasons "
                        f"above and in {EvalFolder(out).results_file}")


def _settings_of(target: Any, suite: str | None, tasks: bool) -> dict:
    """The settings --suite names; without it, a checkpoint's as its cell scores its checkpoints, a cell's as its
    eval section says; anything else the quick suite's, or none at all with --tasks (every item of those
    tasks, as lm_eval runs them: a suite's limit is not taken silently)."""
    if suite is not None or target is None or target.kind not in ("cell", "checkpoint"):
        return {"suite": suite} if suite else {} if tasks else {"suite": "quick"}
    cfg = target.cell.config()
    ecfg = (cfg.eval.at_checkpoints() or cfg.eval) if target.kind == "checkpoint" else cfg.eval
    return ecfg.model_dump(mode="json", exclude={"checkpoints"})


@contextmanager
def _bars(console):
    """One progress bar per task, fed by the engine's events (requests done / total, with the time left)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from tunelab.core.events import EvalProgress, EvalTask

    bars: list = []

    def finish(progress) -> None:  # a task is over: its bar shows full; one that scored nothing has none
        total = progress.tasks[-1].total
        if total:
            progress.update(bars[-1], completed=total)
        else:
            progress.remove_task(bars[-1])

    with Progress(TextColumn("{task.description:12s}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=False) as progress:

        def emit(ev) -> None:
            if isinstance(ev, EvalTask):
                if bars:
                    finish(progress)
                bars.append(progress.add_task(ev.task, total=None))
            elif isinstance(ev, EvalProgress) and bars:
                progress.update(bars[-1], completed=ev.done, total=ev.total)

        yield emit
        if bars:
            finish(progress)


@eval_app.command("pull")
def pull_cmd(
    dest: Annotated[Path | None, typer.Option(help="target folder; default: $TUNELAB_CACHE/eval-data")] = None,
) -> None:
    """Put the benchmark data that needs no hub into the offline cache (HumanEval, MMLU, exemplars)."""
    from tunelab.evals.testsets.pull import pull

    pull(dest)


@app.command("chat", rich_help_panel=EVALUATE)
def chat_cmd(
    target: Annotated[str, typer.Argument(help="a done cell (its folder, or its name as the leaderboard prints it), "
                                               "an export, a catalog alias, a folder or a hub id")],
    prompt: Annotated[str | None, typer.Option(help="answer this one message and exit (no terminal needed)")] = None,
    system: Annotated[str | None, typer.Option(help="a system message that starts the conversation")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="most tokens per answer")] = 256,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy, else sampling temperature")] = 0.7,
    template: Annotated[str, typer.Option(help="auto (the template a cell trained with, else the tokenizer's chat "
                                               "template, else alpaca), chat, alpaca or plain")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    runs_dir: RunsDir = Path("runs"),
) -> None:
    """Talk to a model, its answers streamed token by token."""
    from tunelab.folders.targets import resolve
    from tunelab.tools import chat

    found = resolve(target, "chat", ("cell", "model", "alias", "hub"), runs_dir)
    target = str(found.cell.path) if found.kind == "cell" else found.model_name

    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device!r}: allowed are auto, cpu, cuda")
    if template not in chat.TEMPLATE_CHOICES:  # before the model loads, which takes a while
        raise UserError(f"--template {template!r}: allowed are {', '.join(chat.TEMPLATE_CHOICES)}")
    from tunelab.machine.runtime import device_of as device_for

    quiet_libraries()
    with interruptible("chat ended"):
        model, tok, trained, label = chat.load_target(target, device_for(device))
        name, note = chat.choose_template(template, tok, trained)
        if note:
            err.print(f"[dim]{escape(note)}", highlight=False, soft_wrap=True)
        chat.session(model, tok, name, system=system, max_new_tokens=max_new_tokens, temperature=temperature,
                     prompt=prompt, label=label, info=lambda m: err.print(f"[dim]{escape(m)}", highlight=False))
