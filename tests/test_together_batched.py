"""Batched mode of a together-group (#46, train/batched.py): one step of every member in one pass through the base,
each row through its own adapter. From the same state, each member's loss, gradients and random stream after the
pass are those of its step alone (its adapter alone active, its own batch and shapes: exact mode, which
test_together_train.py shows is the cell alone bit for bit), within 1e-6 in fp32: LoRA with dropout (two ranks,
other targets), DoRA with dropout, IA3 on attention and feed-forward modules, gradient accumulation, rows of
different widths. End to end, `exp run --together-mode batched` trains a group, each member says so, and its
numbers stay close to alone's; what cannot join steps exact and `exp plan` says why.
"""

from __future__ import annotations

import pytest
import torch
from conftest import write

from tunelab.core.config import CellConfig, ModelCfg
from tunelab.core.files import read_json, read_jsonl
from tunelab.models import loading
from tunelab.train import batched, checkpoint, members
from tunelab.train.data import collate, label_tokens
from tunelab.train.parallel.local import forward_loss

CELLS = [
    {"peft": {"method": "lora", "dropout": 0.1}, "train": {"seed": 0}},
    {"peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.2, "target_modules": ["q_proj", "v_proj"]},
     "train": {"seed": 1}},
    {"peft": {"method": "dora", "dropout": 0.05}, "train": {"seed": 2}},
    {"peft": {"method": "ia3"}, "train": {"seed": 3}},
]


def _cfg(over: dict) -> CellConfig:
    return CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      **over})


def _batch(gen: torch.Generator, rows: int, longest: int, vocab: int) -> dict:
    """Rows of different lengths (the last one `longest`), their first half prompt (label -100)."""
    out = []
    for i in range(rows):
        n = longest - 3 * (rows - 1 - i)
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2:]})
    return collate(0)(out)


@pytest.fixture(scope="module")
def group():
    model, _ = loading.load(ModelCfg(name="tiny-random-llama"))
    cfgs = [_cfg(c) for c in CELLS]
    states = []
    for k, cfg in enumerate(cfgs):
        model = members.inject(model, members.member_name(k), cfg)
        states.append(checkpoint.rng_state())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters past their init (LoRA's B is zero there, IA3's vectors one): each changes its rows
        for n, p in model.named_parameters():
            if "lora_B" in n or "ia3_l" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    vocab = model.config.vocab_size
    # each member its own batches and widths; two micro-batches a step (gradient accumulation)
    micro = [[_batch(gen, 3, 20 + 5 * k, vocab), _batch(gen, 3, 14 + 7 * k, vocab)] for k in range(len(cfgs))]
    return model, cfgs, states, micro


def _grads(model, name: str) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if f".{name}." in n + "." and p.grad is not None}


def _alone(model, k: int, state: dict, micro: list[dict]) -> tuple[float, dict, torch.Tensor]:
    """Member k's backward passes with its adapter alone active, as exact mode (and the cell alone) runs them."""
    name = members.member_name(k)
    members.activate(model, name)
    model.train()
    checkpoint.set_rng_state(state)
    n = sum(label_tokens(b) for b in micro)
    loss = 0.0
    for b in micro:
        step = forward_loss(model, b, n, torch.device("cpu"), "fp32")
        step.backward()
        loss += float(step.detach())
    out = loss, _grads(model, name), torch.get_rng_state()
    model.zero_grad(set_to_none=True)
    return out


