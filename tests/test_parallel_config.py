"""The `parallel` section: layouts a backend cannot run are refused at `exp plan` with the reason."""

from __future__ import annotations

import pytest
import torch
from conftest import write
from pydantic import ValidationError

from tunelab.core.config import ParallelCfg, world_size
from tunelab.core.errors import UserError

MATRIX = """name: par
base:
  model: {name: tiny-random-llama}
  data: {recipe: arithmetic}
  parallel: PARALLEL
"""


def test_world_size_is_the_product():
    assert world_size(ParallelCfg(dp=2, tp=2, pp=2, microbatches=2)) == 8
    assert world_size(ParallelCfg()) == 1


@pytest.mark.parametrize(("parallel", "reason"), [
    ("{tp: 2, backend: deepspeed}", "deepspeed runs ZeRO data parallelism only"),
    ("{dp: 2, zero: 1}", "zero: 1"),
    ("{pp: 4, pp_schedule: 1f1b, microbatches: 2}", "needs microbatches >= pp"),
    ("{pp: 2, pp_schedule: interleaved_1f1b, microbatches: 3}", "multiple of pp"),
    ("{microbatches: 4}", "needs pp > 1"),
    ("{dp: 0}", "greater than or equal to 1"),
    ("{backend: megatron}", "native"),
])
def test_plan_refuses_layout_with_reason(cli, tmp_path, parallel, reason):
    f = write(tmp_path / "m.yaml", MATRIX.replace("PARALLEL", parallel))
    code, _, err = cli("plan", f)
    assert code == 2
    assert "parallel" in err and reason in " ".join(err.split())


def test_plan_accepts_3d_layout(cli, tmp_path):
    f = write(tmp_path / "m.yaml", MATRIX.replace("PARALLEL", "{dp: 2, tp: 2, pp: 2, microbatches: 2}"))
    code, out, err = cli("plan", f)
    assert code == 0, err


def _cell(parallel: dict, **sections):
    from tunelab.core.config import CellConfig

    return CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      "parallel": parallel, **sections})


@pytest.mark.parametrize(("parallel", "sections", "reason"), [
    ({"dp": 3}, {"train": {"batch_size": 4}}, "divisible by parallel.dp"),
    ({"dp": 2, "backend": "deepspeed", "zero": 2, "cpu_offload": True}, {"optim": {"name": "adalomo"}},
     "nothing would move"),
    ({"dp": 2}, {"optim": {"name": "sophiag"}}, "Hessian"),
    ({"cpu_offload": True}, {}, "would be ignored"),
])
def test_cross_section_checks(parallel, sections, reason):
    from tunelab.core.layouts import check_layout as check_cell
    from tunelab.plan import check

    with pytest.raises(ValueError, match=reason):
        check_cell(_cell(parallel, **sections))
    assert reason in check(_cell(parallel, **sections))[0].message  # what `exp plan` says


def test_grouping_by_length_has_nothing_to_group_in_packed_rows():
    from tunelab.plan import check

    cell = _cell({}, data={"recipe": "arithmetic", "pack": True}, train={"group_by_length": True})
    assert "group_by_length" in check(cell)[0].message and "data.pack" in check(cell)[0].message
    assert check(_cell({}, train={"group_by_length": True})) == []


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2, "microbatches": 2}, {"dp": 2, "tp": 2, "pp": 2,
                                                                               "microbatches": 2},
                                      {"dp": 2, "backend": "deepspeed", "zero": 1},
                                      {"dp": 2, "backend": "deepspeed", "zero": 3, "cpu_offload": True}])
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_in_backward_optimizers_run_under_every_engine(parallel, name):
    from tunelab.core.layouts import check_layout as check_cell

    check_cell(_cell(parallel, optim={"name": name}))  # tests/parallel runs them against one process


def test_prepare_refuses_what_check_cell_refuses():
    from tunelab.train import parallel as par

    # CellConfig refuses this layout itself; model_copy skips validation, as a hand-built config would.
    cell = _cell({}, train={"batch_size": 4}).model_copy(update={"parallel": ParallelCfg(dp=3)})
    with pytest.raises(UserError, match="divisible"):
        par.prepare(None, None, cell, par.Layout(device=__import__("torch").device("cpu")))


