"""How many times compiled FlexAttention compiles in one run, and whether any call ran it uncompiled.

For each model that takes FlexAttention (a bias scheme: alibi, relative, fire; with attention=default,
sliding_window, gemma2; with and without document masking) the script runs what one training process runs
through attention, in one process, and counts the compiles of FlexAttention's frame in each phase:

- ``train``: training steps at the training length (on a CPU forward only, without gradients: FlexAttention
  has no CPU backward; on CUDA forward and backward, which compile a kernel of their own per grad mode);
- ``val``: validation batches at the training length, without gradients;
- ``length``: the length study after training (``eval_length.factors`` 1, 2, 4, 8, its real function and its
  batch of 4,096 tokens; its last batch at each length is smaller, and padded to the others' size);
- ``passkey``: the passkey study after it (its real function, 4 depths x 5 prompts at each length, greedy answers
  decoded with a KV cache; batches of 16 x the training length, the default's 16,384 tokens at a context of
  1,024, so that 4x and 8x have a smaller last batch): every pass reads a KV cache, which takes the dense
  route, so it compiles nothing;
- ``generate``: decoding without a KV cache, which runs whole sequences padded to multiples of 128.

    python scripts/flex_recompiles.py                        # CPU: Dynamo's compiles, run by eager FlexAttention
    python scripts/flex_recompiles.py --backend inductor     # the real kernels (about 4 s each on a CPU)
    python scripts/flex_recompiles.py --device cuda          # on a GPU: Inductor, training with gradients
    python scripts/flex_recompiles.py --pos alibi --attention gemma2 --json out.json

A compile is one entry of torch.compile's cache for ``flex_attention``: counted by the backend, which
Dynamo calls once per entry, so the same on every backend. The FlexAttention route is forced where it would
not be taken (a CPU). ``limit_hits`` counts torch's lines that the recompile limit was hit (the limit is
gptlab.model.attention.FLEX_RECOMPILE_LIMIT; torch's own default is 8 per function): past it, calls run
FlexAttention uncompiled, which on a GPU holds the whole score matrix. The exit status is 1 when any did.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gptlab
from gptlab.data.datamodule import document_ids
from gptlab.data.tokenizers import CharTokenizer
from gptlab.evaluation import passkey
from gptlab.evaluation.length import loss_by_position
from gptlab.evaluation.options import LengthEvalOptions, PasskeyOptions
from gptlab.model import attention
from gptlab.runs.jsonfile import all_figures_as_json, write_json

POSITIONS = ("alibi", "relative", "fire")
ATTENTIONS = ("default", "sliding_window", "gemma2")
PHASES = ("train", "val", "length", "passkey", "generate")
EOT = 0  # the end-of-text id of the documents drawn for document masking


class CountingBackend:
    """A torch.compile backend that counts the graphs Dynamo hands it (one per cache entry) and compiles
    each with ``name``'s backend."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.compiles = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.compiles += 1
        return torch._dynamo.lookup_backend(self.name)(graph, example_inputs)


class UncompiledCalls(logging.Handler):
    """Counts gptlab's warning that a FlexAttention call ran uncompiled, and torch's own line that the
    recompile limit was hit (each such call runs uncompiled)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.gptlab = 0
        self.torch = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "UNCOMPILED" in message:
            self.gptlab += 1
        elif "hit config.recompile_limit" in message:
            self.torch += 1


@dataclass
class Row:
    pos: str
    attention: str
    document_mask: bool
    compiles: dict[str, int] = field(default_factory=dict)  # per phase
    total: int = 0
    limit_hits: int = 0  # torch's lines that the recompile limit was hit: calls run uncompiled
    seconds: float = 0.0


@contextmanager
def flex_forced(backend: CountingBackend) -> Iterator[None]:
    """The FlexAttention route on any device, compiled with ``backend``, from an empty compile cache."""
    available, chosen = attention.flex_attention_available, attention.FLEX_BACKEND
    attention.flex_attention_available = lambda device, head_dim=64: True
    attention.FLEX_BACKEND = backend  # type: ignore[assignment]
    attention.reset_compiled_flex_attention()
    try:
        yield
    finally:
        attention.flex_attention_available, attention.FLEX_BACKEND = available, chosen
        attention.reset_compiled_flex_attention()


def build_model(pos: str, variant: str, block_size: int, n_layer: int, device: str) -> gptlab.GPT:
    cfg = gptlab.compose(
        "model=tiny",
        f"pos={pos}",
        f"attention={variant}",
        f"model.block_size={block_size}",
        f"model.n_layer={n_layer}",
        "model.n_head=2",
        "model.n_embd=64",
        "model.vocab_size=64",
    )
    torch.manual_seed(0)
    return gptlab.build_model(cfg).to(device)


def tokens_with_documents(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` token ids with an end-of-text token about every 40 (documents of varying length)."""
    tokens = torch.randint(1, vocab, (n,), generator=generator)
    tokens[torch.rand(n, generator=generator) < 1 / 40] = EOT
    return tokens


