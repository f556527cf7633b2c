"""Validation loss and perplexity of a trained run at 1x, 2x, 4x and 8x its training context.

    python scripts/eval_length.py outputs/runs/<date>/<time>            # a run directory
    python scripts/eval_length.py path/to/last.ckpt --factors 1 2 4 16  # a checkpoint inside a run directory
                                                                        # (a file or a sharded directory)
    python scripts/eval_length.py --sweep outputs/multirun/pos_sweep --plot docs/pos_sweep.png

Writes <run dir>/eval_length/{length.json, loss_vs_length.png, loss_by_position.png} and the passkey
retrieval study's passkey.{json,md,png} (length x depth of the key; --no-passkey skips it), prints tables; a
run that logged to W&B gets a W&B run in its group with the same figures. ``--sweep`` gathers the results of
a multirun trained with ``eval_length.enabled=true`` (experiment=pos_sweep) into one table and plot, and the
passkey results into a second table (also written to <first sweep dir>/passkey_summary.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gptlab.cli import ArgumentParser
from gptlab.comparison import length_table as sweep
from gptlab.comparison.table import condition_labels
from gptlab.errors import ConfigError, DataError
from gptlab.evaluation import length, long_context
from gptlab.evaluation.options import DEFAULT_FACTORS, ROPE_SCALINGS, PasskeyOptions
from gptlab.runs import find_run_dirs


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="a run directory or a checkpoint (file or sharded directory)")
    parser.add_argument(
        "--factors",
        type=int,
        nargs="+",
        default=list(DEFAULT_FACTORS),
        help=f"multiples of the training context to evaluate at (default {' '.join(map(str, DEFAULT_FACTORS))})",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="validation tokens to use (default all)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per forward pass")
    parser.add_argument("--out", default=None, help="output folder (default <run dir>/eval_length)")
    parser.add_argument("--no-wandb", action="store_true", help="do not log to W&B even if the run did")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument(
        "--rope-scalings",
        nargs="*",
        default=list(ROPE_SCALINGS),
        help="context-scaling methods studied where the scheme has them (none: only the model as trained)",
    )
    parser.add_argument("--no-passkey", action="store_true", help="skip the passkey retrieval study")
    parser.add_argument("--passkey-depths", type=int, default=4, help="depth bins of the passkey study")
    parser.add_argument("--passkey-trials", type=int, default=5, help="passkey prompts per length and depth")
    parser.add_argument("--passkey-seed", type=int, default=0)
    parser.add_argument("--passkey-key-digits", type=int, default=5, help="digits of each pass key")
    parser.add_argument("--sweep", nargs="+", default=None, help="multirun directories to summarise instead")
    parser.add_argument("--plot", default=None, help="with --sweep: where to write the plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.sweep:
            results = sweep.collect(args.sweep)
            metric = sweep.metric_for(results)  # bits per byte across tokenizers
            table = sweep.summarize(args.sweep, plot=args.plot, results=results, metric=metric)
            print(f"{sweep.METRICS[metric].capitalize()} at each multiple of the training context:")
            print(table)
            _, conditions = condition_labels([p for d in args.sweep for p in find_run_dirs(d)])
            passkey_table = long_context.passkey_sweep_table(
                long_context.collect_passkey(args.sweep, conditions)
            )
            if passkey_table:
                (Path(args.sweep[0]) / "passkey_summary.md").write_text(passkey_table + "\n")
                print("\nPasskey retrieval (accuracy over depths and trials):\n" + passkey_table)
            return 0
        if not args.path:
            parser.error("give a run directory or checkpoint (or --sweep DIR)")
        options = length.LengthEvalOptions(
            factors=args.factors,
            max_tokens=args.max_tokens,
            batch_tokens=args.batch_tokens,
            rope_scalings=args.rope_scalings,
        )
        passkey_options = None
        if not args.no_passkey:
            passkey_options = PasskeyOptions(
                depths=args.passkey_depths,
                trials=args.passkey_trials,
                seed=args.passkey_seed,
                key_digits=args.passkey_key_digits,
            )
        result, paths = length.evaluate_run(
            args.path,
            options,
            out_dir=args.out,
            use_wandb=not args.no_wandb,
            device=args.device,
            passkey_options=passkey_options,
        )
    except (ConfigError, DataError) as e:
        print(f"eval_length: error: {e}", file=sys.stderr)
        return 2
    print(length.format_table(result))
    if result.get("passkey"):
        from gptlab.evaluation.passkey import format_table

        print("\nPasskey retrieval (correct / trials):\n" + format_table(result["passkey"]))
    print("Wrote " + ", ".join(str(p) for p in paths))
    if "wandb_run" in result:
        print(f"W&B: {result['wandb_run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
