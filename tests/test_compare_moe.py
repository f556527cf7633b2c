"""What a comparison says a Mixture-of-Experts run's size is: an ``active`` column beside ``parameters``
(the weights one token passes through against every weight), with its legend, only where a row's two differ;
the same figures from the CSV, the W&B run file and the Python API's DataFrame; and a run that logged no
``parameters/active`` (one from before the count, or a damaged file) read as what it is, never as its
total when it is an MoE."""

from __future__ import annotations

import csv
import shutil
import sys

import pytest
from conftest import TINY, load_script

import gptlab
from gptlab.comparison.records import RunRecord
from gptlab.comparison.report import compare
from gptlab.comparison.table import ACTIVE_NOTE, markdown_table, summarize
from gptlab.model.counting import human

# Two tiny runs in one folder, one dense and one MoE (8 experts, top-2: a token passes through a quarter of
# the experts), with the CSV and the W&B logger, so that both readers read the same runs.
COMMON = [
    *TINY,
    "tokenizer=char",
    "logger=[csv,wandb]",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "callbacks.sample_generation=null",
]
DENSE_ONLY_HEADER = "| # | runs | seeds | val/loss | Δ vs best (95% CI) | vs best (Holm) | val/ppl | tokens/s | MFU | parameters |"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"root", "dense", "moe": run dirs, "counts": {mlp: the trained model's own parameter_counts()}}."""
    root = tmp_path_factory.mktemp("moe_compare")
    out: dict = {"root": root, "counts": {}}
    for mlp in ("dense", "moe"):
        run_dir = root / "runs" / mlp
        gptlab.train(*COMMON, f"paths.root_dir={root}", f"mlp={mlp}", run_dir=run_dir)
        out[mlp] = run_dir
        out["counts"][mlp] = gptlab.load_run(run_dir).model.parameter_counts()  # counted from its weights
    return out


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The markdown table in ``text`` as {first condition cell: {header: cell}}."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]
    return {row[header[1]]: row for row in rows}


def compare_script(args: list[str], capsys) -> str:
    module = load_script("compare")
    try:
        assert module.main([str(a) for a in args]) == 0
    finally:
        sys.modules.pop("compare", None)
    return capsys.readouterr().out


@pytest.mark.parametrize("source", ["csv", "wandb"])
def test_an_moe_row_shows_its_active_parameters_beside_its_total_with_a_legend(
    runs, source, tmp_path, capsys
):
    counts = runs["counts"]
    assert (
        counts["moe"]["active"] < counts["moe"]["total"]
        and counts["dense"]["active"] == counts["dense"]["total"]
    )
    printed = compare_script([runs["root"] / "runs", "--out", tmp_path, "--source", source], capsys)
    header = next(line for line in printed.splitlines() if line.startswith("| #"))
    assert header.endswith("| MFU | parameters | active |")
    rows = table_rows(printed)
    assert (rows["moe"]["parameters"], rows["moe"]["active"]) == (
        human(counts["moe"]["total"]),
        human(counts["moe"]["active"]),
    )
    assert rows["dense"]["parameters"] == rows["dense"]["active"] == human(counts["dense"]["total"])
    assert ACTIVE_NOTE in printed  # under the printed table, and in comparison.md
    written = (tmp_path / "comparison.md").read_text()
    assert table_rows(written) == rows and ACTIVE_NOTE in written
    assert "logged no parameters/active" not in written  # read as logged, not counted again


def test_the_dataframe_holds_both_counts(runs):
    pytest.importorskip("pandas")
    frame = gptlab.compare(runs["root"] / "runs").to_frame().set_index("mlp")
    for mlp in ("dense", "moe"):
        assert frame.loc[mlp, "parameters"] == runs["counts"][mlp]["total"]
        assert frame.loc[mlp, "active_parameters"] == runs["counts"][mlp]["active"]


def test_a_dense_only_table_has_no_active_column_and_no_legend(runs, tmp_path, capsys):
    printed = compare_script([runs["dense"], "--out", tmp_path], capsys)
    assert DENSE_ONLY_HEADER in printed.splitlines()
    assert ACTIVE_NOTE not in printed and ACTIVE_NOTE not in (tmp_path / "comparison.md").read_text()
    (row,) = compare(runs["dense"], tmp_path).rows
    assert row.active_parameters == row.parameters == runs["counts"]["dense"]["total"]


def _without_active_count(run_dir) -> None:
    """Rewrite a run's metrics.csv without its parameters/active column, as a run logged it before the count
    (and the W&B file away, so that nothing else holds it)."""
    path = run_dir / "csv" / "metrics.csv"
    header, *rows = list(csv.reader(path.open()))
    keep = [i for i, name in enumerate(header) if name != "parameters/active"]
    assert len(keep) == len(header) - 1
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([[line[i] for i in keep] for line in (header, *rows)])
    shutil.rmtree(run_dir / "wandb")


def test_a_run_that_logged_no_active_count_is_read_as_what_it_is(runs, tmp_path):
    """A dense run without parameters/active: its total, and no column. An MoE run without it: counted from its
    config (the figure it would have logged), with a note. An MoE run whose config cannot be counted: unknown,
    shown as ``-`` in the active column with a note, never as its total."""
    folder = tmp_path / "runs"
    for mlp in ("dense", "moe"):
        shutil.copytree(runs[mlp], folder / mlp)
        _without_active_count(folder / mlp)
    counts = runs["counts"]
    dense = compare(folder / "dense", tmp_path / "dense")
    assert dense.rows[0].active_parameters == counts["dense"]["total"] and "| active |" not in dense.table
    result = compare(folder, tmp_path / "both")
    rows = table_rows(result.table)
    assert rows["moe"]["active"] == human(counts["moe"]["active"])
    assert rows["dense"]["active"] == human(counts["dense"]["total"])
    (note,) = [note for path, note in result.notes if path.name == "moe"]
    assert note == (
        "an mlp=moe run that logged no parameters/active: its active parameters are counted from its config "
        f"({counts['moe']['active']:,} of {counts['moe']['total']:,})"
    )

    (folder / "moe" / "config_resolved.yaml").unlink()  # its overrides still say mlp=moe
    result = compare(folder, tmp_path / "unknown")
    rows = table_rows(result.table)
    assert rows["moe"]["parameters"] == human(counts["moe"]["total"]) and rows["moe"]["active"] == "-"
    assert ACTIVE_NOTE in result.body
    (note,) = [note for path, note in result.notes if path.name == "moe"]
    assert note.startswith(
        "an mlp=moe run that logged no parameters/active, and its config cannot be counted"
    )
    assert note.endswith("its active parameters are unknown")


def test_a_run_that_logged_no_count_at_all_leaves_a_dense_row_dense(tmp_path):
    """A dense condition whose second seed logged no parameters at all (killed before the count): its
    parameters and active are the first seed's, equal, and the table has no active column."""
    counted = RunRecord(
        tmp_path / "a", {"seed": "0"}, val_loss=[(2, 2.0)], parameters=1e3, active_parameters=1e3
    )
    uncounted = RunRecord(tmp_path / "b", {"seed": "1"}, val_loss=[(2, 2.1)])
    (row,) = summarize([counted, uncounted], [])
    assert row.parameters == row.active_parameters == 1e3 and not row.sparse
    assert markdown_table([row], []).splitlines()[0] == DENSE_ONLY_HEADER
