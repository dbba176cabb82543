"""Several adapters of one base evaluated together (evals.run_together, evals/engine/route.py) against each evaluated
alone (evals.run on train.peft.for_eval of its own model): LoRA, DoRA and IA3 adapters with non-trivial weights on
the tiny random Llama, their rows mixed in the same packed passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tunelab import evals
from tunelab.core.config import EvalCfg, ModelCfg, PeftCfg
from tunelab.evals.engine import route
from tunelab.evals.engine.generate import Decoder, Request, first_divergence
from tunelab.evals.engine.packed import PackedModel, Segment
from tunelab.models import loading
from tunelab.train import peft

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
KINDS = {"lora": PeftCfg(method="lora"), "lora_qv": PeftCfg(method="lora", r=4, target_modules=["q_proj", "v_proj"]),
         "dora": PeftCfg(method="dora"), "ia3": PeftCfg(method="ia3")}


def make_adapter(folder: Path, cfg: PeftCfg, seed: int, model: str = "tiny-random-llama", scale: float = 1.0) -> Path:
    """An adapter as a cell's final/ holds it, with random non-trivial weights (lora_B != 0, ia3 != 1, DoRA
    magnitudes moved), so that a row sent through the wrong adapter shows."""
    base, tok = loading.load(ModelCfg(name=model))
    wrapped = peft.apply(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if p.requires_grad:
                noise = scale * torch.randn(p.shape, generator=gen)
                p.copy_(p * (1 + 0.3 * noise) if "ia3_l" in name or "magnitude" in name else 0.15 * noise)
    wrapped.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {kind: make_adapter(root / kind, cfg, seed) for seed, (kind, cfg) in enumerate(KINDS.items())}


def alone(folder: Path, merged: bool = False, model: str = "tiny-random-llama"):
    """The adapter evaluated alone as a cell evaluates its final/ (train.peft.load_trained + for_eval)."""
    from peft import PeftModel

    base, tok = loading.load(ModelCfg(name=model))
    model = PeftModel.from_pretrained(base, folder).eval()
    return (model.merge_and_unload() if merged else peft.for_eval(model)), tok


def together(folders: dict[str, Path], model: str = "tiny-random-llama"):
    base, tok = loading.load(ModelCfg(name=model))
    return peft.load_adapters(base, list(folders.values()), list(folders)).eval(), tok


def sequences(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (int(torch.randint(5, 41, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def logliks(packed: PackedModel, seqs: list[list[int]], names: list[str | None], per_pass: int = 5) -> list[float]:
    """Sum of log p(token t | < t) over t >= 1 of each sequence, `per_pass` sequences to a packed pass, each through
    its adapter."""
    out = []
    with packed.running():
        for a in range(0, len(seqs), per_pass):
            batch, segs, tokens, positions, keep = seqs[a:a + per_pass], [], [], [], []
            for s, name in zip(batch, names[a:a + per_pass]):
                keep += range(len(tokens), len(tokens) + len(s) - 1)
                tokens += s
                positions += range(len(s))
                segs.append(Segment(0, len(s), adapter=name))
            logits, at = packed.forward(tokens, positions, segs, keep), 0
            for s in batch:
                lp = F.log_softmax(logits[at:at + len(s) - 1].float(), -1)
                out.append(float(lp.gather(1, torch.tensor(s[1:])[:, None]).sum()))
                at += len(s) - 1
    return out


def test_mixed_passes_score_each_row_as_its_adapter_alone(adapters):
    model, tok = together(adapters)
    names = list(adapters)
    seqs = {n: sequences(6, seed) for seed, n in enumerate(names)}
    order = [(n, j) for j in range(6) for n in names]  # every pass holds rows of several adapters
    with route.installed(model):
        mixed = logliks(PackedModel(model), [seqs[n][j] for n, j in order], [n for n, _ in order])
    got = {key: v for key, v in zip(order, mixed)}
    for n in names:
        one, _ = alone(adapters[n])
        ref = logliks(PackedModel(one), seqs[n], [None] * 6)
        assert [got[n, j] for j in range(6)] == ref, n  # bit for bit: the same adapter, unmerged, the same rounding
        merged, _ = alone(adapters[n], merged=True)
        drift = max(abs(a - b) for a, b in zip(ref, logliks(PackedModel(merged), seqs[n], [None] * 6)))
        print(f"{n}: |unmerged - merged| of whole-sequence sums (~{sum(ref) / 6:.0f}) at most {drift:.1e}")


def test_where_hflm_serves_each_adapter_is_answered_as_alone(adapters):
    """lm-eval's own HFLM code (here: prefix sharing off), one adapter after another, every row routed to it."""
    from tunelab.evals.lmeval.fanout import FanOutLM
    from tunelab.evals.lmeval.lm import SharedPrefixLM

    chosen = {k: adapters[k] for k in ("dora", "ia3")}
    model, tok = together(chosen)
    requests = [(None, s[:-3], s[-3:]) for s in sequences(6, 3)]
    with route.installed(model):
        lm = FanOutLM(model, tok, list(chosen), batch_size=4, share_prefixes=False)
        answers = [lm._loglikelihood_tokens(requests), *lm.others]
    assert lm.served == {("loglikelihood", "hf: share_prefixes off"): 6}
    for got, folder in zip(answers, chosen.values()):
        one, _ = alone(folder)
        assert got == SharedPrefixLM(one, tok, batch_size=4, share_prefixes=False)._loglikelihood_tokens(requests)


