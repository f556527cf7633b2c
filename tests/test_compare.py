"""The comparison of a sweep, on a small real sweep: `python train.py -m pos=learned,rope
activation=gelu,swiglu seed=0,1` with the length study on, then `scripts/compare.py` over its directory. A
condition is a (pos, activation) pair, with two seeds each. Every figure of the table is checked against
what the runs themselves wrote (their W&B files and eval_length/length.json)."""

import csv
import io
import json
import math
import re
import runpy
import shutil
import statistics
import subprocess
import sys

import pytest
from conftest import ROOT
from scipy import stats

from gptlab.comparison.records import RunRecord, read_run_dir
from gptlab.comparison.report import compare, write_comparison
from gptlab.comparison.stats import contrasts, difference_interval, holm, verdict, welch
from gptlab.comparison.table import summarize
from gptlab.errors import DataError
from gptlab.evaluation.long_context import format_perplexity
from gptlab.runs import Run, find_run_dirs
from gptlab.runs.naming import identity, is_sweep_value, swept_keys_of
from gptlab.tracking.wandb_runs import find_runs, read_run


@pytest.fixture(scope="module")
def sweep(tiny_sweep):
    """The session's real sweep (tests/conftest.py: SWEEP), shared with test_sweeps and test_run_identity."""
    root, sweep_dir, _ = tiny_sweep
    return root, sweep_dir


def final_losses(sweep_dir) -> dict[tuple[str, str], list[float]]:
    """(pos, activation) -> the final val/loss of each of its runs, from the runs' W&B files."""
    out: dict[tuple[str, str], list[float]] = {}
    for run_dir in find_run_dirs(sweep_dir):
        run = read_run(find_runs(run_dir)[0])
        condition = (run.config["pos"]["name"], run.config["activation"]["name"])
        out.setdefault(condition, []).append(run.metric("val/loss")[-1][1])
    return out


def table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


def p_cell(p: float) -> str:
    return "p<0.001" if p < 0.001 else f"p={p:.2g}" if p < 0.1 else f"p={p:.2f}"


def test_every_run_ends_with_a_validation_at_its_last_step(sweep):
    _, sweep_dir = sweep
    for run_dir in find_run_dirs(sweep_dir):
        wandb_run = read_run(find_runs(run_dir)[0])
        # validations after steps 4 and 7
        assert [s for s, _ in wandb_run.metric("val/loss")] == [4, 7]
        result = Run(run_dir).result()
        assert result["global_step"] == 7 and result["finished"] and result["diverged"] is False
        assert result["metrics"]["val/loss"] == pytest.approx(wandb_run.metric("val/loss")[-1][1], rel=1e-6)
        assert wandb_run.summary["val/loss"] == pytest.approx(result["metrics"]["val/loss"], rel=1e-6)
        # which run it is: run.json's id, in result.json with the W&B run's
        assert result["run_id"] == Run(run_dir).info().run_id and result["wandb_run_id"] == wandb_run.run_id


def test_a_row_per_condition_with_intervals_and_holm_adjusted_tests(sweep, capsys):
    root, sweep_dir = sweep
    script = runpy.run_path(str(ROOT / "scripts" / "compare.py"))
    assert script["main"]([str(sweep_dir), "--source", "wandb"]) == 0
    printed = capsys.readouterr().out
    header, *rows = table_rows(printed.split("\n\n")[0])
    assert header[:7] == [
        "#",
        "pos",
        "activation",
        "seeds",
        "val/loss",
        "Δ vs best (95% CI)",
        "vs best (Holm)",
    ]
    assert header[11:13] == ["ppl@1x", "ppl@2x"]  # then the passkey study's columns, which it also ran

    finals = final_losses(sweep_dir)
    by_mean = sorted(finals, key=lambda c: statistics.fmean(finals[c]))
    assert [tuple(r[1:3]) for r in rows] == by_mean and [r[3] for r in rows] == ["2"] * 4
    for row in rows:
        mean, std = (float(x) for x in row[4].split(" ± "))
        assert mean == pytest.approx(statistics.fmean(finals[tuple(row[1:3])]), abs=1e-4)
        assert std == pytest.approx(statistics.stdev(finals[tuple(row[1:3])]), abs=1e-4)
    assert rows[0][5] == "-" and rows[0][6] == "reference"
    # each other row: Welch's test against the best, p-values Holm-adjusted over the three tests, and the
    # difference of means with scipy's 95% Welch interval
    best = finals[by_mean[0]]
    tests = [stats.ttest_ind(finals[c], best, equal_var=False) for c in by_mean[1:]]
    raw = [t.pvalue for t in tests]
    order = sorted(range(3), key=lambda i: raw[i])
    adjusted, running = [0.0] * 3, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * raw[i]))
        adjusted[i] = running
    for row, test, p in zip(rows[1:], tests, adjusted):
        assert row[6] == f"{'worse' if p < 0.05 else 'within noise'}, {p_cell(p)}"
        low, high = test.confidence_interval(0.95)
        difference = statistics.fmean(finals[tuple(row[1:3])]) - statistics.fmean(best)
        assert row[5] == f"{difference:+.4f} [{low:+.4f}, {high:+.4f}]"
    text = (sweep_dir / "comparison.md").read_text()
    assert "A condition is what a run set for `pos`, `activation`" in text and "Holm's method" in text


