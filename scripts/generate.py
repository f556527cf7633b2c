"""Continue a prompt with a trained model.

    python scripts/generate.py ckpt=outputs/runs/<date>/<time> prompt="The sky is"
    python scripts/generate.py outputs/runs/<date>/<time>                     # the same: ckpt as a path
    python scripts/generate.py ckpt=... prompt="def" temperature=0.8 top_k=50 top_p=0.95 samples=3
    python scripts/generate.py ckpt=... prompt="The sky is" temperature=0      # greedy

`ckpt` is a run directory (its best checkpoint; which=last for the last) or a checkpoint: a .ckpt file or a
sharded checkpoint directory (strategy=fsdp, DeepSpeed), read with tensors only. Tokens are sampled (by default
at temperature 1 from the 40 most likely, seeded: the same command prints the same text), restricted to the
top_k most likely and/or the top_p nucleus; temperature=0 is greedy decoding, which for a briefly trained
model is often a run of newlines and spaces. The default prompt is the one a run's samples continue
(conf/callbacks/default.yaml).

stdout holds the text alone, each sample the prompt and its continuation (on a terminal the prompt is shown
bold, apart from what the model wrote; NO_COLOR=1 turns that off); stderr says which checkpoint was read and
how the tokens were chosen.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import cast

import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

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


#: the options' types (as their annotations read), for a value of the wrong type
TYPE_NAMES = {
    "int": "an integer",
    "float": "a number",
    "int | None": "an integer or null",
    "float | None": "a number or null",
}

USAGE = "usage: python scripts/generate.py ckpt=<run dir or checkpoint> [prompt='...'] [key=value ...]"


def help_page() -> str:
    """``--help``: the usage, this module's description and every option with its default."""
    defaults = Options()
    rows = [f"  {f.name}={getattr(defaults, f.name)!r}" for f in fields(Options) if f.name != "ckpt"]
    return "\n".join(
        [USAGE, "", (__doc__ or "").strip(), "", "options (key=value) and their defaults:", *rows]
    )