def test_one_batched_step_gives_each_member_its_alone_loss_gradients_and_random_stream(group):
    model, cfgs, states, micro = group
    assert batched.unroutable(model) is None
    alone = [_alone(model, k, states[k], micro[k]) for k in range(len(cfgs))]

    ms = [members.Member(k, cfg, model, None, {**states[k], "torch": states[k]["torch"].clone()}, None)
          for k, cfg in enumerate(cfgs)]
    done = batched.backward(ms, micro, [sum(label_tokens(b) for b in mb) for mb in micro], 0,
                            torch.device("cpu"), "fp32")
    for k, m in enumerate(ms):
        loss, grads, rng = alone[k]
        got = _grads(model, m.name)
        assert set(got) == set(grads) and grads, m.name
        assert abs(float(done.losses[k]) - loss) <= 1e-6, (m.name, float(done.losses[k]), loss)
        worst = max(float((got[n] - g).abs().max()) for n, g in grads.items())
        scale = max(float(g.abs().max()) for g in grads.values())
        assert worst <= 1e-6 * max(1.0, scale), (m.name, worst, scale)
        assert scale > 0, m.name  # the gradients are not all zero (the test could not fail then)
        assert torch.equal(m.rng["torch"], rng), f"{m.name}: its dropout drew other numbers than alone"
    model.zero_grad(set_to_none=True)


def test_rows_meet_only_their_own_adapter(group):
    """A member's gradients come from its own rows only: a batched pass whose other rows change leaves them as they
    were (the routing cannot leak one member's rows into another's adapter)."""
    model, cfgs, states, micro = group
    n = [sum(label_tokens(b) for b in mb) for mb in micro]

    def grads_of_first(others: list[list[dict]]) -> dict[str, torch.Tensor]:
        ms = [members.Member(k, cfg, model, None, {**states[k]}, None) for k, cfg in enumerate(cfgs)]
        batched.backward(ms, [micro[0], *others], n[:1] + [sum(label_tokens(b) for b in mb) for mb in others], 0,
                         torch.device("cpu"), "fp32")
        out = _grads(model, "m0")
        model.zero_grad(set_to_none=True)
        return out

    a = grads_of_first(micro[1:])
    b = grads_of_first([micro[3], micro[1], micro[2]][::-1])
    assert all(float((a[k] - b[k]).abs().max()) <= 1e-6 for k in a)


def test_what_cannot_be_batched_says_why():
    from tunelab.run.together import why_not_batched

    assert why_not_batched(_cfg({"peft": {"method": "lora"}})) is None
    assert "data.pack" in why_not_batched(_cfg({"peft": {"method": "lora"}, "data": {"recipe": "arithmetic",
                                                                                    "pack": True}}))
    assert "adalomo" in why_not_batched(_cfg({"peft": {"method": "lora"}, "optim": {"name": "adalomo"}}))
    assert "gradient checkpointing" in why_not_batched(
        _cfg({"peft": {"method": "lora", "dropout": 0.1}, "train": {"gradient_checkpointing": True}}))
    assert why_not_batched(_cfg({"peft": {"method": "lora", "dropout": 0.0},
                                 "train": {"gradient_checkpointing": True}})) is None


MATRIX = """name: bt
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 4, batch_size: 4, warmup_steps: 1, device: cpu}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
include:
  - {peft.method: lora, peft.dropout: 0.1, optim.lr: 1.0e-3}
  - {peft.method: dora, peft.dropout: 0.05, optim.lr: 2.0e-3, train.seed: 1}
  - {peft.method: ia3, optim.lr: 1.0e-2}
  - {peft.method: lora, optim.name: adalomo, optim.lr: 1.0e-2}
"""