def test_length_table_has_a_row_per_condition(sweep):
    _, sweep_dir = sweep
    result = compare(sweep_dir, sweep_dir / "report")
    for row in result.rows:
        pos = row.choice["pos"]
        studies = [Run(r.path).length_result() for r in row.runs]
        assert all(s is not None and s["pos"] == pos for s in studies) and len(studies) == 2
        # the perplexity of the seeds' mean loss: their perplexities' geometric mean
        ppl1 = statistics.geometric_mean(s["variants"][pos]["1"]["ppl"] for s in studies)
        assert row.outputs["length"]["ppl@1x"] == pytest.approx(ppl1)
        if pos == "learned":  # a 32-position table cannot run at 64 tokens
            assert row.outputs["length"]["ppl@2x"] is None
            assert "error" in studies[0]["variants"]["learned"]["2"]
        else:
            ppl2 = statistics.geometric_mean(s["variants"][pos]["2"]["ppl"] for s in studies)
            assert row.outputs["length"]["ppl@2x"] == pytest.approx(ppl2)
    header, *rows = table_rows(result.table)
    cells = {(r[1], r[2]): dict(zip(header, r)) for r in rows}
    assert cells[("learned", "gelu")]["ppl@2x"] == "n/a" and float(cells[("rope", "swiglu")]["ppl@2x"]) > 1
    # the length study's own table: one row per condition (not one per scheme), each with its two seeds,
    # then RoPE's context scalings per condition
    as_trained, scalings = result.length_table.split("\n\n")
    length_rows = {r[0]: r for r in table_rows(as_trained)[1:]}
    assert sorted(length_rows) == sorted(f"pos={p} activation={a}" for p, a in final_losses(sweep_dir))
    for name, row in length_rows.items():
        pos, activation = (part.split("=")[1] for part in name.split())
        losses = [
            Run(r.path).length_result()["variants"][pos]["1"]["loss"]
            for table_row in result.rows
            if (table_row.choice["pos"], table_row.choice["activation"]) == (pos, activation)
            for r in table_row.runs
        ]
        assert row[1] == "2" and row[2] == f"{statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f}"
        assert (row[3] == "cannot run") == (pos == "learned")
    assert "| pos=rope activation=gelu +ntk | 2 |" in scalings and "learned" not in scalings
    assert result.length_plot.stat().st_size > 10_000 and result.plot_path.stat().st_size > 10_000


def test_baseline_and_single_seed_rows(sweep):
    _, sweep_dir = sweep
    records = [read_run_dir(p) for p in find_run_dirs(sweep_dir)]
    result = compare(sweep_dir, sweep_dir / "vs_learned", baseline="pos=learned activation=gelu")
    assert "| vs pos=learned activation=gelu (Holm) |" in result.table
    verdicts = {(r.choice["pos"], r.choice["activation"]): r.significance for r in result.rows}
    assert verdicts[("learned", "gelu")] == "reference"
    # one seed of rope/gelu left: its row cannot tell
    one_rope = [
        r
        for r in records
        if not (
            r.overrides["pos"] == "rope"
            and r.overrides["activation"] == "gelu"
            and r.overrides["seed"] == "1"
        )
    ]
    single = write_comparison(
        one_rope, sweep_dir / "single", "single", sweep_dir, baseline="pos=learned activation=gelu"
    )
    verdicts = {(r.choice["pos"], r.choice["activation"]): r.significance for r in single.rows}
    assert verdicts[("rope", "gelu")] == "cannot tell (1 seed)"
    with pytest.raises(DataError, match="--baseline 'pos=learned' matches 2 of the conditions"):
        compare(sweep_dir, sweep_dir / "x", baseline="pos=learned")
    # --ignore: the activation does not define a condition; its runs pool as four seeds per scheme
    pooled = compare(sweep_dir, sweep_dir / "pooled", ignore=["activation"])
    assert pooled.keys == ["pos"] and [len(r.runs) for r in pooled.rows] == [4, 4]


