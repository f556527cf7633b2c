"""The memory of one training step on the dense attention route (a positional bias or a window on a CPU), with
the blocks' masks passed to SDPA 4-d as the model does, so that its CPU kernel takes its fused route wherever
the mask needs no gradient, or 3-d as it did before (its explicit route whatever the mask), one fresh process
per route and row:

    python scripts/dense_route_step_memory.py                  # T=1024 and 2048: alibi, relative, a window
    python scripts/dense_route_step_memory.py --context 2048 --batch 1 --pos alibi

The stack of ``scripts/bench_attention.py`` (2 layers (``--layers``) of 4 heads of 64, a 512-way output layer), one thread;
``--routes whole`` also measures one whole mask, built once per forward pass and shared by the layers.
Each row prints the step's peak resident memory above what the process held just before it (``ru_maxrss``),
what the forward pass kept for the backward (the tensors autograd saved, each storage counted once), and the
loss and the sum of the scheme's gradients, the same in both routes.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Any

import torch

from gptlab.model import GPT, GPTConfig, attention

ROUTES = {
    "4d": "4-d masks (fused where no gradient)",
    "3d": "3-d masks (explicit route)",
    "whole": "4-d, one whole mask shared by the layers",
}


def measure(pos: str, context: int, batch: int, layers: int, window: int, route: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    if route == "3d":
        attention.fused_kernel_mask = lambda mask: mask  # type: ignore[assignment]
    if route == "whole":
        build = attention.AttentionBias.build

        def whole(*args: Any, **kwargs: Any) -> attention.AttentionBias | None:
            bias = build(*args, **kwargs)
            if bias is not None and isinstance(bias.mask, attention.DenseMask):
                bias.mask = bias.mask.whole()
            return bias

        attention.AttentionBias.build = whole  # type: ignore[method-assign]
    attn = {"window": window, "window_pattern": "LG"} if window else {}
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=512, pos=pos, n_layer=layers, n_head=4, n_embd=256, block_size=context, attention=attn
        )
    )
    idx = torch.randint(0, 512, (batch, context + 1))
    kept: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[(t.untyped_storage().data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx[:, :-1], idx[:, 1:])
    assert loss is not None
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    scheme_grad = sum(
        float(p.grad.abs().sum()) for p in model.transformer.pos.parameters() if p.grad is not None
    )
    return dict(
        peak_mib=peak / 1024, kept_mib=sum(kept.values()) / 2**20, loss=loss.item(), scheme_grad=scheme_grad
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pos", nargs="+", default=["alibi", "relative", "nope+window"])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--routes", nargs="+", choices=list(ROUTES), default=["4d", "3d"])
    parser.add_argument("--window", type=int, default=256, help="local layers of this window (pattern LG)")
    parser.add_argument("--row", nargs=4, help=argparse.SUPPRESS)  # pos context window route, in a child
    args = parser.parse_args()
    if args.row:
        pos, context, window, route = args.row
        print(json.dumps(measure(pos, int(context), args.batch, args.layers, int(window), route)))
        return
    print(
        f"batch={args.batch}, {args.layers} layers of 4 heads of 64, one thread; peak / kept for the backward, MiB"
    )
    for context in args.context:
        for name in args.pos:
            pos, window = ("nope", args.window) if name == "nope+window" else (name, 0)
            cells = []
            for route in args.routes:
                row = [pos, str(context), str(window), route]
                child = [sys.executable, __file__, "--batch", str(args.batch), "--layers", str(args.layers)]
                child += ["--row", *row]
                out = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
                cells.append(
                    f"{ROUTES[route]}: {out['peak_mib']:.0f} / {out['kept_mib']:.0f}"
                    f" (loss {out['loss']:.6f}, scheme grad {out['scheme_grad']:.6g})"
                )
            print(f"T={context} {name}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
