"""CoLLiE's figure, from the memory model: total memory vs model size per optimizer.

    python -m tunelab.train.parallel.figure docs/memory_vs_size.png

Prints the markdown table of docs/parallelism.md and writes the PNG (matplotlib). Setting as in
CoLLiE's figure: tensor parallel over 8 devices, batch 1, 2048 tokens, bf16; activation
checkpointing on; memory summed over the 8 devices.
"""

from __future__ import annotations

import sys

from tunelab.train.parallel.memory import GB, SHAPES, Setup, estimate

METHODS = {"AdamW": ("adamw", "none"), "Lion": ("lion", "none"), "Adan": ("adan", "none"),
           "Sophia": ("sophiag", "none"), "LOMO": ("lomo", "none"), "AdaLomo": ("adalomo", "none"),
           "LoRA (AdamW)": ("adamw", "lora")}
COLLIE_GB_PER_B = {"AdamW": 30.5, "Lion": 30.5, "Adan": 34.5, "Sophia": 34.5, "LOMO": 2.1, "LoRA (AdamW)": 2.1}
TP = 8


def totals() -> dict[str, dict[str, float]]:
    """method -> model -> GB summed over the TP devices."""
    return {m: {name: estimate(shape, Setup(optim=o, peft=p, tp=TP, activation_checkpointing=True)).peak * TP / GB
                for name, shape in SHAPES.items()} for m, (o, p) in METHODS.items()}


def table(t: dict) -> str:
    names = list(SHAPES)
    lines = ["| method | " + " | ".join(names) + " | GB per B params (ours) | CoLLiE's fit |",
             "|---|" + "---|" * (len(names) + 2)]
    billions = {n: SHAPES[n].total() / 1e9 for n in names}
    for m, row in t.items():
        slope = sum(row[n] for n in names) / sum(billions.values())
        collie = COLLIE_GB_PER_B.get(m)
        lines.append(f"| {m} | " + " | ".join(f"{row[n]:.0f}" for n in names)
                     + f" | {slope:.1f} | {collie if collie else '-'} |")
    return "\n".join(lines)


def plot(t: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [SHAPES[n].total() / 1e9 for n in SHAPES]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, row in t.items():
        line, = ax.plot(xs, list(row.values()), marker="o", label=m)
        if m in COLLIE_GB_PER_B:
            ax.plot(xs, [COLLIE_GB_PER_B[m] * x for x in xs], ls=":", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("parameters (billions; LLaMA 7B, 13B, 30B, 65B)")
    ax.set_ylabel(f"memory summed over {TP} devices (GB)")
    ax.set_title("tunelab memory model (solid) vs CoLLiE's fits (dotted)\n"
                 f"tp={TP}, batch 1, 2048 tokens, bf16, activation checkpointing")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    t = totals()
    print(table(t))
    if argv:
        plot(t, argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])
