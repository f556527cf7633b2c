"""What the SHA-256 digest beside each checkpoint costs: a model=small checkpoint (its weights and AdamW's
two moments, about 190 MB) is saved the way training saves it, then read the way resuming reads it, and the
seconds of the digest are printed beside the seconds of the save and the load. The files live in a temporary
folder, deleted afterwards.

    python scripts/checkpoint_digest_cost.py            # 3 repeats, medians
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.parallel.checkpoint_io import AtomicCheckpointIO
from gptlab.runs import digests
from gptlab.runs.checkpoints import load_checkpoint
from gptlab.runs.layout import LAST_CHECKPOINT


def small_checkpoint() -> dict:
    """model=small with the GPT-2 vocabulary, after one AdamW step (so its moments exist)."""
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=50257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    return {"state_dict": state, "optimizer_states": [optimizer.state_dict()], "global_step": 1}


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    checkpoint = small_checkpoint()
    io = AtomicCheckpointIO()
    rows: dict[str, list[float]] = {"save": [], "digest": [], "load": [], "verify": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / LAST_CHECKPOINT
        for _ in range(args.repeats):
            rows["save"].append(seconds(lambda: io.save_checkpoint(checkpoint, path)))  # digest included
            rows["digest"].append(seconds(lambda: digests.compute(path)))  # the part the digest adds
            rows["load"].append(seconds(lambda: load_checkpoint(path)))  # verify included
            rows["verify"].append(seconds(lambda: digests.check(path)))
        size = path.stat().st_size
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model=small checkpoint: {size / 1e6:.0f} MB, medians of {args.repeats}")
    print(
        f"save {med['save']:.2f} s, of which the digest {med['digest']:.2f} s ({size / 1e6 / med['digest']:.0f} MB/s)"
    )
    print(f"load {med['load']:.2f} s, of which the check {med['verify']:.2f} s")


if __name__ == "__main__":
    main()
