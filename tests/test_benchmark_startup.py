"""scripts/benchmark.py --startup: where `python train.py`'s time goes before its first step, from whole
processes with marks at gptlab's own functions."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT, load_script


@pytest.fixture(scope="module")
def profile():
    yield load_script("benchmark")
    del sys.modules["benchmark"]


def marks(**walls: float) -> dict[str, dict[str, float]]:
    return {label.replace("_", " "): {"wall": t, "cpu": t / 2} for label, t in walls.items()}


def test_each_phase_is_the_span_since_the_mark_reached_before_it(profile):
    order = ["Hydra starts", "task starts", "config parsed", "data ready", "exited"]
    # "config parsed" not reached (an older build): its span joins the next mark's
    spans = profile.startup_phases(
        marks(Hydra_starts=0.5, task_starts=1.25, data_ready=4.0, exited=9.0), order, "wall"
    )
    assert spans == {"Hydra starts": 0.5, "task starts": 0.75, "data ready": 2.75, "exited": 5.0}
    assert profile.startup_phases(marks(Hydra_starts=0.5, exited=9.0), order, "cpu") == {
        "Hydra starts": 0.25,
        "exited": 4.25,
    }


def test_the_table_has_each_builds_wall_and_cpu_medians_and_the_ratios_round_by_round(profile):
    order = ["task starts", "first step", "exited"]
    results = {
        "new": [
            marks(task_starts=1.0, first_step=4.0, exited=6.0),
            marks(task_starts=1.0, first_step=5.0, exited=8.0),
        ],
        "old": [
            marks(task_starts=2.0, first_step=8.0, exited=12.0),
            marks(task_starts=2.0, first_step=6.0, exited=10.0),
        ],
    }
    lines = profile.startup_report(["new", "old"], results, order).splitlines()
    assert lines[0] == "| phase (ends at) | new: wall s | CPU s | old: wall s | CPU s |"
    assert (
        lines[2]
        == "| Hydra composes the config | 1.00 (1.00-1.00) | 0.50 (0.50-0.50) | 2.00 (2.00-2.00) | 1.00 (1.00-1.00) |"
    )
    assert (
        lines[3]
        == "| first step | 3.50 (3.00-4.00) | 1.75 (1.50-2.00) | 5.00 (4.00-6.00) | 2.50 (2.00-3.00) |"
    )
    assert (
        lines[5]
        == "| **to the first step** | 4.50 (4.00-5.00) | 2.25 (2.00-2.50) | 7.00 (6.00-8.00) | 3.50 (3.00-4.00) |"
    )
    # the ratios are taken round by round: 4/8 and 5/6
    assert "new / old, to the first step, wall: 0.67 (0.50-0.83) over 2 rounds" in lines


def test_a_real_run_reaches_every_mark_in_order(profile, tmp_path):
    """word2vec's marks from a real `python train.py task=word2vec` process (no Lightning: seconds)."""
    overrides = ["task=word2vec", "trainer.max_steps=2", "word2vec.evaluate=false", "logger=none"]
    got = profile.StartupBuild("here", ROOT).run(overrides, tmp_path / "run")
    order = [label for label, *_ in profile.startup_marks(overrides)] + ["exited"]
    assert list(got) == order
    walls = [got[label]["wall"] for label in order]
    assert walls == sorted(walls) and walls[0] > 0
    assert 0 < got["exited"]["cpu"]
    assert not (tmp_path / "run").exists()  # each run's folder is removed
