"""The Python API (gptlab.compose, train, load_run, compare) against what `python train.py` and
`scripts/compare.py` do: the same config, the same refusals, a run directory like any other, the checkpoint's
model, the comparison's rows. Two tiny runs (a few steps, csv logger) are trained once for the module."""

from __future__ import annotations

import json
import logging
import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CONF, ROOT, TINY
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import gptlab
from gptlab.errors import ConfigError, DataError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.runs.checkpoints import load_checkpoint, model_config_dict, model_weights
from gptlab.runs.layout import last_checkpoint

SMALL = [*TINY, "tokenizer=char", "logger=csv", "trainer.max_steps=2", "trainer.val_check_interval=2"]


def cli(args: list[str], cwd: Path, monkeypatch, capfd) -> tuple[int, str, str]:
    """`python train.py <args>` run in this process (as the doc runner runs it): exit status, stdout, stderr."""
    GlobalHydra.instance().clear()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *args])
    capfd.readouterr()
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
    out, err = capfd.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    """Two tiny runs in one folder: rope, from compose()'s config changed in Python (trainer.max_steps 2 -> 3),
    and learned, from overrides."""
    root = tmp_path_factory.mktemp("api")
    common = [*SMALL, f"paths.root_dir={root}"]
    handlers = logging.getLogger().handlers[:]
    cfg = gptlab.compose(*common, "pos=rope")
    cfg.trainer.max_steps = 3
    rope = gptlab.train(cfg, run_dir=root / "runs" / "rope")
    learned = gptlab.train(common, "pos=learned", "trainer.max_steps=3", run_dir=root / "runs" / "learned")
    return {
        "root": root,
        "common": common,
        "rope": rope,
        "learned": learned,
        "handlers": (handlers, logging.getLogger().handlers[:]),
    }


# ---- compose -------------------------------------------------------------------------------------------


def test_compose_gives_the_config_train_py_runs(tmp_path, monkeypatch, capfd):
    overrides = [
        "model=small",
        "pos=rope",
        "activation=swiglu",
        "trainer.max_steps=20",
        "+trainer.max_time=null",
    ]
    status, out, err = cli([*overrides, "--cfg", "job"], tmp_path, monkeypatch, capfd)
    assert status == 0, err
    printed = yaml.safe_load(out)
    composed = gptlab.compose(overrides)  # a list, or strings
    assert OmegaConf.to_container(composed, resolve=False) == printed
    assert composed == gptlab.compose(*overrides)
    assert composed.pos.name == "rope" and composed.trainer.max_steps == 20


@pytest.mark.parametrize(
    "override",
    [
        "pos=rotary",  # a choice that does not exist (Hydra's refusal)
        "trainer.max_step=5",  # a key that does not exist (Hydra's refusal)
        "model.n_layer=abc",  # a value of the wrong type (gptlab's typed parse)
    ],
)
def test_a_bad_override_is_refused_with_the_message_train_py_prints(override, tmp_path, monkeypatch, capfd):
    with pytest.raises(ConfigError) as refused:
        gptlab.compose("tokenizer=char", override)
    status, _, err = cli(["tokenizer=char", "logger=csv", override], tmp_path, monkeypatch, capfd)
    assert status != 0
    message = str(refused.value)
    for line in message.splitlines():
        assert line.strip() in err, f"{line!r} is not in what train.py printed:\n{err}"
    assert override.split("=")[0].split(".")[-1] in message


def test_compose_leaves_the_callers_hydra_as_it_was():
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), job_name="mine", version_base="1.3"):
        gptlab.compose("pos=alibi")
        assert GlobalHydra.instance().is_initialized()
        assert compose("train", return_hydra_config=True).hydra.job.name == "mine"
    assert not GlobalHydra.instance().is_initialized()


