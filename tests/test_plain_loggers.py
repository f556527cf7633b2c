"""Loggers without Lightning (gptlab.tracking.plain_loggers), for task=word2vec's plain loop: a whole
``python train.py task=word2vec`` with CSV, W&B and TensorBoard never imports Lightning, and its metrics land
where scripts/compare.py and the W&B reader read them; the CSV file is the one Lightning's CSVLogger writes;
a resumed run logs each step once and continues its W&B run, a W&B run the process had open gets none of its
records; W&B online without a key is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import ROOT, needs_gensim

from gptlab.comparison.records import read_metrics_csv
from gptlab.errors import ConfigError
from gptlab.tracking import plain_loggers, wandb_check
from gptlab.tracking.wandb_runs import find_runs, read_run

W2V = [
    "task=word2vec",
    "word2vec.dim=16",
    "word2vec.epochs=1",
    "word2vec.batch_size=512",
    "word2vec.threads=1",
]

# train.py run as `python train.py ...`; at exit (Hydra's main may end in sys.exit) the Lightning modules
# the process imported are printed on the last line.
PROBE = """
import atexit, json, runpy, sys
def report():
    names = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"))
    print("LIGHTNING_MODULES=" + json.dumps(names), flush=True)
atexit.register(report)
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@needs_gensim  # the run's evaluation too imports no Lightning
def test_word2vec_with_csv_wandb_and_tensorboard_imports_no_lightning(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            str(ROOT / "train.py"),
            *W2V,
            "trainer.max_steps=30",
            "trainer.log_every_n_steps=5",
            "logger=all",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Trained 30 steps" in proc.stdout
    probe = [line for line in proc.stdout.splitlines() if line.startswith("LIGHTNING_MODULES=")]
    assert probe and json.loads(probe[-1].partition("=")[2]) == []

    # CSV: where read_run_dir looks (csv/**/metrics.csv), read by the comparison's own checked reader
    (csv_file,) = run_dir.glob("csv/**/metrics.csv")
    notes: list[str] = []
    rows = read_metrics_csv(csv_file, notes)
    assert not notes
    train = [(step, values) for step, values in rows if "train/loss" in values]
    assert [step for step, _ in train] == [1, 6, 11, 16, 21, 26]  # the steps done when logged
    assert all({"train/lr", "train/words_per_second", "train/progress"} <= set(v) for _, v in train)
    assert any("eval/wordsim353/coverage" in values for _, values in rows)  # the scores, at the last step
    assert csv_file.read_bytes().count(b"\r\n") == len(rows) + 1  # csv's line ends, as Lightning writes

    # W&B: the offline run file, its id in the checkpoint (a resume continues it) and in result.json
    (wandb_file,) = find_runs(run_dir)
    logged = read_run(wandb_file)
    assert [s for s, _ in logged.metric("train/loss")] == [1, 6, 11, 16, 21, 26]
    assert "eval/wordsim353/coverage" in logged.summary
    assert logged.config["word2vec"]["dim"] == 16 and logged.job_type == "train"
    assert "task=word2vec" in logged.tags
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    result = json.loads((run_dir / "result.json").read_text())
    assert ckpt["wandb_run_id"] == result["wandb_run_id"] == logged.run_id
    assert logged.exit_code == 0

    # TensorBoard: its event file
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_the_csv_file_is_the_one_lightnings_csv_logger_writes(tmp_path):
    """The same metrics through Lightning's CSVLogger and through the plain one give the same bytes, a new
    column (which rewrites the header) included."""
    from gptlab.tracking.loggers import csv_logger as lightning_csv_logger

    calls: list[tuple[dict[str, float], int]] = [
        ({"train/loss": 4.25, "train/lr": 0.025}, 0),
        ({"train/loss": 3.5, "train/lr": 0.0125}, 1),
        ({"eval/score": 0.1, "train/loss": float("inf")}, 2),
        ({"train/loss": torch.tensor(1 / 3), "train/steps": 4}, 3),
    ]
    files = []
    for name, factory in (("lightning", lightning_csv_logger), ("plain", plain_loggers.csv_logger)):
        logger = factory(str(tmp_path / name))
        for i, (metrics, step) in enumerate(calls):
            logger.log_metrics(metrics, step=step)
            if i in (1, 2):  # saved between calls, as at a checkpoint: the header grows on the second save
                logger.save()
        logger.finalize("success")
        files.append((tmp_path / name / "csv" / "metrics.csv").read_bytes())
    assert files[0] == files[1]
    assert files[1].startswith(b"eval/score,step,train/loss,train/lr,train/steps\r\n")


def test_a_resumed_plain_csv_drops_the_rows_after_the_checkpoint_and_keeps_the_earlier_ones(tmp_path):
    first = plain_loggers.csv_logger(str(tmp_path))
    for step in (1, 11, 21, 31):
        first.log_metrics({"train/loss": 1.0 / step}, step=step)
    first.save()  # killed after step 31's row was written, from the checkpoint of step 20
    resumed = plain_loggers.csv_logger(str(tmp_path), resumed_at=20)
    for step in (21, 31):
        resumed.log_metrics({"train/loss": 2.0 / step}, step=step)
    resumed.finalize("success")
    rows = read_metrics_csv(tmp_path / "csv" / "metrics.csv", [])
    assert rows == [
        (1, {"train/loss": 1.0}),
        (11, {"train/loss": 1 / 11}),
        (21, {"train/loss": 2 / 21}),
        (31, {"train/loss": 2 / 31}),
    ]


def test_a_stopped_word2vec_run_resumes_its_csv_rows_once_and_its_wandb_run(tmp_path, make_cfg):
    """SIGTERM stops training with a checkpoint; the resumed run's metrics.csv holds every logged step once
    and its W&B run is the one the checkpoint names. A W&B run the process already had open (a notebook's)
    gets none of either part's records."""
    import wandb

    from gptlab.tasks.word2vec import run

    base = [
        *W2V,
        "word2vec.epochs=2",
        "word2vec.checkpoint_every=5",
        "word2vec.evaluate=false",
        "trainer.log_every_n_steps=1",
        "logger=[csv,wandb]",
    ]
    out = tmp_path / "stopped"
    ckpt = out / "checkpoints" / "last.ckpt"
    (tmp_path / "other").mkdir()
    other = wandb.init(project="other", dir=str(tmp_path / "other"), mode="offline", reinit="create_new")
    other.log({"other/metric": 1.0})

    def send_sigterm() -> None:
        # as long as a loaded machine needs to get there; never a signal before the checkpoint: the
        # test's assertions then say the run was not stopped
        deadline = time.monotonic() + 600
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if ckpt.exists():
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        threading.Thread(target=send_sigterm, daemon=True).start()
        run(make_cfg(*base, f"paths.output_dir={out}"))
        saved = torch.load(ckpt, weights_only=True)
        stopped = saved["global_step"]
        resumed = run(make_cfg(*base, f"paths.output_dir={out}", f"resume={out}"))
    finally:
        other.finish()
    assert 5 <= stopped < resumed["train/steps"]
    rows = read_metrics_csv(out / "csv" / "metrics.csv", [])
    assert [step for step, _ in rows] == list(range(1, int(resumed["train/steps"]) + 1))  # each step once
    first, second = (read_run(p) for p in find_runs(out / "wandb"))
    assert first.run_id == second.run_id == saved["wandb_run_id"]
    assert min(s for s, _ in second.metric("train/loss")) > stopped
    (other_file,) = find_runs(tmp_path / "other" / "wandb")
    assert {k for k in read_run(other_file).summary if not k.startswith("_")} == {"other/metric"}


def test_wandb_online_without_a_key_is_refused_for_word2vec_too(tmp_path, make_cfg, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setattr(wandb_check, "_working", set())
    from gptlab.tasks.word2vec import run

    with pytest.raises(ConfigError, match="no W&B API key is set") as refused:
        run(
            make_cfg(
                *W2V,
                "word2vec.evaluate=false",  # the refusal named is W&B's, with or without gensim installed
                "logger=wandb",
                "logger.wandb.mode=online",
                f"paths.output_dir={tmp_path / 'run'}",
            )
        )
    assert "logger=csv" in str(refused.value)
    assert not list((tmp_path / "run").glob("checkpoints/*"))  # refused before training


def test_a_wandb_run_opened_in_the_background_gets_every_record_in_order(tmp_path):
    """open_in_background: the run id is known at once, the config and metrics logged while W&B starts are
    all in the run, in order, once it is finished; an error of wandb.init is raised where the run is next
    needed, not lost in the thread."""
    lg = plain_loggers.wandb_logger(str(tmp_path), project="bg", mode="offline")
    lg.open_in_background()
    run_id = lg.version
    assert run_id and len(run_id) == 8
    lg.log_hyperparams({"word2vec": {"dim": 16}})
    for step in range(1, 6):
        lg.log_metrics({"train/loss": 1.0 / step}, step=step)
    lg.finalize("success")
    plain_loggers.finish_loggers([lg], failed=False)
    import wandb

    wandb.teardown()  # the service process writes the run's file after finish() returns: wait for it
    (path,) = find_runs(tmp_path / "wandb")
    run = read_run(path)
    assert run.run_id == run_id and run.exit_code == 0
    assert run.metric("train/loss") == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert run.config["word2vec"] in ({"dim": 16}, {"value": {"dim": 16}})

    broken = plain_loggers.WandbRunLogger({"dir": str(tmp_path / "broken"), "mode": "offline", "no_such": 1})
    broken.open_in_background()
    with pytest.raises(TypeError, match="no_such"):  # at the first call after the thread ended
        broken.log_metrics({"train/loss": 1.0}, step=1)
        broken.finalize("success")
