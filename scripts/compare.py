"""Compare the runs of a sweep: `python scripts/compare.py outputs/multirun/<date>/<time>`.

Writes comparison.md (the conditions sorted by final validation loss: mean ± std over seeds, the difference to
the best or --baseline with its 95% interval and Welch's t-test, Holm-adjusted over the table, throughput,
the parameters (every weight; and where a Mixture-of-Experts condition's differ, the active ones a token
passes through, beside them), perplexity at longer contexts; unfinished runs listed apart with their step; the length study's table when
the runs hold one; the commit and the commands), val_loss.png and
loss_vs_context.png into the sweep directory, or --out, and prints the tables. --readme FILE also replaces the
block between `<!-- comparison: NAME -->` and `<!-- /comparison: NAME -->` in FILE (NAME: the sweep
directory's name), so one command regenerates a README's table from one sweep directory.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gptlab.cli import ArgumentParser
from gptlab.comparison.records import SOURCES
from gptlab.comparison.report import compare, compare_online, update_readme
from gptlab.comparison.stats import DEFAULT_ALPHA
from gptlab.comparison.table import ranking_line
from gptlab.errors import DataError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "sweep_dir", nargs="?", help="a multirun directory (or any folder holding run directories)"
    )
    parser.add_argument("--out", default=None, help="where to write comparison.md and the figures")
    parser.add_argument(
        "--baseline", default=None, help="the choice each row is tested against, e.g. pos=learned"
    )
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="significance level (0.05)")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="KEY",
        help="a key that does not define a condition (runs differing in it pool as seeds); repeatable",
    )
    parser.add_argument(
        "--include-unfinished",
        action="store_true",
        help="rank killed, stopped or running runs too, at the step they reached (marked in the table)",
    )
    parser.add_argument("--readme", default=None, help="a markdown file whose comparison block to replace")
    parser.add_argument(
        "--name", default=None, help="with --readme: the block's name (default: sweep dir name)"
    )
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read the runs online, through the W&B API")
    parser.add_argument("--group", help="with --wandb: the W&B group (the sweep) to compare")
    parser.add_argument(
        "--source",
        choices=SOURCES,
        default="auto",
        help="read metrics from csv/metrics.csv, the W&B run files, or auto (CSV when present)",
    )
    args = parser.parse_args(argv)
    if bool(args.wandb) == bool(args.sweep_dir) or bool(args.wandb) != bool(args.group):
        parser.error("pass a sweep directory, or --wandb ENTITY/PROJECT --group GROUP (and --out)")
    command = "python scripts/compare.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    try:
        if args.wandb:
            result = compare_online(
                args.wandb, args.group, args.out or "comparison", args.baseline, args.alpha
            )
        else:
            result = compare(
                args.sweep_dir,
                args.out,
                args.source,
                args.baseline,
                args.alpha,
                command,
                args.ignore,
                args.include_unfinished,
            )
        if args.readme:
            update_readme(args.readme, args.name or Path(args.sweep_dir or args.group).name, result)
    except DataError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    if result.rows:
        print(ranking_line(result.rows[0].metric))
    print(result.table)
    for note in result.table_notes:
        print(f"\n{note}")
    if result.unfinished:
        print(f"\nUnfinished ({'ranked above' if args.include_unfinished else 'not ranked'}):")
        for run in result.unfinished:
            print(f"  {run.path}: {run.describe_status()}")
    if result.length_table:
        print(f"\n{result.length_table}")
    for path, note in result.notes:
        print(f"read {path}: {note}", file=sys.stderr)
    for path, reason in result.skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    print(f"\nTable: {result.markdown_path}\nCurves: {result.plot_path}", flush=True)
    if args.readme:
        print(f"Updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
