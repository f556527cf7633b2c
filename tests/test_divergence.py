"""A run that diverged says so (its last log line, result.json), and a non-finite metric is written as what
it is, never left out for an earlier step's value to show through."""

from __future__ import annotations

import json
import math

import pytest
from conftest import TINY, strict_json

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
        f"The run diverged: its final validation loss, {final:.4g} nats, is above the validation split's "
        f"unigram entropy, {entropy:.4f} nats"
    )
    assert "Lower the learning rate (optim.lr)" in warning.getMessage()
    # and the comparison reads it as diverged
    assert read_run_dir(out).diverged
    for path in out.rglob("*.json"):  # result.json, run.json, checkpoints/best.json
        strict_json(path)


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


def test_a_missing_metric_is_null_and_the_table_shows_it_as_unavailable(tmp_path):
    """A figure not measured is written as null (strict JSON, no NaN token), read back as missing by the
    Python API and the comparison, and shown as unavailable in the table, never as 0; a NaN a writer did not
    expect (outside the metrics) refuses to be written and leaves the earlier result whole."""
    from gptlab.api import TrainResult
    from gptlab.comparison.table import _output_cell
    from gptlab.evaluation.downstream import final_values

    session = RunSession(cfg=None, settings=None, run_dir=tmp_path)
    figures = {"eval/task/acc": None, "eval/task/bits_per_byte": math.nan, "eval/other/acc": 0.5}
    session.write_result({**figures, "val/loss": 3.0}, 8, True, False)
    text = (tmp_path / "result.json").read_text()
    result = strict_json(tmp_path / "result.json")
    assert (
        result["metrics"]["eval/task/acc"] is None and result["metrics"]["eval/task/bits_per_byte"] == "nan"
    )
    assert result_metric(result, "eval/task/acc") is None
    read = TrainResult.read(tmp_path)
    assert read.missing == ("eval/task/acc",) and "eval/task/acc" not in read.metrics
    assert math.isnan(read.metrics["eval/task/bits_per_byte"])
    columns = final_values(Run(tmp_path))
    assert columns == {"eval/task/acc": None, "eval/task/bits_per_byte": None, "eval/other/acc": 0.5}
    cells = {k: _output_cell(v, "{:.4g}".format, "n/a") for k, v in columns.items()}
    assert cells == {"eval/task/acc": "n/a", "eval/task/bits_per_byte": "n/a", "eval/other/acc": "0.5"}

    with pytest.raises(ValueError, match="not JSON compliant"):
        session.write_result({"val/loss": 2.0}, 9, True, False, extra={"entropy": math.nan})
    assert (tmp_path / "result.json").read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary file left


def test_files_an_older_gptlab_wrote_with_nan_tokens_still_read(tmp_path):
    """Before the strict writer, word2vec's metrics.json held bare NaN tokens (and a result.json could, outside
    its metrics): Python's json reads them, and gptlab's readers take them as the figures they are."""
    from gptlab.api import TrainResult
    from gptlab.runs.jsonfile import read_figure

    (tmp_path / "result.json").write_text(
        '{"metrics": {"eval/analogy/accuracy": NaN, "val/loss": Infinity, "train/loss": "nan", "lr": 0.001},'
        ' "global_step": 4, "finished": true, "divergence": {"unigram_entropy": NaN}}'
    )
    read = TrainResult.read(tmp_path)
    assert math.isnan(read.metrics["eval/analogy/accuracy"]) and read.metrics["val/loss"] == math.inf
    assert math.isnan(read.metrics["train/loss"]) and read.metrics["lr"] == 0.001 and read.missing == ()
    assert result_metric(Run(tmp_path).result(), "val/loss") == math.inf
    metrics = json.loads('{"train/words_per_second": NaN, "train/seconds": 0.5}')
    assert (
        math.isnan(read_figure(metrics["train/words_per_second"]))
        and read_figure(metrics["train/seconds"]) == 0.5
    )
    assert read_figure(None) is None and read_figure(True) is None and read_figure("fast") is None
