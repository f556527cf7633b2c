"""The memory of one forward pass on the dense attention route (a positional bias, a window or a logit cap on a
CPU), with the mask built one block of queries at a time as the model does, or whole and sliced per block as
it did before, one fresh process per row:

    python scripts/dense_mask_memory.py                        # T=4096: alibi, relative, alibi + window; the study
    python scripts/dense_mask_memory.py --pos fire --context 2048 --no-study

Forward rows: one window of ``--context`` tokens, 12 heads of 64, 2 layers, a 256-way output layer (so that the
attention's share shows), no gradient. Study rows: the length study's longest length, ``loss_by_position`` (the
study's own function) at 8x a training context of 1,024 tokens, with GPT-2's 50,257-way output layer as a run
has it. Each row prints the pass's peak resident memory above what the process held just before it
(``ru_maxrss``, which sees every tensor the pass allocates), its time, and a figure of its result (the last
position's first logit, or the mean loss), the same in both routes to fp32 rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gptlab.evaluation.length import loss_by_position
from gptlab.model import GPT, GPTConfig

# the scripts' shared measures and the route before (scripts/ is this script's first import path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import route_with_whole_mask  # noqa: E402
from document_mask_memory import peak_mib, resident_mib  # noqa: E402

ROUTES = ("whole mask", "blocks")


def one_row(args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    study = args.what == "study"
    window = args.window if args.what == "window" else None
    attention = {} if window is None else {"window": window, "window_pattern": "LG"}
    length = args.train_context * args.factor if study else args.context
    config = GPTConfig(
        vocab_size=50257 if study else 256,
        block_size=args.train_context if study else length,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.heads * args.head_dim,
        pos=args.pos[0],
        attention=attention,
    )
    model = GPT(config).eval()
    tokens = torch.randint(0, config.vocab_size, (length + 1,))
    route = route_with_whole_mask() if args.route == "whole mask" else contextlib.nullcontext()
    with torch.no_grad(), route:
        model(tokens[None, :8])  # the kernels' first-call allocations
        before = resident_mib()
        start = time.perf_counter()
        if study:
            losses, _ = loss_by_position(model, tokens.numpy().astype(np.int64), length, args.batch_tokens)
            figure = float(losses.mean())
        else:
            logits, _ = model(tokens[None, :length])
            assert logits is not None
            figure = float(logits[0, -1, 0])
        seconds = time.perf_counter() - start
    return {
        "pos": args.pos[0],
        "window": window,
        "what": f"length study at {args.factor}x {args.train_context}" if study else "one forward",
        "tokens": length,
        "route": args.route,
        "peak above start (MiB)": round(peak_mib() - before, 1),
        "seconds": round(seconds, 2),
        "mean loss" if study else "last logit": round(figure, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pos", nargs="+", default=["alibi", "relative"], help="forward rows' schemes")
    parser.add_argument("--window-pos", nargs="*", default=["alibi"], help="schemes also with --window")
    parser.add_argument("--window", type=int, default=1024, help="local layers of this window (pattern LG)")
    parser.add_argument("--study-pos", nargs="*", default=["alibi"], help="schemes of the length-study rows")
    parser.add_argument("--no-study", action="store_true", help="no length-study rows")
    parser.add_argument("--context", type=int, default=4096, help="the forward rows' tokens")
    parser.add_argument("--train-context", type=int, default=1024, help="the study's training context")
    parser.add_argument("--factor", type=int, default=8, help="the study's longest length, x train-context")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="the study's eval_length.batch_tokens")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--what", choices=["forward", "window", "study"], help=argparse.SUPPRESS)
    parser.add_argument("--route", choices=ROUTES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.what is not None:
        print(json.dumps(one_row(args)))
        return
    shape = [
        f"--{name}={getattr(args, name.replace('-', '_'))}"
        for name in ("window", "context", "train-context", "factor", "batch-tokens", "heads", "head-dim")
    ]
    shape += [f"--layers={args.layers}", f"--threads={args.threads}"]
    rows = [("forward", pos) for pos in args.pos] + [("window", pos) for pos in args.window_pos]
    rows += [] if args.no_study else [("study", pos) for pos in args.study_pos]
    for what, pos in rows:
        for route in ROUTES:  # a fresh process per row: ru_maxrss is a high-water mark for the process's life
            out = subprocess.run(
                [sys.executable, __file__, *shape, "--pos", pos, "--what", what, "--route", route],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                sys.exit(f"pos={pos} ({what}, {route}) failed:\n{out.stderr}")
            print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
