"""Which cells train together (#46, run/together.py): the grouping key holds what the base and its batches are made
of and nothing that rides on it; every reason a cell runs alone is said by `exp plan`; how cells are grouped is a
run setting (`--together`, the file's `run:` section) that never changes a cell's id; bad settings are exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write

from tunelab import plan
from tunelab.run import together
from tunelab.run.together import Setting, Unit, key, why_alone

BASE = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic", "max_length": 48},
        "peft": {"method": "lora"}, "train": {"steps": 4, "batch_size": 2}, "eval": {"tasks": ["val_loss"]}}


def cfg(**changes):
    raw = json.loads(json.dumps(BASE))
    for dotted, value in changes.items():
        section, _, name = dotted.partition("__")
        raw.setdefault(section, {})[name] = value
    return plan.cell_config(raw)


FREE = [{"train__seed": 3}, {"train__steps": 9}, {"train__schedule": "linear"}, {"train__warmup_steps": 2},
        {"train__max_grad_norm": None}, {"optim__lr": 1e-3}, {"optim__name": "lion"}, {"optim__weight_decay": 0.1},
        {"peft__r": 32}, {"peft__alpha": 4.0}, {"peft__dropout": 0.0}, {"peft__target_modules": ["q_proj"]},
        {"peft__method": "dora"}, {"peft__method": "ia3"}, {"train__loss_chunk": 64}, {"train__eval_every": 2},
        {"train__save_every": 2}, {"eval__tasks": ["val_loss", "gsm8k_smoke"]}, {"eval__val_batches": 3}]
SHARED = [{"model__dtype": "bfloat16"}, {"data__max_length": 64}, {"data__recipe": "dolly"},
          {"train__batch_size": 4}, {"train__grad_accum": 2}, {"train__precision": "bf16"},
          {"train__gradient_checkpointing": True}]


@pytest.mark.parametrize("change", FREE, ids=lambda c: next(iter(c)))
def test_what_rides_on_the_base_is_each_members_own(change):
    assert key(cfg(**change)) == key(cfg()) and why_alone(cfg(**change)) is None


@pytest.mark.parametrize("change", SHARED, ids=lambda c: next(iter(c)))
def test_what_the_base_and_its_batches_are_made_of_is_shared(change):
    assert key(cfg(**change)) != key(cfg())


@pytest.mark.parametrize(("change", "words"), [
    ({"peft__method": "none"}, "trains the base model itself"),
    ({"peft__method": "prefix"}, "one prompt adapter per model"),
    ({"parallel__dp": 2}, "runs on 2 processes"),
    ({"train__compile": True}, "train.compile"),
    ({"eval__checkpoints": {"at": [2], "workers": 1}}, "eval.checkpoints.workers"),
    ({"eval__checkpoints": {"at": [2], "workers": 0}, "train__select": {"metric": "val_loss"}}, "train.select"),
    ({"peft__target_modules": ["q_proj", "lm_head"]}, "['lm_head']: the output head and the input embeddings"),
    ({"peft__method": "ia3", "peft__target_modules": ["model.embed_tokens", "down_proj"]}, "['model.embed_tokens']"),
], ids=["none", "prefix", "dp", "compile", "beside", "select", "head", "embeddings"])
def test_each_reason_to_run_alone(change, words):
    assert words in (why_alone(cfg(**change)) or "")


def test_checkpoint_scores_after_training_join():
    assert why_alone(cfg(eval__checkpoints={"at": [2], "workers": 0})) is None
    assert why_alone(cfg(eval__checkpoints={"at": [2]}, train__device="cpu")) is None  # after training on CPU


class C:
    def __init__(self, slug, **changes):
        self.slug, self.config = slug, cfg(**changes)


def test_units_keep_cell_order_cap_at_n_and_say_why_a_cell_is_alone():
    cells = [C("a"), C("full", peft__method="none"), C("b", optim__lr=1e-3), C("ia3", peft__method="ia3"),
             C("c", peft__r=4), C("long", data__max_length=64)]
    units = together.plan(cells, Setting())
    assert [[c.slug for c in u.cells] for u in units] == [["a", "b", "ia3", "c"], ["full"], ["long"]]
    assert units[0].together and "trains the base" in units[1].why and units[2].why == together.NO_PARTNER
    two = together.plan(cells, Setting.parse("2", None))
    assert [[c.slug for c in u.cells] for u in two if u.together] == [["a", "b"], ["ia3", "c"]]
    assert all(not u.together for u in together.plan(cells, Setting.parse("off", None)))
    three = together.plan(cells, Setting.parse(3, None))
    assert "fill its groups (3 members)" in next(u.why for u in three if u.cells[0].slug == "c")
    late = together.plan(cells, Setting(), alone=lambda c: "told so" if c.slug == "b" else None)
    assert Unit((cells[2],), why="told so") in late


def test_auto_sizes_each_group_on_its_own_members():
    """Under auto each group is sized on the cells it takes: a later run of larger ranks gets smaller groups than the
    first cells' size (which could overfill the device)."""
    cells = [C(f"r{r}-{i}", peft__r=r, train__seed=i) for i, r in enumerate([8, 8, 8, 32, 32, 32])]
    units = together.plan(cells, Setting(), cap_of=lambda cs: 3 if cs[0].config.peft.r <= 8 else 2)
    assert [[c.slug for c in u.cells] for u in units] == [["r8-0", "r8-1", "r8-2"], ["r32-3", "r32-4"], ["r32-5"]]
    assert units[2].why == "its base's other cells fill its groups (3 + 2 members)"
    one = together.plan(cells[:2], Setting(), cap_of=lambda cs: 1)
    assert all("one member at a time fits" in u.why for u in one)


