"""How a together-group's model is handled at the cost of one member, not of all: train/modes.py's set_training
gives the flags nn.Module.train gives (peft's DoRA layer's own train() kept: its cache cleared; transformers' kernels
mode set as PreTrainedModel.train sets it); train/members.py's Index (the tuner layers and each member's parameters,
found once) follows members injected and removed; a member added beside an earlier one with its targets (`_beside`)
is, tensor for tensor and draw for draw, what peft's add_adapter makes (test_together_train.py shows members are
then the cell alone bit for bit)."""

from __future__ import annotations

import pytest
import torch

from tunelab.core.config import CellConfig, ModelCfg
from tunelab.models import loading
from tunelab.train import members
from tunelab.train.modes import evaluating, set_training

METHODS = ["lora", "dora", "ia3"]


def _cfg(method: str, seed: int) -> CellConfig:
    return CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      "peft": {"method": method, "dropout": 0.1} if method != "ia3" else
                                      {"method": method}, "train": {"seed": seed}})


@pytest.fixture(scope="module")
def group():
    model, _ = loading.load(ModelCfg(name="tiny-random-llama"))
    for k, method in enumerate(METHODS):
        model = members.inject(model, members.member_name(k), _cfg(method, k))
    return model


def _state(model) -> list:
    """Each module's flag and kernels mode, and the function a kernel layer's forward runs (a CPU's mode switch skips
    the kernels' walk: the layers must keep what the walk would give them)."""
    return [(n, m.training, getattr(m, "_kernels_mode", None), getattr(m.__dict__.get("forward"), "__func__", None))
            for n, m in model.named_modules()]


@pytest.mark.parametrize("mode", [False, True])
def test_set_training_gives_the_flags_of_nn_module_train(group, mode):
    for start in (True, False):
        group.train(start)
        group.train(mode)
        expected = _state(group)
        group.train(start)
        set_training(group, mode)
        assert _state(group) == expected
        assert {flag for _, flag, _, _ in expected} == {mode}  # (every module switched: the check can fail)
        assert {kmode for _, _, kmode, _ in expected} - {None}  # (the model's kernels mode is in the check)
        assert any(hasattr(type(m), "kernel_layer_name") for m in group.modules())  # (and kernel layers' forwards)


def test_set_training_runs_a_module_s_own_train(group):
    from peft.tuners.lora.dora import DoraLinearLayer

    dora = [m for m in group.modules() if isinstance(m, DoraLinearLayer)]
    assert dora
    for m in dora:
        m._cache_store("probe", 1)  # DoRA's train(True) clears its cache: a walk that skipped it would keep this
    set_training(group, True)
    assert all(m._cache_get("probe", None) is None for m in dora)


def test_evaluating_switches_once_and_puts_the_mode_back(group):
    set_training(group, True)
    with evaluating(group):
        assert not any(m.training for m in group.modules())
        with evaluating(group):  # nested: nothing switched, nothing put back
            pass
        assert not group.training
    assert all(m.training for m in group.modules())
    set_training(group, False)
    group.base_model.model.model.layers[0].train()  # a part left in training mode under a top module in eval mode
    with evaluating(group):
        assert not any(m.training for m in group.modules())  # all in eval mode, as model.eval() would put them
    assert not any(m.training for m in group.modules())  # and left there, as model.train(False) after


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_the_member_index_follows_members_injected_and_removed():
    model, _ = loading.load(ModelCfg(name="tiny-random-llama"))
    model = members.inject(model, "m0", _cfg("lora", 0))
    model = members.inject(model, "m1", _cfg("lora", 1))
    members.activate(model, "m0")
    assert _trainable(model) and all(".m0." in n for n in _trainable(model))
    model = members.inject(model, "m2", _cfg("ia3", 2))  # after an activate: the index is found again
    members.activate(model, "m2")
    assert _trainable(model) and all(n.endswith(".m2") or ".m2." in n for n in _trainable(model))
    active = {tuple(layer.active_adapters) for layer in members.tuner_layers(model)}
    assert ("m2",) in active and ("m0",) not in active
    members.remove(model, "m1")
    assert "m1" not in members.Index.of(model).params
    assert not any(".m1." in n for n, _ in model.named_parameters())
    members.activate(model, "m0")
    assert _trainable(model) == {n for n, _ in model.named_parameters() if ".m0." in n}


SPECS = [("lora", 8, None), ("lora", 4, None), ("dora", 8, None), ("lora", 16, ["q_proj", "v_proj"]),
         ("lora", 8, ["q_proj", "v_proj"]), ("ia3", 0, None), ("lora", 32, None)]


def _spec_cfg(k: int) -> CellConfig:
    method, r, targets = SPECS[k]
    peft = {"method": method, "dropout": 0.1, "r": r} if method != "ia3" else {"method": method}
    if targets:
        peft["target_modules"] = targets
    return CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      "peft": peft, "train": {"seed": k}})


def _injected(monkeypatch, beside: bool) -> tuple:
    """Every SPECS member injected in order, through the fast path where it applies (`beside`) or peft's add_adapter
    always; -> (model, whether each later same-type member went beside, the torch RNG state after each)."""
    went: list[bool] = []
    real = members._beside
    monkeypatch.setattr(members, "_beside", (lambda *a: went.append(real(*a)) or went[-1]) if beside else
                        (lambda *a: False))
    model, _ = loading.load(ModelCfg(name="tiny-random-llama"))
    states = []
    for k in range(len(SPECS)):
        model = members.inject(model, members.member_name(k), _spec_cfg(k))
        states.append(torch.get_rng_state())
    monkeypatch.setattr(members, "_beside", real)
    return model, went, states


def test_a_member_added_beside_an_earlier_one_is_what_peft_s_add_adapter_makes(monkeypatch):
    fast, went, fast_states = _injected(monkeypatch, beside=True)
    slow, _, slow_states = _injected(monkeypatch, beside=False)
    # LoRA r4 and DoRA beside m0, the second q/v member beside the first; the first q/v member (no earlier one with its
    # targets) and r32 after IA3 nested (IA3 wraps the layers: peft's own path) through add_adapter
    assert went == [True, True, False, True, False]
    a, b = fast.state_dict(), slow.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(fast_states, slow_states))  # the same draws, member by member
    assert [(n, p.requires_grad) for n, p in fast.named_parameters()] == \
        [(n, p.requires_grad) for n, p in slow.named_parameters()]
    assert {k: repr(v) for k, v in fast.peft_config.items()} == {k: repr(v) for k, v in slow.peft_config.items()}
    assert sorted(fast.base_model.targeted_module_names) == sorted(slow.base_model.targeted_module_names)