def test_one_command_regenerates_the_readme_block_with_commit_and_commands(sweep, tmp_path):
    _, sweep_dir = sweep
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n\n<!-- comparison: tiny_pos -->\nold table\n<!-- /comparison: tiny_pos -->\n\nend\n"
    )
    out = tmp_path / "docs" / "tiny_pos"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "compare.py"),
            str(sweep_dir),
            "--out",
            str(out),
            "--readme",
            str(readme),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "Updated" in proc.stdout
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\nend\n") and "old table" not in text
    assert "](docs/tiny_pos/val_loss.png)" in text and "](docs/tiny_pos/loss_vs_context.png)" in text
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert "docs/tiny_pos/long_context.png" in links and all((tmp_path / link).is_file() for link in links)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout
    assert f"at commit {commit.strip()}" in text
    # the commands: the sweep's, from its multirun.yaml, and this one
    assert "Trained with `python train.py -m" in text and "activation=gelu,swiglu" in text
    assert f"Compared with `python scripts/compare.py {sweep_dir} --out {out} --readme {readme}`" in text
    tables = [line for line in (out / "comparison.md").read_text().splitlines() if line.startswith("|")]
    assert len(tables) > 8 and all(line in text for line in tables)


def test_a_folder_without_runs_is_refused_with_the_fix(tmp_path):
    with pytest.raises(DataError, match="none holds .hydra/overrides.yaml.*outputs/multirun"):
        compare(tmp_path)
    with pytest.raises(DataError, match="is not a directory"):
        compare(tmp_path / "missing")
    with pytest.raises(DataError, match="source='tensorboard' is not one of"):
        compare(tmp_path, source="tensorboard")


def test_welch_matches_the_textbook_sleep_data():
    # Student's sleep data (Cushny & Peebles), as in R's `t.test(extra ~ group, data = sleep)`:
    # t = -1.8608, df = 17.776, p-value = 0.07939.
    drug1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    drug2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    test = welch(drug1, drug2)
    assert test.t == pytest.approx(-1.8608, abs=1e-4)
    assert test.df == pytest.approx(17.776, abs=1e-3)
    assert test.p == pytest.approx(0.07939, abs=1e-5)
    assert verdict(drug2, drug1) == "within noise, p=0.079"
    assert verdict([2.0, 2.1, 2.05], [1.0, 1.1, 1.05]).startswith("worse, p")
    assert verdict([1.0, 1.1, 1.05], [2.0, 2.1, 2.05]).startswith("better, p")
    assert verdict([3.0, 3.01, 3.02], [1.0, 1.01, 1.02]) == "worse, p<0.001"
    assert verdict([1.0], [2.0, 2.1]) == "cannot tell (1 seed)"
    # the interval of the difference of means: R's t.test gives -3.3654832 to 0.2054832 (95%)
    difference, low, high = difference_interval(drug1, drug2)
    assert (difference, low, high) == pytest.approx((-1.58, -3.3654832, 0.2054832), abs=1e-6)
    assert welch([1.0, 1.0], [2.0, 2.0]).p == 0.0 and welch([1.0, 1.0], [1.0, 1.0]).p == 1.0
    assert math.isfinite(welch([1.0, 1.0], [2.0, 2.1]).p)


def test_holm_adjusts_step_down_and_keeps_the_order():
    # m = 4: the sorted p-values are multiplied by 4, 3, 2, 1 and made non-decreasing
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []
    # three conditions of 2 seeds each against a reference: each row's p is its Welch p adjusted among the three
    reference, close, far = [1.0, 1.02], [1.10, 1.13], [1.5, 1.51]
    raw = welch(close, reference).p
    out = contrasts([reference, close, far, [1.0, 1.03]], reference=0)
    assert out[0].verdict == "reference" and out[1].p == pytest.approx(raw)
    assert out[1].p_holm == pytest.approx(
        holm([raw, welch(far, reference).p, welch([1.0, 1.03], reference).p])[0]
    )
    assert out[2].verdict.startswith("worse") and out[2].low > 0


def test_names_groups_and_tags_come_from_the_overrides():
    overrides = ["pos=rope", "activation=swiglu", "seed=1", "paths.root_dir=/x", "optim.lr=0.0012345678"]
    swept = swept_keys_of(["pos=rope,alibi", "activation=swiglu", "seed=0,1,2", "optim.lr=0.0012345678"])
    assert swept == ["pos", "seed"]
    run = identity(overrides, multirun=True, sweep_dir="outputs/multirun/d/t", job_num=4, swept_keys=swept)
    assert run.name == "pos=rope seed=1"
    assert run.group == "outputs/multirun/d/t" and run.job_type == "sweep"
    assert run.tags == ["pos=rope", "activation=swiglu", "seed=1", "optim.lr=0.0012345678"]
    assert run.group_key == "pos=rope"
    named = identity(["experiment=pos_sweep", *overrides], multirun=True, experiment="pos_sweep")
    assert named.group == "pos_sweep" and "lr=0.00123" in named.name
    searched = identity(overrides, multirun=True, swept_keys=["optim.lr"], searching=True)
    assert (
        searched.name == "lr=0.00123"
        and searched.job_type == "search"
        and searched.group_key == searched.tags[-1]
    )
    single = identity(["pos=nope"])
    assert single.group is None and single.job_type == "train" and single.name == "pos=nope"
    assert is_sweep_value("range(1,4)") and is_sweep_value("a,b") and is_sweep_value("glob(*)")
    assert not is_sweep_value("0.5") and not is_sweep_value("[0.9,0.95]") and not is_sweep_value("'a,b'")
    assert swept_keys_of(["optim.betas=[0.9,0.95]", "seed=0,1"]) == ["seed"]