def test_a_searchs_first_rung_takes_the_plain_cells_of_its_base_along():
    """tune/driver.py: the matrix's plain cells that could join the first rung's trials train with them (a default
    row of the same base); a full fine-tuning row, another base, or together off: they run after the search."""
    from tunelab.tune.driver import _joining

    trials = [C("t0", optim__lr=1e-3), C("t1", optim__lr=1e-4)]
    plain = [C("a"), C("full", peft__method="none"), C("ia3", peft__method="ia3"), C("long", data__max_length=64)]
    assert [c.slug for c in _joining(plain, trials, Setting())] == ["a", "ia3"]
    assert [c.slug for c in _joining(plain, trials, Setting.parse("2", None))] == ["a", "ia3"]  # groups cap it later
    assert _joining(plain, trials, Setting.parse("off", None)) == []
    assert _joining(plain, [C("full-trial", peft__method="none")], Setting()) == []


MATRIX = """name: tg
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic, max_length: 48}
  train: {steps: 2, batch_size: 2}
  eval: {tasks: [val_loss]}
matrix:
  peft.method: [none, lora, dora]
  optim.lr: [1.0e-3, 1.0e-4]
RUN"""


def test_exp_plan_says_which_cells_join_and_why_the_others_run_alone(cli, tmp_path):
    path = write(tmp_path / "tg.yaml", MATRIX.replace("RUN", ""))
    code, out, err = cli("plan", path)
    assert code == 0, err
    text = " ".join(out.split())
    assert "group 1 (4 members, one base): lora-lr0.001, lora-lr0.0001, dora-lr0.001, dora-lr0.0001" in text
    assert "none-lr0.001 runs alone: peft.method none: it trains the base model itself" in text
    code, out, _ = cli("plan", path, "--together", "off")
    assert "group 1" not in out and out.count("runs alone: --together off") == 6


def test_the_run_section_and_the_flag_change_no_cell_id(cli, tmp_path):
    ids = []
    for name, run, flags in (("a", "", ()), ("b", "run: {together: 2}\n", ()), ("c", "", ("--together", "off")),
                             ("d", "run: {together: off}\n", ())):  # (YAML reads a bare off as false)
        path = write(tmp_path / f"{name}.yaml", MATRIX.replace("RUN", run))
        code, out, err = cli("plan", path, "--json", *flags)
        assert code == 0, err
        rows = json.loads(out)  # (stdout is the plan alone: what libraries print goes to stderr)
        ids.append([(r["id"], r["eval_id"]) for r in rows])
        joined = [r["together"] for r in rows if "group" in r["together"]]
        assert len(joined) == {"a": 4, "b": 4, "c": 0, "d": 0}[name]
        if name == "b":
            assert {len(j["members"]) for j in joined} == {2}
    assert ids[0] == ids[1] == ids[2] == ids[3]


def test_exp_plan_sizes_auto_groups_as_exp_run_does(cli, tmp_path):
    """Nine IA3 cells, a method the memory model does not cover: auto takes at most capacity.FALLBACK members, in
    the plan as in the runner (runner.units)."""
    from tunelab.run import groups, together
    from tunelab.train.parallel.capacity import FALLBACK

    lrs = str([i / 1000 for i in range(1, 10)])
    text = MATRIX.replace("[none, lora, dora]", "[ia3]").replace("[1.0e-3, 1.0e-4]", lrs)
    path = write(tmp_path / "ia3.yaml", text.replace("RUN", ""))
    code, out, err = cli("plan", path, "--json")
    assert code == 0, err
    joins = [r["together"] for r in json.loads(out)]
    assert [len(j["members"]) for j in joins if "group" in j][:1] == [FALLBACK] and FALLBACK < 9
    assert joins[-1] == {"alone": f"its base's other cells fill its groups ({FALLBACK} members)"}
    from tunelab.matrix import expansion

    cells = expansion.load(path)[1]
    runner_units = together.plan(cells, together.Setting(), cap_of=groups.auto_cap)
    assert [len(u.cells) for u in runner_units] == [FALLBACK, 1]


