"""Compare the runs of a sweep: `python scripts/compare.py outputs/multirun/<date>/<time>`.

Writes comparison.md (a table sorted by final validation loss, mean ± std over seeds) and val_loss.png
(validation-loss curves per choice, mean and spread over seeds) into the sweep directory, or --out, and
prints the table.
"""

from __future__ import annotations

import argparse
import sys

from gptlab.errors import DataError
from gptlab.tracking.compare import SOURCES, compare, compare_online


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "sweep_dir", nargs="?", help="a multirun directory (or any folder holding run directories)"
    )
    parser.add_argument("--out", default=None, help="where to write comparison.md and val_loss.png")
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
    try:
        if args.wandb:
            result = compare_online(args.wandb, args.group, args.out or "comparison")
        else:
            result = compare(args.sweep_dir, args.out, args.source)
    except DataError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    print(result.table)
    for path, reason in result.skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    print(f"\nTable: {result.markdown_path}\nCurves: {result.plot_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