class ApiRunStandIn:
    """Stands in for wandb.apis.public.Run: the W&B API cannot be reached from the test machine. It has the
    attributes the comparison reads (config, summary, path, scan_history with the API's filtering: only rows
    holding every requested key)."""

    def __init__(self, pos: str, seed: int, losses: list[float], state: str = "finished") -> None:
        self.state = state
        self.config = {
            "pos": {"name": pos},
            "seed": seed,
            "sweep": {"overrides": [f"pos={pos}", f"seed={seed}"]},
        }
        self.summary = {"parameters/total": 2_000_000}
        self.path = ["me", "gptlab", f"{pos}{seed}"]
        self.rows = [{"trainer/global_step": 10 * (i + 1), "val/loss": v} for i, v in enumerate(losses)]
        self.rows.append({"trainer/global_step": 5, "train/tokens_per_second": 900.0})

    def scan_history(self, keys: list[str]):
        return [r for r in self.rows if all(k in r for k in keys)]


def test_online_runs_group_like_local_ones(tmp_path):
    from gptlab.comparison.records import record_from_api_run

    records = [
        record_from_api_run(ApiRunStandIn("rope", 0, [3.0, 2.0])),
        record_from_api_run(ApiRunStandIn("rope", 1, [3.1, 2.2])),
        record_from_api_run(ApiRunStandIn("learned", 0, [3.2, 2.5])),
    ]
    crashed = record_from_api_run(ApiRunStandIn("learned", 1, [3.0, 1.0], state="crashed"))
    assert crashed.status == "killed" and crashed.step == 20
    result = write_comparison([*records, crashed], tmp_path, "me/gptlab group")
    assert [(r.choice["pos"], len(r.runs)) for r in result.rows] == [("rope", 2), ("learned", 1)]
    assert result.unfinished == (crashed,)
    assert result.rows[0].val_loss_mean == pytest.approx(2.1)
    assert result.rows[0].tokens_per_second == 900.0 and result.rows[0].parameters == 2_000_000
    assert result.rows[1].significance == "cannot tell (1 seed)"
    assert records[0].val_loss == [(10, 3.0), (20, 2.0)]


def test_online_comparison_reads_the_group_through_the_wandb_api(tmp_path, monkeypatch):
    from gptlab.comparison.report import compare_online
    from gptlab.tracking import wandb_runs

    asked = []

    def group_runs(project, group):
        asked.append((project, group))
        return [ApiRunStandIn("rope", 0, [3.0, 2.0]), ApiRunStandIn("learned", 0, [3.2, 2.5])]

    monkeypatch.setattr(wandb_runs, "group_runs", group_runs)
    result = compare_online("me/gptlab", "pos_sweep", tmp_path)
    assert asked == [("me/gptlab", "pos_sweep")]
    assert [r.choice["pos"] for r in result.rows] == ["rope", "learned"]
    assert (tmp_path / "comparison.md").is_file()


def test_online_moe_runs_show_their_active_parameters_beside_their_total(tmp_path):
    """Through the W&B API: an MoE run's summary holds both counts, a dense run of an older gptlab its total
    alone (its active parameters are its total); an MoE run whose summary lacks the active count and whose
    config cannot be counted shows ``-``, not its total."""
    from gptlab.comparison.records import record_from_api_run
    from gptlab.comparison.table import ACTIVE_NOTE

    moe = ApiRunStandIn("rope", 0, [3.0, 2.0])
    moe.config["mlp"] = {"name": "moe", "experts": 8, "top_k": 2}
    moe.summary = {"parameters/total": 3_000_000, "parameters/active": 1_000_000}
    dense = ApiRunStandIn("learned", 0, [3.2, 2.5])  # summary: parameters/total 2,000,000 only
    result = write_comparison([record_from_api_run(r) for r in (moe, dense)], tmp_path, "me/gptlab group")
    rows = {row[1]: row for row in table_rows(result.table)}
    header = table_rows(result.table)[0]
    at = header.index("parameters")
    assert header[at + 1] == "active"
    assert (rows["rope"][at], rows["rope"][at + 1]) == ("3.00M", "1.00M")
    assert (rows["learned"][at], rows["learned"][at + 1]) == ("2.00M", "2.00M")
    assert result.table_notes == (ACTIVE_NOTE,)

    del moe.summary["parameters/active"]
    record = record_from_api_run(moe)
    assert record.parameters == 3_000_000 and record.active_parameters is None
    assert record.notes[-1].endswith("its active parameters are unknown")
    result = write_comparison([record, record_from_api_run(dense)], tmp_path, "me/gptlab group")
    rows = {row[1]: row for row in table_rows(result.table)}
    assert (rows["rope"][at], rows["rope"][at + 1]) == ("3.00M", "-")