def refuse(message: str) -> None:
    """A usage error as argparse reports one: the usage, then ``generate: error: ...``, status 2."""
    print(f"{USAGE}\ngenerate: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def parse_options(argv: list[str]) -> Options:
    """``key=value`` arguments (and ``ckpt`` as a bare path) as Options; ``--help`` prints the help page. A
    mistyped key or flag is refused with the closest option, a value of the wrong type with the option's
    type, before the checkpoint is read."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(help_page())
        raise SystemExit(0)
    names = [f.name for f in fields(Options)]
    given: list[str] = []  # the arguments as key=value
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):  # a flag: generate takes key=value options
                close = difflib.get_close_matches(arg.lstrip("-"), names, n=1)
                hint = f" Did you mean {close[0]}=...?" if close else f" Its options: {', '.join(names)}."
                refuse(f"unrecognized argument {arg}: options are given as key=value.{hint}")
            arg = f"ckpt={arg}"  # a bare path: the run directory or checkpoint
        key = arg.split("=", 1)[0]
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"Did you mean {close[0]}={arg.split('=', 1)[1]}?" if close else ""
            refuse(f"unknown option {key!r}. Its options: {', '.join(names)}. {hint}".rstrip())
        if key == "ckpt" and any(g.startswith("ckpt=") for g in given):
            refuse("two checkpoints given: pass one run directory or checkpoint (ckpt=... or a bare path)")
        given.append(arg)
        try:  # one at a time: the refusal names the value at fault
            OmegaConf.merge(OmegaConf.structured(Options), OmegaConf.from_dotlist([arg]))
        except ValidationError:
            expected = next(f.type for f in fields(Options) if f.name == key)
            default = getattr(Options(), key)
            refuse(
                f"{arg} is not a valid {key}: it must be {TYPE_NAMES.get(str(expected), expected)} (e.g. {key}={default})"
            )
    opts = OmegaConf.merge(OmegaConf.structured(Options), OmegaConf.from_dotlist(given))
    if OmegaConf.is_missing(opts, "ckpt"):
        refuse("no checkpoint given: ckpt=<run dir or checkpoint> (or the path alone)")
    message = out_of_range(cast(Options, opts))
    if message:
        refuse(message)
    return cast(Options, opts)


def out_of_range(opts: Options) -> str | None:
    """Why a value of the right type cannot work, with the fix; None where every value can. Without this the
    sampler would read a negative temperature as greedy, a top_p above 1 as no nucleus, and a negative
    max_new_tokens as nothing to generate, and print the prompt alone."""
    if opts.max_new_tokens < 1:
        return f"max_new_tokens={opts.max_new_tokens} must be a positive number of tokens (e.g. max_new_tokens=64)."
    if not (math.isfinite(opts.temperature) and opts.temperature >= 0):
        return (
            f"temperature={opts.temperature:g} must be 0 (greedy decoding) or more: 1 samples from the model's "
            "distribution as it is, below 1 sharpens it (e.g. temperature=0.8)."
        )
    if opts.top_k is not None and opts.top_k < 0:
        return (
            f"top_k={opts.top_k} must be a positive number of tokens (e.g. top_k=40), or null (or 0) to sample "
            "from the whole vocabulary."
        )
    if opts.top_p is not None and not 0 < opts.top_p <= 1:
        return (
            f"top_p={opts.top_p:g} must be above 0 and at most 1 (e.g. top_p=0.95: the likeliest tokens that hold "
            "95% of the probability), or null for no nucleus."
        )
    if opts.samples < 1:
        return f"samples={opts.samples} must be a positive number of continuations (e.g. samples=3)."
    if opts.which not in ("best", "last"):
        return f"which={opts.which!r} must be best (the best checkpoint by validation loss) or last."
    return None


def decoding(opts: Options) -> str:
    """How the tokens are chosen, with every setting that applies, for the line on stderr: a reader of the
    samples knows what they are samples of, and the command that gives the same text."""
    if opts.temperature == 0:
        chosen = (
            "greedy decoding (temperature=0: the likeliest token each time; top_k and top_p do not apply)"
        )
    else:
        top_k = f"top_k={opts.top_k}" if opts.top_k else "top_k=null (the whole vocabulary)"
        top_p = f"top_p={opts.top_p:g}" if opts.top_p is not None else "top_p=null (no nucleus)"
        chosen = f"sampled at temperature={opts.temperature:g}, {top_k}, {top_p}, seed={opts.seed}"
    return f"{chosen}; at most {opts.max_new_tokens} new tokens, ending early at <|endoftext|>"


def prompt_apart(prompt: str, stream: object) -> str:
    """The prompt as printed before its continuation: bold on a terminal, so that what the model wrote stands
    apart from it (the continuation often goes on mid-word); as it is where the text goes to a file or a
    pipe, or where NO_COLOR is set (no-color.org)."""
    isatty = getattr(stream, "isatty", None)
    if not prompt or os.environ.get("NO_COLOR") or not (isatty and isatty()):
        return prompt
    return f"\x1b[1m{prompt}\x1b[0m"


def main(argv: list[str]) -> None:
    opts = parse_options(argv)
    try:
        run = load_run(opts.ckpt, which=opts.which)
    except ConfigError as e:  # a path that is not there, or not a checkpoint: bad input, status 2
        refuse(str(e))
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
    chosen = "" if run.checkpoint == Path(opts.ckpt) else f" (the run's {opts.which} checkpoint)"
    print(f"# {run.checkpoint}{chosen}", file=sys.stderr)
    print(f"# {decoding(opts)}", file=sys.stderr, flush=True)
    shown = prompt_apart(opts.prompt, sys.stdout)
    for row in out.tolist():
        continuation = row[len(ids) :]
        if tok.eot_id in continuation:
            continuation = continuation[: continuation.index(tok.eot_id)]
        print(shown + tok.decode(continuation))
        if opts.samples > 1:
            print("-" * 40)


if __name__ == "__main__":
    main(sys.argv[1:])
