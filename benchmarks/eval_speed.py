"""tunelab's evaluation engine vs lm-eval's `hf` model, same model, same data, same prompts, in one run.

    python benchmarks/eval_speed.py --task mmlu|gsm8k|bbh|humaneval|NAME [--data-dir DIR] [--include-path DIR]
        [--limit L] [--subsets N] [--batch-size B] [--peer-batch-sizes 1,8,16] [--tunelab-runs once|interleaved]
        [--max-new-tokens N] [--threads T]
        [--row-quantum Q]

NAME: any other lm-eval task or group with local data: one of an --include-path folder whose YAML names local
files (`benchmarks/lm_task_fixtures.py` writes a multiple-choice and a generation task from local test sets), or
one of lm-eval's own with its splits under --data-dir as <dir>/<task>/<split>.jsonl. Both sides run the same
task definition: tunelab through `evals.run` (eval.tasks: [NAME]), lm-eval through its own `hf` model.

tunelab: the model loaded once, then `evals.run` with tunelab's task definitions (`SharedPrefixLM`:
few-shot prefixes run once; generation on tunelab's decoding engine) or, for HumanEval,
`humaneval.generate`. lm-eval: what `lm_eval --model hf --tasks ...` does, a fresh HFLM loaded from
the model folder at each of `--peer-batch-sizes`, with lm-eval's built-in tasks (mmlu_*, gsm8k_cot,
bbh_cot_fewshot_*) pointed at the same local files; for HumanEval (lm-eval's task downloads the
dataset and executes code unsandboxed) HFLM's own `generate_until` on the same prompts and stop
sequences. Both timings include loading the model; HumanEval's cover loading and generation (the sandboxed
scoring is the same code for both and runs afterwards).

tunelab runs before every lm-eval run and once after the last (`--tunelab-runs interleaved`, the default), so
that a change in the machine's load hits both sides; its median time is compared.
An lm-eval batch size whose first batch cannot be held in the machine's memory (MMLU at 32: the 32 longest 5-shot
prompts, padded alike, need some 17 GB of fp32 logits and as much again for their log-softmax) fails inside this
process (its address space capped at what is available while lm-eval runs) and is reported as not fitting; the
kernel's OOM killer would otherwise end the whole invocation.

Prints items, seconds, items/s and the score of every run, the ratio against the fastest lm-eval batch
size, whether the scores are identical, and for generation tasks the parity of the generated strings
with lm-eval at batch size 1: how many are identical, and for each one that is not, the logit gap at
the first diverging token (a near-tie below 1e-4 explains it).

`--row-quantum 1` shows what the engine's batch invariance costs: every pass is padded to a multiple of
`packed.ROW_QUANTUM` (4) rows so that a row rounds alike in any batch, and at batch size 1 that turns
MKL's one-row kernel into its slower several-row one; 1 drops the padding (and the invariance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

NEAR_TIE = 1e-4
BENCHMARKS = ("mmlu", "gsm8k", "bbh", "humaneval")  # tunelab's, with their own peer task definitions below


def load_model(name: str):
    from tunelab.core.config import ModelCfg
    from tunelab.models import loading

    return loading.load(ModelCfg(name=name, dtype="float32", attn="sdpa"))


# -- tunelab ------------------------------------------------------------------------------------------

def tunelab_run(args, subsets: list[str]) -> dict:
    """{seconds, n, score, raw: {(subset, doc_id): generated string}}"""
    from tunelab import evals

    t0, c0 = time.perf_counter(), time.process_time()
    model, tok = load_model(args.model)
    if args.task == "humaneval":
        from tunelab.evals import humaneval

        problems = humaneval.load_problems(args.limit)
        outs = humaneval.generate(model, tok, [p["prompt"] for p in problems], max_new_tokens=args.max_new_tokens,
                                  batch_size=args.batch_size)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        return {"seconds": seconds, "cpu": cpu, "n": len(problems), "score": pass_at_1(problems, [o[0] for o in outs]),
                "raw": {("humaneval", i): o[0] for i, o in enumerate(outs)}, "model": (model, tok)}
    from tunelab.core.config import EvalCfg

    cfg = EvalCfg(tasks=[args.task], limit=args.limit, data_dir=str(args.data_dir) if args.data_dir else None,
                  batch_size=args.batch_size, subtasks={args.task: subsets} if subsets else {},
                  max_new_tokens=args.max_new_tokens,
                  include_path=str(args.include_path) if args.include_path else None)
    result = evals.run(model, tok, cfg, evals.Context(out_dir=args.out))["tasks"][args.task]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if result["status"] != "ok":
        raise SystemExit(f"{args.task} is unavailable: {result['reason']}")
    raw, items = {}, {}
    for line in (args.out / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "raw" in r:
            raw[(r["subtask"] if args.task not in ("gsm8k", "mmlu") else args.task, r["doc_id"])] = r["raw"]
        if args.task == "mmlu":  # (right or not, the log-likelihood of each answer)
            items[(r["subtask"], r["doc_id"])] = (r["acc"], [x[0] for x in r["response"]])
    # mmlu's headline is weighted by subject size, bbh's the macro average over tasks: as lm-eval's groups
    return {"seconds": seconds, "cpu": cpu, "n": result["n"], "score": result["value"], "raw": raw, "items": items,
            "model": (model, tok), "metric": result.get("lm_eval_metric"), "served": result.get("served")}


def pass_at_1(problems: list[dict], completions: list[str]) -> float:
    from tunelab.evals import humaneval

    records = humaneval.score(problems, [[c] for c in completions], timeout_s=5.0)
    return sum(r["passed"] for r in records) / len(records)


# -- lm-eval ------------------------------------------------------------------------------------------

def peer_tasks(args, subsets: list[str]):
    from lm_eval.tasks import TaskManager

    from tunelab.evals.testsets import exemplars
    from tunelab.evals.testsets.sources import read_jsonl

    data, lm_tasks = args.data_dir, exemplars.lm_eval_tasks_dir()

    def files(path: Path, splits=("test",)):
        return {"dataset_path": "json", "dataset_name": None,
                "dataset_kwargs": {"data_files": {s: str(path / f"{s}.jsonl") for s in splits}}}

    if args.task not in BENCHMARKS:
        return generic_peer_tasks(args)
    if args.task == "mmlu":
        tasks = []
        for s in subsets:
            dev = data / "mmlu" / s / "dev.jsonl"
            shots = min(5, len(read_jsonl(dev)))  # first_n refuses more shots than the pool
            tasks.append({"task": f"mmlu_{s}", "num_fewshot": shots, **files(data / "mmlu" / s, ("test", "dev"))})
        folder, names = lm_tasks / "mmlu" / "default", {f"mmlu_{s}": s for s in subsets}
    elif args.task == "gsm8k":
        tasks = [{"task": "gsm8k_cot", **files(data / "gsm8k" / "main")}]
        folder, names = lm_tasks / "gsm8k", {"gsm8k_cot": "gsm8k"}
    else:
        tasks = [{"task": f"bbh_cot_fewshot_{s}", **files(data / "bbh" / s)} for s in subsets]
        folder, names = lm_tasks / "bbh" / "cot_fewshot", {f"bbh_cot_fewshot_{s}": s for s in subsets}
    # A dict naming a registered task replaces its config only as a member of a group. Only the task's
    # folder is indexed; the CLI indexes every built-in task first (~18 s here), which is not timed.
    tm = TaskManager(include_defaults=False, include_path=str(folder))
    return [{"group": "speed", "task": tasks}], tm, names


def generic_peer_tasks(args):
    """lm-eval's own definition of the task: from --include-path, or lm-eval's with its splits under --data-dir
    (a member of a group takes the override of its dataset)."""
    from lm_eval.tasks import TaskManager

    from tunelab.plan import lmtasks

    if args.include_path:
        tm = TaskManager(include_defaults=False, include_path=str(args.include_path))
        leaves = [t.name for t in lmtasks.leaves(args.task, lmtasks.convert(tm.task_index))]
        return [args.task], tm, {t: t for t in leaves}
    tm = TaskManager(include_defaults=False, include_path=[str(Path(lmtasks.builtin()[args.task].yaml).parent)])
    cfg = tm.task_index[args.task].cfg
    splits = {cfg[k]: str(args.data_dir / args.task / f"{cfg[k]}.jsonl") for k in
              ("training_split", "validation_split", "test_split", "fewshot_split") if cfg.get(k)}
    files = {"dataset_path": "json", "dataset_name": None,
             "dataset_kwargs": {"data_files": {s: f for s, f in splits.items() if Path(f).is_file()}}}
    return [{"group": "speed", "task": [{"task": args.task, **files}]}], tm, {args.task: args.task}


def peer_run(args, subsets: list[str], batch_size: int) -> dict:
    import lm_eval

    from tunelab.models import loading

    model_args = {"pretrained": loading.resolve(args.model), "dtype": "float32", "device": "cpu"}
    if args.task == "humaneval":
        return peer_humaneval(args, model_args, batch_size)
    tasks, tm, names = peer_tasks(args, subsets)
    gen = {"max_gen_toks": args.max_new_tokens} if args.max_new_tokens else None
    t0, c0 = time.perf_counter(), time.process_time()
    out = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, task_manager=tm, limit=args.limit,
                                  batch_size=batch_size, log_samples=True, gen_kwargs=gen)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    counts = {t: out["n-samples"][t]["effective"] for t in names}
    metric = {"mmlu": "acc,none", "gsm8k": "exact_match,strict-match", "bbh": "exact_match,get-answer"}.get(
        args.task, args.metric)
    values = {t: out["results"][t][metric] for t in names}
    if args.task not in BENCHMARKS and args.task in out["results"]:
        score = out["results"][args.task][metric]  # the task itself, or its group's own aggregate
    elif args.task == "bbh":
        score = sum(values.values()) / len(values)
    else:
        score = sum(values[t] * counts[t] for t in names) / sum(counts.values())
    raw, contexts, items = {}, {}, {}
    for t, subset in names.items():
        for s in out["samples"][t]:
            key = (subset, s["doc_id"])
            if isinstance(s["resps"][0][0], str):
                raw[key], contexts[key] = s["resps"][0][0], s["arguments"][0]
            elif args.task == "mmlu":
                items[key] = (s["acc"], [r[0][0] for r in s["resps"]])
    return {"seconds": seconds, "cpu": cpu, "n": sum(counts.values()), "score": score, "raw": raw,
            "contexts": contexts, "items": items}


def peer_humaneval(args, model_args: dict, batch_size: int) -> dict:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from tunelab.evals import humaneval

    problems = humaneval.load_problems(args.limit)
    gen = {"until": list(humaneval.STOP_SEQUENCES), "max_gen_toks": args.max_new_tokens, "do_sample": False}
    requests = [Instance("generate_until", {}, (p["prompt"], dict(gen)), i) for i, p in enumerate(problems)]
    t0, c0 = time.perf_counter(), time.process_time()
    lm = HFLM(batch_size=batch_size, **model_args)
    texts = lm.generate_until(requests, disable_tqdm=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": seconds, "cpu": cpu, "n": len(problems), "score": pass_at_1(problems, texts),
            "raw": {("humaneval", i): t for i, t in enumerate(texts)},
            "contexts": {("humaneval", i): (p["prompt"], gen) for i, p in enumerate(problems)}}


# -- parity -------------------------------------------------------------------------------------------

def explain(model, tok, context: str, gen_kwargs: dict, max_new_tokens: int):
    """Regenerate one item with tunelab's engine and lm-eval's way (model.generate, batch size 1) and
    return the first divergence between the two token streams."""
    from tunelab.evals.engine.generate import Decoder, Request, first_divergence

    ids = tuple(tok(context)["input_ids"])
    n = gen_kwargs.get("max_gen_toks", max_new_tokens)
    ours = Decoder(model, tok, batch_size=1).generate([Request(ids, n, tuple(gen_kwargs.get("until", ())))])[0]
    return first_divergence(model, ids, ours.tokens, n)


def parity(ours: dict, ref: dict, args) -> list[str]:
    lines = []
    keys = sorted(ref["raw"])
    same = [k for k in keys if ours["raw"].get(k) == ref["raw"][k]]
    lines.append(f"generated strings identical to lm-eval at batch size 1: {len(same)}/{len(keys)} "
                 f"({100 * len(same) / max(1, len(keys)):.1f}%)")
    model, tok = ours["model"]
    for k in keys:
        if k in same:
            continue
        context, gen_kwargs = ref["contexts"][k]
        div = explain(model, tok, context, gen_kwargs, args.max_new_tokens or 256)
        if div is None:
            # Regenerated alone, tunelab's tokens are the model's greedy choice at every step: the strings
            # differ in where a stop string was matched or how the text was cut, not in a token
            lines.append(f"  {k}: differs by where a stop string was matched (token streams agree)")
        else:
            verdict = "near-tie" if div.gap < NEAR_TIE else "NOT A NEAR-TIE"
            lines.append(f"  {k}: first diverging token {div.step}: ours {div.ours} vs theirs {div.theirs}, "
                         f"logit gap {div.gap:.2e} ({verdict})")
    return lines


# -- main ---------------------------------------------------------------------------------------------

def subsets_for(args) -> list[str]:
    from tunelab.evals.testsets import exemplars

    if args.task == "mmlu":
        return exemplars.mmlu_subjects()[: args.subsets]
    if args.task == "bbh":
        return exemplars.bbh_tasks()[: args.subsets]
    return []


def parse_args() -> argparse.Namespace:
    """The command line, with each task's defaults filled in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="mmlu", help="mmlu, gsm8k, bbh, humaneval, or any lm-eval task with local data "
                    "(--include-path, or --data-dir as <dir>/<task>/<split>.jsonl)")
    ap.add_argument("--include-path", type=Path, default=None,
                    help="a folder of lm-eval task YAMLs (eval.include_path)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="local test files (<dir>/gsm8k/main/test.jsonl, <dir>/bbh/<task>/test.jsonl, "
                         "<dir>/mmlu/<subject>/{test,dev}.jsonl); MMLU defaults to the offline copy of `exp eval pull`")
    ap.add_argument("--limit", type=int, default=None, help="items per MMLU subject / BBH task, GSM8K items, "
                    "HumanEval problems (default: mmlu 7, bbh 2, gsm8k 32, humaneval 16)")
    ap.add_argument("--subsets", type=int, default=None,
                    help="the first N MMLU subjects / BBH tasks, alphabetical (default: mmlu 57, bbh 8)")
    ap.add_argument("--batch-size", type=int, default=16, help="tunelab's batch size")
    ap.add_argument("--peer-batch-sizes", default=None,
                    help="lm-eval batch sizes to run, comma-separated (default: 1,2,4,8,16,32 for mmlu, else 1,8,16; "
                         "1 is the parity run of the generation tasks)")
    ap.add_argument("--tunelab-runs", choices=["once", "interleaved"], default="interleaved",
                    help="interleaved (default): tunelab before every lm-eval run and once after the last, its median "
                         "against the fastest lm-eval run, so a change in the machine's load hits both sides")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: each task's own (HumanEval 256)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for both (default 1: on a shared 2-core machine MKL's threads wait on each "
                         "other for the small matrices of decoding)")
    ap.add_argument("--row-quantum", type=int, default=None,
                    help="pad tunelab's passes to a multiple of this many rows (default: the engine's own, 4)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/tunelab-eval-speed"))
    args = ap.parse_args()
    defaults = {"mmlu": 7, "gsm8k": 32, "bbh": 2, "humaneval": 16}
    args.limit = args.limit or defaults.get(args.task)
    args.subsets = args.subsets or {"mmlu": 57, "bbh": 8}.get(args.task)
    args.peer_batch_sizes = args.peer_batch_sizes or ("1,2,4,8,16,32" if args.task == "mmlu" else "1,8,16")
    if args.task not in BENCHMARKS and not (args.include_path or args.data_dir):
        ap.error(f"--task {args.task} needs its local data: --include-path (a task folder) or --data-dir")
    if args.task == "humaneval":
        args.max_new_tokens = args.max_new_tokens or 256
    if args.task == "mmlu" and args.data_dir is None:
        from tunelab.evals.testsets.pull import pull_mmlu
        from tunelab.evals.testsets.sources import cache_root

        args.data_dir = cache_root()
        if not (args.data_dir / "mmlu" / "anatomy" / "test.jsonl").is_file():
            pull_mmlu(args.data_dir)
    if args.task in ("gsm8k", "bbh") and args.data_dir is None:
        ap.error(f"--task {args.task} needs --data-dir (its test set has no offline source)")
    return args


