"""Evaluate a trained run with EleutherAI's lm-evaluation-harness.

    python scripts/evaluate.py outputs/runs/<date>/<time> tasks=hellaswag,lambada_openai
    python scripts/evaluate.py outputs/runs/<date>/<time> tasks=my_task --include-path my_tasks/ limit=100
    python scripts/evaluate.py path/to/last.ckpt tasks=lambada_openai num_fewshot=0 batch_size=16

Options as key=value: tasks (comma-separated, required), num_fewshot, limit, batch_size, max_length (default:
the run's training context), device, which (last|best checkpoint of a run directory), seed, bootstrap_iters
(standard errors; 0 skips them).
Writes <run dir>/eval_harness/results.json (and samples_<task>.jsonl with --log-samples), prints the harness's
table and logs harness/<task>/<metric> to the run's W&B run. Hub tasks (hellaswag, lambada_openai, ...) need
the Hugging Face hub; --include-path tasks with local data files run offline.

The harness's own command line works too, with the gptlab model registered:
    python -m gptlab.evaluation.harness run --model gptlab --model_args run=<run dir> --tasks lambada_openai
"""

from __future__ import annotations

import argparse
import logging
import sys

from gptlab.cli import ArgumentParser
from gptlab.errors import ConfigError, DataError

OPTIONS = {
    "tasks": str,
    "num_fewshot": int,
    "limit": float,
    "batch_size": int,
    "max_length": int,
    "device": str,
    "which": str,
    "seed": int,
    "bootstrap_iters": int,
}


def parse_options(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.lstrip("-").replace("-", "_")
        if not sep or key not in OPTIONS:
            raise ConfigError(
                f"{item!r} is not an option: pass key=value with key one of {', '.join(OPTIONS)} "
                "(e.g. tasks=hellaswag,lambada_openai)."
            )
        try:
            options[key] = OPTIONS[key](value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be of type {OPTIONS[key].__name__}.") from None
    if "limit" in options and float(options["limit"]).is_integer() and float(options["limit"]) >= 1:
        options["limit"] = int(options["limit"])  # a count of documents; below 1 it is a fraction
    return options


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run directory or a .ckpt file")
    parser.add_argument(
        "options", nargs="*", help="key=value: tasks=..., num_fewshot=, limit=, batch_size=, ..."
    )
    parser.add_argument("--include-path", action="append", default=None, help="a folder of task YAMLs")
    parser.add_argument("--log-samples", action="store_true", help="also write samples_<task>.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default <run dir>/eval_harness)")
    parser.add_argument("--no-wandb", action="store_true", help="do not log to W&B")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        options = parse_options(args.options)
        tasks = [t for t in str(options.pop("tasks", "")).split(",") if t]
        from gptlab.evaluation import harness

        record, path = harness.evaluate(
            args.path,
            tasks,
            include_path=args.include_path,
            log_samples=args.log_samples,
            out_dir=args.out,
            use_wandb=not args.no_wandb,
            **options,
        )
    except (ConfigError, DataError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(record))
    print(f"Wrote {path}")
    if "wandb_run" in record:
        print(f"W&B: {record['wandb_run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