def test_an_adapter_routing_cannot_serve_is_refused_and_peft_forwards_come_back(tmp_path):
    from peft.tuners.tuners_utils import BaseTunerLayer

    from tunelab.core.errors import UserError

    folder = make_adapter(tmp_path / "emb", PeftCfg(method="lora", target_modules=["embed_tokens", "q_proj"]), 0)
    model, tok = together({"emb": folder})
    with pytest.raises(UserError, match=r"model\.embed_tokens \(a peft\.tuners\.lora\.layer\.Embedding\)"):
        evals.run_together(model, tok, EvalCfg(tasks=["val_loss"]), [evals.Context(out_dir=tmp_path / "o")], ["emb"])
    assert not (tmp_path / "o").exists()
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    with route.installed(model):
        assert all("forward" in m.__dict__ for m in layers if type(m).__name__ == "Linear")
    assert not any("forward" in m.__dict__ for m in layers) and route.router_of(model) is None


def test_greedy_generation_of_mixed_rows_equals_each_alone(adapters):
    model, tok = together(adapters)
    names = list(adapters)
    gen = torch.Generator().manual_seed(7)
    prompts = {n: [tuple(torch.randint(3, 1000, (12 + 5 * k,), generator=gen).tolist()) for k in range(3)]
               for n in names}
    requests = [Request(p, 12, adapter=n) for k in range(3) for n in names for p in [prompts[n][k]]]
    with route.installed(model):
        outs = Decoder(model, tok, batch_size=5, stop_eos=set()).generate(requests)
    mine = {(r.adapter, r.ids): o.tokens for r, o in zip(requests, outs)}
    for n in names:
        one, _ = alone(adapters[n])
        ref = Decoder(one, tok, batch_size=3, stop_eos=set()).generate([Request(p, 12) for p in prompts[n]])
        for p, o in zip(prompts[n], ref):
            if mine[n, p] != o.tokens:  # only a near-tie may flip a greedy token: say by how much
                d = first_divergence(one, p, mine[n, p], 12)
                print(f"{n}: differs at step {d.step if d else None}, logit gap {d.gap if d else None}")
            assert mine[n, p] == o.tokens, n


