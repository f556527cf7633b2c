"""The names of a run's files have one owner (gptlab.runs.layout), and the best checkpoint's loss is what the
run measured, whatever its file name's format says."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import pytest
from conftest import ROOT, TINY

from gptlab.errors import ConfigError
from gptlab.runs import Run, digests
from gptlab.runs.layout import (
    BEST_FILENAME,
    LAST_CHECKPOINT,
    best_scores_file,
    last_checkpoint,
    read_best_scores,
)

SRC = ROOT / "src" / "gptlab"
LAYOUT = SRC / "runs" / "layout.py"


def test_only_the_layout_spells_the_run_file_names():
    """A renamed file (last.ckpt, the best's pattern, the run's JSON files) is renamed in one module: every
    other module builds the path through gptlab.runs.layout."""
    names = [LAST_CHECKPOINT, "best-step", "best.json", '"result.json"', '"run.json"', '"run.lock"']
    spelled = {
        name: sorted(
            str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if p != LAYOUT and name in p.read_text()
        )
        for name in names
    }
    assert all(not where for where in spelled.values()), spelled
    assert BEST_FILENAME.startswith("best-") and all(name.strip('"') in LAYOUT.read_text() for name in names)


def logged_val_losses(run_dir: Path) -> dict[int, float]:
    """val/loss by step, as the CSV logger wrote it: an account of the losses independent of the checkpoints."""
    (metrics,) = run_dir.glob("csv/**/metrics.csv")
    with metrics.open() as f:
        return {int(row["step"]): float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")}


@pytest.fixture(scope="module")
def run_with_another_best_format(tmp_path_factory):
    """A tiny run that keeps its two best checkpoints (validations at steps 4 and 8) under a format whose
    only number after ``val`` is the step: ``best-val4.ckpt``, ``best-val8.ckpt``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gptlab.tasks.gpt import run

    root = tmp_path_factory.mktemp("best_format")
    run_dir = root / "run"
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                *TINY,
                "tokenizer=char",
                "logger=csv",
                "callbacks.model_checkpoint.filename='best-val{step}'",
                "callbacks.model_checkpoint.save_top_k=2",
                f"paths.root_dir={root}",
                f"paths.output_dir={run_dir}",
            ],
        )
    run(cfg)
    return run_dir


def test_a_changed_best_format_still_ranks_by_the_loss_the_run_measured(run_with_another_best_format):
    run_dir = run_with_another_best_format
    run = Run(run_dir)
    logged = logged_val_losses(run_dir)
    assert set(logged) >= {4, 8} and logged[4] != logged[8]
    by_loss = sorted((4, 8), key=lambda step: logged[step])
    # best first by the measured loss; a name's "val<digits>" (here the step) is not a loss
    assert [p.name for p in run.best_checkpoints()] == [f"best-val{step}.ckpt" for step in by_loss]
    for step in (4, 8):
        path = run.checkpoint_dir / f"best-val{step}.ckpt"
        assert run.best_score(path) == pytest.approx(logged[step], rel=1e-6)
        assert digests.check(path).verified  # each best keeps its digest
    assert run.checkpoint("best").name == f"best-val{by_loss[0]}.ckpt"
    recorded = read_best_scores(run.checkpoint_dir)
    assert recorded is not None and recorded.monitor == "val/loss" and recorded.mode == "min"
    # the best at the last step is the last checkpoint's second name: one file on disk, not two copies
    assert os.path.samefile(run.checkpoint_dir / "best-val8.ckpt", last_checkpoint(run_dir))


def test_a_run_without_best_json_ranks_by_the_score_in_each_checkpoint(
    run_with_another_best_format, tmp_path
):
    """A run written before best.json: each best's score comes from the checkpoint's own ModelCheckpoint
    state, still not from its name."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_with_another_best_format, copy)
    best_scores_file(Run(copy).checkpoint_dir).unlink()
    logged = logged_val_losses(copy)
    run = Run(copy)
    by_loss = sorted((4, 8), key=lambda step: logged[step])
    assert [p.name for p in run.best_checkpoints()] == [f"best-val{step}.ckpt" for step in by_loss]
    for step in (4, 8):
        assert run.best_score(run.checkpoint_dir / f"best-val{step}.ckpt") == pytest.approx(
            logged[step], rel=1e-6
        )


def test_a_best_format_without_the_prefix_is_refused_naming_the_value_and_the_fix(make_cfg):
    from gptlab.training.callbacks import instantiate_callbacks

    cfg = make_cfg(*TINY, "callbacks.model_checkpoint.filename='val{step}'")
    with pytest.raises(ConfigError) as refused:
        instantiate_callbacks(cfg.callbacks)
    message = str(refused.value)
    assert "callbacks.model_checkpoint.filename='val{step}' must start with 'best-'" in message
    assert re.search(r"or null for gptlab's default \('best-step", message)
