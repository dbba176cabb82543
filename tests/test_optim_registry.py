"""The optimizer registry: every name trains, bad names, arguments and combinations fail at plan time."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import write
from test_optim_lomo import fixed_batch, max_param_diff, tiny_llama

from tunelab.core.config import CellConfig, OptimCfg
from tunelab.train import optim

EVERY_NAME = sorted(optim.OPTIMIZERS) + ["torch.optim.RMSprop", "tunelab.optimizers:Lion"]


@pytest.mark.parametrize("name", EVERY_NAME)
def test_every_optimizer_trains_through_build(name):
    model, batch = tiny_llama(), fixed_batch()
    start = copy.deepcopy(model)
    kwargs = {"hessian_interval": 1} if name == "sophiag" else {}
    opt = optim.build(list(model.named_parameters()), OptimCfg(name=name, lr=1e-3, kwargs=kwargs),
                      max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # the loop drives every optimizer so
    for step in (1, 2):
        if hasattr(opt, "fused_step"):
            loss, norm = opt.fused_step(lambda: model(**batch).loss)
            assert math.isfinite(loss) and norm > 0
        else:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if hasattr(opt, "after_step"):
            opt.after_step(step=step, model=model, batch=batch)
        sched.step()
    assert max_param_diff(model, start) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_optimizers_take_the_loop_clip_unless_kwargs_set_it():
    params = list(tiny_llama().parameters())
    assert optim.build(params, OptimCfg(name="lomo"), max_grad_norm=0.5).clip_grad_norm == 0.5
    assert optim.build(params, OptimCfg(name="adalomo"), max_grad_norm=None).clip_grad_norm is None
    cfg = OptimCfg(name="lomo", kwargs={"clip_grad_norm": 2.0})
    assert optim.build(params, cfg, max_grad_norm=0.5).clip_grad_norm == 2.0


def test_yaml_lists_become_tuples_and_reach_the_constructor():
    opt = optim.build(tiny_llama().parameters(), OptimCfg(name="lion", kwargs={"betas": [0.5, 0.6]}))
    assert opt.param_groups[0]["betas"] == (0.5, 0.6)
    opt = optim.build(tiny_llama().parameters(), OptimCfg(name="adamw", weight_decay=0.3))
    assert opt.param_groups[0]["weight_decay"] == 0.3


BAD_ARGS = {
    "unknown_kwarg": ({"name": "lion", "kwargs": {"beta": 0.9}}, ["'lion'", "['beta']", "betas"]),
    "unknown_torch_kwarg": ({"name": "torch.optim.RMSprop", "kwargs": {"momentun": 0.9}},
                            ["['momentun']", "momentum"]),
    "lr_in_kwargs": ({"name": "adamw", "kwargs": {"lr": 0.1}}, ["optim.kwargs.lr", "set optim.lr instead"]),
    "no_weight_decay": ({"name": "torch.optim.LBFGS", "weight_decay": 0.1}, ["has no weight_decay"]),
    "takes_a_model": ({"name": "lomo_optim:Lomo"}, ["built from a model", "optim.name: lomo or adalomo"]),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_optimizer_arguments_fail_at_plan_time(cli, tmp_path, case):
    optim_section, needles = BAD_ARGS[case]
    text = ("name: bad\nbase:\n  model: {name: tiny-random-llama}\n  data: {recipe: arithmetic}\n"
            f"  optim: {optim_section!r}\n".replace("'", '"'))
    code, out, err = cli("plan", write(tmp_path / f"{case}.yaml", text))
    message = " ".join(err.split())
    assert code == 2, (out, err)
    assert "Traceback" not in out + err and f"{case}.yaml" in message and "base.optim" in message
    for needle in needles:
        assert needle in message, message


def check_compatible(cell: CellConfig) -> None:
    from tunelab.plan.optim import compatible

    errs = compatible(cell)
    if errs:
        raise ValueError("; ".join(errs))


def cell(**sections) -> CellConfig:
    return CellConfig.model_validate({"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic"},
                                      **sections})


@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_update_in_backward_refuses_accumulation_and_fp16(name):
    with pytest.raises(ValueError, match="train.grad_accum.*batch_size"):
        check_compatible(cell(optim={"name": name}, train={"grad_accum": 2}))
    with pytest.raises(ValueError, match="float16.*loss scaling.*bfloat16"):
        check_compatible(cell(optim={"name": name}, model={"name": "tiny-random-llama", "dtype": "float16"}))
    check_compatible(cell(optim={"name": name}, model={"name": "tiny-random-llama", "dtype": "bfloat16"}))
    check_compatible(cell(optim={"name": name}, peft={"method": "lora"}))
    check_compatible(cell(optim={"name": "adamw"}, train={"grad_accum": 2}))


def test_the_optimizers_x_peft_matrix_plans_every_sensible_cell():
    from conftest import REPO

    from tunelab.matrix.expansion import load

    _, cells = load(REPO / "experiments" / "optimizers_x_peft.yaml")
    pairs = {(c.config.optim.name, c.config.peft.method) for c in cells}
    assert {o for o, _ in pairs} == set(optim.OPTIMIZERS)  # every registered optimizer has a row
    assert ("lomo", "none") in pairs and ("adalomo", "none") in pairs and ("lomo", "lora") not in pairs
    assert ("muon", "prompt") not in pairs and ("muon", "p_tuning") in pairs
    for c in cells:
        check_compatible(c.config)
