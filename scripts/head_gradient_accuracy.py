"""How far each ``loss.impl``'s gradients are from exact ones, through a model, under bf16 autocast.

    python scripts/head_gradient_accuracy.py                 # CUDA when there is one, else the CPU
    python scripts/head_gradient_accuracy.py --device cpu --seeds 3

A 2-layer model at GPT-2's vocabulary (width 256, 8 x 128 tokens, random targets, at initialisation, where the
softmax is flat and every vocabulary entry's gradient counts) takes one backward pass in fp32 with the plain head:
the reference. Each implementation then takes one under bf16 autocast, and the table gives, per parameter, the
relative error ``|g - g_ref| / |g_ref|``, and the largest per implementation.

Besides the implementations that run on the device, ``cce (arithmetic)`` follows Cut Cross-Entropy 25.1.1's
backward step by step in torch, on any device: per tile of 128 rows by 128 vocabulary entries, the softmax
gradient in fp32 rounded to bf16, its two products accumulated in fp32 and rounded to bf16, each then added into
bf16 gradient buffers in a random tile order (the kernel takes a lock per tile and adds in the order tiles
finish: ``tl_lock_add`` in its ``cce_backward.py``). With ``--seeds`` above 1 it runs that many tile orders. On
CUDA with cut-cross-entropy installed, the kernel itself runs beside it (``cce``).

On a CPU: plain 8.1e-3, chunked 7.3e-3 at most; cce (arithmetic) 2.53e-1 and 2.47e-1 for two tile orders (at
``transformer.ln_f.weight``; 5-6% at every bias, 1.1e-1 at ``ln_f.bias``). On an H200 the kernel
itself was 2.23e-1 from the plain head at the same parameter (scripts/gpu_check.py, docs/performance.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gptlab.model.config import GPTConfig  # noqa: E402
from gptlab.model.gpt import GPT  # noqa: E402
from gptlab.model.head_loss import HeadLoss, available  # noqa: E402

TILE_ROWS, TILE_VOCAB = 128, 128  # the kernel's most common tile (its autotuner's configs: 32-256)


class TiledBf16Accumulation(torch.autograd.Function):
    """The mean cross-entropy of ``hidden @ weight^T`` with Cut Cross-Entropy's backward arithmetic (module
    docstring). The forward is exact (fp32 log-sum-exp over bf16 operands), as the kernel's is."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, order_seed: int) -> Tensor:
        e, c = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
        logits = e.float() @ c.float().T
        lse = torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(e, c, targets, lse)
        ctx.order_seed = order_seed
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return (lse - logits.gather(1, targets[:, None])[:, 0]).mean()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        e, c, targets, lse = ctx.saved_tensors
        rows, vocab = e.shape[0], c.shape[0]
        de, dc = torch.zeros_like(e), torch.zeros_like(c)
        tiles = [(r, v) for r in range(0, rows, TILE_ROWS) for v in range(0, vocab, TILE_VOCAB)]
        order = torch.randperm(len(tiles), generator=torch.Generator().manual_seed(ctx.order_seed))
        scale = float(grad) / rows
        for i in order.tolist():
            r, v = tiles[i]
            e_tile, c_tile = e[r : r + TILE_ROWS], c[v : v + TILE_VOCAB]
            d = torch.exp(e_tile.float() @ c_tile.float().T - lse[r : r + TILE_ROWS, None])
            t = targets[r : r + TILE_ROWS] - v
            hit = (t >= 0) & (t < c_tile.shape[0])
            d[hit.nonzero()[:, 0], t[hit]] -= 1.0
            d = (d * scale).to(torch.bfloat16)
            # each product in fp32, rounded to bf16, then added to the bf16 buffer (a bf16 sum)
            de[r : r + TILE_ROWS] += (d.float() @ c_tile.float()).to(torch.bfloat16)
            dc[v : v + TILE_VOCAB] += (d.float().T @ e_tile.float()).to(torch.bfloat16)
        return de.to(ctx.dtypes[0]), dc.to(ctx.dtypes[1]), None, None


class TiledHead:
    """A head loss for ``GPT.forward(head_loss=...)`` that computes :class:`TiledBf16Accumulation`."""

    def __init__(self, order_seed: int, final_softcap: float | None) -> None:
        self.order_seed, self.final_softcap = order_seed, final_softcap

    def __call__(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None,
        vocab_size: int | None = None,
    ) -> Tensor:
        assert bias is None
        flat = hidden.reshape(-1, hidden.size(-1))
        # the vocabulary's rows, as the kernel is given them (the model stores the layer padded: vocab_multiple)
        weight = weight if vocab_size is None else weight[:vocab_size]
        return TiledBf16Accumulation.apply(flat, weight, targets.reshape(-1), self.order_seed)


def gradient_errors(
    device: torch.device, seeds: int = 1, vocab_size: int = 50257, width: int = 256
) -> dict[str, dict[str, float]]:
    """{implementation: {parameter: relative error against the fp32 plain head}} (module docstring); a smaller
    ``vocab_size`` and ``width`` for a quick look (fewer bf16 additions per gradient: smaller errors)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab_size, block_size=128, n_layer=2, n_head=4, n_embd=width)
    model = GPT(config).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (8, 128), device=device, generator=g)
    targets = torch.randint(0, config.vocab_size, (8, 128), device=device, generator=g)

    def gradients(head: Callable[..., Tensor], autocast: bool) -> dict[str, Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(idx, targets, head_loss=head)
        assert loss is not None
        loss.backward()
        return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = gradients(HeadLoss("plain"), autocast=False)
    heads: dict[str, Callable[..., Tensor]] = {}
    for impl in ("plain", "chunked", "liger", "cce"):
        if available(impl, device, dtype=torch.bfloat16):
            heads[impl] = HeadLoss(impl)
    for seed in range(seeds):
        heads["cce (arithmetic)" + (f" order {seed}" if seeds > 1 else "")] = TiledHead(
            seed, model.final_softcap
        )
    errors = {}
    for name, head in heads.items():
        got = gradients(head, autocast=True)
        errors[name] = {
            p: float((got[p] - want).norm() / want.norm().clamp_min(1e-30)) for p, want in reference.items()
        }
    return errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seeds", type=int, default=2, help="tile orders of the cce arithmetic")
    args = parser.parse_args(argv)
    errors = gradient_errors(torch.device(args.device), args.seeds)
    names = list(errors)
    params = list(next(iter(errors.values())))
    width = max(len(p) for p in params)
    print(f"{'parameter':{width}s}" + "".join(f"  {n:>22s}" for n in names))
    for p in params:
        print(f"{p:{width}s}" + "".join(f"  {errors[n][p]:22.2e}" for n in names))
    print(f"{'largest':{width}s}" + "".join(f"  {max(errors[n].values()):22.2e}" for n in names))


if __name__ == "__main__":
    main()
