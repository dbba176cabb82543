"""`train.compile`: the decoder body of a one-process training step under torch.compile.

What the compiler buys on a step is fusion of the elementwise work between the matrix products (norms, rotary
embeddings, the SiLU product, residual adds, dropout) into fewer passes over memory; the matrix products are the
same library calls. The body (embeddings, decoder layers, final norm) is compiled as one graph with dynamic
shapes, so batches of any length reuse it; the output head and the loss stay as train/chunked.py runs them (their
time is matrix products), and packed rows keep their attention by example through an operator the compiler does
not look into (train/segments.py). Compiling costs tens of seconds to minutes before the first step (inductor
keeps what it built on disk, so a second run of the same shapes starts sooner), once more for the first
validation (no gradients: a different graph).

Only while a step (or a validation batch) runs is the body compiled: the model handed back after training, its
evaluation and decoding run its own eager code. LOMO/AdaLomo update inside backward, parameter by parameter, which
a compiled backward (every gradient at its end) would undo, and the engines wrap the model their own way: the
planner refuses those (layouts.across).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tunelab.train.parallel.anatomy import causal_lm


class CompiledBody:
    def __init__(self, model: Any):
        lm = causal_lm(model)
        self.body = getattr(lm, lm.base_model_prefix)
        # What Module.compile() installs, kept here so that it is in place only while a step runs.
        self.fn = torch.compile(self.body._call_impl, dynamic=True)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.body._compiled_call_impl = self.fn
        try:
            yield
        finally:
            self.body._compiled_call_impl = None
