"""The cell's typed events: their wire format round-trips, anything else on the stream is not an event, and
data building reports its progress."""

from __future__ import annotations

import pytest

from tunelab.core import events


@pytest.mark.parametrize("event", [events.Stage("load"), events.Step(3, 20, 1.5, {"lr": 1e-3}),
                                   events.Resumed(10, "step-10"), events.EvalTask("mmlu"),
                                   events.EvalProgress("mmlu", 40, 57), events.DataProgress(2000, 5000)])
def test_events_round_trip(event):
    assert events.decode(events.encode(event)) == event


def test_the_wire_format_is_the_documented_one():
    step = '{"stage": "train", "step": 3, "total": 20, "loss": 1.5, "metrics": {}}'
    assert events.encode(events.Step(3, 20, 1.5)) == step
    assert events.encode(events.Stage("data")) == '{"stage": "data"}'


@pytest.mark.parametrize("line", ["not json", "[1, 2]", '{"no": "stage"}', '{"stage": "train", "step": 1}',
                                  '{"stage": "load", "extra": 1}'])
def test_other_lines_are_not_events(line):
    assert events.decode(line) is None


def test_data_build_reports_progress(tmp_path):
    from tunelab.core.config import DataCfg, ModelCfg
    from tunelab.data.build import build
    from tunelab.models import loading

    _, tok = loading.load(ModelCfg(name="tiny-random-llama"))
    seen = []
    build(DataCfg(recipe="arithmetic", max_length=64), tok, tmp_path, num_proc=1,
          progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_the_runner_shows_eval_and_data_progress_on_the_cells_line():
    from tunelab.run.progress import shown as _shown

    assert _shown(events.EvalProgress("gsm8k", 3, 8)) == {"total": 8, "completed": 3, "info": "eval gsm8k 3/8"}
    assert _shown(events.DataProgress(200, 500)) == {"info": "tokenizing 200/500"}
    assert _shown(events.Step(4, 20, 1.25)) == {"completed": 4, "info": "train loss 1.2500"}
