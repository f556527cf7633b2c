"""The memory of feeding one long prompt into the KV cache, in one call or through ``GPT.prefill`` (chunks of
queries whose dense attention mask stays within ``PREFILL_MASK_BYTES``), on the dense SDPA route that every
cached pass takes, one fresh process per row:

    python scripts/prefill_memory.py                          # T=4096, 12 heads of 64, 2 layers, alibi and rope
    python scripts/prefill_memory.py --pos relative --context 8192 --window 1024

Each row prints the prompt's peak resident memory above what the process held just before it (``ru_maxrss``,
which sees every tensor the pass allocates), its time, and the last position's first logit (the same in both
rows to fp32 rounding). The output layer is GPT-2's (50,257 tokens): one call also makes every position's
logits, which the chunks do not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from gptlab.model import GPT, GPTConfig, KVCache
from gptlab.model.gpt import prefill_chunk

# the same two measures as the document mask's script (scripts/ is this script's first import path)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from document_mask_memory import peak_mib, resident_mib  # noqa: E402


def one_prompt(args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    attention = {} if args.window is None else {"window": args.window, "window_pattern": "LG"}
    config = GPTConfig(
        vocab_size=50257,
        block_size=1024,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.heads * args.head_dim,
        pos=args.pos[0],
        attention=attention,
    )
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (1, args.context))
    with torch.no_grad():
        model(idx[:, :8], cache=KVCache.empty(config.n_layer))  # the kernels' first-call allocations
        before = resident_mib()
        start = time.perf_counter()
        cache = KVCache.empty(config.n_layer)
        if args.how == "one call":
            logits, _ = model(idx, cache=cache)
            assert logits is not None
            last = logits[:, -1]
        else:
            last = model.prefill(idx, cache)
        seconds = time.perf_counter() - start
    chunk = (
        args.context if args.how == "one call" else min(args.context, prefill_chunk(args.heads, args.context))
    )
    return {
        "pos": args.pos[0],
        "window": args.window,
        "how": args.how,
        "queries per chunk": chunk,
        "peak above start (MiB)": round(peak_mib() - before, 1),
        "seconds": round(seconds, 2),
        "first logit": round(float(last[0, 0]), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pos", nargs="+", default=["alibi", "rope"])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096, help="the prompt's tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--window", type=int, default=None, help="local layers of this window (pattern LG)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--how", choices=["one call", "prefill"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.how is not None:
        print(json.dumps(one_prompt(args)))
        return
    argv = [a for a in sys.argv[1:] if a not in ("--pos", *args.pos)]
    for pos in args.pos:  # a fresh process per row: ru_maxrss is a high-water mark for the process's life
        for how in ("one call", "prefill"):
            out = subprocess.run(
                [sys.executable, __file__, *argv, "--pos", pos, "--how", how], capture_output=True, text=True
            )
            if out.returncode != 0:
                sys.exit(f"pos={pos} ({how}) failed:\n{out.stderr}")
            print(out.stdout.strip())


if __name__ == "__main__":
    main()
