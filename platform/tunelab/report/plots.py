"""The report's figures as PNG bytes: loss curves of every cell, scores along training (each checkpoint's scores
against its step), and memory and speed bars per configuration.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot): no global figure state, no display, the
same picture on a laptop and a headless CI machine. The bars take their numbers from the leaderboard's own
board (report/table.py), one sub-board per optimizer x PEFT method, so a bar is what the leaderboard calls a
configuration: seeds folded into a mean, the standard deviation over runs as its error bar.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from tunelab.report.records import TRAIN_FIGURES, Record
from tunelab.report.scores import fmt
from tunelab.report.table import build, grouped

DPI = 100
GROUP_KEYS = ("optim.name", "peft.method")


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _steps(metrics: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric; a step logged twice (a cell resumed from a checkpoint older than its last
    logged step trains those steps again) keeps its last value."""
    by_step = {m["step"]: float(m[key]) for m in metrics
               if isinstance(m.get("step"), int) and isinstance(m.get(key), (int, float))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def loss_curves(records: list[Record]) -> bytes | None:
    """Train loss per step (lines) and validation loss where it was logged (circles), one colour per cell;
    None when no cell has logged a step."""
    curves = [(r.slug, _steps(m, "loss"), _steps(m, "val_loss")) for r in records if (m := r.metrics())]
    curves = [c for c in curves if c[1][0]]
    if not curves:
        return None
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot()
    colors = [f"C{i}" for i in range(10)]
    for i, (slug, (steps, loss), (vsteps, vloss)) in enumerate(curves):
        style: dict[str, Any] = dict(color=colors[i % 10], linestyle=("-", "--", ":", "-.")[i // 10 % 4])
        ax.plot(steps, loss, label=slug, linewidth=1.5, marker="." if len(steps) < 30 else None, **style)
        if vsteps:
            ax.plot(vsteps, vloss, linestyle="none", marker="o", markersize=6, markerfacecolor="none",
                    color=style["color"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    any_val = any(v[0] for _, _, v in curves)
    ax.set_title("train loss (lines) and validation loss (circles)" if any_val else
                 "train loss (no validation loss logged during training: train.eval_every is off)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(title="cell", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1),
              ncol=1 + len(curves) // 16)
    return _png(fig)


def _group_label(rec: Record) -> str:
    return " x ".join(str(rec.config.get(k)) for k in GROUP_KEYS)


def bar_rows(records: list[Record]) -> list[dict]:
    """One entry per configuration: its group (optim.name x peft.method), its leaderboard label, and the
    leaderboard's Stat of each train figure shown (tok/s, peak MB)."""
    groups: dict[str, dict[str, str]] = {}
    for r in records:
        groups.setdefault(_group_label(r), {k: str(r.config.get(k)) for k in GROUP_KEYS})
    out = []
    for label, where in groups.items():
        board = build(records, where=where)
        for row in board.rows:
            out.append({"group": label, "cell": row["cell"],
                        **{c.name: row[c.name] for c in board.columns if c.kind == "figure"}})
    return out


def throughput_bars(records: list[Record]) -> bytes | None:
    """Peak memory and tokens/s, one horizontal bar per configuration coloured by optimizer x PEFT method;
    None when no cell has finished training."""
    rows = bar_rows(records)
    panels = [TRAIN_FIGURES[k][0] for k in ("peak_mem_mb", "tokens_per_s")]
    if not any(r.get(p) is not None and r[p].mean is not None for r in rows for p in panels):
        return None
    groups = list(dict.fromkeys(r["group"] for r in rows))
    color = {g: f"C{i % 10}" for i, g in enumerate(groups)}
    fig = Figure(figsize=(8, 1.2 + 0.32 * len(rows)))
    axes = fig.subplots(1, 2, sharey=True)
    ys = list(range(len(rows)))[::-1]  # the first configuration on top
    for ax, panel in zip(axes, panels):
        for y, r in zip(ys, rows):
            st = r.get(panel)
            if st is None or st.mean is None:
                continue
            err = st.spread if st.n > 1 and st.spread is not None else None
            ax.barh(y, st.mean, xerr=err, color=color[r["group"]], capsize=3, height=0.7)
            spread = f" ±{fmt(err)} ({st.n} runs)" if err is not None else ""
            ax.text(st.mean + (err or 0), y, f" {fmt(st.mean)}{spread}", va="center", fontsize=7)
        ax.set_title({"peak MB": "peak memory (MB)", "tok/s": "tokens/s"}.get(panel, panel), fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.35)
    axes[0].set_yticks(ys, [r["cell"] for r in rows], fontsize=8)
    handles = [Patch(color=color[g], label=g) for g in groups]
    fig.legend(handles=handles, title=" x ".join(GROUP_KEYS), fontsize=8, title_fontsize=8,
               loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(4, len(groups)))
    return _png(fig)


def _band(recs: list[Record], task: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean, std over the runs) of one task's checkpoint scores across the runs of a configuration."""
    steps = sorted({s for r in recs for s, scores in r.curve.items() if task in scores})
    out: tuple[list[int], list[float], list[float]] = ([], [], [])
    for s in steps:
        vals = [sc.value for r in recs if (sc := r.curve.get(s, {}).get(task)) is not None and sc.ok
                and sc.value is not None]
        if vals:
            out[0].append(s)
            out[1].append(statistics.fmean(vals))
            out[2].append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
    return out


def _title(recs: list[Record], task: str) -> str:
    scores = [sc for r in recs for step in r.curve.values() if (sc := step.get(task)) is not None]
    header = scores[0].header if scores else task
    marks = ("*" if any(s.subset for s in scores) else "") + \
        (" (unavailable)" if scores and not any(s.ok for s in scores) else "")
    return header + marks


def score_curves(records: list[Record]) -> bytes | None:
    """Every checkpoint score (eval.checkpoints) against its step, one panel per task, one line per configuration
    (the leaderboard's rows: seeds folded into their mean, with a band of ± one standard deviation); a star marks
    the checkpoint train.select made final/. None when no checkpoint has been scored."""
    tasks = list(dict.fromkeys(t for r in records for step in sorted(r.curve) for t in r.curve[step]))
    if not tasks:
        return None
    groups = [(label, g) for label, g in grouped(records) if any(r.curve for r in g)]
    cols = min(3, len(tasks))
    rows = -(-len(tasks) // cols)
    fig = Figure(figsize=(3.6 * cols + 1.8, 2.8 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, task in zip(axes, tasks):
        for i, (label, g) in enumerate(groups):
            steps, mean, std = _band(g, task)
            if not steps:
                continue
            ax.plot(steps, mean, color=f"C{i % 10}", marker="o", markersize=3, linewidth=1.4, label=label)
            if any(std):
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                color=f"C{i % 10}", alpha=0.2, linewidth=0)
            for r in g:
                chosen = r.train.get("final_step")
                selected = r.config.get("train.select.metric") == task
                sc = r.curve.get(chosen, {}).get(task) if selected and isinstance(chosen, int) else None
                if sc is not None and sc.ok:
                    ax.plot([chosen], [sc.value], marker="*", markersize=11, color=f"C{i % 10}", linestyle="none")
        ax.set_title(_title(records, task), fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, title="configuration", fontsize=8, title_fontsize=8, loc="upper left",
               bbox_to_anchor=(1.0, 0.95))
    fig.tight_layout()
    return _png(fig)
