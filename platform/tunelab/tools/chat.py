"""`exp chat CELL_DIR|MODEL`: talk to a model, its tokens printed as they are generated.

The prompt format matters more than anything else for a small fine-tuned model, so a cell (or its export) is
prompted the way it trained: the cell's data template. Any other model gets its tokenizer's chat template, or
the Alpaca prompt tunelab trains with when it has none (said once). A PEFT cell loads its base model and the
adapter from final/, merged for generation where the method allows it, as the cell's evaluation did.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tunelab.core.errors import UserError
from tunelab.core.files import read_json
from tunelab.data.recipe import trained_template
from tunelab.folders.cell import CellFolder, open_finished

TEMPLATE_CHOICES = ("auto", "chat", "alpaca", "plain")


def _load(name: str, device, *, dtype: str = "auto", revision: str | None = None, what: str = "MODEL"):
    from tunelab import plan
    from tunelab.models import loading
    from tunelab.plan.sections import looks_like_path

    try:
        cfg = plan.section_config("model", {"name": name, "dtype": dtype, "revision": revision})
    except plan.Invalid as e:
        raise UserError(e.problems[0].message, key=what) from None
    if looks_like_path(name) and not Path(name).expanduser().is_dir():
        raise UserError(f"{name!r} is not a catalog alias, and no folder of that name exists on this machine",
                        key=what)
    try:
        return loading.load(cfg, device)
    except OSError as e:
        raise UserError(str(e), key=what) from None


def _with_adapter(name: str, adapter: Path, device, **kw):
    """The base model with a PEFT adapter on top, merged where peft can (what the cell's evaluation ran)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tunelab.train.peft import for_eval

    model, _ = _load(name, device, **kw)
    tok = AutoTokenizer.from_pretrained(adapter)  # the cell's tokenizer, saved beside the adapter
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return for_eval(PeftModel.from_pretrained(model, adapter).to(device)), tok


def load_target(target: str, device) -> tuple[object, object, str | None, str]:
    """(model, tokenizer, the template it trained with or None, a label for messages)."""
    path = Path(target).expanduser()
    path = path.resolve() if path.exists() else path  # a relative folder is still a folder, not a hub id
    if CellFolder(path).exists():
        cell = open_finished(path, "chat")
        m = cell.raw_config()["model"]
        kw = {"dtype": m.get("dtype", "auto"), "revision": m.get("revision"), "what": "model.name in config.yaml"}
        if cell.method == "none":
            model, tok = _load(str(cell.final), device, dtype=kw["dtype"])
        else:
            model, tok = _with_adapter(cell.base, cell.final, device, **kw)
        return model, tok, trained_template(cell.raw_config()), f"cell {cell.title} ({cell.method})"
    trained = (read_json(path / "tunelab_export.json", dict) or {}).get("template") if path.is_dir() else None
    adapter = read_json(path / "adapter_config.json", dict) if path.is_dir() else None
    if adapter:
        base = adapter.get("base_model_name_or_path")
        if not base:
            raise UserError("adapter_config.json has no base_model_name_or_path", file=path)
        model, tok = _with_adapter(base, path, device, what="base_model_name_or_path in adapter_config.json")
        return model, tok, trained, f"{target} (adapter over {base})"
    model, tok = _load(target, device)
    return model, tok, trained, target


def choose_template(requested: str, tok, trained: str | None) -> tuple[str, str | None]:
    """(template, a note to print once, or None)."""
    has_chat = bool(getattr(tok, "chat_template", None))
    if requested not in TEMPLATE_CHOICES:
        raise UserError(f"--template {requested!r}: allowed are {', '.join(TEMPLATE_CHOICES)}")
    if requested == "chat" and not has_chat:
        raise UserError("--template chat: this tokenizer has no chat template; use alpaca, plain or auto")
    if requested != "auto":
        return requested, None
    if trained:
        return trained, f"prompt format: {trained}, the template this model was trained with (--template to change)"
    if has_chat:
        return "chat", None
    return "alpaca", ("the tokenizer has no chat template; using the Alpaca prompt tunelab trains with "
                      "(--template to choose another)")


def render(conv: list[dict], template: str, tok) -> tuple[str, bool]:
    """The prompt text for a conversation that ends with a user turn, and whether to add the tokenizer's BOS."""
    if template == "chat":
        return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True), False
    from tunelab.data.templates import TEMPLATES

    t = TEMPLATES[template].load()
    text = "".join(s.text + ((tok.eos_token or "") if s.eos else "") for s in t.fn(conv, tok))
    return text, t.add_special_tokens


def _stopper(event: threading.Event):
    import torch
    from transformers import StoppingCriteria

    class Stop(StoppingCriteria):  # Ctrl-C ends the answer being generated, not the session
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), event.is_set(), dtype=torch.bool, device=input_ids.device)

    return Stop()


def generate(model, tok, text: str, add_special: bool, *, max_new_tokens: int, temperature: float,
             write: Callable[[str], None]) -> str:
    """Generate in a thread and hand each decoded piece to `write` as it comes; returns the whole answer."""
    import copy

    from transformers import StoppingCriteriaList, TextIteratorStreamer

    device = next(model.parameters()).device
    enc = tok(text, return_tensors="pt", add_special_tokens=add_special).to(device)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    gen = copy.deepcopy(model.generation_config)
    sample = temperature > 0
    # Greedy decoding ignores the sampling knobs a model's generation config may carry; unset them.
    gen.update(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
               top_p=gen.top_p if sample else None, top_k=gen.top_k if sample else None,
               pad_token_id=tok.pad_token_id, eos_token_id=gen.eos_token_id or tok.eos_token_id)
    stop, failure = threading.Event(), []

    def work():
        try:
            model.generate(**enc, generation_config=gen, streamer=streamer,
                           stopping_criteria=StoppingCriteriaList([_stopper(stop)]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    pieces = []
    try:
        for piece in streamer:
            pieces.append(piece)
            write(piece)
    except KeyboardInterrupt:
        stop.set()
        for piece in streamer:  # drain what was already decoded
            pieces.append(piece)
        write(" [stopped]")
    thread.join()
    if failure:
        raise failure[0]
    return "".join(pieces)


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def session(model, tok, template: str, *, system: str | None, max_new_tokens: int, temperature: float,
            prompt: str | None, label: str, info: Callable[[str], None]) -> None:
    """One answer to `prompt`, or a conversation read from the terminal until /exit or end of input."""
    start = [{"role": "system", "content": system}] if system else []

    def answer(conv: list[dict]) -> str:
        reply = generate(model, tok, *render(conv, template, tok), max_new_tokens=max_new_tokens,
                         temperature=temperature, write=_write)
        _write("\n")
        if not reply.strip():  # a blank line alone looks like a bug in the command, not the model
            info("(the model ended its answer without any text)")
        return reply

    if prompt is not None:
        answer([*start, {"role": "user", "content": prompt}])
        return
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    info(f"chatting with {label}; /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops an answer")
    conv = list(start)
    while True:
        try:
            line = input(">>> ").strip()
        except (EOFError, KeyboardInterrupt):
            _write("\n")
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            conv = list(start)
            continue
        if not line:
            continue
        conv.append({"role": "user", "content": line})
        conv.append({"role": "assistant", "content": answer(conv)})
