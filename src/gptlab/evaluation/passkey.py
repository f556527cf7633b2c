"""Passkey retrieval: can the model still use a fact placed far back in its context?

The protocol of Mohtashami & Jaggi 2023 ("Landmark Attention: Random-Access Infinite Context Length for
Transformers", section 4.2): an instruction, filler sentences repeated, "The pass key is N. Remember it. N is
the pass key." at some depth of the filler, more filler, then "What is the pass key? The pass key is"; the
answer is the first number in the model's greedy continuation. Each prompt is built to an exact token length
(the answer's tokens included), at multiples of the training context, and the key's depth is drawn uniformly
inside each depth bin. Keys and depths come from a seeded generator per (length, bin, trial), so a cell's
trials repeat whatever other cells are run.

Besides accuracy, each cell reports the mean log-probability per token of the true key (teacher-forced),
which separates "nowhere near" from "almost" for models too small to answer exactly.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gptlab.data.tokenizers import Tokenizer
from gptlab.evaluation.options import PasskeyOptions
from gptlab.model.gpt import GPT, KVCache
from gptlab.runs.jsonfile import all_figures_as_json, write_json
from gptlab.tracking.studies import StudyTable

log = logging.getLogger(__name__)

RESULT_FILE = "passkey.json"
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def depth_bins(n: int) -> list[tuple[float, float]]:
    return [(i / n, (i + 1) / n) for i in range(n)]


def bin_label(bin_: Sequence[float]) -> str:
    return f"{round(100 * bin_[0])}-{round(100 * bin_[1])}%"


def _same_text(a: str, b: str) -> bool:
    return "".join(a.split()) == "".join(b.split())


def encodability_error(tokenizer: Tokenizer, digits: int) -> str | None:
    """Why this vocabulary cannot pose the task (a piece of it does not survive encode/decode), or None."""
    samples = [INTRO, FILLER, KEY_SENTENCE.format(key="1234567890"[:digits]), QUESTION, " 9876543210"]
    for text in samples:
        back = tokenizer.decode(tokenizer.encode(text))
        if not _same_text(back, text):
            if any(c.isdigit() for c in text) and not any(c.isdigit() for c in back):
                return (
                    f"tokenizer={tokenizer.name} cannot encode the pass key's digits ({text.strip()!r} comes back "
                    f"as {back.strip()!r}): passkey retrieval needs a vocabulary with digits (gpt2 or char)"
                )
            return (
                f"tokenizer={tokenizer.name} cannot encode the passkey prompt ({text.strip()!r} comes back as "
                f"{back.strip()!r})"
            )
    return None


@dataclass
class Prompt:
    ids: list[int]
    key: int
    answer_ids: list[int]
    depth: float  # fraction of the filler before the key sentence
    intro: bool


def build_prompts(
    tokenizer: Tokenizer,
    length: int,
    bin_: tuple[float, float],
    trials: int,
    rng_key: Sequence[int],
    digits: int,
) -> list[Prompt] | str:
    """``trials`` prompts whose tokens plus the answer's take exactly ``length`` tokens, or why none fits."""
    filler_unit = tokenizer.encode(FILLER)
    intro, question = tokenizer.encode(INTRO), tokenizer.encode(QUESTION)
    rng = np.random.default_rng([*rng_key])
    prompts: list[Prompt] = []
    keys = rng.integers(10 ** (digits - 1), 10**digits, size=trials)
    depths = rng.uniform(bin_[0], bin_[1], size=trials)
    answers = [tokenizer.encode(f" {int(k)}.") for k in keys]
    budget = max(len(a) for a in answers)  # every prompt of a cell has one length: one batch
    for key, depth, answer in zip(keys, depths, answers):
        sentence = tokenizer.encode(KEY_SENTENCE.format(key=int(key)))
        fixed = len(sentence) + len(question) + budget
        use_intro = fixed + len(intro) <= length
        n_filler = length - fixed - (len(intro) if use_intro else 0)
        if n_filler < 0:
            return (
                f"a passkey prompt needs at least {fixed} tokens (key sentence, question and answer), more "
                f"than {length}"
            )
        filler = (filler_unit * (n_filler // max(1, len(filler_unit)) + 1))[:n_filler]
        cut = int(round(float(depth) * n_filler))
        ids = (intro if use_intro else []) + filler[:cut] + sentence + filler[cut:] + question
        prompts.append(Prompt(ids, int(key), answer, float(depth), use_intro))
    return prompts


@torch.no_grad()
def score_prompts(model: GPT, prompts: list[Prompt], tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """Greedy answers and the true key's log-probability for equal-length prompts, in one batch. Each
    prompt's figures are those it gets scored alone: its answer is decoded and teacher-forced to its own
    length (``len(answer_ids)``, which varies with the key under BPE), whatever the others' lengths.

    Every pass reads a KV cache (the prompt, the teacher-forced answer, each greedy token), and GPT.forward
    takes FlexAttention only without one: the study runs the dense route everywhere and compiles no
    FlexAttention kernel, whatever its batch sizes (``tests/test_flex_compile.py`` counts them). The prompt
    goes in through ``GPT.prefill``, in chunks of queries whose dense mask stays within
    ``gptlab.model.gpt.PREFILL_MASK_BYTES`` (256 MiB) at any length."""
    device = next(model.parameters()).device
    idx = torch.tensor([p.ids for p in prompts], device=device)  # (B, P)
    cache = KVCache.empty(model.config.n_layer)
    first = model.prefill(idx, cache)  # (B, V): the first answer token's logits, the prompt in bounded chunks
    own = [len(p.answer_ids) for p in prompts]  # each prompt's answer length
    n_answer = max(own)
    # Teacher forcing on the true answer, from a copy of the cache (its tensors are never written in place).
    # A shorter answer is padded at its end with its last token: causal attention keeps the padding from the
    # positions before it, and its log-probabilities are dropped below.
    answers = torch.tensor(
        [p.answer_ids + p.answer_ids[-1:] * (n_answer - len(p.answer_ids)) for p in prompts], device=device
    )  # (B, A)
    forked = KVCache(layers=list(cache.layers), length=cache.length)
    rest = model(answers[:, :-1], cache=forked)[0] if n_answer > 1 else first[:, None, :][:, :0]
    answer_logits = torch.cat([first[:, None, :], rest], dim=1)  # (B, A, V)
    logprobs = F.log_softmax(answer_logits.double(), dim=-1).gather(2, answers[..., None])[..., 0]  # (B, A)
    # Greedy decoding, as many tokens as the longest answer takes; each prompt keeps as many as its own.
    generated, step = [], first.argmax(-1, keepdim=True)  # (B, 1)
    for i in range(n_answer):
        generated.append(step)
        if i + 1 < n_answer:
            logits, _ = model(step, cache=cache)
            step = logits[:, -1, :].argmax(-1, keepdim=True)
    tokens = torch.cat(generated, dim=1).tolist()
    out = []
    for p, n, row, lp in zip(prompts, own, tokens, logprobs.tolist(), strict=True):
        text = tokenizer.decode(row[:n])
        lp = lp[:n]
        found = re.search(r"\d+", text)
        digits = len(str(p.key))
        out.append(
            {
                "key": p.key,
                "depth": round(p.depth, 4),
                "answer": text,
                "correct": bool(found and found.group() == str(p.key)),
                "key_logprob": float(np.mean(lp[: len(tokenizer.encode(f" {p.key}"))] or lp)),
                "digits_right": sum(a == b for a, b in zip(found.group() if found else "", str(p.key)))
                / digits,
            }
        )
    return out


def bounded_reason(model: GPT, length: int) -> str | None:
    limit = model.transformer.pos.max_positions
    if limit is not None and length > limit:
        return f"pos={model.config.pos.name} has a table of {limit} positions, so it cannot run at {length} tokens"
    return None


def evaluate_passkey(
    model: GPT,
    tokenizer: Tokenizer,
    train_context: int,
    factors: Sequence[int],
    options: PasskeyOptions | None = None,
    scalings: Sequence[str] = (),
) -> dict[str, Any]:
    """The length x depth table of passkey accuracy at ``factors`` x ``train_context`` tokens, for the model
    as trained and, under ``scaled``, with each of ``scalings`` the scheme has (e.g. RoPE's ``ntk``) set to
    the factor, as the length study does."""
    options = options or PasskeyOptions()
    bins = depth_bins(options.depths)
    result: dict[str, Any] = {
        "protocol": "passkey retrieval (Mohtashami & Jaggi 2023), greedy answer",
        "pos": model.config.pos.name,
        "tokenizer": tokenizer.name,
        "train_context": train_context,
        "factors": list(factors),
        "depth_bins": [bin_label(b) for b in bins],
        "trials": options.trials,
        "seed": options.seed,
        "cells": {},
        "metrics": {},
        "scaled": {},
    }
    reason = encodability_error(tokenizer, options.key_digits)
    if reason is not None:
        result["error"] = reason
        log.warning("Passkey retrieval not run: %s", reason)
        return result
    pos = model.transformer.pos
    was_training = model.training
    model.eval()
    try:
        result["cells"], result["metrics"] = _table(model, tokenizer, train_context, factors, options, None)
        for method in [s for s in scalings if s in getattr(pos, "context_scalings", ())]:
            name = f"{model.config.pos.name}+{method}"
            cells, metrics = _table(model, tokenizer, train_context, factors, options, method)
            metrics = {k.replace("passkey/", f"passkey/{name}/", 1): v for k, v in metrics.items()}
            result["scaled"][name] = {"cells": cells, "metrics": metrics}
            result["metrics"].update(metrics)
    finally:
        model.train(was_training)
    return result


def _table(
    model: GPT,
    tokenizer: Tokenizer,
    train_context: int,
    factors: Sequence[int],
    options: PasskeyOptions,
    scaling: str | None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """(cells by factor and depth bin, metrics) for the model as trained (``scaling`` None) or with the
    scheme's context scaling set to each factor (factor 1 is the model as trained, so it is skipped)."""
    cells: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    pos = model.transformer.pos
    for factor in factors:
        if scaling is not None and factor == 1:
            continue
        length = factor * train_context
        row: dict[str, Any] = {}
        for b, bin_ in enumerate(depth_bins(options.depths)):
            cell: dict[str, Any] = {"context": length}
            reason = bounded_reason(model, length)
            prompts = (
                build_prompts(
                    tokenizer, length, bin_, options.trials, (options.seed, factor, b), options.key_digits
                )
                if reason is None
                else reason
            )
            if isinstance(prompts, str):
                cell["error"] = prompts
            else:
                t0 = time.perf_counter()
                batch = max(1, options.batch_tokens // length)
                with pos.scaled(float(factor), scaling) if scaling is not None else nullcontext():
                    scored = [
                        s
                        for i in range(0, len(prompts), batch)
                        for s in score_prompts(model, prompts[i : i + batch], tokenizer)
                    ]
                cell.update(
                    accuracy=float(np.mean([s["correct"] for s in scored])),
                    correct=int(sum(s["correct"] for s in scored)),
                    key_logprob=float(np.mean([s["key_logprob"] for s in scored])),
                    digit_accuracy=float(np.mean([s["digits_right"] for s in scored])),
                    intro=all(p.intro for p in prompts),
                    seconds=round(time.perf_counter() - t0, 3),
                    examples=scored,
                )
            row[bin_label(bin_)] = cell
        cells[str(factor)] = row
        scored_cells = [c for c in row.values() if "accuracy" in c]
        if scored_cells:
            metrics[f"passkey/acc@{factor}x"] = float(np.mean([c["accuracy"] for c in scored_cells]))
            metrics[f"passkey/key_logprob@{factor}x"] = float(
                np.mean([c["key_logprob"] for c in scored_cells])
            )
        name = model.config.pos.name + (f"+{scaling}" if scaling else "")
        log.info("passkey, %s at %dx (%d tokens): %s", name, factor, length, format_row(row))
    return cells, metrics


def format_cell(cell: dict[str, Any]) -> str:
    if "accuracy" in cell:
        return f"{cell['correct']}/{len(cell['examples'])}"
    if "table of" in cell.get("error", ""):
        return "cannot run"
    return "too short"


def format_row(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {format_cell(c)}" for k, c in row.items())


def format_table(result: dict[str, Any]) -> str:
    """Markdown: one row per length, one column per depth bin, correct/trials in each cell."""
    if "error" in result:
        return f"passkey retrieval not run: {result['error']}"
    bins = result["depth_bins"]
    lines = [
        "| length | " + " | ".join(f"depth {b}" for b in bins) + " | accuracy | key log-prob |",
        "|---" * (len(bins) + 3) + "|",
    ]
    tables = [("", result["cells"], result["metrics"], "passkey/")]
    tables += [
        (f"{n} ", v["cells"], v["metrics"], f"passkey/{n}/") for n, v in result.get("scaled", {}).items()
    ]
    for name, cells, metrics, prefix in tables:
        for factor in result["factors"]:
            if str(factor) not in cells:
                continue
            row = cells[str(factor)]
            acc = metrics.get(f"{prefix}acc@{factor}x")
            lp = metrics.get(f"{prefix}key_logprob@{factor}x")
            lines.append(
                f"| {name}{factor}x ({factor * result['train_context']}) | "
                + " | ".join(format_cell(row[b]) for b in bins)
                + f" | {'-' if acc is None else f'{acc:.0%}'} | {'-' if lp is None else f'{lp:.2f}'} |"
            )
    notes = sorted({c["error"] for row in result["cells"].values() for c in row.values() if "error" in c})
    return "\n".join(lines + [f"\n{n}" for n in notes])


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``passkey.json``, ``passkey.md`` and ``passkey.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / RESULT_FILE
    # strict JSON, whole or not at all; a diverged model's key log-probability (NaN) as "nan"
    write_json(json_path, all_figures_as_json(result))
    md_path = out_dir / "passkey.md"
    md_path.write_text(format_table(result) + "\n")
    from gptlab.evaluation.plots import plot_passkey_heatmap

    return [json_path, md_path, plot_passkey_heatmap(result, out_dir / "passkey.png", format_cell)]


def results_table(result: dict[str, Any]) -> StudyTable:
    """The study as a table of one row per (factor, depth) cell (logged as ``passkey/table``)."""
    rows = [
        [int(f), cell["context"], b, cell.get("accuracy"), cell.get("key_logprob"), cell.get("error")]
        for f, row in result.get("cells", {}).items()
        for b, cell in row.items()
    ]
    return StudyTable(columns=["factor", "context", "depth", "accuracy", "key_logprob", "error"], rows=rows)


def run_study(
    model: GPT,
    tokenizer: Tokenizer,
    train_context: int,
    factors: Sequence[int],
    options: PasskeyOptions | None,
    out_dir: Path,
    scalings: Sequence[str] = (),
) -> tuple[dict[str, Any] | None, list[Path]]:
    """The length study's passkey part: ``options`` are ``eval_length.passkey``'s, as the run's config parsed
    them (None or enabled=false: off); ``scalings``: the length study's context scalings (those the scheme
    has are run too)."""
    if options is None or not options.enabled:
        return None, []
    result = evaluate_passkey(model, tokenizer, train_context, factors, options, scalings)
    return result, write_outputs(result, out_dir)
