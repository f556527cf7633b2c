"""A run directory holds one run, and every reader says which run it read and whether it finished: the three
ways the comparison could print a wrong number, each through `python train.py` as a user runs it."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
from types import SimpleNamespace

import pytest
from conftest import ROOT, TINY, run_train

from gptlab.comparison.records import read_run_dir
from gptlab.comparison.report import compare
from gptlab.runs import Run, find_run_dirs
from gptlab.runs.layout import REPLACED_DIR, last_checkpoint
from gptlab.tracking.wandb_runs import find_runs, read_run

FAST = [*TINY, "tokenizer=char", "trainer.val_check_interval=1", "logger=[csv,wandb]"]


def final_line(output: str) -> float:
    return float(re.search(r"Final validation loss (\d+\.\d+)", output).group(1))


def train(tmp_path, *args: str, check: bool = True):
    flags = [a for a in args if a.startswith("-")]  # -m goes before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    return run_train([*flags, *FAST, f"paths.root_dir={tmp_path}", *overrides], cwd=tmp_path, check=check)


@pytest.fixture(scope="module")
def overwritten(tmp_path_factory) -> SimpleNamespace:
    """Four commands into one hydra.run.dir D: one refused at config time (a typo), a 2-step run, a fresh
    1-step run (refused: D holds a run), the same with overwrite=true. What a test must see between two
    commands is recorded as it happens. D and the first run set aside in it are shared: copy before changing."""
    root = tmp_path_factory.mktemp("overwrite")
    run_dir = root / "D"
    seen = SimpleNamespace(root=root, run_dir=run_dir)
    # a command refused at config time removes the folder it made for its run: the next one starts there
    seen.typo = train(root, "model.n_head=3", f"hydra.run.dir={run_dir}", check=False)
    seen.left_after_typo = run_dir.exists()
    seen.first = train(root, "trainer.max_steps=2", f"hydra.run.dir={run_dir}")
    paths = (run_dir / "result.json", run_dir / ".hydra" / "overrides.yaml")
    seen.before = {p: p.read_bytes() for p in paths}
    seen.refused = train(root, "trainer.max_steps=1", f"hydra.run.dir={run_dir}", check=False)
    seen.after_refusal = {p: p.read_bytes() for p in paths}
    seen.wandb_runs_after_refusal = len(find_runs(run_dir))
    seen.second = train(root, "trainer.max_steps=1", f"hydra.run.dir={run_dir}", "overwrite=true")
    (seen.aside,) = (run_dir / REPLACED_DIR).iterdir()
    return seen


def copy_run(run_dir, to):
    """A copy of a run directory (times kept), without the runs an overwrite set aside in it."""
    return shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns(REPLACED_DIR))


def test_a_fresh_run_into_a_run_directory_is_refused_and_overwrite_moves_the_old_run_aside(overwritten):
    run_dir = overwritten.run_dir
    assert overwritten.typo.returncode == 2 and not overwritten.left_after_typo
    refused = overwritten.refused
    assert refused.returncode == 2
    message = refused.stderr
    assert f"{run_dir} already holds a run" in message and "Traceback" not in message
    assert (
        "resume=auto" in message and "hydra.run.dir=<another dir>" in message and "overwrite=true" in message
    )
    # nothing of the first run was touched: not its overrides (Hydra had not written yet), not its result
    assert overwritten.after_refusal == overwritten.before and overwritten.wandb_runs_after_refusal == 1

    loss = final_line(overwritten.second.stdout)
    assert loss != pytest.approx(final_line(overwritten.first.stdout), abs=1e-4)
    # the readers read the second run only, from its metrics file and from its W&B file
    for source in ("csv", "wandb"):
        record = read_run_dir(run_dir, source)
        assert record.final_val_loss == pytest.approx(loss, abs=5e-5) and record.notes == []
        assert record.finished and record.step == 1 and record.run_id == Run(run_dir).info().run_id
    assert Run(run_dir).result()["metrics"]["val/loss"] == pytest.approx(loss, abs=5e-5)
    assert "step000001" in Run(run_dir).checkpoint("best").name
    assert len(find_runs(run_dir)) == 1
    # the first run is whole, set aside: its result, its checkpoints, its overrides
    aside = overwritten.aside
    assert Run(aside).result()["global_step"] == 2 and (last_checkpoint(aside)).is_file()
    assert "trainer.max_steps=2" in (aside / ".hydra" / "overrides.yaml").read_text()
    assert Run(aside).info().run_id != Run(run_dir).info().run_id


def test_a_sweep_into_a_used_sweep_directory_is_refused(tiny_sweep, tmp_path):
    sweep_dir = tmp_path / "sweep"
    # the session's real sweep, copied: its jobs are moved aside here
    shutil.copytree(tiny_sweep[1], sweep_dir)
    jobs = len(find_run_dirs(sweep_dir))
    refused = train(
        tmp_path, "-m", "trainer.max_steps=1", "seed=2", f"hydra.sweep.dir={sweep_dir}", check=False
    )
    assert refused.returncode == 2 and f"{sweep_dir} already holds {jobs} run(s)" in refused.stderr
    assert "hydra.sweep.dir=<another dir>" in refused.stderr
    train(tmp_path, "-m", "trainer.max_steps=1", "seed=2", f"hydra.sweep.dir={sweep_dir}", "overwrite=true")
    result = compare(sweep_dir)
    assert [len(r.runs) for r in result.rows] == [1] and result.rows[0].runs[0].overrides["seed"] == "2"


def test_a_directory_with_traces_of_two_runs_is_read_as_one_and_says_so(overwritten, tmp_path, caplog):
    """What an older gptlab left when a second run was started into a run directory: the second run's CSV
    rows after the first's, and both runs' W&B files. The readers take the run that wrote result.json.
    The two runs: copies of the 2-step run and of the 1-step run started after it."""
    first = copy_run(overwritten.aside, tmp_path / "A")
    second = copy_run(overwritten.run_dir, tmp_path / "B")
    loss = final_line(overwritten.second.stdout)
    rows = []
    for run_dir in (first, second):
        with (run_dir / "csv" / "metrics.csv").open() as f:
            rows += list(csv.DictReader(f))
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with (second / "csv" / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    (folder,) = [p.parent for p in find_runs(first)]
    (best,) = first.glob("checkpoints/best-*.ckpt")
    shutil.copy2(best, second / "checkpoints")  # keeps its time: written before the second run started
    copied = shutil.copytree(folder, second / "wandb" / folder.name)
    for file in copied.glob("*.wandb"):
        os.utime(file)  # the newest W&B file is the other run's: the reader must not take the newest

    from_csv = read_run_dir(second, "csv")
    assert from_csv.final_val_loss == pytest.approx(loss, abs=5e-5)
    assert any("holds 2 runs" in note for note in from_csv.notes)
    from_wandb = read_run_dir(second, "wandb")
    wanted = Run(second).result()["wandb_run_id"]
    assert from_wandb.final_val_loss == pytest.approx(loss, abs=5e-5)
    other = read_run(find_runs(first)[0]).run_id
    assert from_wandb.notes == [f"2 W&B runs ({wanted}, {other}) in one run directory; read {wanted}"]
    # the best checkpoint is the second run's, whichever name sorts first; the other run's is named
    with caplog.at_level("WARNING"):
        assert "step000001" in Run(second).checkpoint("best").name
    assert f"{best.name} predate(s) this run" in caplog.text


def test_a_sweep_with_a_killed_run_shows_it_unfinished_at_its_step_and_unranked(tmp_path):
    sweep_dir = tmp_path / "sweep"
    killed = run_train(
        [
            "-m",
            *FAST,
            "trainer.max_steps=8",
            "trainer.val_check_interval=4",
            "trainer.log_every_n_steps=1",
            "pos=learned,nope",
            "seed=0,1",
            f"paths.root_dir={tmp_path}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        check=False,
        script=ROOT / "tests" / "faults.py",
        env={"GPTLAB_TEST_FAULT": "kill_at_step:6:pos=nope&seed=1"},
    )
    # the last job (pos=nope seed=1) is SIGKILLed after its 6th step: the sweep dies with it
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    dead = sweep_dir / "3"
    assert Run(dead).result() is None and Run(sweep_dir / "0").result()["finished"]
    record = read_run_dir(dead)
    assert not record.finished and record.status == "killed" and record.step == 6 and record.max_steps == 8
    assert record.describe_status() == "killed at step 6 of 8 (no result.json)"

    result = compare(sweep_dir)
    runs = {row.choice["pos"]: [r.path.name for r in row.runs] for row in result.rows}
    assert runs == {"learned": ["0", "1"], "nope": ["2"]}  # the killed run is in no row, and no reference
    assert [r.path for r in result.unfinished] == [dead]
    text = result.markdown_path.read_text()
    assert "3 runs ranked (1 unfinished, listed below)" in text
    assert f"| 3 | nope | 1 | killed at step 6 of 8 (no result.json) | {record.final_val_loss:.4f} |" in text

    ranked = compare(sweep_dir, tmp_path / "all", include_unfinished=True)
    assert {row.choice["pos"]: len(row.runs) for row in ranked.rows} == {"learned": 2, "nope": 2}
    assert "| 2 (1 unfinished) |" in ranked.table


def test_run_json_names_the_run_and_each_part(overwritten, tmp_path):
    run_dir = copy_run(overwritten.run_dir, tmp_path / "R")  # a 1-step run, continued here
    started = json.loads((run_dir / "run.json").read_text())
    train(tmp_path, "trainer.max_steps=3", f"hydra.run.dir={run_dir}", "resume=auto")
    resumed = json.loads((run_dir / "run.json").read_text())
    assert resumed["run_id"] == started["run_id"] and [p["resumed"] for p in resumed["parts"]] == [
        False,
        True,
    ]
    assert Run(run_dir).result()["run_id"] == started["run_id"] and Run(run_dir).result()["global_step"] == 3


def test_a_refused_resume_leaves_the_runs_first_command_in_place(tmp_path):
    # resume=<run> with another model is refused; what it typed goes to .hydra/parts/, and the first command
    # still finds the run: resume=auto with it continues (here: the run is finished, nothing to do)
    train(tmp_path, "trainer.max_steps=2")
    (run_dir,) = [p for p in find_run_dirs(tmp_path / "outputs") if Run(p).result()]
    first = (run_dir / ".hydra" / "overrides.yaml").read_bytes()
    refused = train(tmp_path, "trainer.max_steps=2", "model.n_embd=64", f"resume={run_dir}", check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert (run_dir / ".hydra" / "overrides.yaml").read_bytes() == first
    (part,) = (run_dir / ".hydra" / "parts").glob("*/overrides.yaml")
    assert "model.n_embd=64" in part.read_text()
    again = train(tmp_path, "trainer.max_steps=2", "resume=auto")
    assert "nothing to do" in again.stdout + again.stderr
    assert str(run_dir) in again.stdout + again.stderr
    assert [p for p in find_run_dirs(tmp_path / "outputs") if Run(p).result()] == [run_dir]
