"""Time a training step (forward + backward) of the transformer stack with each attention-bias scheme against
the fused causal kernel (pos=learned), interleaved in one process, and print the ratios.

    python scripts/bench_attention.py                        # T=1024, the small model's shape, CPU or GPU
    python scripts/bench_attention.py --context 256 --repeats 7 --pos alibi relative

The stack is the token embedding, the scheme, the blocks and the final norm; the output layer is left out
(it is the same for every scheme and would hide the attention). Rows:

- ``<pos>``: the model as it runs (bias built once per forward; query blocks on CPU, each building its own
  rows of the mask, FlexAttention on CUDA);
- ``<pos> (3-d masks, SDPA's explicit route)``: the blocks' masks passed as (n_head, rows, keys), which sends
  SDPA's CPU kernel to its explicit route even where the mask needs no gradient (CPU), and the same with
  denormals flushed;
- ``<pos> (whole mask, sliced per block)``: the whole (n_head, T, T) mask built once per forward and sliced by
  the query blocks, the CPU route before the blocks built their own rows;
- ``<pos> (bias per layer, one masked call)``: the route before either change, for comparison (CPU);
- ``... flush denormals``: the same with ``torch.set_flush_denormal(True)``, as ``python train.py`` runs.
  ALiBi's large negative biases make softmax produce subnormal floats, which x86 CPUs process very slowly.

On a machine shared with other jobs, ``--threads 1 --clock cpu`` (this process's CPU time) gives steadier
ratios than wall time. With more threads the CPU clock also counts the threads' spin-waiting, so use it
with one thread only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from gptlab.model import GPT, GPTConfig, attention
from gptlab.model.attention import FROM_SCHEME


@contextlib.contextmanager
def route_before_shared_bias() -> Iterator[None]:
    """Every layer builds its own bias and attends in one masked call over the whole (T, T) square."""
    block = attention.QUERY_BLOCK
    forward = attention.CausalSelfAttention.forward

    def per_layer(self, x, pos, positions, cache, bias=FROM_SCHEME, first_values=None):  # noqa: ANN001
        return forward(self, x, pos, positions, cache, FROM_SCHEME, first_values)

    attention.QUERY_BLOCK = 1 << 30
    attention.CausalSelfAttention.forward = per_layer
    try:
        yield
    finally:
        attention.QUERY_BLOCK = block
        attention.CausalSelfAttention.forward = forward


@contextlib.contextmanager
def route_with_whole_mask() -> Iterator[None]:
    """The mask built whole, once per forward, and sliced by the query blocks."""
    cls = attention.AttentionBias
    original = cls.__dict__["build"]  # the classmethod itself, put back as it was
    build = cls.build

    def whole(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        bias = build(*args, **kwargs)
        if bias is not None and isinstance(bias.mask, attention.DenseMask):
            bias.mask = bias.mask.whole()
        return bias

    cls.build = whole  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.build = original


@contextlib.contextmanager
def route_with_3d_masks() -> Iterator[None]:
    """The query blocks' masks passed to SDPA as (n_head or 1, rows, keys), as before: its CPU kernel then
    takes its explicit route even where the mask needs no gradient."""
    original = attention.fused_kernel_mask
    attention.fused_kernel_mask = lambda mask: mask
    try:
        yield
    finally:
        attention.fused_kernel_mask = original


@contextlib.contextmanager
def route_with_3d_masks_flushing() -> Iterator[None]:
    with route_with_3d_masks(), flushing_denormals(True):
        yield


@contextlib.contextmanager
def flushing_denormals(on: bool) -> Iterator[None]:
    torch.set_flush_denormal(on)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def stack_step(model: GPT, idx: torch.Tensor) -> Callable[[], None]:
    """One forward + backward through embedding, scheme, blocks and final norm (no output layer)."""

    def step() -> None:
        t = model.transformer
        positions = torch.arange(idx.size(1), device=idx.device)
        x = t.pos.embed(t.wte(idx), positions)
        bias = attention.AttentionBias.build(
            t.pos,
            positions,
            positions,
            attention.flex_attention_available(idx.device, model.config.head_dim),
        )
        for block in t.h:
            x, _ = block(x, t.pos, positions, None, bias)
        t.ln_f(x).square().mean().backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pos", nargs="+", default=["alibi", "relative", "fire"])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time, steadier than wall time on a shared machine (with --threads 1)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" or args.device != "cpu" else time.process_time

    device = torch.device(args.device)
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.context)
    idx = torch.randint(0, 512, (args.batch, args.context), device=device)
    cases: dict[str, tuple[Callable[[], None], Callable[[], contextlib.AbstractContextManager]]] = {}
    for pos in ["learned", *args.pos]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=512, pos=pos, **shape)).to(device)
        step = stack_step(model, idx)
        cases[pos] = (step, contextlib.nullcontext)
        if device.type == "cpu":
            cases[f"{pos}, flush denormals"] = (step, lambda: flushing_denormals(True))
            if pos != "learned":
                cases[f"{pos} (3-d masks, SDPA's explicit route)"] = (step, route_with_3d_masks)
                cases[f"{pos} (3-d masks), flush denormals"] = (step, route_with_3d_masks_flushing)
                cases[f"{pos} (whole mask, sliced per block)"] = (step, route_with_whole_mask)
                cases[f"{pos} (bias per layer, one masked call)"] = (step, route_before_shared_bias)

    times: dict[str, list[float]] = {name: [] for name in cases}
    for step, context in cases.values():  # warm-up (and compilation on CUDA)
        with context():
            step()
    for _ in range(args.repeats):  # interleaved: every case once per round
        for name, (step, context) in cases.items():
            with context():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = clock()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(clock() - start)

    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"device={device.type} threads={torch.get_num_threads()} T={args.context} batch={args.batch} "
        f"n_layer={args.n_layer} n_head={args.n_head} n_embd={args.n_embd} repeats={args.repeats} "
        f"clock={args.clock}"
    )
    print(f"{'stack training step':48s} {'median ms':>10s} {'vs fused causal':>16s} {'range of rounds':>16s}")
    for name, median in medians.items():
        base_name = "learned, flush denormals" if "flush" in name else "learned"
        # each round's ratio to the same round's baseline: the spread the interleaving leaves
        rounds = [t / b for t, b in zip(times[name], times[base_name])]
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}x"
        print(f"{name:48s} {median * 1000:10.1f} {median / medians[base_name]:15.2f}x {spread:>16s}")
    print(json.dumps({name: round(m / medians["learned"], 3) for name, m in medians.items()}))


if __name__ == "__main__":
    main()
