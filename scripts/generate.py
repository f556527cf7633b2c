"""Continue a prompt with a trained model.

    python scripts/generate.py ckpt=outputs/runs/<date>/<time> prompt="The sky is"
    python scripts/generate.py ckpt=... prompt="def" temperature=0.8 top_k=50 top_p=0.95 samples=3
    python scripts/generate.py ckpt=... prompt="The sky is" temperature=0      # greedy

`ckpt` is a run directory (its best checkpoint; which=last for the last) or a checkpoint: a .ckpt file or a
sharded checkpoint directory (strategy=fsdp, DeepSpeed), read with tensors only. Tokens are sampled (by default
at temperature 1 from the 40 most likely, seeded: the same command prints the same text), restricted to the
top_k most likely and/or the top_p nucleus; temperature=0 is greedy decoding, which for a briefly trained
model is often a run of newlines and spaces. The default prompt is the one a run's samples continue
(conf/callbacks/default.yaml).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from gptlab.errors import ConfigError
from gptlab.runs.trained import load_run


@dataclass
class Options:
    ckpt: str = "???"
    prompt: str = "In this case, the"
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = 40
    top_p: float | None = None
    samples: int = 1
    seed: int = 0
    which: str = "best"


def main(argv: list[str]) -> None:
    opts = OmegaConf.merge(OmegaConf.structured(Options), OmegaConf.from_cli(argv))
    if OmegaConf.is_missing(opts, "ckpt"):
        sys.exit(
            "usage: python scripts/generate.py ckpt=<run dir or .ckpt> prompt='...' [temperature=0.8 top_k=50]"
        )
    try:
        run = load_run(opts.ckpt, which=opts.which)
    except ConfigError as e:
        sys.exit(f"generate: error: {e}")
    model, tok = run.model, run.tokenizer
    ids = tok.encode(opts.prompt) or [tok.eot_id]
    idx = torch.tensor([ids] * opts.samples)
    generator = torch.Generator().manual_seed(opts.seed)
    out = model.generate(
        idx,
        opts.max_new_tokens,
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        eot_id=tok.eot_id,
        generator=generator,
    )
    print(f"# {run.checkpoint}", file=sys.stderr)
    for row in out.tolist():
        continuation = row[len(ids) :]
        if tok.eot_id in continuation:
            continuation = continuation[: continuation.index(tok.eot_id)]
        print(opts.prompt + tok.decode(continuation))
        if opts.samples > 1:
            print("-" * 40)


if __name__ == "__main__":
    main(sys.argv[1:])