def test_setup_without_torchrun_says_how_to_start(monkeypatch):
    from tunelab.train.parallel import setup

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match="torchrun --nproc-per-node 4"):
        setup(ParallelCfg(dp=2, tp=2))


def test_setup_one_process_is_plain():
    from tunelab.train.parallel import setup

    layout = setup(ParallelCfg())
    assert not layout.distributed and layout.is_main and layout.coord("dp") == 0


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **kw}))


def test_model_shape_checks():
    from tunelab.train.parallel import stages, tp

    with pytest.raises(UserError, match="do not split evenly"):
        stages.split_layers(3, 2)
    with pytest.raises(UserError, match="key-value heads"):
        tp.check_divisible(_llama().config, 4)


def test_last_stage_gets_its_own_copy_of_a_tied_embedding():
    from tunelab.train.parallel import stages
    from tunelab.train.parallel.anatomy import anatomy

    model = _llama(num_hidden_layers=2, tie_word_embeddings=True)
    embed = model.get_input_embeddings().weight.detach().clone()
    (last,) = stages.build(model, anatomy(model), [1], 2)
    head = last.parts.lm_head.weight
    assert head is not model.get_input_embeddings().weight and head.requires_grad
    assert torch.equal(head.detach(), embed)  # the same values, its own tensor (tests/parallel syncs them)
    assert model.get_input_embeddings().weight.numel() == 0  # not held on the last stage's rank


def test_stage_keeps_parameter_names():
    from tunelab.train.parallel import stages
    from tunelab.train.parallel.anatomy import anatomy

    model = _llama(num_hidden_layers=2)
    names = set(dict(model.named_parameters()))
    first, last = stages.build(model, anatomy(model), [0, 1], 2)
    got = set(dict(first.named_parameters())) | set(dict(last.named_parameters()))
    assert got == names and "lm_head.weight" not in dict(first.named_parameters())


def test_tp_plan_comes_from_the_model_config():
    from tunelab.train.parallel.tp import family_plan

    cfg = _llama().config
    assert family_plan(cfg) == dict(cfg.base_model_tp_plan)


def test_memory_cli_bad_input(cli):
    code, _, err = cli("memory", "--model", "llama-7b", "--optim", "nope")
    assert code == 2 and "--optim" in err
    code, out, _ = cli("memory", "--model", "llama-7b", "--tp", "8")
    assert code == 0 and "devices needed" in out
    code, _, err = cli("memory", "--model", "llama-7b", "--peft", "lora", "--lora-dropout", "1.5")
    assert code == 2 and "--lora-dropout" in err and "Traceback" not in err


def test_parallel_section_unknown_key_is_refused():
    with pytest.raises(ValidationError):
        ParallelCfg(sharding=2)


@pytest.mark.parametrize("parallel, peft, safetensors, mode", [
    ({"dp": 2}, "lora", True, "meta"),
    ({"tp": 2, "pp": 2}, "none", True, "meta"),
    ({"dp": 2, "backend": "deepspeed", "zero": 3}, "lora", True, "zero3"),
    ({"dp": 2, "backend": "deepspeed", "zero": 2}, "none", True, "whole"),
    ({"dp": 2}, "dora", True, "whole"),
    ({"dp": 2}, "none", False, "whole"),
    ({}, "none", True, "whole"),
])
def test_init_mode_builds_sharded_wherever_it_can(parallel, peft, safetensors, mode):
    """Every multi-process native layout and ZeRO-3 build the model sharded; the rest say why not."""
    from tunelab.core.config import CellConfig
    from tunelab.machine.runtime import Layout
    from tunelab.train.parallel import init_mode

    cell = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      "peft": {"method": peft}, "parallel": parallel})
    world = cell.parallel.dp * cell.parallel.tp * cell.parallel.pp
    layout = Layout(device=torch.device("cpu"), mesh=object() if world > 1 else None, dp=cell.parallel.dp,
                    tp=cell.parallel.tp, pp=cell.parallel.pp)
    got, why = init_mode(cell, layout, safetensors)
    assert got == mode and why
