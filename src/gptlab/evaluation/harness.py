"""A trained gptlab run as a model of EleutherAI's lm-evaluation-harness (``lm-eval``, Gao et al. 2021-).

The class below implements the harness's three request types on the run's own model and tokenizer:

- ``loglikelihood``: log p(continuation | context), summed over the continuation's tokens, and whether greedy
  decoding would produce it; batched, longest first, padded on the right (causal attention never reads the
  padding).
- ``loglikelihood_rolling``: a document's total log-likelihood, cut into the harness's own rolling windows
  of the model's context (``lm_eval.utils.get_rolling_token_windows``: every token predicted once, the first
  conditioned on ``<|endoftext|>``), so that word/byte perplexities compare with any other harness model.
- ``generate_until``: incremental decoding with the model's KV cache, stopping at the task's stop sequences
  or ``<|endoftext|>``; contexts of equal token length are decoded as one batch (the model takes no padding
  mask, so only equal lengths can share a batch without changing the result).

``lm-eval`` 0.4.13 has no entry-point mechanism for model backends (its registry is a fixed table in
``lm_eval/models/__init__.py``): importing this module registers ``gptlab`` in-process, and
``python -m gptlab.evaluation.harness run --model gptlab --model_args run=<run dir> --tasks ...`` is the harness's
own command line with that registration done.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from gptlab.errors import ConfigError, DataError
from gptlab.evaluation.downstream import flat_metrics
from gptlab.model.gpt import GPT, KVCache, sample_next
from gptlab.runs.jsonfile import all_figures_as_json, write_json, write_json_lines
from gptlab.tracking.studies import StudyTable, log_harness_results

log = logging.getLogger(__name__)

RESULT_DIR = "eval_harness"


def load_trained_run(path: str | Path, device: str, which: str = "last") -> Any:
    """The one place that turns a run directory or checkpoint into (model, tokenizer, context)."""
    from gptlab.runs.trained import load_run

    return load_run(path, device, which)


@register_model("gptlab")
class GptlabLM(TemplateLM):
    """A gptlab run (run directory or ``.ckpt``) for lm-evaluation-harness.

    ``max_length`` is the window the harness may fill (default: the run's training context); a scheme with a
    bounded position table (``max_positions``) cannot be given more than its table."""

    def __init__(
        self,
        run: Any = None,
        batch_size: int | str | None = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        which: str = "last",
        seed: int = 1234,
        **_: Any,
    ) -> None:
        super().__init__()
        if run is None:
            raise ConfigError("The gptlab harness model needs run=<run directory or .ckpt file>.")
        if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval's command line passes device=cuda by default: fall back as its own models do.
            device = "cuda" if torch.cuda.is_available() else "cpu"
        trained = run if hasattr(run, "model") else load_trained_run(run, device, which)
        self.run = trained
        self.model: GPT = trained.model.to(device).eval()
        self.tok = trained.tokenizer
        self._device = torch.device(device)
        limit = self.model.transformer.pos.max_positions
        self.max_length = int(max_length or trained.train_context)
        if limit is not None and self.max_length > limit:
            raise ConfigError(
                f"max_length={self.max_length} is past the {limit}-position table of pos={self.model.config.pos.name}: "
                f"pass max_length<={limit}."
            )
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        self.batch_size = max(1, int(batch_size))
        self.max_gen_toks = int(max_gen_toks)
        self.generator = torch.Generator(device=self._device).manual_seed(int(seed))
        self.eot_text = self.tok.decode([self.tok.eot_id])
        self.unknown_words = 0
        self.unknown_chars = 0  # characters a char vocabulary with <|unk|> mapped to it
        if hasattr(self.tok, "unknown_chars"):
            self.tok.unknown_chars = 0

    # ---- tokenization --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = self.tok.encode(string)
        unk = getattr(self.tok, "unk_id", None)
        if unk is not None:
            if getattr(self.tok, "unit", "words") == "characters":
                self.unknown_chars += ids.count(unk)
            else:
                self.unknown_words += ids.count(unk)
        return ids

    def out_of_vocabulary(self) -> dict[str, int]:
        """What the run's vocabulary could not represent in the task texts: characters a char vocabulary
        without <|unk|> dropped, characters or words a vocabulary with one mapped to it (their scores are of
        a different text), counted over every encoding the harness asks for (a context is encoded once alone
        and once with its continuation)."""
        return {
            "dropped_chars": getattr(self.tok, "unknown_chars", 0),
            "unk_chars": self.unknown_chars,
            "unk_words": self.unknown_words,
        }

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(tokens)

    # ---- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), all greedy) per (key, context ids, continuation ids); the
        input keeps the last ``max_length`` tokens of context + continuation, as the harness's models do."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        inputs = []
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:
                out[i] = (0.0, True)
                continue
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"A continuation of {len(continuation)} tokens cannot be scored in a window of "
                    f"max_length={self.max_length} tokens: raise max_length (a scheme that extrapolates) or "
                    "use a task with shorter continuations."
                )
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            inputs.append((i, whole[:-1], whole[-len(continuation) :]))
        inputs.sort(key=lambda r: -len(r[1]))  # similar lengths share a batch: less padding
        for start in range(0, len(inputs), self.batch_size):
            batch = inputs[start : start + self.batch_size]
            width = len(batch[0][1])
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (_, tokens, _) in enumerate(batch):
                ids[row, : len(tokens)] = torch.tensor(tokens)
            logits, _ = self.model(ids.to(self._device))  # (B, width, vocab)
            for row, (i, tokens, continuation) in enumerate(batch):
                n = len(continuation)
                logprobs = F.log_softmax(
                    logits[row, len(tokens) - n : len(tokens)].double(), dim=-1
                )  # (n, V)
                target = torch.tensor(continuation, device=logprobs.device)
                total = float(logprobs.gather(1, target[:, None]).sum())
                greedy = bool((logprobs.argmax(-1) == target).all())
                out[i] = (total, greedy)
        for (key, _, _), answer in zip(requests, out):
            if key is not None and isinstance(key, tuple) and all(k is not None for k in key):
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation ----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple[int, str], list[tuple[int, list[int], dict[str, Any]]]] = defaultdict(list)
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            # The harness's rule: keep the last (max_length - max_new) context tokens.
            keep = max(1, self.max_length - max_new)
            tokens = (self.tok_encode(context) or [self.prefix_token_id])[-keep:]
            key = (len(tokens), json.dumps(gen_kwargs, sort_keys=True, default=str))
            groups[key].append((index, tokens, gen_kwargs))
        for (_, _), members in groups.items():
            gen_kwargs = members[0][2]
            for start in range(0, len(members), self.batch_size):
                batch = members[start : start + self.batch_size]
                texts = self.generate_batch([m[1] for m in batch], **gen_kwargs)
                for (index, _, _), text in zip(batch, texts):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def generate_batch(
        self,
        contexts: list[list[int]],
        until: str | Sequence[str] | None = None,
        max_gen_toks: int | None = None,
        do_sample: bool = False,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        **_: Any,
    ) -> list[str]:
        """Continue equal-length token contexts (greedy unless ``do_sample``), each cut at its first stop
        sequence; decoding ends when every row has stopped."""
        stops = [until] if isinstance(until, str) else list(until or [])
        stops = [s for s in stops if s] + [self.eot_text]
        max_new = int(max_gen_toks or self.max_gen_toks)
        limit = self.model.transformer.pos.max_positions
        if limit is not None:
            max_new = min(max_new, limit - len(contexts[0]))
        temperature = float(temperature) if do_sample else 0.0
        idx = torch.tensor(contexts, dtype=torch.long, device=self._device)  # (B, T)
        cache = KVCache.empty(self.model.config.n_layer)
        last = self.model.prefill(idx, cache)  # (B, vocab): the context in chunks of bounded attention mask
        generated: list[list[int]] = [[] for _ in contexts]
        done = [False] * len(contexts)
        for step in range(max(0, max_new)):
            next_id = sample_next(last, temperature, top_k, top_p, self.generator)  # (B, 1)
            for row, token in enumerate(next_id[:, 0].tolist()):
                if done[row]:
                    continue
                generated[row].append(token)
                tail = self.tok_decode(generated[row][-32:])
                done[row] = token == self.tok.eot_id or any(s in tail for s in stops)
            if all(done) or step == max_new - 1:
                break
            logits, _ = self.model(next_id, cache=cache)
            last = logits[:, -1, :]
        return [cut_at_stops(self.tok_decode(g), stops) for g in generated]


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """``text`` up to its earliest stop sequence."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text


# ---- running the harness on a run ---------------------------------------------------------------


def evaluate(
    path: str | Path,
    tasks: Sequence[str],
    include_path: str | Path | Sequence[str | Path] | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    device: str | None = None,
    which: str = "last",
    log_samples: bool = False,
    out_dir: str | Path | None = None,
    use_wandb: bool = True,
    seed: int = 1234,
    bootstrap_iters: int = 100000,
) -> tuple[dict[str, Any], Path]:
    """Run the harness on a run: returns the results and the path of ``<run dir>/eval_harness/results.json``
    (or ``out_dir``); logs ``harness/<task>/<metric>`` to the run's W&B run when it has one."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ConfigError(
            "No tasks given: pass tasks=hellaswag,lambada_openai (or a task of --include-path)."
        )
    lm = GptlabLM(
        run=path, batch_size=batch_size, max_length=max_length, device=device, which=which, seed=seed
    )
    manager = TaskManager(include_path=include_path)
    _check_known_tasks(manager, tasks)
    results = _simple_evaluate(lm, manager, tasks, num_fewshot, limit, log_samples, seed, bootstrap_iters)
    run = lm.run
    out_dir = Path(out_dir) if out_dir else (run.run_dir or run.checkpoint.parent) / RESULT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = results.pop("samples", None) or {}
    record = _result_record(lm, results)
    _warn_out_of_vocabulary(lm, record["out_of_vocabulary"])
    _write_samples(out_dir, samples)
    if use_wandb and run.run_dir is not None:
        folder = log_harness_results(record["metrics"], harness_table(record["metrics"]), run.run_dir)
        if folder is not None:
            record["wandb_run"] = str(folder)
    path_out = out_dir / "results.json"
    # strict JSON (gptlab.runs.jsonfile), written whole: a diverged model's scores (a NaN perplexity, an
    # infinite one) as "nan" and "inf"; the harness's own "N/A" standard errors kept as it writes them
    write_json(path_out, all_figures_as_json(record, default=lm_utils.handle_non_serializable))
    return record, path_out


def _check_known_tasks(manager: Any, tasks: Sequence[str]) -> None:
    """Refuse task names the harness's task manager does not know."""
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"Unknown harness task(s) {unknown}: see `lm-eval ls tasks`, or pass the folder of your task "
            "YAMLs with --include-path DIR."
        )


