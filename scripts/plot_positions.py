"""Pictures of positional schemes: position tables as heatmaps, position-to-position similarity, and the
attention bias per head.

    python scripts/plot_positions.py outputs/runs/<date>/<time>          # the trained scheme of a run
    python scripts/plot_positions.py --pos sinusoidal rope alibi         # schemes as built, untrained
    python scripts/plot_positions.py RUN --positions 256 --out pictures  # past the training context

Writes <out>/<scheme>_table.png, _similarity.png and _bias.png (whichever apply); the default output folder
is <run dir>/positions, or ./positions for --pos.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gptlab.cli import ArgumentParser
from gptlab.errors import ConfigError
from gptlab.evaluation.plots import plot_scheme
from gptlab.model import positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.runs.trained import load_run


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "runs", nargs="*", help="run directories or checkpoints (files or sharded directories)"
    )
    parser.add_argument(
        "--pos", nargs="+", default=[], help=f"untrained schemes: {', '.join(positional.names())}"
    )
    parser.add_argument(
        "--positions", type=int, default=None, help="positions to draw (default: the context)"
    )
    parser.add_argument("--n-embd", type=int, default=128, help="with --pos: model width")
    parser.add_argument("--n-head", type=int, default=8, help="with --pos: attention heads")
    parser.add_argument("--block-size", type=int, default=128, help="with --pos: training context")
    parser.add_argument("--out", default=None, help="output folder")
    args = parser.parse_args(argv)
    if not args.runs and not args.pos:
        parser.error("give run directories / checkpoints, or --pos SCHEME ...")
    written: list[Path] = []
    try:
        for path in args.runs:
            run = load_run(path)
            out = Path(args.out) if args.out else (run.run_dir or run.checkpoint.parent) / "positions"
            written += plot_scheme(run.model, out, args.positions)
        for name in args.pos:
            torch.manual_seed(0)
            config = GPTConfig(
                vocab_size=2,
                block_size=args.block_size,
                n_layer=1,
                n_head=args.n_head,
                n_embd=args.n_embd,
                pos=name,
            )
            written += plot_scheme(GPT(config), Path(args.out or "positions"), args.positions)
    except ConfigError as e:
        print(f"plot_positions: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    if not written:
        print("nothing to draw: pos=nope adds no position information")
    return 0


if __name__ == "__main__":
    sys.exit(main())
