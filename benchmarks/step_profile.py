"""Where a training step's CPU time goes, by kind of operation: `train_throughput.py --profile DIR`.

Each contender's process runs under torch's profiler from the start of its first timed step to the end of its run
(its model load and warm passes are left out), and writes DIR/<contender>.txt (torch's table of operations by self
CPU time) and DIR/<contender>.json (self CPU seconds by kind, and the tokens of its timed steps). `compare` prints
the kinds side by side in CPU milliseconds per 1,000 tokens, so contenders that trained on different tokens compare.
The profiler slows a step (about 2x on a CPU), so a profiled run's tokens per second are not the benchmark's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

STATE: dict[str, Any] = {}  # in a contender's process: {"profiler": ..., "tokens": int}

# kind -> a pattern of the operator names (self time) it counts; the first match wins, the rest is "other"
KINDS = {
    "matmul": r"^aten::(mm|bmm|addmm|baddbmm|addmv|mv)$",
    "attention": r"scaled_dot_product|flash_attention",
    "softmax, log-softmax": r"softmax",
    "casts and copies": r"^aten::(copy_|_to_copy|clone|contiguous)$",
    "optimizer step": r"adam|_foreach",
    "elementwise": r"^aten::(mul|mul_|add|add_|sub|sub_|div|div_|silu|silu_backward|exp|exp_|rsqrt|pow|neg|"
                   r"where|sum|mean|fill_|zero_|index_add_|index_select|embedding_dense_backward|cat|gather|"
                   r"scatter_add_|addcmul_|addcdiv_|sqrt|sign|lerp_|clamp|masked_fill_)$",
}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def start() -> None:
    """At a contender's first timed step: the profiler, if this process runs under `run`, starts recording."""
    if "profiler" in STATE:
        STATE["profiler"].start()


def run(out: Path, name: str, fn, *args) -> Any:
    """fn(*args) with the profiler armed for `start`; its tables written into `out`."""
    from torch.profiler import ProfilerActivity, profile

    STATE["profiler"] = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    result = fn(*args)
    STATE["profiler"].stop()
    averages = STATE["profiler"].key_averages()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{slug(name)}.txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=60) + "\n"
                                           + matmul_shapes(STATE["profiler"]))
    kinds: dict[str, float] = dict.fromkeys([*KINDS, "other"], 0.0)
    for event in averages:
        kind = next((k for k, pattern in KINDS.items() if re.search(pattern, event.key)), "other")
        kinds[kind] += event.self_cpu_time_total / 1e6
    (out / f"{slug(name)}.json").write_text(json.dumps({"tokens": STATE.get("tokens"), "self_cpu_s": kinds}))
    return result


def matmul_shapes(prof) -> str:
    """aten::mm by its operands' shapes: calls, self CPU seconds and the rate it ran at (GFLOP/s), slowest total
    first; the same product timed alone on this machine says whether a rate is the matmul's or the step's."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::mm" and len(e.input_shapes) >= 2 and len(e.input_shapes[0]) == 2:
            (m, k), (_, n) = e.input_shapes[0], e.input_shapes[1]
            seconds = e.self_cpu_time_total / 1e6
            rows.append((seconds, f"| {m} x {k} @ {k} x {n} | {e.count} | {seconds:.2f} | "
                                  f"{2 * m * k * n * e.count / seconds / 1e9:.0f} |"))
    head = ["| aten::mm operands | calls | self CPU s | GFLOP/s |", "|---|---:|---:|---:|"]
    return "\n".join(head + [r for _, r in sorted(rows, reverse=True)[:40]])


def compare(out: Path, names: list[str]) -> str:
    """A markdown table: CPU ms per 1,000 tokens of each kind, for each profiled contender."""
    got = {n: json.loads((out / f"{slug(n)}.json").read_text()) for n in names if (out / f"{slug(n)}.json").is_file()}
    if not got:
        return "no profile was written"
    per_k = {n: {k: 1e6 * s / r["tokens"] for k, s in r["self_cpu_s"].items()} for n, r in got.items()}
    lines = ["| kind, CPU ms per 1,000 tokens | " + " | ".join(got) + " |", "|---|" + "---:|" * len(got)]
    for kind in [*KINDS, "other"]:
        lines.append(f"| {kind} | " + " | ".join(f"{per_k[n][kind]:.0f}" for n in got) + " |")
    lines.append("| all | " + " | ".join(f"{sum(per_k[n].values()):.0f}" for n in got) + " |")
    return "\n".join(lines)