def _simple_evaluate(
    lm: GptlabLM,
    manager: Any,
    tasks: Sequence[str],
    num_fewshot: int | None,
    limit: int | float | None,
    log_samples: bool,
    seed: int,
    bootstrap_iters: int,
) -> dict[str, Any]:
    """The harness's ``simple_evaluate`` on ``lm``, every seed set; an unreachable dataset is a DataError."""
    import lm_eval

    try:
        results: dict[str, Any] = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,  # the harness's default; 0 skips the standard errors
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except ConnectionError as e:
        raise DataError(
            f"A task's dataset is not on this machine and the Hugging Face hub cannot be reached ({e}). "
            "Connect (and unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE), or evaluate tasks with local data files: "
            "--include-path DIR with YAMLs that set dataset_path: json and dataset_kwargs.data_files."
        ) from None
    return results


def _result_record(lm: GptlabLM, results: dict[str, Any]) -> dict[str, Any]:
    """The ``results.json`` record: the run, checkpoint, versions, tokenizer, flat metrics and harness tables."""
    import lm_eval

    run = lm.run
    return {
        "run": str(run.run_dir or run.checkpoint),
        "checkpoint": str(run.checkpoint),
        "lm_eval_version": lm_eval.__version__,
        "max_length": lm.max_length,
        "tokenizer": lm.tok.name,
        "out_of_vocabulary": lm.out_of_vocabulary(),
        "metrics": flat_metrics(results),
        **{
            k: results[k]
            for k in ("results", "versions", "n-shot", "higher_is_better", "configs")
            if k in results
        },
    }