def test_a_batched_group_trains_end_to_end_close_to_alone(cli, tmp_path):
    path = write(tmp_path / "bt.yaml", MATRIX)
    code, out, err = cli("plan", str(path), "--together-mode", "batched")
    assert code == 0, out + err
    assert "steps exact in its group: optim.name adalomo updates inside its own backward pass" in out
    for runs, how in (("b", ["--together-mode", "batched"]), ("a", ["--together", "off"])):
        code, out, err = cli("run", str(path), *how, "--runs-dir", str(tmp_path / runs))
        assert code == 0, out + err
    root_b, root_a = tmp_path / "b" / "bt", tmp_path / "a" / "bt"
    cells = sorted(p.name for p in root_b.iterdir() if (p / "train" / "summary.json").exists()
                   and read_json(p / "train" / "summary.json").get("together"))
    assert len(cells) == 4, cells  # (the matrix's base cell, full-parameter, trains alone)
    for name in cells:
        got = read_json(root_b / name / "train" / "summary.json")
        want = read_json(root_a / name / "train" / "summary.json")
        assert got["together"]["mode"] == "batched"
        joined = got["together"]["batched"]
        adalomo = "adalomo" in (root_b / name / "config.yaml").read_text()
        assert joined == ("steps exact: optim.name adalomo updates inside its own backward pass" if adalomo else
                          "4 steps in the group's passes"), (name, joined)
        b = [r["loss"] for r in read_jsonl(root_b / name / "train" / "metrics.jsonl")]
        a = [r["loss"] for r in read_jsonl(root_a / name / "train" / "metrics.jsonl")]
        assert len(a) == len(b) == 4
        # the first step from the same state: within 1e-6; later steps drift by rounding only (fp32, 4 steps)
        assert abs(a[0] - b[0]) <= 1e-6, (name, a[0], b[0])
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-3, (name, a, b)
        assert abs(got["val_loss"] - want["val_loss"]) <= 1e-3


def test_the_memory_model_holds_every_members_activations_in_batched_mode():
    from tunelab.train.parallel.memory import SHAPES, Setup, estimate, estimate_group

    s = Setup(peft="lora", lora_r=16, seq=512, batch=4, dp=1)
    one = estimate(SHAPES["llama-7b"], s)
    exact, joined = (estimate_group(SHAPES["llama-7b"], [s] * 4, b) for b in (False, True))
    assert exact.activations == one.activations and joined.activations == 4 * one.activations
    assert joined.grads == 4 * one.grads and joined.params == exact.params and joined.optimizer == exact.optimizer
    assert joined.peak > exact.peak


SEARCH = """name: bs
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  peft: {method: lora, dropout: 0.1}
  train: {steps: 6, batch_size: 4, warmup_steps: 1, device: cpu}
  eval: {tasks: [val_loss], val_batches: 2}
  tracking: {wandb: false}
tune:
  space: {optim.lr: {log_uniform: [1.0e-4, 1.0e-1]}}
  trials: 4
  pruner: halving
  min_steps: 2
"""


def test_a_search_in_batched_mode_decides_as_in_exact_mode(cli, tmp_path):
    """A rung's trials step in one pass, pause at their rung and go on in memory: the same trials, rung decisions
    and winner as exact mode, every value within 1e-3 (rounding, not bit for bit)."""
    path = write(tmp_path / "bs.yaml", SEARCH)
    tables = {}
    for runs, how in (("e", []), ("b", ["--together-mode", "batched"])):
        code, out, err = cli("run", str(path), *how, "--runs-dir", str(tmp_path / runs))
        assert code == 0, out + err
        [study] = sorted((tmp_path / runs / "bs").glob("tune/*/trials.json"))
        tables[runs] = read_json(study)["trials"]
    exact, joined = tables["e"], tables["b"]
    assert [(t["number"], t["params"], t["state"]) for t in exact] == \
        [(t["number"], t["params"], t["state"]) for t in joined]
    best = [min((t for t in table if t["value"] is not None), key=lambda t: t["value"])["number"]
            for table in (exact, joined)]
    assert best[0] == best[1]
    assert max(abs(a["value"] - b["value"]) for a, b in zip(exact, joined) if a["value"] is not None) <= 1e-3
    trials = [read_json(s) for s in (tmp_path / "b" / "bs").glob("*/train/summary.json")]
    promoted = [t for t in trials if t.get("continued_in_memory_from")]
    assert promoted and all(t["together"]["mode"] == "batched" for t in promoted)
    assert all(t["together"]["batched"].endswith("steps in the group's passes")
               and not t["together"]["batched"].startswith("0 ") for t in promoted)