def test_identity_from_a_composed_config():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from gptlab import CONFIG_DIR
    from gptlab.runs.naming import labels_from_hydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train", overrides=["pos=nope", "seed=3", "experiment=depth_sweep"], return_hydra_config=True
        )
    run = labels_from_hydra(cfg.hydra)
    assert run.name == "pos=nope seed=3" and run.group == "depth_sweep" and run.job_type == "train"
    assert run.tags == ["pos=nope", "seed=3", "experiment=depth_sweep"]
    assert labels_from_hydra().name is None  # no Hydra job running: W&B picks a name


# ---- nothing lost and nothing silently wrong ------------------------------------------------------------
def _copy_runs(sweep_dir, dest):
    """The sweep's run directories (and multirun.yaml) copied to ``dest``, to change without touching the
    shared sweep; {(pos, activation, seed): run dir}."""
    shutil.copy(sweep_dir / "multirun.yaml", dest / "multirun.yaml")
    runs = {}
    for run_dir in find_run_dirs(sweep_dir):
        copy = dest / run_dir.relative_to(sweep_dir)
        shutil.copytree(run_dir, copy)
        o = Run(copy).choices()
        runs[(o["pos"], o["activation"], o["seed"])] = copy
    return runs


def _edit_csv(run_dir, edit) -> None:
    """Rewrite a run's csv/metrics.csv with ``edit(header, rows)`` applied to its rows (lists of strings)."""
    path = run_dir / "csv" / "metrics.csv"
    header, *rows = list(csv.reader(path.open()))
    edit(header, rows)
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def test_inf_finals_garbled_metrics_and_impossible_mfu_are_shown_as_such(sweep, tmp_path, capsys):
    _, sweep_dir = sweep
    runs = _copy_runs(sweep_dir, tmp_path)

    # 1. rope/swiglu seed 0 ends at inf: Lightning's CSV writer writes it as "inf"
    def final_inf(header, rows):
        last = max(i for i, r in enumerate(rows) if r[header.index("val/loss")])
        earlier_ppl[:] = [r[header.index("val/ppl")] for r in rows[:last] if r[header.index("val/ppl")]]
        rows[last][header.index("val/loss")] = rows[last][header.index("val/ppl")] = "inf"

    earlier_ppl: list[str] = []
    _edit_csv(runs[("rope", "swiglu", "0")], final_inf)
    record = read_run_dir(runs[("rope", "swiglu", "0")])
    assert record.final_val_loss == math.inf and record.val_ppl == math.inf and record.diverged

    # 2. learned/gelu seed 1: a second writer's lines landed in the middle of one of its lines
    garbled = runs[("learned", "gelu", "1")] / "csv" / "metrics.csv"
    mine, theirs = garbled.read_text(), (runs[("rope", "gelu", "0")] / "csv" / "metrics.csv").read_text()
    cut = mine.index("\n", len(mine) // 2) - 5
    garbled.write_text(mine[:cut] + theirs + mine[cut:])

    # 3. rope/gelu seed 0 measured against a peak far too low: an MFU of 137%
    def mfu_too_high(header, rows):
        for row in rows:
            if row[header.index("train/mfu")]:
                row[header.index("train/mfu")] = "1.37"

    _edit_csv(runs[("rope", "gelu", "0")], mfu_too_high)

    script = runpy.run_path(str(ROOT / "scripts" / "compare.py"))
    assert script["main"]([str(tmp_path), "--source", "csv", "--out", str(tmp_path / "report")]) == 0
    out, err = capsys.readouterr()
    header, *rows = table_rows(out.split("\n\n")[0])
    cells = [dict(zip(header, r)) for r in rows]
    by_condition = {(c["pos"], c["activation"]): c for c in cells}
    # the inf final: inf in its row, never an earlier step's value; the row is last and untested, the
    # reference is the best of the others
    inf_row = by_condition[("rope", "swiglu")]
    assert cells[-1] is inf_row and inf_row["seeds"] == "2 (1 diverged)"
    assert inf_row["val/loss"] == "inf" and inf_row["val/ppl"] == "inf"
    assert (
        inf_row["vs best (Holm)"] == "diverged (1 of 2 runs): not tested"
        and inf_row["Δ vs best (95% CI)"] == "-"
    )
    assert not any(f"{float(p):.2f}" in inf_row["val/ppl"] for p in earlier_ppl)
    assert cells[0]["vs best (Holm)"] == "reference" and cells[0] is not inf_row
    assert "`diverged`: a run of the condition ended with a validation loss that is non-finite" in out
    # the garbled file: listed as unreadable with the line that gave it away, not ranked, no row of zeros
    assert by_condition[("learned", "gelu")]["seeds"] == "1"
    unreadable = runs[("learned", "gelu", "1")]
    assert re.search(
        rf"skipped {re.escape(str(unreadable))}: metrics unreadable: .*metrics.csv line \d+ has \d+ fields",
        err,
    )
    assert not any(c["val/loss"].startswith("0.0000") for c in cells)
    # the impossible MFU: not shown as a utilisation, with the note saying why
    assert by_condition[("rope", "gelu")]["MFU"] == "invalid (>100%)"
    assert all(
        c["MFU"].endswith("%") and float(c["MFU"].split("%")[0]) <= 100
        for c in cells
        if c is not by_condition[("rope", "gelu")]
    )
    assert "MFU `invalid (>100%)`: a run measured more FLOP/s than the peak" in out
    text = (tmp_path / "report" / "comparison.md").read_text()
    assert "| inf |" in text and "invalid (>100%)" in text and "metrics unreadable" in text

    # read with the W&B files as well (auto), the garbled CSV gives way to the run's W&B file, and says so
    auto = read_run_dir(unreadable)
    assert auto.source == "wandb" and any(n.startswith("metrics unreadable: ") for n in auto.notes)
    logged = read_run(find_runs(unreadable)[0]).metric("val/loss")[-1][1]
    assert auto.final_val_loss == pytest.approx(logged, rel=1e-6)


def test_a_conditions_perplexities_are_the_perplexity_of_its_mean_loss(sweep, tmp_path, capsys):
    # rope/gelu seed 1 ends a nat above seed 0 (its final validation and its length study at 1x): the row's
    # val/ppl must be exp of the val/loss beside it, not the mean of the seeds' perplexities (Jensen's gap)
    _, sweep_dir = sweep
    runs = _copy_runs(sweep_dir, tmp_path)
    worse = runs[("rope", "gelu", "1")]

    def a_nat_worse(header, rows):
        last = max(i for i, r in enumerate(rows) if r[header.index("val/loss")])
        loss = float(rows[last][header.index("val/loss")]) + 1.0
        rows[last][header.index("val/loss")], rows[last][header.index("val/ppl")] = (
            repr(loss),
            repr(math.exp(loss)),
        )

    _edit_csv(worse, a_nat_worse)
    result = json.loads((worse / "result.json").read_text())  # the run's own final, as it would have written
    result["metrics"]["val/loss"] += 1.0
    result["metrics"]["val/ppl"] = math.exp(result["metrics"]["val/loss"])
    (worse / "result.json").write_text(json.dumps(result))
    study_path = worse / "eval_length" / "length.json"
    study = json.loads(study_path.read_text())
    entry = study["variants"]["rope"]["1"]
    entry["loss"] += 1.0
    entry["ppl"] = math.exp(entry["loss"])
    study_path.write_text(json.dumps(study))

    script = runpy.run_path(str(ROOT / "scripts" / "compare.py"))
    assert script["main"]([str(tmp_path), "--source", "csv", "--out", str(tmp_path / "report")]) == 0
    header, *rows = table_rows(capsys.readouterr().out.split("\n\n")[0])
    row = {(r[1], r[2]): dict(zip(header, r)) for r in rows}[("rope", "gelu")]
    losses = [read_run_dir(runs[("rope", "gelu", seed)], "csv").final_val_loss for seed in "01"]
    assert losses[1] - losses[0] > 0.9
    assert row["val/loss"].split(" ± ")[0] == f"{statistics.fmean(losses):.4f}"
    assert row["val/ppl"] == format_perplexity(math.exp(statistics.fmean(losses)))
    assert float(row["val/ppl"]) < statistics.fmean(map(math.exp, losses)) - 1  # the plain mean lies above
    study_losses = [
        Run(runs[("rope", "gelu", seed)]).length_result()["variants"]["rope"]["1"]["loss"] for seed in "01"
    ]
    assert row["ppl@1x"] == format_perplexity(math.exp(statistics.fmean(study_losses)))
    # the legend says what the columns are
    text = (tmp_path / "report" / "comparison.md").read_text()
    assert (
        "`val/ppl`: exp of the mean final validation loss over seeds" in text and "`ppl@Nx`: likewise" in text
    )


def test_harness_perplexities_average_as_perplexities_and_accuracies_as_means(tmp_path):
    runs = [
        RunRecord(
            path=tmp_path / f"seed{seed}",
            overrides={"seed": str(seed)},
            val_loss=[(7, loss)],
            val_ppl=math.exp(loss),
            outputs={"eval_harness": {"eval/wikitext/word_perplexity": ppl, "eval/piqa/acc": acc}},
        )
        for seed, loss, ppl, acc in [(0, 3.0, 10.0, 0.2), (1, 4.0, 40.0, 0.4)]
    ]
    (row,) = summarize(runs, keys=[])
    assert row.val_ppl == pytest.approx(math.exp(3.5))
    assert row.outputs["eval_harness"] == pytest.approx(
        {"eval/wikitext/word_perplexity": 20.0, "eval/piqa/acc": 0.3}
    )


def test_every_perplexity_prints_five_significant_digits_and_at_most_two_decimals(tmp_path):
    """val/ppl, ppl@Nx, the harness's perplexities and the run's closing line print a perplexity alike: 8.81,
    118.53, 1234.6, 13314 (no decimals at that size), a diverged model's as 1.23e+37; committed tables
    (every perplexity under 1,000) read as they did with two decimals."""
    from gptlab.comparison.table import markdown_table
    from gptlab.tasks.gpt import validation_line

    ppls = {"a": 8.8123, "b": 118.5317, "c": 1234.5678, "d": 13314.34}
    runs = [
        RunRecord(
            path=tmp_path / name,
            overrides={"pos": name, "seed": "0"},
            val_loss=[(7, math.log(ppl))],
            val_ppl=ppl,
            outputs={
                "length": {"ppl@1x": ppl},
                "eval_harness": {"eval/wikitext/word_perplexity": ppl, "eval/piqa/acc": 0.25},
            },
        )
        for name, ppl in ppls.items()
    ]
    header, *rows = table_rows(markdown_table(summarize(runs, keys=["pos"]), ["pos"]))
    cells = {
        r[header.index("pos")]: [
            r[header.index(h)] for h in ("val/ppl", "ppl@1x", "eval/wikitext/word_perplexity")
        ]
        for r in rows
    }
    expected = {"a": "8.81", "b": "118.53", "c": "1234.6", "d": "13314"}
    assert cells == {name: [shown] * 3 for name, shown in expected.items()}
    assert [r[header.index("eval/piqa/acc")] for r in rows] == [
        "0.25"
    ] * 4  # not a perplexity: its own format
    for name, shown in expected.items():
        assert f"(perplexity {shown})" in validation_line(math.log(ppls[name]), None)
    assert "(perplexity 1.23e+37)" in validation_line(math.log(1.234e37), None)
    assert "(perplexity inf)" in validation_line(800.0, None)


def test_a_baseline_that_diverged_is_refused_and_a_result_can_mark_divergence(sweep, tmp_path):
    _, sweep_dir = sweep
    runs = _copy_runs(sweep_dir, tmp_path)
    # result.json says the run diverged (its final loss above the validation split's unigram entropy)
    path = runs[("learned", "swiglu", "1")] / "result.json"
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "diverged": True}))
    compared = compare(tmp_path, tmp_path / "report")
    marked = [r for r in compared.rows if r.diverged]
    assert [r.label for r in marked] == ["pos=learned activation=swiglu"] and compared.rows[-1] is marked[0]
    with pytest.raises(
        DataError, match="--baseline 'pos=learned activation=swiglu' names a condition that diverged"
    ):
        compare(tmp_path, tmp_path / "x", baseline="pos=learned activation=swiglu")


