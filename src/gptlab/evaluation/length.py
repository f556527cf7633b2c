"""Length extrapolation: validation loss, perplexity and bits per byte at 1x, 2x, 4x, 8x the training context,
and the loss at each token position.

A model trained on windows of ``T`` tokens is evaluated on non-overlapping validation windows of ``f * T``
tokens. Schemes without a bounded table run at every length; a scheme with a table (``learned``) is reported as
unable to run past it. A scheme with context-scaling methods (RoPE and xPos: linear interpolation, NTK-aware,
YaRN) is also evaluated with each of them set to the factor ``f``, since those exist exactly for this question.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gptlab.data.tokenizers import TokenBytes, Tokenizer, bits_per_byte
from gptlab.errors import EvaluationStopped
from gptlab.evaluation import passkey, plots
from gptlab.evaluation.long_context import perplexity
from gptlab.evaluation.options import ROPE_SCALINGS, LengthEvalOptions
from gptlab.model import attention
from gptlab.model.gpt import GPT
from gptlab.runs.jsonfile import all_figures_as_json, write_json
from gptlab.runs.layout import EVAL_LENGTH_DIR, LENGTH_FILE
from gptlab.tracking.studies import LengthStudy, StudyTable, log_length_study, log_length_study_as_new_run

log = logging.getLogger(__name__)

RESULT_FILE = LENGTH_FILE  # <run dir>/eval_length/length.json (gptlab.runs.layout)

# The parts of the study after training, as result.json's ``stopped_during`` names them (their config keys).
LENGTH_PART, PASSKEY_PART = "eval_length", "eval_length.passkey"


class StudyStopped(EvaluationStopped):
    """A stop signal that ended the study after training: in which part (``during``: :data:`LENGTH_PART` or
    :data:`PASSKEY_PART`), what was finished before it (``result``: the length study's entries scored, without
    the entry under way; no passkey figure) and the figures a whole study would have added (``missing``:
    :func:`summary_metrics`' names)."""

    def __init__(self, signum: int, during: str, result: dict[str, Any], missing: Sequence[str] = ()) -> None:
        super().__init__(signum)
        self.during, self.result, self.missing = during, result, list(missing)


# ---- evaluation -----------------------------------------------------------------------------------


@torch.no_grad()
def loss_by_position(
    model: GPT, tokens: np.ndarray, context: int, batch_tokens: int, pad_last_batch: bool | None = None
) -> tuple[np.ndarray, int]:
    """Mean next-token loss at each of the ``context`` positions over non-overlapping windows of ``tokens``;
    returns the (context,) losses and the number of windows.

    The windows run ``batch_tokens // context`` at a time. ``pad_last_batch``: run the last, smaller batch at
    the others' size, its extra rows copies of its last window whose losses are dropped before they are
    counted (the figures are the same either way); None pads where the model attends through compiled
    FlexAttention (``runs_compiled_flex_attention``), whose kernel is compiled once per batch size, so that
    each length compiles once and not twice. Elsewhere the copies would be computed for nothing."""
    n_windows = (len(tokens) - 1) // context
    if n_windows == 0:
        raise ValueError(f"{len(tokens)} validation tokens hold no window of {context + 1}")
    device = next(model.parameters()).device
    if pad_last_batch is None:
        pad_last_batch = runs_compiled_flex_attention(model, device)
    batch = min(n_windows, max(1, batch_tokens // context))  # one batch of all when they fit: nothing to pad
    total = torch.zeros(context, dtype=torch.float64)
    for start in range(0, n_windows, batch):
        rows = list(range(start, min(n_windows, start + batch)))
        scored = len(rows)
        if pad_last_batch:
            rows += [rows[-1]] * (batch - scored)
        rows_np = np.stack([tokens[i * context : i * context + context + 1] for i in rows]).astype(np.int64)
        windows = torch.from_numpy(rows_np).to(device)  # (B, context + 1)
        logits, _ = model(windows[:, :-1])  # (B, context, vocab)
        loss = F.cross_entropy(
            logits.float().transpose(1, 2), windows[:, 1:], reduction="none"
        )  # (B, context)
        total += loss[:scored].double().sum(0).cpu()  # the padding's rows never counted
    return (total / n_windows).numpy(), n_windows


def runs_compiled_flex_attention(model: GPT, device: torch.device) -> bool:
    """Whether ``model``'s evaluation passes on ``device`` attend through compiled FlexAttention (GPT.forward's
    route: a positional bias, a window or a logit cap, on CUDA), which compiles a kernel per batch size."""
    dropout = model.training and model.config.dropout > 0  # FlexAttention has no dropout
    return (
        model.takes_flex_attention
        and not dropout
        and attention.flex_attention_available(device, model.config.head_dim)
    )


def unsupported_reason(model: GPT, context: int) -> str | None:
    """Why the model cannot run at ``context`` tokens, or None when it can."""
    limit = model.transformer.pos.max_positions
    if limit is not None and context > limit:
        return (
            f"pos={model.config.pos.name} has a table of {limit} positions and no vector for the positions past it, "
            f"so it cannot run at {context} tokens"
        )
    return None


def evaluate_lengths(
    model: GPT,
    tokens: np.ndarray,
    train_context: int,
    options: LengthEvalOptions | None = None,
    tokenizer: Tokenizer | None = None,
    interrupting: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, Any]:
    """Loss, perplexity, bits per byte (with the ``tokenizer`` the tokens come from) and loss by position at
    each factor of ``train_context``, for the model as trained and with each context-scaling method its scheme
    has. ``tokens``: the flat validation token ids. ``interrupting``: where a stop signal ends the work at once
    (:meth:`gptlab.runs.signals.StopSignals.interrupting`); it comes out as :class:`StudyStopped`, with the
    entries finished."""
    options = options or LengthEvalOptions()
    token_bytes = TokenBytes.of(tokenizer) if tokenizer is not None else None
    split_tokens = len(tokens)
    if options.max_tokens is not None:
        tokens = tokens[: options.max_tokens]
    was_training = model.training
    model.eval()
    variants = _length_variants(model, options)
    result: dict[str, Any] = {
        "pos": model.config.pos.name,
        "pos_options": dataclasses.asdict(model.config.pos.options),
        "train_context": train_context,
        "factors": list(options.factors),
        "validation_tokens": int(len(tokens)),  # those studied: the first eval_length.max_tokens
        "split_tokens": int(split_tokens),  # the validation split's
        "variants": {},
    }
    try:
        with interrupting():
            for name, scaling in variants:
                entries: dict[str, Any] = {}
                result["variants"][name] = entries  # filled as each entry is finished
                for factor in options.factors:
                    if scaling is not None and factor == 1:
                        continue  # scaling by 1 is the model as trained
                    entry = _length_entry(
                        model, tokens, name, factor, factor * train_context, scaling, options, token_bytes
                    )
                    entries[str(factor)] = entry
                _log_not_evaluated(name, entries)
    except EvaluationStopped as stop:
        raise StudyStopped(stop.signum, LENGTH_PART, result) from None
    finally:
        model.train(was_training)
    return result


def _log_not_evaluated(name: str, entries: dict[str, Any]) -> None:
    """One line for the factors of a variant that could not be evaluated, with the reason at the shortest of
    them (a longer context fails for the same reason: a position table or a split too short)."""
    skipped = [(factor, entry) for factor, entry in entries.items() if "error" in entry]
    if not skipped:
        return
    factors = ", ".join(f"{factor}x" for factor, _ in skipped)
    contexts = ", ".join(f"{entry['context']:,}" for _, entry in skipped)
    more = " (and so at the longer ones)" if len(skipped) > 1 else ""
    log.info(
        "%s at %s (%s tokens): not evaluated: %s%s", name, factors, contexts, skipped[0][1]["error"], more
    )


def _length_variants(model: GPT, options: LengthEvalOptions) -> list[tuple[str, str | None]]:
    """(name, scaling) of the scheme as trained and of each context-scaling method it has among those asked."""
    pos = model.transformer.pos
    variants: list[tuple[str, str | None]] = [(model.config.pos.name, None)]
    variants += [
        (f"{model.config.pos.name}+{s}", s) for s in options.rope_scalings if s in pos.context_scalings
    ]
    return variants


def _length_entry(
    model: GPT,
    tokens: np.ndarray,
    name: str,
    factor: int,
    context: int,
    scaling: str | None,
    options: LengthEvalOptions,
    token_bytes: TokenBytes | None = None,
) -> dict[str, Any]:
    """One variant at one factor: its scores, or the reason it could not be evaluated."""
    entry: dict[str, Any] = {"context": context}
    reason = _skip_reason(model, tokens, context)
    if reason is not None:
        entry["error"] = reason
    else:
        entry.update(_score_at_length(model, tokens, context, factor, scaling, options.batch_tokens))
        if token_bytes is not None:
            # the scored tokens are tokens[1 : tokens + 1], each after the one before it
            scored = entry["tokens"]
            entry["bytes"] = token_bytes.count_array(tokens[:scored], tokens[1 : scored + 1])
            entry["bpb"] = bits_per_byte(entry["loss"] * scored, entry["bytes"])
        log.info(
            "%s at %dx (%d tokens): loss %.4f, perplexity %.2f%s",
            name,
            factor,
            context,
            entry["loss"],
            entry["ppl"],
            f", {entry['bpb']:.4f} bits per byte" if "bpb" in entry else "",
        )
    return entry


def _skip_reason(model: GPT, tokens: np.ndarray, context: int) -> str | None:
    """Why ``model`` is not evaluated at ``context`` tokens of ``tokens``, or None when it is."""
    reason = unsupported_reason(model, context)
    if reason is None and len(tokens) - 1 < context:
        reason = f"the validation split has {len(tokens)} tokens, fewer than {context + 1}"
    return reason


def _score_at_length(
    model: GPT, tokens: np.ndarray, context: int, factor: int, scaling: str | None, batch_tokens: int
) -> dict[str, Any]:
    """Loss, perplexity and loss by position at ``context`` tokens, with ``scaling`` set to ``factor`` if any."""
    pos = model.transformer.pos
    t0 = time.perf_counter()
    with pos.scaled(float(factor), scaling) if scaling is not None else nullcontext():
        by_position, windows = loss_by_position(model, tokens, context, batch_tokens)
    loss = float(by_position.mean())
    return {
        "loss": loss,
        "ppl": perplexity(loss),
        "windows": windows,
        "tokens": windows * context,
        "seconds": time.perf_counter() - t0,
        "loss_by_position": [round(float(v), 5) for v in by_position],
    }


def summary_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Flat metrics, e.g. ``length/rope+yarn/loss@4x``; the scheme as trained is ``length/loss@4x``."""
    out: dict[str, float] = {}
    for name, entries in result["variants"].items():
        prefix = "length/" if name == result["pos"] else f"length/{name}/"
        for factor, entry in entries.items():
            if "loss" in entry:
                out[f"{prefix}loss@{factor}x"] = entry["loss"]
                out[f"{prefix}ppl@{factor}x"] = entry["ppl"]
            if "bpb" in entry:
                out[f"{prefix}bpb@{factor}x"] = entry["bpb"]
    out.update((result.get("passkey") or {}).get("metrics", {}))
    return out


def planned_metrics(
    model: GPT,
    tokens: np.ndarray,
    train_context: int,
    options: LengthEvalOptions,
    tokenizer: Tokenizer | None,
    passkey_options: passkey.PasskeyOptions | None,
) -> list[str]:
    """The names :func:`summary_metrics` gives for the whole study (the passkey study's included), found
    without running the model: each entry that can run (as :func:`evaluate_lengths` and
    :func:`gptlab.evaluation.passkey.evaluate_passkey` decide it) and its figures. A stopped study's missing
    figures are those of these it did not reach."""
    if options.max_tokens is not None:
        tokens = tokens[: options.max_tokens]
    names: list[str] = []
    for name, scaling in _length_variants(model, options):
        prefix = "length/" if scaling is None else f"length/{name}/"
        for factor in options.factors:
            if (scaling is not None and factor == 1) or _skip_reason(model, tokens, factor * train_context):
                continue
            kinds = ("loss", "ppl", "bpb") if tokenizer is not None else ("loss", "ppl")
            names += [f"{prefix}{kind}@{factor}x" for kind in kinds]
    if passkey_options is None or not passkey_options.enabled or tokenizer is None:
        return names
    if passkey.encodability_error(tokenizer, passkey_options.key_digits) is not None:
        return names
    pos = model.transformer.pos
    methods = [s for s in options.rope_scalings if s in getattr(pos, "context_scalings", ())]
    for scaling in [None, *methods]:
        prefix = "passkey/" if scaling is None else f"passkey/{model.config.pos.name}+{scaling}/"
        for factor in options.factors:
            length = factor * train_context
            if (scaling is not None and factor == 1) or passkey.bounded_reason(model, length) is not None:
                continue
            bins = passkey.depth_bins(passkey_options.depths)
            key = passkey_options.seed, factor
            if any(
                not isinstance(
                    passkey.build_prompts(
                        tokenizer, length, bin_, passkey_options.trials, (*key, b), passkey_options.key_digits
                    ),
                    str,
                )
                for b, bin_ in enumerate(bins)
            ):  # a cell with a prompt that fits: the factor has its figures
                names += [f"{prefix}acc@{factor}x", f"{prefix}key_logprob@{factor}x"]
    return names


def format_table(result: dict[str, Any]) -> str:
    factors = result["factors"]
    head = "| variant | " + " | ".join(f"{f}x ({f * result['train_context']})" for f in factors) + " |"
    lines = [head, "|---" * (len(factors) + 1) + "|"]
    for name, entries in result["variants"].items():
        cells = []
        for f in factors:
            entry = entries.get(str(f))
            if entry is None:
                cells.append("(as trained)")
            elif "loss" in entry:
                bpb = f", {entry['bpb']:.3f} bpb" if "bpb" in entry else ""
                cells.append(f"{entry['loss']:.3f} (ppl {entry['ppl']:.1f}{bpb})")
            else:
                cells.append("cannot run")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    scored = scored_tokens_line(result)
    return "\n".join(lines) + (f"\n{scored}" if scored else "")


def scored_tokens_line(result: dict[str, Any]) -> str:
    """Which tokens each column's figures are over: a context scores its whole windows of the studied
    tokens, so a longer one can leave more of the tail out, and ``eval_length.max_tokens`` studies only the
    first tokens of the split. Empty where no figure was measured."""
    trained = result["variants"].get(result["pos"], {})
    counts = [f"{factor}x {entry['tokens']:,}" for factor, entry in trained.items() if "tokens" in entry]
    if not counts:
        return ""
    studied = int(result["validation_tokens"])
    split = int(result.get("split_tokens", studied))  # a length.json written before it was recorded
    of = (
        f"the {studied:,} validation tokens"
        if studied == split
        else f"the first {studied:,} of the {split:,} validation tokens (eval_length.max_tokens)"
    )
    return (
        f"Tokens scored at each context, its whole windows (the first token and the tail after the last window "
        f"are not): {', '.join(counts)}, of {of}"
    )


# ---- outputs --------------------------------------------------------------------------------------


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``length.json`` and the plots in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULT_FILE
    # strict JSON, a diverged model's figures (a NaN loss, an infinite perplexity) as "nan" and "inf"; whole or
    # not at all: never a part that reads as a shorter study
    write_json(path, all_figures_as_json(result))
    return [path, *plots.plot_length_result(result, out_dir)]


def study_to_log(result: dict[str, Any], paths: Sequence[Path]) -> LengthStudy:
    """What is logged to W&B of the study: the summary metrics, a table of one row per (variant, factor), the
    plots among ``paths`` and the passkey study's table when there was one."""
    rows = [
        [name, int(factor), entry["context"], entry.get("loss"), entry.get("ppl"), entry.get("bpb")]
        for name, entries in result["variants"].items()
        for factor, entry in entries.items()
    ]
    return LengthStudy(
        summary=summary_metrics(result),
        table=StudyTable(columns=["variant", "factor", "context", "loss", "ppl", "bpb"], rows=rows),
        paths=paths,
        passkey_table=passkey.results_table(result["passkey"]) if result.get("passkey") else None,
    )


# ---- entry points ---------------------------------------------------------------------------------


def evaluate_run(
    path: str | Path,
    options: LengthEvalOptions | None = None,
    out_dir: str | Path | None = None,
    use_wandb: bool = True,
    device: str | None = None,
    passkey_options: passkey.PasskeyOptions | None = None,
) -> tuple[dict[str, Any], list[Path]]:
    """Evaluate a run directory or checkpoint; writes JSON and plots to ``out_dir`` (default
    ``<run dir>/eval_length``) and, when the run logged to W&B, a W&B run in the same group.
    ``passkey_options``: the passkey study's (gptlab.evaluation.passkey); None skips it."""
    from gptlab.runs.trained import held_out_tokens, load_run

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    trained = load_run(path, device)
    tokens = held_out_tokens(trained)
    result = evaluate_lengths(trained.model, tokens, trained.train_context, options, trained.tokenizer)
    result["checkpoint"] = str(trained.checkpoint)
    out_dir = Path(out_dir) if out_dir else (trained.run_dir or trained.checkpoint.parent) / EVAL_LENGTH_DIR
    paths = write_outputs(result, out_dir)
    if passkey_options is not None:
        study, more = passkey.run_study(
            trained.model,
            trained.tokenizer,
            trained.train_context,
            result["factors"],
            passkey_options,
            out_dir,
            (options or LengthEvalOptions()).rope_scalings,
        )
        result["passkey"], paths = study, paths + more
    if use_wandb and trained.run_dir is not None:
        wandb_run_dir = log_length_study_as_new_run(
            study_to_log(result, paths),
            trained.run_dir,
            config={"pos": result["pos"], "train_context": result["train_context"]},
        )
        if wandb_run_dir is not None:
            result["wandb_run"] = str(wandb_run_dir)
            write_json(out_dir / RESULT_FILE, all_figures_as_json(result))
    return result, paths


def after_training(
    model: GPT,
    prepared: Any,
    train_context: int,
    options: LengthEvalOptions,
    passkey_options: passkey.PasskeyOptions | None,
    run_dir: Path,
    loggers: Sequence[Any],
    interrupting: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, Any]:
    """The training task's hook (``eval_length.enabled=true``): evaluate the freshly trained model, write
    ``<run dir>/eval_length/`` and log to the run's own W&B run when it has one. ``prepared``: the run's
    ``PreparedCorpus``; ``passkey_options``: None for no passkey study.

    ``interrupting`` (:meth:`gptlab.runs.signals.StopSignals.interrupting`): a stop signal ends the
    scoring at once, with :class:`StudyStopped` (what was finished, what is missing); one that comes while a
    file is written waits for it (``length.json`` whole; the passkey study does not start). Nothing of a
    stopped part is written, and nothing is logged."""
    tokens = prepared.val.array()  # one flat file, header-carrying shards or a stream's held-out tokens
    out_dir = run_dir / EVAL_LENGTH_DIR

    def stopped(stop: StudyStopped) -> StudyStopped:
        done = summary_metrics(stop.result)
        planned = planned_metrics(model, tokens, train_context, options, prepared.tokenizer, passkey_options)
        stop.missing = [name for name in planned if name not in done]
        return stop

    try:
        result = evaluate_lengths(model, tokens, train_context, options, prepared.tokenizer, interrupting)
    except StudyStopped as stop:
        raise stopped(stop) from None
    paths = write_outputs(result, out_dir)
    log.info("Length extrapolation (validation loss by context):\n%s", format_table(result))
    study: dict[str, Any] | None = None
    if passkey_options is not None and passkey_options.enabled:  # passkey.run_study's test
        try:
            with interrupting():
                study = passkey.evaluate_passkey(
                    model, prepared.tokenizer, train_context, options.factors, passkey_options,
                    options.rope_scalings,
                )  # fmt: skip
        except EvaluationStopped as stop:
            raise stopped(StudyStopped(stop.signum, PASSKEY_PART, result)) from None
        paths += passkey.write_outputs(study, out_dir)
    result["passkey"] = study
    if study is not None:
        log.info("Passkey retrieval (correct / trials):\n%s", passkey.format_table(study))
    log_length_study(study_to_log(result, paths), loggers)
    return result


def rerun_command(
    run_dir: Path, options: LengthEvalOptions, passkey_options: passkey.PasskeyOptions | None
) -> str:
    """``scripts/eval_length.py`` on ``run_dir``'s last checkpoint with the study's options as the run had
    them (those left at their defaults unsaid): the figures the study after training gives. The batch sizes
    change none of them."""
    args = ["python", "scripts/eval_length.py", str(run_dir), "--factors", *map(str, options.factors)]
    if options.max_tokens is not None:
        args += ["--max-tokens", str(options.max_tokens)]
    if options.batch_tokens != LengthEvalOptions.batch_tokens:
        args += ["--batch-tokens", str(options.batch_tokens)]
    if list(options.rope_scalings) != list(ROPE_SCALINGS):
        args += ["--rope-scalings", *options.rope_scalings]
    if passkey_options is None or not passkey_options.enabled:
        args.append("--no-passkey")
    else:
        p = passkey_options
        args += ["--passkey-depths", str(p.depths), "--passkey-trials", str(p.trials)]
        args += ["--passkey-seed", str(p.seed)]
        if p.key_digits != passkey.PasskeyOptions.key_digits:
            args += ["--passkey-key-digits", str(p.key_digits)]
    return shlex.join(args)
