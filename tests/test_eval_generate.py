"""The decoding engine (tunelab.evals.engine.generate) on the tiny random Llama: greedy parity with lm-eval's hf
model at batch size 1 on GSM8K and BBH prompts, outputs that do not depend on the batch size, every row
stopping at its own stop string, seeded sampling."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunelab import evals
from tunelab.core.config import EvalCfg, ModelCfg
from tunelab.evals.engine.generate import Decoder, Request, cut_at_stop, first_divergence
from tunelab.models import loading

FIXTURES = Path(__file__).parent / "fixtures" / "eval"
BBH = ["navigate", "boolean_expressions"]
GEN_TOKENS = 40
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return loading.load(ModelCfg(name="tiny-random-llama"))


def lm_eval_hf_bs1() -> dict:
    """lm-eval as its CLI runs it, at batch size 1: a fresh HFLM loaded from the folder, lm-eval's own
    gsm8k_cot and bbh_cot_fewshot_* tasks pointed at the fixture files."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tunelab.evals.testsets.exemplars import lm_eval_tasks_dir

    def files(local, name):
        return {"dataset_path": "json", "dataset_name": None,
                "dataset_kwargs": {"data_files": {"test": str(FIXTURES / local / name / "test.jsonl")}}}

    tasks = [{"task": "gsm8k_cot", **files("gsm8k", "main")}]
    tasks += [{"task": f"bbh_cot_fewshot_{t}", **files("bbh", t)} for t in BBH]
    lm_tasks = lm_eval_tasks_dir()
    tm = TaskManager(include_defaults=False,
                     include_path=[str(lm_tasks / "gsm8k"), str(lm_tasks / "bbh" / "cot_fewshot")])
    return lm_eval.simple_evaluate(model="hf", model_args={"pretrained": loading.resolve("tiny-random-llama"),
                                                           "device": "cpu", "dtype": "float32"},
                                   tasks=[{"group": "parity", "task": tasks}], task_manager=tm, batch_size=1,
                                   log_samples=True, gen_kwargs={"max_gen_toks": GEN_TOKENS})


def test_greedy_generations_match_lm_eval_hf_at_batch_size_1(tiny, tmp_path):
    import json

    cfg = EvalCfg(tasks=["gsm8k", "bbh"], data_dir=str(FIXTURES), subtasks={"bbh": BBH},
                  max_new_tokens=GEN_TOKENS, batch_size=4)
    ctx = evals.Context(out_dir=tmp_path)
    ours = evals.run(*tiny, cfg, ctx)["tasks"]
    ref = lm_eval_hf_bs1()
    assert ours["gsm8k"]["value"] == ref["results"]["gsm8k_cot"]["exact_match,strict-match"]
    for t in BBH:
        assert ours["bbh"]["subtasks"][t]["value"] == ref["results"][f"bbh_cot_fewshot_{t}"]["exact_match,get-answer"]
    theirs = {("gsm8k", d["doc_id"]): (d["arguments"][0][0], d["resps"][0][0])
              for d in ref["samples"]["gsm8k_cot"]}
    for t in BBH:
        theirs |= {(t, d["doc_id"]): (d["arguments"][0][0], d["resps"][0][0])
                   for d in ref["samples"][f"bbh_cot_fewshot_{t}"]}
    mine = {("gsm8k" if r["task"] == "gsm8k" else r["subtask"], r["doc_id"]): r["raw"]
            for r in map(json.loads, (tmp_path / "samples.jsonl").read_text().splitlines())}
    assert mine.keys() == theirs.keys() and len(mine) == 8
    lm = ctx._lm
    differ = [key for key in mine if mine[key] != theirs[key][1]]
    for key in differ:
        # A different string must come from a near-tie: the logits of the two tokens at the first step where
        # the generations part, within float rounding of each other.
        ids = lm.tok_batch_encode([theirs[key][0]])[0][0].tolist()
        tokens = Decoder(*tiny, batch_size=1).generate([Request(tuple(ids), GEN_TOKENS)])[0].tokens
        div = first_divergence(tiny[0], ids, tokens, GEN_TOKENS)
        print(f"{key}: differs from lm-eval at token {div and div.step}, logit gap {div and div.gap:.2e}")
        assert div is not None and div.gap < NEAR_TIE, key
    print(f"{len(mine) - len(differ)}/{len(mine)} generations identical to lm-eval's hf model at batch size 1")


def prompts(tokenizer) -> list[tuple[int, ...]]:
    """Requests with a long shared prefix (two groups) and some without, of different lengths."""
    shots = "Q: There are 15 trees. Workers plant more; now there are 21. How many were planted?\nA: 6.\n\n" * 3
    other = "Given a series of navigation instructions, determine the end point.\n\n" * 4
    texts = [shots + f"Q: Tom has {i} apples and buys {i * 7 % 11} more. How many now?\nA:" for i in range(9)]
    texts += [other + f"Q: Take {i} steps. Turn around." + " Take 1 step." * i + "\nA:" for i in range(6)]
    texts += [f"def f{i}(x):\n    return x" + " + 1" * i for i in range(4)]
    return [tuple(tokenizer(t)["input_ids"]) for t in texts]