def test_compose_with_the_joblib_launcher_gives_no_schema_warning_and_leaves_the_plugins_schema():
    """hydra/launcher=joblib: conf/hydra/launcher/joblib.yaml is composed without Hydra's warning that it was
    validated against the plugin's same-named schema, as train.py composes it; the schema is there again
    afterwards, for a Hydra app of the caller's own that composes the plugin's config."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf

    Plugins.instance()
    store = ConfigStore.instance()
    # registered as in a fresh process (train.py, run in this process by other tests, drops it for good)
    store.store(group="hydra/launcher", name="joblib", node=JobLibLauncherConf, provider="joblib_launcher")
    schema = store.repo["hydra"]["launcher"]["joblib.yaml"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = gptlab.compose("hydra/launcher=joblib", "tokenizer=char")
    assert cfg.tokenizer.name == "char"
    said = [str(w.message) for w in caught]
    assert not any("ConfigStore schema" in message for message in said), said
    assert store.repo["hydra"]["launcher"]["joblib.yaml"] is schema


# ---- train ---------------------------------------------------------------------------------------------


def test_train_returns_the_result_the_run_wrote(runs):
    result = runs["rope"]
    assert isinstance(result, gptlab.TrainResult)
    written = json.loads((result.run_dir / "result.json").read_text())
    assert result.metrics == written["metrics"] and result.metrics["val/loss"] == result.val_loss
    assert (result.step, result.finished, result.stopped, result.diverged) == (3, True, False, False)
    assert result.run_id == json.loads((result.run_dir / "run.json").read_text())["run_id"]


def test_a_trained_run_is_a_run_like_any_other(runs):
    """The files train.py writes; the overrides recorded where resume=auto and compare.py read them, with the
    change made to the config in Python in place of the override it replaced."""
    run_dir = runs["rope"].run_dir
    assert run_dir == runs["root"] / "runs" / "rope"
    for name in (
        "run.json",
        "result.json",
        "config_resolved.yaml",
        "csv/metrics.csv",
        "checkpoints/last.ckpt",
    ):
        assert (run_dir / name).is_file(), name
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    edited = ["trainer.max_steps=3" if o == "trainer.max_steps=2" else o for o in runs["common"]]
    assert overrides == [*edited, "pos=rope"]
    assert json.loads((run_dir / "run.json").read_text())["parts"][0]["overrides"] == overrides
    assert yaml.safe_load((run_dir / "config_resolved.yaml").read_text())["trainer"]["max_steps"] == 3
    assert (run_dir / "train.log").is_file()  # Hydra's job log, as for train.py


def test_train_leaves_the_callers_logging_as_it_was(runs):
    """Hydra logs a run to its train.log; once it ends, nothing more goes there (the next run's lines go to
    the next run's log), and the caller's handlers are back."""
    before, after = runs["handlers"]
    assert after == before
    rope_log = (runs["rope"].run_dir / "train.log").read_text()
    learned_log = (runs["learned"].run_dir / "train.log").read_text()
    assert str(runs["rope"].run_dir) in rope_log and str(runs["learned"].run_dir) not in rope_log
    assert str(runs["learned"].run_dir) in learned_log


def test_a_directory_holding_a_run_is_refused_and_the_run_kept(runs):
    run_dir = runs["rope"].run_dir
    before = (run_dir / "result.json").read_bytes()
    with pytest.raises(ConfigError, match="holds") as refused:
        gptlab.train(*SMALL, f"paths.root_dir={runs['root']}", run_dir=run_dir)
    assert str(run_dir) in str(refused.value) and "resume=auto" in str(refused.value)
    assert (run_dir / "result.json").read_bytes() == before


def test_a_config_not_made_by_compose_is_refused(make_cfg):
    with pytest.raises(ConfigError, match=r"not made by gptlab.compose\(\)"):
        gptlab.train(make_cfg("tokenizer=char"))


def test_several_devices_are_refused_before_any_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.devices=2: .*python train.py"):
        gptlab.train(
            "tokenizer=char", "trainer.accelerator=cpu", "trainer.devices=2", run_dir=tmp_path / "run"
        )
    assert not (tmp_path / "run").exists()


# ---- load_run ------------------------------------------------------------------------------------------


def test_load_run_gives_the_checkpoints_model(runs):
    run = gptlab.load_run(runs["rope"].run_dir)
    checkpoint = load_checkpoint(last_checkpoint(runs["rope"].run_dir))
    reference = GPT(GPTConfig.from_dict(model_config_dict(checkpoint)))
    reference.load_state_dict(model_weights(checkpoint))
    reference.eval()
    batch = torch.tensor([run.tokenizer.encode("The sky is blue and")] * 2)
    with torch.no_grad():
        assert torch.equal(run.model(batch)[0], reference(batch)[0])
    assert next(run.model.parameters()).device.type == "cpu" and not run.model.training
    assert run.config["pos"]["name"] == "rope" and run.metrics == runs["rope"].metrics
    text = run.generate("The", max_new_tokens=5)
    assert text.startswith("The") and text == run.generate("The", max_new_tokens=5)  # greedy


# ---- compare -------------------------------------------------------------------------------------------


def test_compare_gives_a_row_per_condition(runs, tmp_path):
    rows = gptlab.compare(runs["root"] / "runs")
    assert rows.keys == ["pos"] and len(rows) == 2
    by_pos = {row.choice["pos"]: row for row in rows}
    for pos in ("rope", "learned"):
        assert by_pos[pos].val_loss_mean == pytest.approx(runs[pos].metrics["val/loss"], rel=1e-6)
    frame = rows.to_frame()
    assert list(frame["pos"]) == [row.choice["pos"] for row in rows]
    assert list(frame["val_loss"]) == [row.val_loss_mean for row in rows]
    assert rows.report is None and not rows.unfinished and not rows.skipped
    written = gptlab.compare(runs["root"] / "runs", out_dir=tmp_path)
    assert written.report == tmp_path / "comparison.md" and (tmp_path / "val_loss.png").is_file()
    assert written.table in written.report.read_text()
    assert [r.choice for r in written] == [r.choice for r in rows]


def test_to_frame_without_pandas_says_how_to_install_it(runs, monkeypatch):
    rows = gptlab.compare(runs["root"] / "runs")
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install pandas"):
        rows.to_frame()
    assert rows.records()[0]["pos"] == rows[0].choice["pos"]


def test_a_run_refused_by_its_task_raises_and_leaves_no_folder(tmp_path, monkeypatch):
    """The corpus is read after Hydra made the run directory: the task's DataError is raised as it is, and the
    folder goes, as train.py removes it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.txt").touch()
    with pytest.raises(DataError, match="empty.txt' is empty"):
        gptlab.train("tokenizer=char", "logger=csv", "data.path=empty.txt", run_dir=tmp_path / "runs" / "bad")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(DataError, match="empty.txt' is empty"):  # in the default directory
        gptlab.train("tokenizer=char", "logger=csv", "data.path=empty.txt")
    assert not (tmp_path / "outputs" / "runs").exists()


def test_a_run_without_run_dir_is_where_train_py_puts_it_and_resume_auto_finds_it(tmp_path, monkeypatch):
    """No run_dir: outputs/runs/<date>/<time> of the working directory; the same overrides with resume=auto
    continue that run in its directory (finished: validated again, nothing trained), as from the command
    line."""
    monkeypatch.chdir(tmp_path)
    overrides = [*SMALL, f"paths.root_dir={tmp_path}"]
    first = gptlab.train(*overrides)
    assert first.run_dir.parent.parent == tmp_path / "outputs" / "runs" and first.finished
    again = gptlab.train(*overrides, "resume=auto")
    assert again.run_dir == first.run_dir and again.run_id == first.run_id and again.step == first.step
    parts = json.loads((first.run_dir / "run.json").read_text())["parts"]
    assert [p["resumed"] for p in parts] == [False, True]


def test_the_api_names_load_without_torch_lightning_or_hydra():
    """`import gptlab` and its API's names stay light: what a call needs is imported by the call."""
    code = (
        "import sys, gptlab; gptlab.compose, gptlab.train, gptlab.load_run, gptlab.compare, gptlab.TrainResult; "
        "print(sorted(m for m in ('torch', 'lightning', 'hydra', 'wandb') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
