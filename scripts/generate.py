"""Continue a prompt with a trained model.

    python scripts/generate.py ckpt=outputs/runs/<date>/<time> prompt="The sky is"
    python scripts/generate.py ckpt=... prompt="def" temperature=0.8 top_k=50 top_p=0.95 samples=3

`ckpt` is a run directory (its best checkpoint; which=last for the last) or a checkpoint: a .ckpt file or a
sharded checkpoint directory (strategy=fsdp, DeepSpeed), read with tensors only. temperature=0 (the default) is greedy decoding;
otherwise tokens are sampled, restricted to the top_k most likely and/or the top_p nucleus.
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
    prompt: str = "The"
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
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
