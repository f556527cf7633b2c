"""A run that diverged says so (its last log line, result.json), and a non-finite metric is written as what
it is, never left out for an earlier step's value to show through."""

from __future__ import annotations

import json
import math

import pytest
from conftest import TINY

from gptlab.comparison.records import read_run_dir, result_metric
from gptlab.runs import Run
from gptlab.tasks.gpt import run
from gptlab.tasks.skeleton import RunSession


def test_a_run_at_a_huge_learning_rate_ends_marked_diverged_with_the_numbers(make_cfg, tmp_path, caplog):
    out = tmp_path / "run"
    cfg = make_cfg(*TINY, "tokenizer=char", "logger=csv", "optim.lr=10", f"paths.output_dir={out}")
    with caplog.at_level("WARNING", logger="gptlab"):
        metrics = run(cfg)
    result = Run(out).result()
    entropy, final = metrics["unigram_entropy"], metrics["val/loss"]
    assert result["finished"] and result["diverged"] is True
    numbers = result["divergence"]
    assert numbers["val/loss"] == pytest.approx(final) and numbers["unigram_entropy"] == pytest.approx(
        entropy
    )
    assert final > entropy and final > numbers["uniform_loss"] + 1
    # the character vocabulary's uniform guess: ln of its size
    assert math.exp(numbers["uniform_loss"]) == pytest.approx(round(math.exp(numbers["uniform_loss"])))
    warning = caplog.records[-1]
    assert warning.levelname == "WARNING" and warning.getMessage().startswith(
        f"The run diverged: its final validation loss, {final:.4g} nats, is above the corpus's unigram "
        f"entropy, {entropy:.4f} nats"
    )
    assert "Lower the learning rate (optim.lr)" in warning.getMessage()
    # and the comparison reads it as diverged
    assert read_run_dir(out).diverged


def test_a_non_finite_metric_is_written_as_a_string_and_read_back_as_inf(tmp_path):
    session = RunSession(cfg=None, settings=None, run_dir=tmp_path)  # write_result reads neither
    session.write_result(
        {"val/loss": math.inf, "val/ppl": math.inf, "train/loss": math.nan, "lr": 1e-3}, 8, True, False
    )
    text = (tmp_path / "result.json").read_text()
    result = json.loads(text)  # plain JSON: no Infinity or NaN tokens
    assert "Infinity" not in text and "NaN" not in text
    assert result["metrics"] == {"val/loss": "inf", "val/ppl": "inf", "train/loss": "nan", "lr": 1e-3}
    assert result_metric(result, "val/loss") == math.inf and math.isnan(result_metric(result, "train/loss"))
    assert result_metric(result, "lr") == 1e-3 and result_metric(result, "missing") is None
