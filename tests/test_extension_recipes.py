"""docs/ARCHITECTURE.md's recipes, followed: an optimizer, an engine and a CLI verb, each added as the recipe
says (its implementation in a module of the test's own, one registry entry or one decorated function) and
then used through tunelab's ordinary paths with nothing else changed. (The benchmark recipe is followed in
tests/test_eval_engine.py.)"""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from tunelab import plan
from tunelab.core import registries
from tunelab.core.registry import Lazy

CELL = {"model": {"name": "tiny-random-llama"}, "data": {"recipe": "arithmetic", "max_length": 64},
        "train": {"steps": 3, "batch_size": 2, "save_final": False}, "optim": {"lr": 1e-3},
        "eval": {"tasks": ["val_loss"], "val_batches": 1, "batch_size": 4}, "tracking": {"wandb": False}}


@pytest.fixture
def module(tmp_path, monkeypatch):
    """Write a module of the test's own and make it importable (the implementation file of a recipe)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        sys.modules.pop(name, None)
        return name

    return write


def _register(monkeypatch, registry, name: str, entry) -> None:
    """registries.X.add(name, entry), undone after the test (the registry is process-wide)."""
    monkeypatch.setitem(registry._entries, name, entry)


def _train(cfg, tmp_path):
    from transformers import set_seed

    from tunelab import train
    from tunelab.data.build import build
    from tunelab.models import loading

    set_seed(cfg.train.seed)
    model, tok = loading.load(cfg.model, "cpu")
    ds = build(cfg.data, tok, loading.cache_dir())
    return train.run(model, tok, ds, cfg, tmp_path)


def test_an_optimizer_is_one_entry_and_its_class(module, monkeypatch, tmp_path):
    name = module("halfsgd", """
        import torch

        class HalfSGD(torch.optim.Optimizer):
            dampings = []  # the damping of every step taken, whatever instance took it

            def __init__(self, params, lr=1e-3, weight_decay=0.0, damping=0.5):
                super().__init__(params, dict(lr=lr, weight_decay=weight_decay, damping=damping))

            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    HalfSGD.dampings.append(group["damping"])
                    for p in group["params"]:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-group["lr"] * group["damping"])
    """)
    _register(monkeypatch, registries.OPTIMIZERS, "halfsgd", registries.OptimizerSpec(
        Lazy(f"{name}:HalfSGD"), "tests", 0, "SGD at half the rate"))
    cfg = plan.cell_config({**CELL, "optim": {"name": "halfsgd", "lr": 1e-2, "kwargs": {"damping": 0.25}}})
    with pytest.raises(plan.Invalid, match="takes no argument"):  # the planner reads the new constructor
        plan.cell_config({**CELL, "optim": {"name": "halfsgd", "kwargs": {"momentum": 0.9}}})
    ours = _train(cfg, tmp_path / "halfsgd")
    assert ours.steps == 3 and math.isfinite(ours.final_loss)
    assert sys.modules[name].HalfSGD.dampings == [0.25] * 3  # the loop stepped our class, with the cell's damping
    # Its updates took effect at lr x damping: the weights of torch's SGD at 2.5e-3, not at the default 0.5's 5e-3.
    same = _train(plan.cell_config({**CELL, "optim": {"name": "sgd", "lr": 2.5e-3}}), tmp_path / "sgd")
    assert max_weight_diff(ours.model, same.model) < 1e-7
    undamped = _train(plan.cell_config({**CELL, "optim": {"name": "sgd", "lr": 5e-3}}), tmp_path / "undamped")
    assert max_weight_diff(ours.model, undamped.model) > 1e3 * max(max_weight_diff(ours.model, same.model), 1e-9)
    from tunelab.train.parallel.memory import SHAPES, Setup, estimate

    assert estimate(SHAPES["llama-7b"], Setup(optim="halfsgd", dtype="float32")).optimizer == 0  # states: 0


@torch.no_grad()
def max_weight_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_an_engine_is_one_entry_and_its_stepper(module, monkeypatch, tmp_path):
    name = module("soloengine", """
        from tunelab.train.parallel.local import LocalStepper

        class SoloStepper(LocalStepper):
            made = 0

            def __init__(self, model, build_optimizer, cfg, layout):
                super().__init__(model, build_optimizer, cfg, layout)
                SoloStepper.made += 1
    """)
    _register(monkeypatch, registries.ENGINES, "solo", registries.EngineSpec(
        Lazy(f"{name}:SoloStepper"), "one process, through the engine path", "nothing", dims=("dp",), zero=(3,),
        steps_alone=True))
    cfg = plan.cell_config({**CELL, "parallel": {"backend": "solo"}})
    with pytest.raises(plan.Invalid, match="backend: solo runs nothing only"):  # its limits come from its entry
        plan.cell_config({**CELL, "parallel": {"backend": "solo", "tp": 2}})
    ours = _train(cfg, tmp_path / "solo")
    assert sys.modules[name].SoloStepper.made == 1
    plain = _train(plan.cell_config(CELL), tmp_path / "plain")
    assert ours.final_loss == pytest.approx(plain.final_loss, abs=1e-6)  # the same steps, by another path
    from tunelab.tools.listing import rows

    assert ("solo", "one process, through the engine path") in rows("engines")


def test_a_cli_verb_is_one_decorated_function(module, monkeypatch, cli):
    from tunelab.cli.common import app

    monkeypatch.setattr(app, "registered_commands", list(app.registered_commands))
    module("helloverb", """
        import typer
        from tunelab.cli.common import INSPECT, app, out
        from tunelab.core.errors import UserError

        @app.command("hello", rich_help_panel=INSPECT)
        def hello(name: str = typer.Argument(..., help="who")) -> None:
            '''Say hello.'''
            if not name.isidentifier():
                raise UserError(f"hello {name!r}: a name is letters and digits")
            out.print(f"hello {name}")
    """)
    __import__("helloverb")
    assert cli("hello", "ada")[:2] == (0, "hello ada\n")
    code, _, err = cli("hello", "a b")
    assert code == 2 and "a name is letters and digits" in err
    assert "hello" in cli("-h")[1]


def test_no_engine_name_is_spelled_outside_its_entry():
    """What makes the engine recipe two files: the planner, the memory model, the stepper factory and the
    runtime ask the entry, so a new engine needs no edit there."""
    from conftest import REPO

    package = REPO / "platform" / "tunelab"
    # The engines' own modules; cell/environment.py names the deepspeed *package* in its versions snapshot.
    own = {"registries.py", "ds.py", "ds_fused.py", "native.py", "tp.py", "stages.py", "pipeline.py",
           "environment.py"}
    spelled = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py") if p.name not in own
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if any(q + n + q in line for n in registries.ENGINES for q in "\"'")]
    assert not spelled, spelled  # the engines' home modules may spell their own names; nothing else does