def test_a_metrics_file_cut_mid_line_loses_nothing(sweep, tmp_path):
    _, sweep_dir = sweep
    run_dir = tmp_path / "run"
    shutil.copytree(find_run_dirs(sweep_dir)[0], run_dir)
    path = run_dir / "csv" / "metrics.csv"
    whole = read_run_dir(run_dir, "csv")
    text = path.read_text()
    last = text.rstrip("\n").rindex("\n") + 1
    *_, final_row = csv.DictReader(io.StringIO(text))
    assert float(final_row["val/loss"]) == whole.final_val_loss  # the last line is the final validation
    path.write_text(text[: last + (len(text) - last) // 2])  # the writer killed in the middle of it
    cut = read_run_dir(run_dir, "csv")
    notes = " ".join(cut.notes)
    # the line is left out, said so, and the run's own final validation (result.json) read in its place
    assert "its last line is cut short (the writer stopped mid-line); left out" in notes
    assert "before its final validation: result.json's" in notes
    assert [s for s, _ in cut.val_loss] == [s for s, _ in whole.val_loss]
    assert [v for _, v in cut.val_loss] == pytest.approx([v for _, v in whole.val_loss], rel=1e-6)
    assert cut.val_ppl == pytest.approx(whole.val_ppl, rel=1e-6)


def test_runs_that_share_a_seed_count_as_one_seed_and_are_marked_under_the_table(sweep, tmp_path, capsys):
    # the same command run again into the folder: two runs of learned/gelu with seed 0, one with seed 1
    _, sweep_dir = sweep
    runs = _copy_runs(sweep_dir, tmp_path)
    before = {
        (r.choice["pos"], r.choice["activation"]): r for r in compare(tmp_path, tmp_path / "before").rows
    }
    shutil.copytree(runs[("learned", "gelu", "0")], tmp_path / "again")
    result = compare(tmp_path, tmp_path / "report")
    rows = {(r.choice["pos"], r.choice["activation"]): r for r in result.rows}
    again = rows[("learned", "gelu")]
    assert again.repeated_seeds == {"0": 2} and again.seeds == 2 and len(again.runs) == 3
    assert not any(r.repeated_seeds for key, r in rows.items() if key != ("learned", "gelu"))
    # seed 0 counted once: the mean, the spread and the test are those of the folder without the repeat
    # (counted three times, the repeat would pull the mean to seed 0 and shrink the ± and the p-value)
    assert again.final_losses == pytest.approx(before[("learned", "gelu")].final_losses)
    assert again.val_loss_mean == pytest.approx(before[("learned", "gelu")].val_loss_mean)
    assert again.val_loss_std == pytest.approx(before[("learned", "gelu")].val_loss_std)
    for key, row in rows.items():
        assert row.significance == before[key].significance
    cells = {(row[1], row[2]): row[3] for row in table_rows(result.table)[1:]}  # after the header
    assert cells[("learned", "gelu")] == "2 (seed 0 x2)" and cells[("rope", "gelu")] == "2"
    assert any(
        note.startswith("`seed S xN`: N runs of the condition used the same seed S")
        and "count seed S once" in note
        for note in result.table_notes
    )


def _record_offsets(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, length, type) of each record of a W&B run file, walked as the file's format lays them out."""
    import struct

    from gptlab.tracking.wandb_runs import BLOCK_SIZE, HEADER_SIZE

    pos, found = HEADER_SIZE, []
    while pos + HEADER_SIZE <= len(data):
        left = BLOCK_SIZE - pos % BLOCK_SIZE
        _, length, kind = (
            struct.unpack("<IHB", data[pos : pos + HEADER_SIZE]) if left >= HEADER_SIZE else (0, 0, 0)
        )
        if kind == 0:
            pos += left
            continue
        found.append((pos, length, kind))
        pos += HEADER_SIZE + length
    return found


def test_a_damaged_wandb_file_is_read_past_the_damage_and_the_comparison_says_what_is_missing(
    sweep, tmp_path
):
    from gptlab.errors import WandbFileError
    from gptlab.tracking.wandb_runs import iter_payloads

    _, sweep_dir = sweep
    runs = _copy_runs(sweep_dir, tmp_path)
    run_dir = runs[("rope", "gelu", "0")]
    shutil.rmtree(run_dir / "csv")  # its metrics come from the W&B run file alone
    (path,) = find_runs(run_dir)
    whole = read_run(path)
    data = bytearray(path.read_bytes())
    # bytes overwritten in the middle of one record in the middle of the file (a bad sector, a crash)
    records = [r for r in _record_offsets(bytes(data)) if r[1] > 16]
    offset, length, _ = records[len(records) // 2]
    data[offset + 7 + length // 2 : offset + 7 + length // 2 + 4] = b"\xde\xad\xbe\xef"
    path.write_bytes(bytes(data))

    with pytest.raises(WandbFileError, match="checksum mismatch"):  # the strict reader refuses it
        list(iter_payloads(path))
    damaged = read_run(path)
    assert len(damaged.damage) == 1 and damaged.damage[0].startswith(f"bytes {offset:,}-")
    # only that record is lost: every other history row, the run's identity and config are read
    assert len(damaged.history) >= len(whole.history) - 1
    assert all(row in whole.history for row in damaged.history)
    assert (damaged.run_id, damaged.config) == (whole.run_id, whole.config)

    record = read_run_dir(run_dir)
    assert record.source == "wandb"
    assert f"its W&B run file {path} is damaged (bytes {offset:,}-" in "\n".join(record.notes)
    assert record.final_val_loss == pytest.approx(Run(run_dir).result()["metrics"]["val/loss"], rel=1e-6)


def test_a_wandb_file_cut_in_its_last_record_is_read_whole_up_to_it(sweep, tmp_path):
    # a run killed while W&B wrote: the last record is cut short, which is not damage
    _, sweep_dir = sweep
    (path,) = find_runs(find_run_dirs(sweep_dir)[0])
    offset, length, _ = _record_offsets(path.read_bytes())[-1]
    cut = tmp_path / path.name
    cut.write_bytes(path.read_bytes()[: offset + 7 + length // 2])
    read = read_run(cut)
    assert read.damage == [] and read.history == read_run(path).history[: len(read.history)]
    assert len(read.history) >= len(read_run(path).history) - 1
