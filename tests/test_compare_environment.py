"""A comparison names the environment its runs differ in, not only their settings: three tiny real runs made
in this process, two (pos=learned, seeds 0 and 1) with torch.set_num_threads(1) and one (pos=rope) with 2
threads. Each records its environment in result.json and in its W&B run's config; the comparison, from the
run directories, from the W&B files and through the W&B API's shape, says which rows ran with which thread
count, and says nothing where the runs share one."""

from __future__ import annotations

import json
import logging
import shutil
import sys

import pytest
import torch
from conftest import TINY, load_script, strict_json

import gptlab
from gptlab.comparison.environment import ENVIRONMENT_HEADER
from gptlab.comparison.records import read_run_dir, record_from_api_run
from gptlab.comparison.report import compare, write_comparison
from gptlab.runs.layout import git_commit
from gptlab.tracking.wandb_runs import find_runs, read_run

SMALL = [*TINY, "tokenizer=char", "logger=[csv,wandb]", "trainer.max_steps=2", "trainer.val_check_interval=2"]
# name: (pos, seed, torch threads)
RUNS = {"learned0": ("learned", 0, 1), "learned1": ("learned", 1, 1), "rope0": ("rope", 0, 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("environment")
    threads = torch.get_num_threads()
    try:
        for name, (pos, seed, n) in RUNS.items():
            torch.set_num_threads(n)
            gptlab.train(
                [*SMALL, f"paths.root_dir={root}"], f"pos={pos}", f"seed={seed}", run_dir=root / "runs" / name
            )
    finally:
        torch.set_num_threads(threads)
    return root / "runs"


def row_of(result, pos: str) -> int:
    return [row.choice["pos"] for row in result.rows].index(pos) + 1


def test_a_run_records_its_environment_in_result_json_and_its_wandb_config(runs):
    for name, (_, _, n) in RUNS.items():
        result = strict_json(runs / name / "result.json")
        env = result["environment"]
        assert env["torch_threads"] == n
        assert env["precision"] == "32-true" and env["deterministic"] is False
        assert env["torch"] == torch.__version__ and env["gptlab"] == gptlab.__version__
        assert env["lightning"] and env["device"]
        assert env["commit"] == result["git_commit"] == git_commit()
        wandb_config = read_run(find_runs(runs / name)[0]).config
        assert wandb_config["environment"] == env


def test_rows_run_with_other_thread_counts_are_named_under_the_table(runs, tmp_path, capsys, caplog):
    result = compare(runs, tmp_path)
    learned, rope = row_of(result, "learned"), row_of(result, "rope")
    line = f"- torch threads: 1 in row {learned}, 2 in row {rope}"
    text = (tmp_path / "comparison.md").read_text()
    assert ENVIRONMENT_HEADER in text and line in text
    # only the thread count differs: no other field is named
    notes = [n for n in result.table_notes if n.startswith(ENVIRONMENT_HEADER)]
    assert len(notes) == 1 and notes[0].count("\n- ") == 1

    script = load_script("compare")
    capsys.readouterr()
    try:
        assert script.main([str(runs), "--out", str(tmp_path / "console")]) == 0
    finally:
        sys.modules.pop("compare", None)
    out = capsys.readouterr().out
    assert ENVIRONMENT_HEADER in out and line in out

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gptlab"):
        api = gptlab.compare(runs)
    assert any(line in note for note in api.notes) and line in caplog.text


def test_the_wandb_path_says_the_same(runs, tmp_path):
    # the W&B files alone (a run killed before result.json, read from its W&B run's config)
    copies = tmp_path / "runs"
    for name in RUNS:
        shutil.copytree(runs / name, copies / name)
        (copies / name / "result.json").unlink()
    records = [read_run_dir(copies / name, source="wandb") for name in RUNS]
    assert [r.environment["torch_threads"] for r in records] == [1, 1, 2]

    class ApiRun:  # the W&B API cannot be reached here: its run's config, history and summary, from the file
        def __init__(self, name: str) -> None:
            run = read_run(find_runs(runs / name)[0])
            self.config, self.summary, self.state = run.config, run.summary, "finished"
            self.path = ["me", "gptlab", name]
            self.config["sweep"] = {"overrides": [f"pos={RUNS[name][0]}", f"seed={RUNS[name][1]}"]}
            self.history = run.history

        def scan_history(self, keys):
            return [r for r in self.history if all(k in r for k in keys)]

    online = write_comparison([record_from_api_run(ApiRun(n)) for n in RUNS], tmp_path / "online", "group")
    learned, rope = row_of(online, "learned"), row_of(online, "rope")
    assert any(f"- torch threads: 1 in row {learned}, 2 in row {rope}" in n for n in online.table_notes)


def test_one_environment_gives_no_note_and_old_runs_are_said_not_recorded_once(runs, tmp_path):
    learned_only = tmp_path / "learned"
    for name in ("learned0", "learned1"):
        shutil.copytree(runs / name, learned_only / name)
    alike = compare(learned_only, tmp_path / "alike")
    assert not any(ENVIRONMENT_HEADER in n for n in alike.table_notes)
    assert ENVIRONMENT_HEADER not in (tmp_path / "alike" / "comparison.md").read_text()
    # the command that made them (a sweep's multirun.yaml) is said with the environment they share
    (learned_only / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [pos=learned, 'seed=0,1']\n")
    text = (compare(learned_only, tmp_path / "alike").markdown_path).read_text()
    (trained,) = [line for line in text.splitlines() if line.startswith("- Trained with")]
    assert "every run with torch threads 1, " in trained
    assert f"precision 32-true, deterministic algorithms off, torch {torch.__version__}," in trained

    # rope's run made before gptlab recorded its environment: neither its result nor its W&B config has one
    old = tmp_path / "old"
    for name in RUNS:
        shutil.copytree(runs / name, old / name)
    shutil.rmtree(old / "rope0" / "wandb")
    result_path = old / "rope0" / "result.json"
    result = json.loads(result_path.read_text())
    del result["environment"]
    result_path.write_text(json.dumps(result))
    mixed = compare(old, tmp_path / "mixed")
    rope = row_of(mixed, "rope")
    (note,) = [n for n in mixed.table_notes if n.startswith(ENVIRONMENT_HEADER)]
    assert note.endswith(
        f"- not recorded by 1 of the 3 runs (row {rope}: made before gptlab recorded the "
        "environment): they may differ in it too"
    )
    assert "torch threads" not in note  # the runs that recorded it share their thread count

    # no run recorded it: nothing said
    for name in ("learned0", "learned1"):
        shutil.rmtree(old / name / "wandb")
        path = old / name / "result.json"
        result = json.loads(path.read_text())
        del result["environment"]
        path.write_text(json.dumps(result))
    none = compare(old, tmp_path / "none")
    assert not any(ENVIRONMENT_HEADER in n for n in none.table_notes)


def test_a_run_resumed_with_another_thread_count_says_so(runs, tmp_path):
    run_dir = tmp_path / "runs" / "learned0"
    shutil.copytree(runs / "learned0", run_dir)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gptlab.train(
            [*SMALL, f"paths.root_dir={tmp_path}"],
            "pos=learned",
            "seed=0",
            "trainer.max_steps=4",
            "resume=auto",
            run_dir=run_dir,
        )
    finally:
        torch.set_num_threads(threads)
    result = strict_json(run_dir / "result.json")
    assert result["environment"]["torch_threads"] == 2
    assert [p.get("environment_changed") for p in result["parts"]] == [None, {"torch_threads": [1, 2]}]
    record = read_run_dir(run_dir)
    assert (
        "its part from step 2 ran in another environment than the part before it (torch threads 1 -> 2): its "
        "final figures are not those of one environment"
    ) in record.notes