@pytest.mark.parametrize(("args", "run", "words"), [
    (("--together", "banana"), "", ["--together 'banana'", "auto, off, or a number"]),
    (("--together-mode", "fast"), "", ["--together-mode 'fast'", "exact, batched"]),
    ((), "run: {together_mode: fast}\n", ["tg.yaml", "run.together_mode", "exact", "batched"]),
    ((), "run: {together: 0}\n", ["tg.yaml", "run.together", "a number of members"]),
    ((), "run: {together: '0'}\n", ["tg.yaml", "run.together", "a number of members"]),
    (("--together-mode", "exact"), "run: {together: 'x'}\n", ["tg.yaml", "run.together", "a number of members"]),
    ((), "run: {together: true}\n", ["tg.yaml", "run.together", "write auto, or a number"]),
    ((), "run: {togethr: 2}\n", ["tg.yaml", "run.togethr"]),
], ids=["flag", "mode", "file-mode", "file-zero", "file-zero-text", "file-beside-a-flag", "file-true", "file-typo"])
def test_bad_together_settings_are_one_paragraph_and_exit_2(cli, tmp_path, args, run, words):
    path = write(tmp_path / "tg.yaml", MATRIX.replace("RUN", run))
    code, out, err = cli("run", path, "--runs-dir", tmp_path / "runs", *args)
    assert code == 2 and "Traceback" not in err, err
    text = " ".join(err.split())
    assert all(w in text for w in words), text
    assert not (tmp_path / "runs" / "tg").exists()  # nothing half-written


def test_a_groups_memory_counts_the_base_once_and_one_members_step_at_a_time():
    from tunelab.train.parallel.memory import MEMBER_OVERHEAD, SHAPES, Setup, estimate, estimate_group

    shape, lora = SHAPES["llama-7b"], Setup(peft="lora", lora_r=16, seq=512, batch=4, dp=1)
    rank64 = Setup(peft="lora", lora_r=64, seq=1024, batch=4, dp=1)
    one, big = estimate(shape, lora), estimate(shape, rank64)
    group = estimate_group(shape, [lora] * 7 + [rank64])
    base = one.params - (one.trainable * 2)  # bfloat16 weights: 2 bytes a value
    assert group.params == base + 7 * (one.params - base) + (big.params - base) + 8 * MEMBER_OVERHEAD
    assert group.optimizer == 7 * one.optimizer + big.optimizer
    assert group.activations == big.activations and group.grads == big.grads  # one member steps at a time
    assert big.peak < group.peak < 1.1 * big.peak  # 7 more adapters and their state: small beside the base
    batched = estimate_group(shape, [lora] * 7 + [rank64], batched=True)  # one pass: every member's at once
    assert batched.activations == 7 * one.activations + big.activations
    lomo = Setup(peft="lora", lora_r=16, seq=512, batch=4, dp=1, optim="lomo")  # steps exact even in batched mode
    mixed = estimate_group(shape, [lora, lora, lomo], batched=True)
    assert mixed.activations == max(2 * one.activations, estimate(shape, lomo).activations)


def test_exp_memory_predicts_a_group_and_refuses_what_cannot_join(cli):
    code, out, err = cli("memory", "--model", "llama-7b", "--peft", "lora", "--together", "8", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["together"] == 8 and got["group_bytes"]["peak"] > got["estimate_bytes"]["peak"]
    code, _, err = cli("memory", "--model", "llama-7b", "--together", "8")
    assert code == 2 and "--together N" in err and "--peft lora" in " ".join(err.split())
    for args, says in ((("--peft", "lora", "--together", "2", "--backend", "deepspeed"), "--backend"),
                       (("--peft", "lora", "--batched"), "give --together N"),
                       (("--peft", "lora", "--together", "100000000"), "at most 4,096 members"),
                       (("--device-gb", "nan"), "--device-gb must be positive")):
        code, _, err = cli("memory", "--model", "llama-7b", *args)
        assert code == 2 and says in " ".join(err.split()), (args, err)


def test_sizing_a_group_reads_a_llama_config_as_transformers_does_without_importing_it(tmp_path):
    """capacity._model reads a local Llama-like config.json itself (the runner sizes `auto` groups before
    importing transformers): the memory model sees the shape AutoConfig gives; any field missing, AutoConfig.
    (SmolLM2-135M's config gives the same shape both ways too; not here: converting it costs a test 17 s.)"""
    import subprocess
    import sys

    from transformers import AutoConfig

    from tunelab.models.loading import resolve
    from tunelab.train.parallel.capacity import SHAPE_FIELDS, _plain_config
    from tunelab.train.parallel.memory import shape_of

    name = "tiny-random-llama"
    src = resolve(name)
    plain = _plain_config(src)
    assert plain is not None and shape_of(plain) == shape_of(AutoConfig.from_pretrained(src))
    raw = json.loads((Path(src) / "config.json").read_text())
    for field in SHAPE_FIELDS:
        (tmp_path / field).mkdir()
        (tmp_path / field / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != field}))
        assert _plain_config(str(tmp_path / field)) is None  # transformers' defaults then
    probe = ("import sys; from tunelab.core.config import CellConfig; from tunelab.train.parallel import capacity; "
             f"cfg = CellConfig.model_validate({{'model': {{'name': {name!r}}}, 'data': {{'recipe': 'arithmetic'}}, "
             "'peft': {'method': 'lora'}}); "
             "n = capacity.members([cfg] * 3, 3); print(n, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split()[-2:] == ["3", "False"], done.stderr[-2000:]