def _warn_out_of_vocabulary(lm: GptlabLM, out_of_vocabulary: dict[str, int]) -> None:
    """Warn when the run's tokenizer could not represent parts of the task texts."""
    if any(out_of_vocabulary.values()):
        log.warning(
            "The run's %s vocabulary could not represent parts of the task texts (%s): those scores are of "
            "the text without them.",
            lm.tok.name,
            out_of_vocabulary,
        )


def _write_samples(out_dir: Path, samples: dict[str, Any]) -> None:
    """Write each task's logged samples to ``samples_<task>.jsonl`` in ``out_dir``: strict JSON a line, each
    file whole; a non-finite log-likelihood as "nan", "inf" or "-inf" (gptlab.runs.jsonfile)."""
    for task, rows in samples.items():
        converted = [all_figures_as_json(row, default=lm_utils.handle_non_serializable) for row in rows]
        write_json_lines(out_dir / f"samples_{task}.jsonl", converted)


def harness_table(metrics: dict[str, float]) -> StudyTable:
    """The ``harness/<task>/<metric>`` metrics as a table of (task, metric, value) rows."""
    rows = [[k.split("/", 2)[1], k.split("/", 2)[2], v] for k, v in metrics.items()]
    return StudyTable(columns=["task", "metric", "value"], rows=rows)


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's own command line with ``--model gptlab`` registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