def warm_imports() -> None:
    """Import what either side's timed code imports on first use, before any timing: the first run would pay
    for it otherwise (tunelab's runs first)."""
    import lm_eval.evaluator  # noqa: F401
    import lm_eval.models.huggingface  # noqa: F401
    import lm_eval.tasks  # noqa: F401

    from tunelab.evals.lmeval import harness, lm  # noqa: F401


@contextlib.contextmanager
def within_memory():
    """The process's address space capped at what it holds now plus the machine's available memory, so that an
    allocation past it fails in this process (MemoryError, torch's "can't allocate memory") instead of waking the
    kernel's OOM killer, which would end the whole invocation and lose every run's figures."""
    import resource

    held = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) << 10
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (held + available, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e)


def run_all(args, subsets: list[str], peers: list[int]) -> dict:
    """Every run, in order: tunelab first, then each lm-eval batch size (interleaved: tunelab again after each)."""
    runs: dict = {}

    def ours(i: int) -> None:
        name = "tunelab" if i == 0 else f"tunelab #{i + 1}"
        runs[name] = tunelab_run(args, subsets)
        if i:  # only the first run's model is kept (the parity check regenerates with it)
            runs[name].pop("model")
        print(f"{name} done: {runs[name]['seconds']:.1f} s; requests served by {runs[name].get('served')}; load "
              f"average {os.getloadavg()[0]:.1f}", flush=True)

    args.did_not_fit = {}
    ours(0)
    args.metric = runs["tunelab"].get("metric")
    for i, bs in enumerate(peers):
        try:
            with within_memory():
                runs[f"lm-eval bs {bs}"] = peer_run(args, subsets, bs)
        except (MemoryError, RuntimeError) as e:  # a batch size the machine cannot hold is not the peer's best
            if not out_of_memory(e):
                raise
            args.did_not_fit[bs] = str(e).strip().splitlines()[-1][:200]
            print(f"lm-eval batch size {bs}: does not fit in this machine's memory ({args.did_not_fit[bs]})",
                  flush=True)
            continue
        print(f"lm-eval batch size {bs} done: {runs[f'lm-eval bs {bs}']['seconds']:.1f} s, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        if args.tunelab_runs == "interleaved":
            ours(i + 1)
    return runs


def report(args, runs: dict) -> None:
    unit = "questions" if args.task == "mmlu" else "items"
    print(f"\n{'run':16s} {unit:>9s} {'seconds':>8s} {'items/s':>8s} {'cpu s':>8s} {'score':>9s}")
    for name, r in runs.items():
        print(f"{name:16s} {r['n']:9d} {r['seconds']:8.1f} {r['n'] / r['seconds']:8.3f} {r['cpu']:8.1f} "
              f"{r['score']:9.6f}")
    ours = [r for k, r in runs.items() if k.startswith("tunelab")]
    theirs = {k: r for k, r in runs.items() if not k.startswith("tunelab")}
    seconds, cpu = (statistics.median(r[k] for r in ours) for k in ("seconds", "cpu"))
    n = ours[0]["n"]
    best = min(theirs, key=lambda k: theirs[k]["seconds"] / theirs[k]["n"])
    ratio = (n / seconds) / (theirs[best]["n"] / theirs[best]["seconds"])
    cpu_best = min(theirs, key=lambda k: theirs[k]["cpu"] / theirs[k]["n"])
    cpu_ratio = (theirs[cpu_best]["cpu"] / theirs[cpu_best]["n"]) / (cpu / n)
    print(f"tunelab: {len(ours)} run(s), median {seconds:.1f} s ({cpu:.1f} CPU s); fastest lm-eval: {best} "
          f"({theirs[best]['seconds']:.1f} s); speed-up {ratio:.2f}x (items/s, wall clock); in CPU seconds per item "
          f"against {cpu_best}: {cpu_ratio:.2f}x")
    for bs, why in args.did_not_fit.items():
        print(f"lm-eval batch size {bs}: not run to its end, it does not fit in this machine's memory ({why})")
    if len({r["score"] for r in ours}) > 1:
        print("tunelab's runs gave DIFFERENT scores: " + ", ".join(f"{r['score']:.6f}" for r in ours))
    diffs = {k: abs(ours[0]["score"] - r["score"]) for k, r in theirs.items()}
    print("score difference: " + ", ".join(f"{k} {d:.2e}" for k, d in diffs.items())
          + (" (identical)" if not any(diffs.values()) else ""))
    if args.task == "mmlu":
        for k, r in theirs.items():
            print(f"items against {k}: {item_parity(ours[0]['items'], r['items'])}")
    elif ours[0]["raw"] and "lm-eval bs 1" in runs:
        print("\n".join(parity(ours[0], runs["lm-eval bs 1"], args)))


def item_parity(ours: dict, theirs: dict) -> str:
    """MMLU item by item: how many are scored alike (right or wrong), and the largest log-likelihood difference."""
    keys = sorted(theirs)
    same = sum(ours.get(k, (None,))[0] == theirs[k][0] for k in keys)
    gap = max((abs(a - b) for k in keys if k in ours for a, b in zip(ours[k][1], theirs[k][1])), default=float("nan"))
    return f"{same}/{len(keys)} scored alike, log-likelihoods within {gap:.1e}"


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from tunelab.evals.engine import packed

    packed.ROW_QUANTUM = args.row_quantum or packed.ROW_QUANTUM
    subsets = subsets_for(args)
    peers = [int(b) for b in args.peer_batch_sizes.split(",")]
    load = os.getloadavg()
    print(f"model {args.model}, task {args.task}, limit {args.limit}"
          f"{f', {len(subsets)} subsets' if subsets else ''}, tunelab batch {args.batch_size} "
          f"(passes padded to {packed.ROW_QUANTUM} rows; runs {args.tunelab_runs}), lm-eval batch sizes "
          f"{peers}, {torch.get_num_threads()} threads, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
          flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    warm_imports()
    report(args, run_all(args, subsets, peers))
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