def test_outputs_do_not_depend_on_the_batch_size(tiny):
    model, tokenizer = tiny
    ids = prompts(tokenizer)
    reqs = [Request(x, 6 + 3 * (i % 5)) for i, x in enumerate(ids)]
    reqs += [Request(x, 10, temperature=1.0, seed=100 + i) for i, x in enumerate(ids[::2])]
    outs = {bs: Decoder(model, tokenizer, batch_size=bs).generate(reqs) for bs in (1, 4, 16)}
    assert [o.tokens for o in outs[1]] == [o.tokens for o in outs[4]] == [o.tokens for o in outs[16]]
    assert [len(o.tokens) for o in outs[1]] == [r.max_new_tokens for r in reqs]
    # the shared prefixes were found: two groups of nine and six requests run their prefix once
    engine = Decoder(model, tokenizer, batch_size=4)
    from tunelab.evals.engine.generate import groups_by_prefix

    sizes = sorted(len(m) for p, m in groups_by_prefix(ids[:19], engine.min_shared) if p >= engine.min_shared)
    assert sizes[-2:] == [6, 9]


def test_greedy_equals_model_generate(tiny):
    model, tokenizer = tiny
    ids = prompts(tokenizer)[::3]
    outs = Decoder(model, tokenizer, batch_size=4).generate([Request(x, 16) for x in ids])
    for x, out in zip(ids, outs):
        div = first_divergence(model, x, out.tokens, 16)
        assert div is None or div.gap < NEAR_TIE, div


def test_every_row_stops_at_its_own_stop_string(tiny):
    """Stop strings taken from each row's own unstopped completion, at different steps: each row ends
    at the token that completes its stop string while the others go on."""
    model, tokenizer = tiny
    ids = prompts(tokenizer)[:8]
    engine = Decoder(model, tokenizer, batch_size=4, stop_eos=set())
    free = engine.generate([Request(x, 24) for x in ids])

    def text(tokens):
        return tokenizer.decode(tokens, skip_special_tokens=False)

    reqs, expected = [], []
    for i, (x, out) in enumerate(zip(ids, free)):
        # the text of a token from step 2, 4, ... 16 on (one that decodes to visible text)
        at = next(k for k in range(2 + 2 * i, 24) if text(out.tokens[k:k + 1]).strip())
        stop = text(out.tokens[at:at + 1])
        first = next(k for k in range(24) if stop in text(out.tokens[: k + 1]))
        reqs.append(Request(x, 24, ("never generated", stop)))
        expected.append((out.tokens[: first + 1], cut_at_stop(text(out.tokens), [stop])))
    stopped = engine.generate(reqs)
    for out, req, (tokens, cut) in zip(stopped, reqs, expected):
        assert out.reason == "stop" and out.tokens == tokens
        assert cut_at_stop(text(out.tokens), req.stop) == cut
    assert len({len(o.tokens) for o in stopped}) >= 4  # rows stopped at different steps


def test_sampling_is_seeded_per_request(tiny):
    model, tokenizer = tiny
    ids = prompts(tokenizer)[:3]
    engine = Decoder(model, tokenizer, batch_size=2)
    same = [Request(ids[0], 12, temperature=1.0, seed=7)] * 2
    a = engine.generate(same + [Request(ids[1], 12, temperature=1.0, seed=8)])
    b = engine.generate([Request(ids[1], 12, temperature=1.0, seed=8)])
    assert a[0].tokens == a[1].tokens  # the same request and seed: the same draws, in any batch
    assert a[2].tokens == b[0].tokens
    c = engine.generate([Request(ids[0], 12, temperature=1.0, seed=9)])
    assert c[0].tokens != a[0].tokens


def test_batched_decoding_attention_agrees(tiny):
    """The GPU layout of a decoding step (all rows in one masked attention call), run here on CPU: the
    same tokens as row-by-row attention, up to near-ties."""
    model, tokenizer = tiny
    ids = prompts(tokenizer)[::2]
    reqs = [Request(x, 12) for x in ids]
    per_row = Decoder(model, tokenizer, batch_size=4).generate(reqs)
    batched = Decoder(model, tokenizer, batch_size=4, per_row=False)
    assert batched.supported()
    for x, a, b in zip(ids, per_row, batched.generate(reqs)):
        if a.tokens != b.tokens:
            div = first_divergence(model, x, b.tokens, 12)
            assert div is None or div.gap < NEAR_TIE, div


class CountingDecoder(Decoder):
    passes = 0

    def forward(self, *args, **kwargs):
        self.passes += 1
        return super().forward(*args, **kwargs)


def test_drafted_tokens_change_the_passes_not_the_tokens(tiny):
    """Prompt-lookup drafts are checked by the model: the same greedy tokens with and without them
    (up to near-ties), and on a model that repeats itself, far fewer passes."""
    import copy

    import torch

    model, tokenizer = tiny
    ids = prompts(tokenizer)[::2]
    reqs = [Request(x, 20) for x in ids]
    plain = Decoder(model, tokenizer, batch_size=4, draft=0).generate(reqs)
    drafted = Decoder(model, tokenizer, batch_size=4, draft=8).generate(reqs)
    for x, a, b in zip(ids, plain, drafted):
        if a.tokens != b.tokens:
            div = first_divergence(model, x, b.tokens, 20)
            assert div is None or div.gap < NEAR_TIE, div
    # A head that prefers one token, but not by so much that the prompt does not matter at first.
    looping = copy.deepcopy(model)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    head.weight.data.copy_(model.lm_head.weight.data)
    head.bias.data.zero_()
    head.bias.data[tokenizer.convert_tokens_to_ids("1")] = 2.0
    looping.lm_head = head
    counts, outs = {}, {}
    for draft in (0, 8):
        engine = CountingDecoder(looping, tokenizer, batch_size=4, draft=draft, stop_eos=set())
        outs[draft] = [o.tokens for o in engine.generate(reqs[:4])]
        counts[draft] = engine.passes
    assert outs[0] == outs[8]
    assert counts[8] < counts[0] / 2, counts
