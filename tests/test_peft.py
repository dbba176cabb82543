"""Every PEFT method trains, saves its adapter in final/ and reloads from it; evaluation runs the adapter unmerged
with the same outputs; family defaults pick the right modules; qlora is refused off CUDA."""

from __future__ import annotations

import typing

import pytest
import torch
from test_train_loop import cell_cfg, setup

from tunelab import train
from tunelab.core.config import CellConfig, PeftMethod
from tunelab.core.errors import UserError
from tunelab.train import peft

ADAPTERS = ["lora", "dora", "ia3", "prefix", "prompt", "p_tuning"]


def test_registry_and_schema_agree():
    assert set(typing.get_args(PeftMethod)) == set(peft.PEFT_METHODS)


@pytest.mark.parametrize("method", ADAPTERS)
def test_method_trains_saves_and_reloads(tmp_path, method):
    from peft import PeftModel

    cfg = cell_cfg(method, steps=3, save_final=True, optim={"lr": 1e-2})
    model, tok, ds = setup(cfg)
    result = train.run(model, tok, ds, cfg, tmp_path)
    assert 0 < result.trainable_params < result.total_params / 2
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    assert not (tmp_path / "final" / "model.safetensors").exists()  # the adapter only

    model.eval()
    batch = tok(["Below is an instruction that describes a task."], return_tensors="pt")
    with torch.no_grad():
        trained = model(**batch).logits
        base, _, _ = setup(cell_cfg())
        reloaded = PeftModel.from_pretrained(base, tmp_path / "final").eval()
        assert torch.allclose(reloaded(**batch).logits, trained, atol=1e-5)

        evaluated = peft.for_eval(model)
        # tuner layers stay unmerged inside the transformers model; prompt learning keeps its PeftModel
        assert isinstance(evaluated, PeftModel) is (method not in ("lora", "dora", "ia3"))
        assert torch.equal(evaluated(**batch).logits, trained)
    out = evaluated.generate(**batch, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3


def _adapted(model) -> set[str]:
    return {name.split(".")[-4] for name, _ in model.named_parameters() if "lora_A" in name}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_lora_defaults_per_family(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = peft.apply(AutoModelForCausalLM.from_config(config), CellConfig.model_validate(
        {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}, "peft": {"method": "lora"}}).peft)
    assert _adapted(model) == set(peft.FAMILIES[family].linear)
    assert "lm_head" not in _adapted(model)


def test_unknown_family_adapts_every_linear_layer_but_the_head():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4))
    wrapped = peft.apply(model, cell_cfg("lora").peft)
    assert {"c_attn", "c_proj", "c_fc"} <= _adapted(wrapped) and "lm_head" not in _adapted(wrapped)


def test_target_modules_override_and_ia3_defaults():
    model, _, _ = setup(cell_cfg())
    cfg = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                     "peft": {"method": "dora", "target_modules": ["q_proj"]}}).peft
    assert _adapted(peft.apply(model, cfg)) == {"q_proj"}
    model, _, _ = setup(cell_cfg())
    ia3 = peft.apply(model, cell_cfg("ia3").peft)
    scaled = {n.split(".")[-3] for n, _ in ia3.named_parameters() if "ia3_l" in n}
    assert scaled == {"k_proj", "v_proj", "down_proj"}


def test_missing_target_module_is_a_user_error():
    model, _, _ = setup(cell_cfg())
    cfg = CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                     "peft": {"method": "lora", "target_modules": ["no_such_proj"]}}).peft
    with pytest.raises(UserError, match="peft"):
        peft.apply(model, cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_qlora_plans_anywhere_and_is_refused_where_it_cannot_run(tmp_path, cli):
    import torch

    path = tmp_path / "m.yaml"
    path.write_text("name: q\nbase: {model: {name: tiny-random-llama}, data: {recipe: arithmetic}}\n"
                    "matrix: {peft.method: [lora, qlora]}\n")
    code, out, err = cli("plan", path)  # a CPU login node plans (and submits) a GPU matrix
    assert code == 0 and "qlora" in out, err
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal below is for machines without it")
    code, _, err = cli("run", path, "--runs-dir", tmp_path / "runs")
    assert code == 2 and "peft.method" in err and "CUDA" in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_qlora_needs_a_cuda_device_at_load():
    from tunelab.plan import Invalid, cell_config

    with pytest.raises(UserError, match="needs a CUDA device"):
        peft.load_kwargs(cell_cfg().peft.model_copy(update={"method": "qlora"}), "cpu")
    raw = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"}, "peft": {"method": "qlora"},
           "train": {"device": "cpu"}}
    with pytest.raises(Invalid, match="train.device is cpu"):
        cell_config(raw)
