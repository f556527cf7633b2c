"""Fit L(N) = E + A N^-alpha per condition to a sweep over model sizes:
`python scripts/fit_scaling.py outputs/multirun/<date>/<time>` (after `python train.py -m
experiment=scaling_ladder`).

N is the non-embedding parameter count (from each run's config) of the weights a token passes through: a
dense model's all, a Mixture-of-Experts model's (mlp=moe) active ones, its top_k experts' and not all of them
(printed as "active", with the total beside); the loss is the final validation loss; one
fit per condition (the overrides besides size and seed, e.g. pos=rope), with profile-likelihood intervals
(Student's t on the residual degrees of freedom). Writes scaling.md, scaling.json and scaling.png into the sweep directory (or --out) and prints
the table (src/gptlab/comparison/scaling.py).
"""

from __future__ import annotations

import argparse
import sys

from gptlab.cli import ArgumentParser
from gptlab.comparison.scaling import write_scaling
from gptlab.errors import DataError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", nargs="?", help="a multirun directory over model sizes")
    parser.add_argument(
        "--out", default=None, help="where to write scaling.md/.json/.png (default: sweep dir)"
    )
    parser.add_argument("--confidence", type=float, default=0.95, help="interval coverage (0.95)")
    parser.add_argument(
        "--coverage",
        action="store_true",
        help="instead of fitting: how often the intervals hold a known truth, over 1,000 synthetic ladders "
        "of the shipped design at 2, 3 and 6 seeds per size",
    )
    args = parser.parse_args(argv)
    if args.coverage:
        from gptlab.comparison.scaling import LADDER_SIZES, LADDER_TRUTH, interval_coverage

        print(
            f"sizes N = {', '.join(f'{n:,.0f}' for n in LADDER_SIZES)}; truth {LADDER_TRUTH}; noise sd 0.02; "
            f"1,000 ladders each\n\n| seeds per size | E | A | alpha |\n|---:|---:|---:|---:|"
        )
        for seeds in (2, 3, 6):
            covered = interval_coverage(seeds, confidence=args.confidence, seed=seeds)
            print(f"| {seeds} | " + " | ".join(f"{covered[k]:.1%}" for k in ("E", "A", "alpha")) + " |")
        return 0
    if not args.sweep_dir:
        parser.error("pass a sweep directory (or --coverage)")
    try:
        fits, points, skipped, out = write_scaling(args.sweep_dir, args.out, args.confidence)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from gptlab.comparison.scaling import ACTIVE_N_NOTE, markdown_table, n_measure

    for path, why in skipped:
        print(f"left out {path}: {why}", file=sys.stderr)
    measure = n_measure(points)
    print(
        f"{len(points)} runs; N = {measure}" + (f" ({ACTIVE_N_NOTE})" if "active" in measure else "") + "\n"
    )
    for condition in sorted({p.condition for p in points}):
        mine = [p for p in points if p.condition == condition]
        sizes = sorted({p.n for p in mine})
        line = f"{condition}: N = {', '.join(f'{n:,.0f}' for n in sizes)}"
        if any(p.sparse for p in mine):  # an MoE condition: its N is active; its totals beside
            totals = sorted({p.n_total or p.n for p in mine})
            line += f" active (in all {', '.join(f'{n:,.0f}' for n in totals)})"
        print(line)
    print()
    print(markdown_table(fits, args.confidence))
    if not fits:
        print("no condition has 3 or more sizes: nothing fitted", file=sys.stderr)
    print(f"\nwrote {out / 'scaling.md'}, {out / 'scaling.png'}, {out / 'scaling.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
