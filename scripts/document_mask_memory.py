"""The memory of one training step (forward + backward) under ``data.document_mask=true`` with an attention
bias (ALiBi, T5 relative, FIRE) on the dense SDPA route (CPU), at a realistic size, one fresh process per row:

    python scripts/document_mask_memory.py                      # B=8, 12 heads of 64, T=1024, 2 layers
    python scripts/document_mask_memory.py --pos alibi --context 512 --batch 4

Each row prints the mask that ``AttentionBias.build`` makes for the step (its shape and MiB; one block of its
rows where the route builds it a block of queries at a time) and the step's peak resident memory above what
the process held just before it (``ru_maxrss``, the operating system's count, which sees every tensor the
step allocates). ``--no-documents`` gives the same step without
document masking: the bias alone, for comparison. The output layer is a 256-way head (a byte vocabulary),
so that the attention's share shows.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

from gptlab.data.datamodule import document_ids
from gptlab.model import GPT, GPTConfig
from gptlab.model.attention import QUERY_BLOCK, AttentionBias, DenseMask

MIB = 1 << 20


def resident_mib() -> float:
    """This process's resident memory now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def one_step(args: argparse.Namespace) -> dict[str, object]:
    """Build the model and a batch of packed windows, then measure one forward + backward."""
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = GPTConfig(
        vocab_size=256,
        block_size=args.context,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.heads * args.head_dim,
        pos=args.pos[0],
    )
    model = GPT(config)
    eot = 0
    idx = torch.randint(1, 256, (args.batch, args.context + 1))
    # Documents of about context / documents tokens each, starting at different places in each row.
    starts = torch.randint(1, args.context, (args.batch, args.documents - 1))
    idx.scatter_(1, starts, eot)
    x, y = idx[:, :-1], idx[:, 1:]
    doc_ids = None if args.no_documents else document_ids(x, eot)
    positions = torch.arange(args.context)
    # Built as the training step builds it (autograd on), then dropped: the step builds its own.
    built = AttentionBias.build(model.transformer.pos, positions, positions, False, None, None, doc_ids)
    # A mask the route builds per block of queries is shown by one block of its rows (QUERY_BLOCK queries).
    mask = built.mask
    if isinstance(mask, DenseMask):
        mask = mask.rows(0, min(QUERY_BLOCK, args.context), args.context)
    tensors = {
        "mask" if isinstance(built.mask, torch.Tensor) else "mask, one block of queries": (
            list(mask.shape),
            str(mask.dtype).removeprefix("torch."),
            round(mask.numel() * mask.element_size() / MIB, 1),
        )
    }
    del built
    before = resident_mib()
    _, loss = model(x, y, doc_ids=doc_ids)
    assert loss is not None
    loss.backward()
    return {
        "pos": args.pos[0],
        "documents": not args.no_documents,
        "bias tensors": tensors,
        "step peak above start (MiB)": round(peak_mib() - before, 1),
        "loss": float(loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pos", nargs="+", default=["alibi", "relative", "fire"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--documents", type=int, default=4, help="documents per window (at random places)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-documents", action="store_true", help="the same step without document masking")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_step(args)))
        return
    for pos in args.pos:  # a fresh process per row: ru_maxrss is a high-water mark for the process's life
        argv = [a for a in sys.argv[1:] if a != "--pos"]
        argv = [a for a in argv if a not in args.pos]
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--pos", pos, "--child"], capture_output=True, text=True
        )
        if out.returncode != 0:
            sys.exit(f"pos={pos}: the step failed:\n{out.stderr}")
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
