"""The memory model against measured peaks: small Llamas trained on CPU for two steps under
torch's MemTracker (live tensor bytes by kind, peak over the steps), fp32, one process."""

from __future__ import annotations

import pytest
import torch

from tunelab.train.parallel.memory import SHAPES, Setup, devices_needed, estimate, load_shape, shape_of

CASES = {  # name -> (optimizer, peft, seq)
    "adamw-full": ("adamw", "none", 256),
    "sgd-full": ("sgd", "none", 256),
    "adalomo-full": ("adalomo", "none", 256),
}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def _measure(optim: str, peft: str, seq: int) -> float:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _model()
    # (LoRA is not measured here: MemTracker hooks every module input's gradient, which frozen layers lack.)
    params = [p for p in model.parameters() if p.requires_grad]
    if optim == "adalomo":
        from tunelab.train.optimizers import AdaLomo

        opt = AdaLomo(params, lr=1e-3)
    else:
        opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optim](params, lr=1e-3)
    ids = torch.randint(0, 4096, (1, seq), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(2):  # the second step has the optimizer state
            if optim == "adalomo":
                opt.fused_step(lambda: model(input_ids=ids, labels=ids).loss)
            else:
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("case", list(CASES))
def test_prediction_within_15_percent_of_measured_peak(case):
    optim, peft, seq = CASES[case]
    measured = _measure(optim, peft, seq)
    predicted = estimate(shape_of(_model().config), Setup(optim=optim, peft=peft, dtype="float32", seq=seq,
                                                          lora_r=8)).peak
    assert predicted == pytest.approx(measured, rel=0.15), f"predicted {predicted / 2**20:.1f} MiB, " \
                                                            f"measured {measured / 2**20:.1f} MiB"


def test_parameter_count_matches_the_model():
    model = _model()
    assert shape_of(model.config).total() == sum(p.numel() for p in model.parameters())


def test_llama_7b_shape_has_6_7b_parameters():
    assert SHAPES["llama-7b"].total() == 6_738_415_616  # LLaMA-7B's published count


def test_sharding_divides_what_it_shards():
    shape = SHAPES["llama-7b"]
    one = estimate(shape, Setup())
    z3 = estimate(shape, Setup(dp=8, zero=3))
    z1 = estimate(shape, Setup(dp=8, zero=1))
    assert z3.params == pytest.approx(one.params / 8) and z1.params == one.params
    assert z3.optimizer == pytest.approx(one.optimizer / 8) and z1.grads == one.grads
    assert devices_needed(shape, Setup(zero=3), 80) > devices_needed(shape, Setup(zero=3, optim="lomo"), 80) - 1


def test_catalog_alias_reads_config_only():
    shape = load_shape("tiny-random-llama")
    assert (shape.hidden, shape.layers) == (64, 2)
