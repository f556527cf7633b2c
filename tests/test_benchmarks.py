"""scripts/benchmark.py --per-step (and scripts/nanogpt_side_by_side.py, which times through it): seconds per
step from whole processes at two step counts, interleaved in rotating order, with the figures a user pastes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, load_script


@pytest.fixture(scope="module")
def benchmark():
    yield load_script("benchmark")
    del sys.modules["benchmark"]


def recording_program(benchmark, name: str, log: Path, fail_at: int | None = None):
    """A real process per run that appends ``name steps`` to ``log`` and writes a file into its run folder
    (exit status 3 at ``fail_at`` steps, with a message)."""
    code = (
        "import sys, pathlib; name, steps, out, log = sys.argv[1:]; "
        "pathlib.Path(out).mkdir(parents=True); (pathlib.Path(out) / 'ckpt').write_text('x'); "
        "open(log, 'a').write(f'{name} {steps}\\n'); "
        f"sys.exit(print('out of memory at step', steps) or 3) if int(steps) == {fail_at} else None"
    )
    return benchmark.Program(
        name,
        lambda steps, out: [sys.executable, "-c", code, name, str(steps), str(out), str(log)],
        cwd=ROOT,
        tokens_per_step=1024,
    )


def test_runs_alternate_short_then_long_in_an_order_that_rotates_each_round(benchmark, tmp_path):
    log = tmp_path / "log"
    programs = [recording_program(benchmark, name, log) for name in ("A", "B")]
    timing = benchmark.PerStepTiming(programs, short=3, long=7, rounds=2, out=tmp_path / "runs")
    result = timing.run()
    assert log.read_text().split("\n")[:-1] == [
        *("A 3", "B 3"),  # the untimed warm-up
        *("A 3", "B 3", "A 7", "B 7"),
        *("B 3", "A 3", "B 7", "A 7"),
    ]
    assert not any((tmp_path / "runs").iterdir())  # each run's folder (checkpoints) is removed after it
    for name in ("A", "B"):
        figures = result["programs"][name]
        assert len(figures["wall_seconds_short"]) == len(figures["wall_seconds_long"]) == 2


def test_a_failed_run_stops_the_measure_with_its_command_and_output(benchmark, tmp_path):
    programs = [recording_program(benchmark, "A", tmp_path / "log", fail_at=7)]
    timing = benchmark.PerStepTiming(programs, short=3, long=7, rounds=1, out=tmp_path / "runs", warmup=False)
    with pytest.raises(SystemExit) as e:
        timing.run()
    assert "A: `" in str(e.value) and "exited with 3" in str(e.value)
    assert "out of memory at step 7" in str(e.value)


def test_seconds_per_step_are_the_difference_of_the_two_lengths_and_the_ratio_is_per_round(benchmark):
    programs = [
        benchmark.Program("gptlab", lambda s, o: [], ROOT, tokens_per_step=1024),
        benchmark.Program("nanoGPT", lambda s, o: [], ROOT, tokens_per_step=1024),
    ]
    walls = {  # 100 steps between the lengths
        "gptlab": {30: [10.0, 11.0, 10.0], 130: [30.0, 36.0, 30.0]},  # 0.20, 0.25, 0.20 s a step
        "nanoGPT": {30: [12.0, 12.0, 13.0], 130: [52.0, 62.0, 63.0]},  # 0.40, 0.50, 0.50
    }
    result = benchmark.per_step_summary(programs, walls, short=30, long=130)
    g, n = result["programs"]["gptlab"], result["programs"]["nanoGPT"]
    assert g["seconds_per_step"] == pytest.approx([0.20, 0.25, 0.20])
    assert g["tokens_per_second_median"] == pytest.approx(1024 / 0.20)
    assert n["tokens_per_second"] == pytest.approx([1024 / 0.40, 1024 / 0.50, 1024 / 0.50])
    # the ratio of each round's pair, not the ratio of the medians (2.5 here)
    assert n["first_over_this"] == pytest.approx([2.0, 2.0, 2.5])
    assert n["first_over_this_median"] == pytest.approx(2.0)
    result["machine"] = "a CPU, 2 cores"
    table = benchmark.per_step_report(result, "python scripts/benchmark.py --per-step").splitlines()
    assert "| gptlab | 5,120 (4,096-5,120) | 0.200 | - |" in table
    assert "| nanoGPT | 2,048 (2,048-2,560) | 0.500 | 2.00x (2.00-2.50) |" in table
    assert table[-1].startswith(
        "Wall time per step of whole processes, (130 - 30 steps), 3 interleaved rounds"
    )
    assert table[-1].endswith("a CPU, 2 cores. Command: `python scripts/benchmark.py --per-step`")


def test_a_round_whose_long_run_was_not_longer_says_it_has_no_rate(benchmark):
    programs = [benchmark.Program("gptlab", lambda s, o: [], ROOT, tokens_per_step=1024)]
    walls = {"gptlab": {30: [10.0, 20.0], 130: [30.0, 19.0]}}
    result = benchmark.per_step_summary(programs, walls, short=30, long=130)
    # the disturbed round is left out of the medians, not counted as a rate
    assert result["programs"]["gptlab"]["tokens_per_second_median"] == pytest.approx(1024 / 0.2)
    result["machine"] = "a CPU"
    report = benchmark.per_step_report(result, "cmd")
    assert "Round 2: gptlab's long run took no longer than its short run" in report
    assert "| gptlab | 5,120 (5,120) | 0.200 | - |" in report


def test_tokens_per_step_come_from_the_composed_config(benchmark):
    program = benchmark.gptlab_program(
        "gptlab", ROOT, ["data.batch_size=4", "model.block_size=32", "trainer.accumulate_grad_batches=2"]
    )
    assert program.tokens_per_step == 4 * 32 * 2
    argv = program.argv(30, Path("/tmp/run"))
    # one validation, at the run's last step, so that it cancels between the two lengths
    assert argv[-3:] == ["trainer.max_steps=30", "trainer.val_check_interval=30", "hydra.run.dir=/tmp/run"]
    assert program.env["PYTHONPATH"].split(":")[0] == str(ROOT / "src")  # the checkout's own code


def test_per_step_refuses_the_keys_it_sets_itself(benchmark):
    with pytest.raises(SystemExit, match=r"leave out \['trainer.max_steps=5'\]"):
        benchmark.main(["--per-step", "trainer.max_steps=5"])


@pytest.mark.slow
def test_per_step_times_train_py_and_ends_with_the_table(tmp_path):
    overrides = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check_interval"))]
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/benchmark.py",
            "--per-step",
            "--short",
            "1",
            "--long",
            "3",
            "--rounds",
            "1",
            "--no-warmup",
            *overrides,
            "tokenizer=char",
            "logger=csv",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("{")))
    (figures,) = result["programs"].values()
    assert figures["tokens_per_step"] == 4 * 32
    assert len(figures["wall_seconds_short"]) == len(figures["wall_seconds_long"]) == 1
    # the table (at this size the two lengths may take the same time: its rate may be "none")
    header = next(
        i for i, line in enumerate(lines) if line.startswith("| program | tokens/s, median (range) |")
    )
    assert lines[header + 2].startswith(f"| {next(iter(result['programs']))} | ")
    assert lines[-1].startswith("Wall time per step of whole processes, (3 - 1 steps), 1 interleaved rounds")
