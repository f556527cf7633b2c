"""Tokenization in several processes, each writing its own shard.

``multiprocessing`` rather than ``datasets.Dataset.map(num_proc=...)``: ``map`` would store every
document's ids as an Arrow list column (int64, four times the uint16 shards) in its own cache before they
could be written out, doubling the disk traffic of the largest step; here each process writes its shard
directly. At most ``num_proc + 1`` runs of documents are in flight, which bounds the memory.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.sources import BatchPlace, read_batch

log = logging.getLogger(__name__)

SUB_BATCH = 256  # documents per tiktoken call and per progress report

_worker: dict[str, Any] = {}


@dataclass
class TokenizeJob:
    """A run of consecutive documents: the texts themselves, or the places of their Arrow record batches.
    ``keep`` and ``is_val`` have one flag per document (per row of the batches); blank ones are skipped."""

    task: int
    keep: np.ndarray
    is_val: np.ndarray
    texts: list[str] | None = None
    places: list[BatchPlace] | None = None
    field: str = "text"

    def pieces(self) -> Iterator[tuple[list[str], np.ndarray]]:
        """(texts, is_val) of the kept documents, one record batch (or ``SUB_BATCH`` texts) at a time."""
        if self.places is None:
            texts = self.texts or []
            for start in range(0, len(texts), SUB_BATCH):
                stop = start + SUB_BATCH
                keep = self.keep[start:stop]
                yield [t for t, k in zip(texts[start:stop], keep) if k], self.is_val[start:stop][keep]
            return
        row = 0
        for place in self.places:
            keep = self.keep[row : row + place.rows]
            texts = read_batch(place, self.field).to_pylist()
            yield [t for t, k in zip(texts, keep) if k], self.is_val[row : row + place.rows][keep]
            row += place.rows


@dataclass
class JobResult:
    task: int
    documents: dict[str, int]
    tokens: dict[str, int]
    characters: int
    counts: np.ndarray  # (vocab_size,) token frequencies of the validation split
    symbols: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})  # tokens but separators
    unknown: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})  # <|unk|> per split


@dataclass
class TokenizeResult:
    train_shards: list[tuple[str, int]]  # (file name, tokens) in corpus order
    val_tokens: int
    splits: dict[str, dict[str, int]]
    counts: np.ndarray
    characters: int
    seconds: float = 0.0
    dropped_tasks: list[int] = field(default_factory=list)


def _init(tokenizer: Any, dtype: np.dtype, out_dir: Path, progress: Any) -> None:
    _worker.update(tokenizer=tokenizer, dtype=np.dtype(dtype), out_dir=Path(out_dir), progress=progress)


def _init_pool_worker(tokenizer: Any, dtype: np.dtype, out_dir: Path, progress: Any) -> None:
    # A stop signal is the parent's to report: it removes the work folder and says so in one line. A
    # scheduler's SIGTERM and a terminal's Ctrl-C reach every process of the job: a worker ends quietly
    # (SystemExit prints no traceback, as the parent's handlers, inherited by the fork, would), and by an
    # exception, not at once, so that an idle worker lets go of the pool's queue lock on the way out (killed
    # holding it, it would leave the pool's own shutdown waiting for it for ever).
    signal.signal(signal.SIGINT, _quit)
    signal.signal(signal.SIGTERM, _quit)
    _init(tokenizer, dtype, out_dir, progress)


def _quit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _report(docs: int, tokens: int) -> None:
    progress = _worker["progress"]
    if callable(progress):
        progress(docs, tokens)
    elif progress is not None:
        progress.put((docs, tokens))


def tokenize_job(job: TokenizeJob) -> JobResult:
    """Tokenize one run of documents into ``train_<task>.bin`` and ``val_<task>.bin``."""
    tok, dtype, out_dir = _worker["tokenizer"], _worker["dtype"], _worker["out_dir"]
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    documents = {"train": 0, "val": 0}
    tokens = {"train": 0, "val": 0}
    symbols = {"train": 0, "val": 0}
    unknown = {"train": 0, "val": 0}
    characters = 0
    files = {split: open(out_dir / f"{split}_{job.task:06d}.bin", "wb") for split in ("train", "val")}
    try:
        for texts, flags in _sub_batches(job.pieces()):
            characters += sum(len(t) for t in texts)
            ids = tok.encode_batch(texts)
            n_batch = 0
            for split, want in (("train", False), ("val", True)):
                docs = [x for x, v in zip(ids, flags) if v == want]
                if not docs:
                    continue
                flat = np.empty(sum(len(x) + 1 for x in docs), dtype=dtype)
                offset = 0
                for x in docs:  # the document's ids, then <|endoftext|>
                    flat[offset : offset + len(x)] = x
                    flat[offset + len(x)] = tok.eot_id
                    offset += len(x) + 1
                files[split].write(flat.tobytes())
                if want:  # the validation tokens' frequencies: the unigram baseline is theirs
                    counts += np.bincount(flat, minlength=tok.vocab_size)[: tok.vocab_size]
                if tok.unk_id is not None:
                    unknown[split] += int(np.count_nonzero(flat == tok.unk_id))
                documents[split] += len(docs)
                tokens[split] += len(flat)
                symbols[split] += len(flat) - len(docs)
                n_batch += len(flat)
            _report(len(texts), n_batch)
    finally:
        for f in files.values():
            f.close()
    return JobResult(job.task, documents, tokens, characters, counts, symbols, unknown)


def _sub_batches(pieces: Iterator[tuple[list[str], np.ndarray]]) -> Iterator[tuple[list[str], np.ndarray]]:
    for texts, flags in pieces:
        for start in range(0, len(texts), SUB_BATCH):
            yield texts[start : start + SUB_BATCH], flags[start : start + SUB_BATCH]


#: Seconds between two progress lines of a tokenization whose output is not a terminal.
PROGRESS_LINE_SECONDS = 60.0


class ProgressLines:
    """The tokenization's progress where stderr is not a terminal (a SLURM log, a file, a pipe): a log line
    every :data:`PROGRESS_LINE_SECONDS` ("Tokenizing ...: 40,000 / 79,000 documents, 1.65M tok/s"), as a
    run's training progress is given there, instead of a bar that tqdm redraws with carriage returns into
    one ever-longer line. A tokenization shorter than that prints nothing here: the corpus line that follows
    it says what was made."""

    def __init__(self, total: int, desc: str, every_seconds: float | None = None) -> None:
        self.total, self.desc = total, desc
        self.every_seconds = PROGRESS_LINE_SECONDS if every_seconds is None else every_seconds
        self.n = 0
        self.postfix = ""
        self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every_seconds:
            self.last = time.monotonic()
            rate = f", {self.postfix}" if self.postfix else ""
            log.info("%s: %s / %s documents%s", self.desc, f"{self.n:,}", f"{self.total:,}", rate)

    def set_postfix_str(self, s: str, refresh: bool = False) -> None:
        self.postfix = s

    def close(self) -> None:
        pass


def progress(total: int, desc: str) -> Any:
    """tqdm's bar on a terminal and in a notebook (tqdm.auto's widget: a notebook's stderr is no terminal),
    :class:`ProgressLines` elsewhere."""
    import sys

    from tqdm import autonotebook, std
    from tqdm.auto import tqdm

    if autonotebook.tqdm is std.tqdm and not sys.stderr.isatty():
        return ProgressLines(total, desc)
    return tqdm(total=total, desc=desc, unit="doc", dynamic_ncols=True, mininterval=1.0, smoothing=0.1)


def run_tokenize_jobs(
    jobs: Iterator[TokenizeJob],
    tokenizer: Any,
    dtype: np.dtype,
    out_dir: Path,
    num_proc: int,
    n_docs: int,
    max_tokens: int | None,
    desc: str,
) -> TokenizeResult:
    """Run the jobs (in order of ``task``) with a progress bar; stop reading once ``max_tokens`` training
    tokens are written. Leaves ``train_<task>.bin`` shards and one ``val.bin`` in ``out_dir``."""
    t0 = time.perf_counter()
    bar = progress(n_docs, desc)
    n_tokens = 0

    def advance(docs: int, tokens: int) -> None:
        nonlocal n_tokens
        n_tokens += tokens
        elapsed = time.perf_counter() - t0
        bar.set_postfix_str(f"{n_tokens / max(elapsed, 1e-9) / 1e6:.2f}M tok/s", refresh=False)
        bar.update(docs)  # after the rate: a progress line gives the rate up to these documents

    results: list[JobResult] = []

    def enough() -> bool:
        return max_tokens is not None and sum(r.tokens["train"] for r in results) >= max_tokens

    try:
        if num_proc <= 1:
            _init(tokenizer, dtype, out_dir, advance)
            for job in jobs:
                results.append(tokenize_job(job))
                if enough():
                    break
        else:
            results = _run_pool(jobs, tokenizer, dtype, out_dir, num_proc, advance, enough, results)
    finally:
        bar.close()
        _worker.clear()
    return _assemble(results, out_dir, np.dtype(dtype), max_tokens, time.perf_counter() - t0, tokenizer)


def _run_pool(
    jobs: Iterator[TokenizeJob],
    tokenizer: Any,
    dtype: np.dtype,
    out_dir: Path,
    num_proc: int,
    advance: Callable[[int, int], None],
    enough: Callable[[], bool],
    results: list[JobResult],
) -> list[JobResult]:
    # fork: the workers inherit the tokenizer instead of unpickling it; elsewhere the default method.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
    progress = ctx.Queue()

    def drain(wait: float) -> None:
        try:
            advance(*progress.get(timeout=wait))
            while True:
                advance(*progress.get_nowait())
        except queue.Empty:
            pass

    pool = ctx.Pool(num_proc, initializer=_init_pool_worker, initargs=(tokenizer, dtype, out_dir, progress))
    try:
        pending: list[Any] = []
        for job in jobs:
            pending.append(pool.apply_async(tokenize_job, (job,)))
            while len(pending) > num_proc:  # bounded in flight: the oldest finishes first
                while not pending[0].ready():
                    drain(0.2)
                results.append(pending.pop(0).get())
            if enough():
                break
        for res in pending:
            while not res.ready():
                drain(0.2)
            results.append(res.get())
        drain(0.0)
    except BaseException:
        _abandon(pool)
        raise
    # Every job has its result: the workers are idle, and are ended as on the way out of an error. Not
    # Pool.terminate, which takes the task queue's lock and then waits for each worker to exit: a worker that
    # its SIGTERM found waiting for the progress queue's lock, held by a sibling that had already exited, never
    # did, and the preparation waited for ever (seen once in the suite, its parent in waitpid).
    _abandon(pool)
    return results


def _abandon(pool: Any) -> None:
    """End a pool on the way out of an error or a stop signal without ``Pool.terminate``, which first takes the
    task queue's lock: a worker that the signal ended while it held that lock (an idle worker holds it while
    it waits for a task) never gives it back, and the shutdown then waits for ever (seen with SIGTERM sent to
    a preparing job's process group). The pool's worker handler is stopped first, so that no worker is started
    in place of one that ended; the workers are killed and reaped; the pool's own finalizer, which would take
    the lock at exit, is cancelled (its handler threads are daemons and end with the process)."""
    from multiprocessing.pool import TERMINATE

    pool._worker_handler._state = TERMINATE
    pool._change_notifier.put(None)
    pool._worker_handler.join(timeout=10)
    for worker in pool._pool:
        if worker.exitcode is None:
            worker.kill()
    for worker in pool._pool:
        worker.join(timeout=10)
    pool._terminate.cancel()


def _assemble(
    results: list[JobResult],
    out_dir: Path,
    dtype: np.dtype,
    max_tokens: int | None,
    seconds: float,
    tokenizer: Any,
) -> TokenizeResult:
    """Order the shards, cut them at ``max_tokens`` training tokens, and join the validation pieces into
    one ``val.bin`` (the validation split is small and is read whole by evaluations). Per split: its
    documents, tokens, ``symbols`` (tokens without the separators) and ``unknown`` (``<|unk|>`` ids)."""
    itemsize = dtype.itemsize
    results.sort(key=lambda r: r.task)
    kept, train_total = [], 0
    for r in results:
        if max_tokens is not None and train_total >= max_tokens:
            for split in ("train", "val"):
                os.remove(out_dir / f"{split}_{r.task:06d}.bin")
            continue
        kept.append(r)
        if max_tokens is not None and train_total + r.tokens["train"] > max_tokens:
            r.tokens["train"] = max_tokens - train_total
            shard = out_dir / f"train_{r.task:06d}.bin"
            # the symbols and unknowns of the part cut off are not in the cache
            cut = np.fromfile(shard, dtype=dtype, offset=r.tokens["train"] * itemsize)
            r.symbols["train"] -= int(np.count_nonzero(cut != tokenizer.eot_id))
            if tokenizer.unk_id is not None:
                r.unknown["train"] -= int(np.count_nonzero(cut == tokenizer.unk_id))
            os.truncate(shard, r.tokens["train"] * itemsize)
        train_total += r.tokens["train"]
    with open(out_dir / "val.bin", "wb") as val:
        for r in kept:
            piece = out_dir / f"val_{r.task:06d}.bin"
            with open(piece, "rb") as src:
                while chunk := src.read(1 << 24):
                    val.write(chunk)
            os.remove(piece)
    train_shards = []
    for r in kept:
        name = f"train_{r.task:06d}.bin"
        if r.tokens["train"]:
            train_shards.append((name, r.tokens["train"]))
        else:
            os.remove(out_dir / name)
    splits = {
        split: {
            "documents": sum(r.documents[split] for r in kept),
            "tokens": sum(r.tokens[split] for r in kept),
            "symbols": sum(r.symbols[split] for r in kept),
            "unknown": sum(r.unknown[split] for r in kept),
        }
        for split in ("train", "val")
    }
    counts = sum((r.counts for r in kept), np.zeros_like(kept[0].counts))
    return TokenizeResult(
        train_shards, splits["val"]["tokens"], splits, counts, sum(r.characters for r in kept), seconds
    )
