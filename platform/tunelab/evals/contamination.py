"""Does a cell's training data contain the items a stand-in task scores? Checked per cell, reported in
results.json (`contamination`): a stand-in scored on its own training questions would measure memory."""

from __future__ import annotations


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def overlap(questions: list[str], train, tokenizer) -> dict:
    """Questions found verbatim (case and spacing ignored) in the decoded training rows of the cell."""
    rows = [tokenizer.decode(list(ids), skip_special_tokens=True) for ids in train["input_ids"]]
    corpus = "\n".join(_norm(t) for t in rows)
    hits = [q for q in questions if _norm(q) in corpus]
    return {"checked_items": len(questions), "training_rows": len(rows), "overlapping_items": len(hits),
            "examples": hits[:3]}
