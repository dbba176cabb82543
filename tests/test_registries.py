"""One registry shape for every name, each fact written once and read by the checks, the memory model,
`exp ls` and the docs."""

from __future__ import annotations

import typing

import pytest
from conftest import REPO

from tunelab.core import config, registries
from tunelab.core.registry import Registry, UnknownName


def test_registry_errors_list_the_known_names_and_lazy_entries_load_on_use():
    from tunelab.core.registry import Lazy

    reg: Registry[object] = Registry("widget", hint=", or a path")
    reg.add("json", Lazy("json:dumps"))  # lazy: nothing imported until its user loads it
    reg.add("ok", 1)
    with pytest.raises(UnknownName, match="unknown widget 'nope'; known: json, ok, or a path"):
        reg.get("nope")
    with pytest.raises(UnknownName, match="unknown widget 'jsn' \\(did you mean 'json'\\?\\); known: json, ok"):
        reg.get("jsn")
    import json

    assert reg["json"].load() is json.dumps and reg.get("ok") == 1
    assert list(reg) == ["json", "ok"] and "ok" in reg and len(reg) == 2
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("ok", 3)


@pytest.mark.parametrize("reg", [registries.MODELS, registries.TEMPLATES, registries.FORMATS, registries.GENERATORS,
                                 registries.OPTIMIZERS, registries.PEFT, registries.ENGINES, registries.TASKS])
def test_every_lazy_entry_imports(reg):
    from tunelab.core.registry import Lazy

    for name, entry in reg.items():
        if isinstance(entry, Lazy):
            assert entry.load() is not None, name
            continue
        harness = getattr(entry, "harness", None)
        for target in (*(getattr(entry, f, None) for f in ("folder", "wrap", "load_kwargs", "stepper", "run")),
                       *((harness.items, harness.notes) if harness else ())):
            if target is not None:
                assert callable(target.load()), (name, target)
        if isinstance(entry, registries.OptimizerSpec):
            assert isinstance(entry.load(), type), name


def test_the_schema_and_the_registries_agree():
    assert set(typing.get_args(config.PeftMethod)) == set(registries.PEFT)
    # Engines have no Literal in the schema: the registry is the one list, checked at plan time.
    from tunelab.core.layouts import section

    assert all(section(config.ParallelCfg(backend=n, zero=registries.ENGINES[n].zero[-1])) == []
               for n in registries.ENGINES)
    (refused,) = section(config.ParallelCfg(backend="megatron"))
    assert refused.loc == ("parallel", "backend") and all(n in refused.message for n in registries.ENGINES)
    benchmarks = {n for n, t in registries.TASKS.items() if t.harness is not None}
    assert benchmarks == {n for n, t in registries.TASKS.items() if t.run.target.endswith(":harness_task")}


def test_the_docs_table_is_the_registry():
    from tunelab.tools.listing import optimizer_table

    text = (REPO / "docs" / "optimizers.md").read_text()
    start = text.index("\n", text.index("<!-- registry:optimizers")) + 1
    assert text[start:text.index("<!-- /registry:optimizers -->")].strip() == optimizer_table()


@pytest.mark.parametrize(("name", "states"), [("adamw", 2), ("adan", 4), ("sophiag", 2), ("lion", 1), ("sgd", 0)])
def test_memory_model_counts_each_optimizers_states(name, states):
    """Optimizer memory = states x 4 bytes per trainable parameter (fp32 weights: no master copy)."""
    from tunelab.train.parallel.memory import SHAPES, Setup, estimate

    shape = SHAPES["llama-7b"]
    e = estimate(shape, Setup(optim=name, dtype="float32"))
    assert e.optimizer == pytest.approx(states * 4 * shape.total())


def test_memory_model_counts_muon_per_kind_of_parameter():
    from tunelab.train.parallel.memory import SHAPES, Setup, estimate

    shape = SHAPES["llama-7b"]
    hidden = shape.layers * (shape.layer_params() - 2 * shape.hidden)
    e = estimate(shape, Setup(optim="muon", dtype="float32"))
    assert e.optimizer == pytest.approx(4 * (hidden + 2 * (shape.total() - hidden)))
    assert estimate(shape, Setup(optim="adamw", dtype="float32")).optimizer > e.optimizer


@pytest.mark.parametrize("name", ["sophiag", "adan", "muon"])
def test_exp_memory_takes_every_registered_optimizer(cli, name):
    code, out, err = cli("memory", "--model", "llama-7b", "--optim", name)
    assert code == 0, err
    assert "optimizer" in out
