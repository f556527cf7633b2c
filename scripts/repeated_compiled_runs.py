"""Several compiled runs (``compile=true``) one after another in one process, as a notebook trains them with
``gptlab.train()``: what torch.compile keeps between them. Per run: the call's wall time, the graphs Dynamo
compiled in it (a run that finds the graphs of an earlier run of its shapes compiles none; one past torch's
recompile limit compiles none either, and trains uncompiled), the compile cache entries of the block's code
held after it, the process's resident memory after it, and the final validation loss.

    python scripts/repeated_compiled_runs.py                              # 3 runs of a 2-layer char model
    python scripts/repeated_compiled_runs.py --vary-width --runs 6 --steps 6     # a new width each run
    python scripts/repeated_compiled_runs.py --vary-width --runs 6 --steps 6 --keep-compiled-code

The runs of one command share one fresh process (the first starts from an empty compile cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def block_cache_entries() -> int:
    """The compile cache entries Dynamo holds for the transformer block's forward (every Block instance of
    every model compiled in this process shares that code object)."""
    import torch

    from gptlab.model.gpt import Block

    get = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if get is None:
        return -1
    return len(get(Block.forward.__code__)) + len(get(torch.nn.Module._call_impl.__code__))


def runs(args: argparse.Namespace) -> list[dict[str, float]]:
    import torch
    from torch._dynamo.utils import counters

    import gptlab

    torch.set_num_threads(args.threads)
    if args.keep_compiled_code:  # as train() did before it dropped its runs' compiled code
        import gptlab.api

        gptlab.api._drop_compiled_code_of_the_run = lambda before: []
    out = []
    with tempfile.TemporaryDirectory(prefix="gptlab-compiled-runs-") as tmp:
        os.chdir(tmp)
        for k in range(args.runs):
            graphs = counters["stats"]["unique_graphs"]
            t0 = time.perf_counter()
            result = gptlab.train(
                "model.n_layer=2",
                "model.n_head=2",
                f"model.n_embd={64 + 32 * k if args.vary_width else 64}",
                "model.block_size=64",
                "data.batch_size=4",
                f"trainer.max_steps={args.steps}",
                f"trainer.val_check_interval={args.steps}",
                "trainer.limit_val_batches=2",
                "tokenizer=char",
                "logger=csv",
                "compile=true",
                f"seed={k}",
                f"paths.root_dir={tmp}",
                run_dir=Path(tmp) / f"run{k}",
            )
            out.append(
                {
                    "run": k + 1,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "graphs compiled": counters["stats"]["unique_graphs"] - graphs,
                    "cache entries held": block_cache_entries(),
                    "resident MiB after": round(resident_mib()),
                    "val/loss": round(result.metrics.get("val/loss", float("nan")), 4),
                    "finished": result.finished,
                }
            )
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--vary-width", action="store_true", help="run k at n_embd 64 + 32k: a new shape for every run"
    )
    parser.add_argument(
        "--keep-compiled-code",
        action="store_true",
        help="keep each run's compiled code when train() returns (train() drops it): the cache as it grew before",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(runs(args)))
        return
    command = [sys.executable, __file__, "--child", *sys.argv[1:]]
    proc = subprocess.run(command, capture_output=True, text=True, check=True)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
