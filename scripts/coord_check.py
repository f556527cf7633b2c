"""muP's coordinate check: `python scripts/coord_check.py` trains the project's GPT at widths 64 to 1024 for a
few steps, in the standard parametrisation and under muP, and records each layer's activation scale (mean |x|
of its output) per width. Under muP the curves are flat in width; in the standard parametrisation they grow.

Writes coord_check.json (every value, after every step, and the log-log slope against width per layer) and
coord_check.png (one panel per parametrisation) into --out, and prints the slopes
(src/gptlab/comparison/coord_check.py). Cheap by design: a character vocabulary, context 32, batch 8.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gptlab.cli import ArgumentParser
from gptlab.runs.jsonfile import write_json
from gptlab.training.coord_check import coordinate_check, plot_coord_check


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="64,128,256,512,1024", help="comma-separated n_embd values")
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps per model (5)")
    parser.add_argument("--lr", type=float, default=1e-2, help="constant learning rate (1e-2)")
    parser.add_argument("--base-width", type=int, default=None, help="muP base width (default: smallest)")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/coord_check", help="folder for the JSON and the PNG")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    result = coordinate_check(
        widths, steps=args.steps, lr=args.lr, base_width=args.base_width, n_layer=args.n_layer, seed=args.seed
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "coord_check.json", result.to_dict())  # strict JSON (gptlab.runs.jsonfile), whole
    plot_coord_check(result, out / "coord_check.png")
    print(f"mean |activation| after {result.steps} AdamW steps at lr={args.lr}, widths {widths}")
    header = f"| layer | {' | '.join(f'{p}: slope' for p in result.params)} | "
    header += " | ".join(f"{p}: {widths[0]} -> {widths[-1]}" for p in result.params) + " |"
    print(header)
    print("|---" * (1 + 2 * len(result.params)) + "|")
    for layer in result.layers:
        slopes = " | ".join(f"{result.slope(p, layer):+.2f}" for p in result.params)
        spans = " | ".join(
            f"{result.final(p, layer)[0]:.3g} -> {result.final(p, layer)[-1]:.3g}" for p in result.params
        )
        print(f"| {layer} | {slopes} | {spans} |")
    print("\nslope: d log(mean |x|) / d log(width); 0 is flat, 1 grows in proportion to the width")
    print(f"wrote {out / 'coord_check.json'} and {out / 'coord_check.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