def run_phases(
    model: gptlab.GPT, document_mask: bool, device: str, batch: int, backend: CountingBackend
) -> dict[str, int]:
    """Each phase's new compiles, in the order a training process runs them."""
    T, vocab = model.config.block_size, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    compiles: dict[str, int] = {}

    def batch_of(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        window = tokens_with_documents(rows * (T + 1), vocab, g).view(rows, T + 1).to(device)
        x, y = window[:, :-1], window[:, 1:]
        return x, y, document_ids(x, EOT) if document_mask else None

    def phase(name: str, run: Callable[[], None]) -> None:
        before = backend.compiles
        run()
        compiles[name] = backend.compiles - before

    def train() -> None:
        model.train()
        for _ in range(2):
            x, y, doc_ids = batch_of(batch)
            if device == "cpu":  # no backward for FlexAttention on a CPU
                with torch.no_grad():
                    model(x, y, doc_ids=doc_ids)
            else:
                _, loss = model(x, y, doc_ids=doc_ids)
                assert loss is not None
                loss.backward()
                model.zero_grad(set_to_none=True)

    @torch.no_grad()
    def val() -> None:
        model.eval()
        for _ in range(2):
            x, y, doc_ids = batch_of(batch)
            model(x, y, doc_ids=doc_ids)

    @torch.no_grad()
    def length_study() -> None:
        model.eval()
        options = LengthEvalOptions()
        # A batch and a half of validation tokens: at each length a full batch and a smaller last one.
        tokens = np.asarray(tokens_with_documents(int(1.5 * options.batch_tokens) + 1, vocab, g))
        for factor in options.factors:
            loss_by_position(model, tokens, factor * T, options.batch_tokens)

    def passkey_study() -> None:
        # The passkey prompts' characters and digits: 47 ids, inside the model's vocabulary of 64.
        texts = [passkey.INTRO, passkey.FILLER, passkey.KEY_SENTENCE, passkey.QUESTION, "0123456789"]
        chars = CharTokenizer.from_texts(texts)
        options = PasskeyOptions(batch_tokens=16 * T)  # 16 prompts at 1x, 2 at 8x: 2 + 2 + 1 of 5
        result = passkey.evaluate_passkey(model, chars, T, LengthEvalOptions().factors, options)
        assert "error" not in result, result.get("error")

    @torch.no_grad()
    def generate() -> None:
        model.eval()
        prompt = torch.randint(1, vocab, (1, T - 8), generator=g).to(device)
        model.generate(prompt, 16, use_cache=False)  # lengths T - 8 .. T + 7: two buckets of 128

    phase("train", train)
    phase("val", val)
    phase("length", length_study)
    phase("passkey", passkey_study)
    phase("generate", generate)
    return compiles


def measure(
    pos: str, variant: str, document_mask: bool, args: argparse.Namespace, uncompiled: UncompiledCalls
) -> Row:
    row = Row(pos, variant, document_mask)
    backend = CountingBackend(args.backend)
    model = build_model(pos, variant, args.block_size, args.n_layer, args.device)
    start = time.perf_counter()
    limit_hits = uncompiled.torch
    with flex_forced(backend):
        row.compiles = run_phases(model, document_mask, args.device, args.batch, backend)
    row.seconds = round(time.perf_counter() - start, 1)
    row.total = backend.compiles
    row.limit_hits = uncompiled.torch - limit_hits
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--backend", default=None, help="torch.compile backend (default: inductor on CUDA, eager on a CPU)"
    )
    parser.add_argument("--pos", nargs="+", default=list(POSITIONS), choices=POSITIONS)
    parser.add_argument("--attention", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    parser.add_argument(
        "--document-mask",
        nargs="+",
        default=["no", "yes"],
        choices=["no", "yes"],
        help="without, with, or both",
    )
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("inductor" if args.device.startswith("cuda") else "eager")
    torch.set_num_threads(min(2, torch.get_num_threads()))

    uncompiled = UncompiledCalls()
    for name in ("torch._dynamo", "gptlab.model.attention"):
        logging.getLogger(name).addHandler(uncompiled)

    limit = max(getattr(attention, "FLEX_RECOMPILE_LIMIT", 0), torch._dynamo.config.recompile_limit)
    print(
        f"torch {torch.__version__}, device {args.device}, backend {args.backend}, recompile limit {limit}, "
        f"{args.n_layer} layers, block_size {args.block_size}, batch {args.batch}"
    )
    header = f"{'pos':9} {'attention':15} {'docs':5} " + " ".join(f"{p:>8}" for p in PHASES)
    print(header + f" {'total':>6} {'limit_hits':>10} {'seconds':>8}")
    rows = []
    for pos in args.pos:
        for variant in args.attention:
            for docs in args.document_mask:
                row = measure(pos, variant, docs == "yes", args, uncompiled)
                rows.append(row)
                phases = " ".join(f"{row.compiles[p]:>8}" for p in PHASES)
                print(
                    f"{pos:9} {variant:15} {docs:5} {phases} {row.total:>6} {row.limit_hits:>10} "
                    f"{row.seconds:>8}",
                    flush=True,
                )
    if args.json is not None:
        write_json(args.json, all_figures_as_json([asdict(r) for r in rows]))  # strict JSON, whole
    return 1 if any(r.limit_hits for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