def suite(data_dir: Path) -> EvalCfg:
    return EvalCfg(tasks=["val_loss", "mmlu", "gsm8k_smoke", "bbh_smoke", "humaneval"], data_dir=str(data_dir),
                   subtasks={"mmlu": ["abstract_algebra", "anatomy"], "bbh_smoke": ["navigate"]},
                   limits={"gsm8k_smoke": 2}, max_new_tokens=10, batch_size=4, val_batches=2)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The MMLU fixtures and a HumanEval problem (the package's first) as a local data folder."""
    from tunelab.evals.humaneval import load_problems

    root = tmp_path_factory.mktemp("eval-data")
    (root / "mmlu").symlink_to(FIXTURES / "mmlu")
    (root / "humaneval" / "main").mkdir(parents=True)
    (root / "humaneval" / "main" / "test.jsonl").write_text("".join(json.dumps(p) + "\n" for p in load_problems(1)))
    return root


def validation(tok):
    from tunelab.core.config import DataCfg
    from tunelab.data.build import build

    return build(DataCfg(recipe="arithmetic", max_length=64), tok, loading.cache_dir())


def comparable(out_dir: Path) -> tuple[dict, list[str]]:
    """results.json less what depends on how it was run (the wall time, the group's mark, the process's threads),
    and samples.jsonl."""
    res = json.loads((out_dir / "results.json").read_text())
    res.pop("together", None)
    res.pop("threads", None)
    for task in res["tasks"].values():
        task.pop("seconds")
    return res, (out_dir / "samples.jsonl").read_text().splitlines()


def test_each_adapter_gets_the_results_it_gets_alone(adapters, data_dir, tmp_path):
    chosen = {k: adapters[k] for k in ("lora", "dora", "ia3")}
    model, tok = together(chosen)
    data = validation(tok)
    ctxs = [evals.Context(out_dir=tmp_path / "together" / n, validation=data["validation"], train=data["train"])
            for n in chosen]
    outs = evals.run_together(model, tok, suite(data_dir), ctxs, list(chosen))
    assert [o["together"]["member"] for o in outs] == [0, 1, 2] and all(o["complete"] for o in outs)
    values = {}
    for n, folder in chosen.items():
        one, tok1 = alone(folder)
        ctx = evals.Context(out_dir=tmp_path / "alone" / n, validation=data["validation"], train=data["train"])
        evals.run(one, tok1, suite(data_dir), ctx)
        ours, theirs = comparable(tmp_path / "together" / n), comparable(tmp_path / "alone" / n)
        assert ours == theirs, n
        values[n] = {t: r["value"] for t, r in ours[0]["tasks"].items()}
        assert all(r["status"] == "ok" for r in ours[0]["tasks"].values()), ours[0]["tasks"]
        assert ours[0]["tasks"]["mmlu"]["served"] == {"loglikelihood": {"engine": 24}}
    # the adapters differ, so equal results per adapter are not an accident of one model scored three times
    assert len({json.dumps(v["val_loss"]) for v in values.values()}) == 3


CELLS = """name: adapters
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 64}
  optim: {lr: 1.0e-2}
  train: {steps: 2, batch_size: 2}
  eval: {tasks: [val_loss, gsm8k_smoke], val_batches: 2, limit: 2, max_new_tokens: 6}
  tracking: {wandb: false}
matrix:
  peft.method: [lora, ia3, none]
"""


def test_exp_eval_run_adapters_writes_what_each_cell_wrote_alone(cli, tmp_path):
    from conftest import write

    runs = tmp_path / "runs"
    code, _, err = cli("run", write(tmp_path / "adapters.yaml", CELLS), "--runs-dir", runs)
    assert code == 0, err
    cells = {json.loads((p / "cell.json").read_text())["slug"]: p for p in (runs / "adapters").iterdir()
             if (p / "cell.json").is_file()}
    (eval_dir,) = [p for p in (cells["lora"] / "eval").iterdir() if p.is_dir()]
    by_exp_run = {m: comparable(cells[m] / "eval" / eval_dir.name) for m in ("lora", "ia3")}

    # a CELL as everywhere: by the name the leaderboard prints, by its final/
    code, out, err = cli("eval", "run", "tiny-random-llama", "--adapters", "lora", cells["ia3"] / "final",
                         "--runs-dir", runs)
    assert code == 0, err
    for m in ("lora", "ia3"):
        written = json.loads((cells[m] / "eval" / eval_dir.name / "results.json").read_text())
        assert written["together"]["adapters"] == 2
        assert comparable(cells[m] / "eval" / eval_dir.name) == by_exp_run[m], m
        assert f"adapters/{m}:" in out
    assert by_exp_run["lora"][0]["tasks"]["val_loss"] != by_exp_run["ia3"][0]["tasks"]["val_loss"]

    import shutil

    import yaml

    from tunelab.folders.cell import CellFolder

    other = shutil.copytree(cells["ia3"], tmp_path / "other-eval")  # the same cell with another eval section
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["eval"]["limit"] = 3
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    head = shutil.copytree(cells["lora"], tmp_path / "head")  # a cell whose adapter sits on the shared output head
    cfg = yaml.safe_load((head / "config.yaml").read_text())
    cfg["peft"]["target_modules"] = ["q_proj", "lm_head"]
    (head / "config.yaml").write_text(yaml.safe_dump(cfg))
    def files():  # a lock's file says who holds it: taking a lock writes nothing else
        return {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    refusals = {
        "the cells' eval sections differ": ("tiny-random-llama", "--adapters", cells["lora"], other),
        "a none cell: --adapters evaluates lora, dora, ia3 adapters": ("tiny-random-llama", "--adapters",
                                                                        cells["lora"], cells["none"]),
        "base model is 'tiny-random-llama', not": (str(tmp_path / "elsewhere"), "--adapters", cells["lora"]),
        "`exp eval run --adapters` takes a cell": ("tiny-random-llama", "--adapters", tmp_path),
        "the cell is named twice": ("tiny-random-llama", "--adapters", cells["lora"], cells["lora"] / "final"),
        "--adapters needs the cells": ("tiny-random-llama", "--adapters"),
        "unexpected argument(s) after MODEL": ("tiny-random-llama", cells["lora"]),
        "--out: with --adapters": ("tiny-random-llama", "--adapters", cells["lora"], "--out", tmp_path / "o"),
        "peft.target_modules: its adapter adapts ['lm_head']": ("tiny-random-llama", "--adapters", cells["lora"], head),
    }
    held = CellFolder(cells["ia3"]).lock()
    assert held.acquire(wait=0)
    with held:  # another process works in a cell: it is not evaluated under it
        code, _, err = cli("eval", "run", "tiny-random-llama", "--adapters", cells["lora"], cells["ia3"])
        assert code == 2 and "the cell is in use" in err
    for says, args in refusals.items():
        code, _, err = cli("eval", "run", *args)
        assert code == 2 and says in " ".join(err.split()) and "Traceback" not in err, (args, err)
    assert files() == before  # nothing written


@pytest.mark.slow
def test_the_quick_suite_on_smollm2_gives_two_adapters_what_each_gets_alone(tmp_path):
    """The quick suite (evals/quick.yaml; GSM8K and BBH unavailable offline, their smoke stand-ins run) on
    SmolLM2-135M-Instruct with a LoRA and an IA3 adapter: every task's results and samples equal alone's."""
    from tunelab import plan

    model = "smollm2-135m-instruct"
    chosen = {"lora": make_adapter(tmp_path / "lora", KINDS["lora"], 0, model, scale=0.1),
              "ia3": make_adapter(tmp_path / "ia3", KINDS["ia3"], 1, model, scale=0.1)}
    cfg = plan.eval_config({"suite": "quick"})
    both, tok = together(chosen, model)
    data = validation(tok)

    def ctx(where: Path):
        return evals.Context(out_dir=where, validation=data["validation"], train=data["train"])

    evals.run_together(both, tok, cfg, [ctx(tmp_path / "together" / n) for n in chosen], list(chosen))
    for n, folder in chosen.items():
        one, tok1 = alone(folder, model=model)
        evals.run(one, tok1, cfg, ctx(tmp_path / "alone" / n))
        ours, theirs = comparable(tmp_path / "together" / n), comparable(tmp_path / "alone" / n)
        assert ours == theirs, n
        assert {t for t, r in ours[0]["tasks"].items() if r["status"] == "ok"} >= {
            "val_loss", "mmlu", "gsm8k_smoke", "bbh_smoke", "humaneval"}
