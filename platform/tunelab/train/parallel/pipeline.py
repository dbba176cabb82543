"""Pipeline schedules over this rank's stages, with the loss that matches one process:
summed token cross-entropy / label tokens of the whole optimizer step.

With `at_labels` the last stage runs the final norm and the output head only at the positions that
carry a label (train/loss.py), the head and the loss together in chunks (train/chunked.py): every rank
passes the micro-batch's shifted labels as a keyword argument, which the schedule splits like the inputs
and hands to each stage without sending it between ranks; the last stage returns the summed token loss
of its micro-batch."""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from tunelab.train.loss import shifted_labels

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
MAX_CACHED_SHAPES = 8
PAD_TO = 32  # sequence lengths are padded up to a multiple of this: fewer shapes, fewer new stages


def pad(b: dict, multiple: int = PAD_TO) -> dict:
    """Right-pad to a multiple of `multiple` tokens; padding is masked and carries no label, so
    the real tokens' outputs and the loss do not change."""
    extra = -b["input_ids"].shape[1] % multiple
    if not extra:
        return b
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.nn.functional.pad(v, (0, extra), value=fill[k]) for k, v in b.items()}


class Pipeline:
    def __init__(self, modules, stage_ids: list[int], layout, pcfg, loss_function, vocab_size: int,
                 grad_scale: float = 1.0, at_labels: bool = False):
        self.modules, self.ids, self.layout, self.pcfg = modules, stage_ids, layout, pcfg
        self.n_stages = layout.pp * len(stage_ids)
        self.first, self.last = 0 in stage_ids, self.n_stages - 1 in stage_ids
        self._loss_function, self._vocab = loss_function, vocab_size
        self._n_items = 1
        self._scale = grad_scale  # the backward loss is scaled by it (see native.py); reports are not
        self._schedules: dict[tuple, object] = {}
        self._at_labels = at_labels

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = torch.tensor(self._n_items, device=logits.device)
        if self._at_labels:  # the last stage returned the summed loss itself (1 element)
            return logits.sum() / n * self._scale
        loss = self._loss_function(logits=logits, labels=labels, vocab_size=self._vocab, num_items_in_batch=n)
        return loss * self._scale

    def _schedule(self, shape: tuple):
        """Stages learn their activation shapes on first use, so each batch shape gets its own
        (cheap) stage objects around the same modules; padding varies from batch to batch."""
        if shape not in self._schedules:
            if len(self._schedules) >= MAX_CACHED_SHAPES:
                self._schedules.clear()
            group = self.layout.group("pp")
            st = [PipelineStage(m, i, self.n_stages, self.layout.device, group=group)
                  for m, i in zip(self.modules, self.ids)]
            cls = SCHEDULES[self.pcfg.pp_schedule]
            # scale_grads=False: the loss is already normalized by the step's label tokens.
            self._schedules[shape] = (cls(st, self.pcfg.microbatches, loss_fn=self._loss, scale_grads=False)
                                      if len(st) > 1 else
                                      cls(st[0], self.pcfg.microbatches, loss_fn=self._loss, scale_grads=False))
        return self._schedules[shape]

    def _run(self, method: str, b: dict, n_items: int) -> float:
        self._n_items = n_items
        b = pad(b)
        shape = tuple(b["input_ids"].shape)
        # A new stage infers its shapes with a real forward/backward and then, under FSDP, drops
        # all gradients: keep the ones this step has accumulated so far and add them back.
        kept = {} if shape in self._schedules else {
            p: p.grad for m in self.modules for p in m.parameters() if p.grad is not None}
        sched = getattr(self._schedule(shape), method)
        losses: list[torch.Tensor] = []
        target = {"target": b["labels"], "losses": losses} if self.last else {}
        args = (b["input_ids"], b["attention_mask"]) if self.first else ()
        keep = {"targets": shifted_labels(b["labels"])} if self._at_labels else {}
        sched(*args, **keep, **target)
        for p, g in kept.items():
            p.grad = g if p.grad is None else p.grad + g
        return sum(float(x.detach()) for x in losses) / self._scale

    def step(self, b: dict, n_items: int) -> float:
        """Forward and backward of one micro-batch through all stages; the loss on the last stage, 0 elsewhere."""
        return self._run("step", b, n_items)

    def eval(self, b: dict) -> float:
        """Summed token loss of a batch on the last stage (0 elsewhere), forward only."""
        return self._run("eval", b, 1)
