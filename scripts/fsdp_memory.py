"""What one rank of ``strategy=fsdp`` holds at its peak over a forward and backward pass, measured against the
estimate that the model card and the memory check make (``gptlab.planning.memory_per_device``): two CPU
processes (gloo), the model sharded as a run shards it (``gptlab.parallel.transforms.shard``: one FSDP2 unit per
block, the root unit holding the embeddings, the final norm and the tied output layer).

    python scripts/fsdp_memory.py                       # a 2-layer model whose root unit outweighs its blocks
    python scripts/fsdp_memory.py --vocab 2048 --layers 4 --json

Measured: the most bytes the CPU allocator held at once on the rank, over one forward and backward pass
(torch's profiler records every allocation and free), above what the rank held before it (its shards of the
weights). Estimated: the same parts of ``memory_per_device`` (gradient shards, activations, the output layer
and loss, the gathered units), without the sharded weights (held before the pass) and the optimizer state (not
made by a forward and backward pass).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 2**20


def config_of(args: argparse.Namespace) -> Any:
    from gptlab.model.config import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab,
        block_size=args.context,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
        dropout=0.0,
    )


def head_loss(args: argparse.Namespace) -> Any:
    from gptlab.model.head_loss import HeadLoss

    return HeadLoss(args.head, chunk_rows=args.chunk_rows) if args.head == "chunked" else HeadLoss(args.head)


def estimate(args: argparse.Namespace) -> dict[str, float]:
    """The parts of the estimate a forward and backward pass allocates, in bytes."""
    from gptlab.planning import HeadPlan, TrainingPlan, memory_per_device

    plan = TrainingPlan(
        "fsdp",
        n_devices=2,
        precision="32-true",
        micro_batch=args.batch,
        context=args.context,
        head=HeadPlan.of(head_loss(args), "cpu", "32-true"),
    )
    e = memory_per_device(config_of(args), plan)
    return {
        "gradients": e.gradients,
        "activations": e.activations,
        "head": e.head,
        "gathered blocks": e.buffers - e.gathered_root,
        "gathered root": e.gathered_root,
    }


def rank_main(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from gptlab.model.gpt import GPT
    from gptlab.parallel.transforms import shard
    from gptlab.planning import cpu_peak_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT(config_of(args))
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
        strategy = SimpleNamespace(
            device_mesh={"data_parallel": mesh}, hybrid=False, cpu_offload=False, reshard_after_forward=True
        )
        shard(model, strategy)
        generator = torch.Generator().manual_seed(rank)
        x = torch.randint(0, args.vocab, (args.batch, args.context), generator=generator)
        y = torch.randint(0, args.vocab, (args.batch, args.context), generator=generator)
        head = head_loss(args)

        def step() -> None:
            _, loss = model(x, y, head_loss=head)
            loss.backward()

        step()  # FSDP's lazy set-up and first allocations outside the measure
        model.zero_grad(set_to_none=True)
        measured = cpu_peak_bytes(step)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"measured": measured}))
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gptlab-fsdp-memory-") as tmp:
        mp.spawn(rank_main, args=(args, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        measured = [json.loads(Path(tmp, f"rank{r}.json").read_text())["measured"] for r in range(2)]
    parts = estimate(args)
    total = sum(parts.values())
    return {
        "measured_bytes": measured,
        "estimate_bytes": total,
        "estimate_without_root_bytes": total - parts["gathered root"],
        "parts_bytes": parts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--head", default="chunked", help="loss.impl: chunked (a CPU run's) or plain")
    parser.add_argument(
        "--chunk-rows", type=int, default=None, help="chunked's rows per chunk (None: its default)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    for name, value in result["parts_bytes"].items():
        print(f"estimate: {name:<16} {value / MiB:8.2f} MiB")
    print(f"estimate, total            {result['estimate_bytes'] / MiB:8.2f} MiB")
    print(f"estimate without the root  {result['estimate_without_root_bytes'] / MiB:8.2f} MiB")
    for rank, value in enumerate(result["measured_bytes"]):
        print(f"measured, rank {rank}           {value / MiB:8.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
