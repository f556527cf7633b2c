"""Corpus preparation: documents -> train/val split by document -> tokens in sharded files, cached.

Memory stays that of a small corpus whatever the corpus size: the documents stay in the Arrow files that
``datasets`` writes (read back batch by batch, never as a list of all texts); one pass of Arrow compute
gives each document's length and the place of each record batch, from which a seeded split picks whole
documents for validation; then a process pool gets runs of consecutive record batches (their places, not
their texts), and each process reads, tokenizes and writes its run as its own shard (flat uint16 ids while
the vocabulary fits, else uint32, ``<|endoftext|>`` after every document).
An ``index.json`` lists the shards; the split's windows run across shard boundaries as in one file.

A cache folder is keyed by a fingerprint of the corpus, the split and the tokenizer, built in a temporary
folder and renamed into place at the end, so a killed preparation leaves no half cache: the next run
removes the dead one's temporary folder and starts again. A lock file lets one process prepare a cache
while the others that need it wait.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from gptlab.data import tokenizers
from gptlab.data.shards import (
    DamagedCache,
    TokenShards,
    read_index,
    token_counts,
    token_dtype,
    token_folder,
    unigram_entropy,
    write_index,
)
from gptlab.data.sources import BatchPlace, DataSpec, iter_batches, load_documents, source_fingerprint
from gptlab.data.tokenize_pool import TokenizeJob, TokenizeResult, run_tokenize_jobs
from gptlab.errors import ConfigError, DataError, PreparationStopped

log = logging.getLogger(__name__)

# 3: <|unk|> kept and counted per split, a CRC-32 per file in index.json
CACHE_FORMAT = 3
# Text per shard (one pool task): enough tasks for every process, shards a memmap-friendly size.
MIN_TASK_CHARS = 1 << 20
MAX_TASK_CHARS = 64 << 20


@dataclass
class PreparedCorpus:
    """A corpus's tokens, split, ready for windows: ``train`` and ``val`` read as one sequence each."""

    train: TokenShards
    val: TokenShards
    dtype: np.dtype
    tokenizer: tokenizers.Tokenizer
    meta: dict[str, Any]

    @functools.cached_property
    def unigram_entropy(self) -> float:
        """The entropy of the validation split's own token frequencies, in nats: the lowest loss any model
        that ignores context can score on the validation tokens (the cross-entropy of a fixed distribution
        is at least this entropy), so a validation loss below it is the model's use of context. One
        definition for every source: counted from the validation tokens at each start (caches, token files
        and streams alike), never from the training split, which a stream or large token files do not
        hold at the start. A baseline learned from the training split's frequencies would score on
        validation only with a smoothing for the ids training never saw, and its figure is the smoothing's
        (on the default corpus 5.71 to 5.94 nats from add-0.1 to add-one)."""
        return unigram_entropy(token_counts(self.val, self.tokenizer.vocab_size))


# ---- split ------------------------------------------------------------------------------------------


def split_documents(lengths: Any, val_fraction: float, seed: int) -> np.ndarray:
    """A deterministic document-level split: a seeded permutation of the documents, taken into validation
    until it holds ``val_fraction`` of the characters (at least one document stays in training). Returns a
    boolean ``is_val`` per document. The split depends on the corpus alone, so every tokenizer and model
    sees the same validation text."""
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    n = len(lengths_arr)
    is_val = np.zeros(n, dtype=bool)
    if n < 2:
        return is_val  # one document: split_single_document cuts its tail instead
    order = np.random.default_rng(seed).permutation(n)
    taken = np.cumsum(lengths_arr[order])
    # the first k documents of the permutation, k the smallest count whose characters reach the target
    k = int(np.searchsorted(taken, val_fraction * taken[-1], side="left")) + 1
    is_val[order[: min(k, n - 1)]] = True
    return is_val


def split_single_document(text: str, val_fraction: float) -> tuple[str, str]:
    """One long document: its last ``val_fraction`` (cut at a line or word boundary) is validation."""
    cut = int(len(text) * (1 - val_fraction))
    boundary = text.rfind("\n", 0, cut)
    if boundary < cut * 0.9:
        boundary = text.rfind(" ", 0, cut)
    cut = boundary if boundary > 0 else cut
    return text[:cut], text[cut:]


# ---- reading the documents in batches ---------------------------------------------------------------


def scan(ds: Any, field: str) -> tuple[np.ndarray, list[BatchPlace] | None]:
    """Characters per document (0 for documents with only whitespace), from Arrow compute, and the place
    of every record batch on disk (None for a dataset in memory)."""
    import pyarrow.compute as pc

    parts: list[np.ndarray] = []
    places: list[BatchPlace | None] = []
    for column, place in iter_batches(ds, field):
        column = pc.fill_null(column, "")
        lengths = pc.utf8_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        blank = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0).to_numpy(zero_copy_only=False)
        lengths[blank] = 0
        parts.append(lengths)
        places.append(place)
    lengths = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    # iter_batches gives every batch a place, or none at all
    return lengths, (cast(list[BatchPlace], places) if places and places[0] is not None else None)


def _documents(ds: Any, field: str, keep: np.ndarray) -> Iterator[str]:
    row = 0
    for column, _ in iter_batches(ds, field):
        texts = column.to_pylist()
        for i, text in enumerate(texts):
            if keep[row + i]:
                yield text
        row += len(texts)


# ---- the cache --------------------------------------------------------------------------------------


def _tokenizer_node(tokenizer: str | dict[str, Any]) -> dict[str, Any]:
    node = {"name": tokenizer} if isinstance(tokenizer, str) else dict(tokenizer)
    options = tokenizers.options_of(node["name"], node)
    return {"name": node["name"], "options": {k: v for k, v in vars(options).items()}}


def prepare(spec: DataSpec, tokenizer: str | dict[str, Any]) -> PreparedCorpus:
    """The tokenized corpus, building and caching it on the first call for this fingerprint. ``tokenizer``:
    a name or a ``conf/tokenizer`` node (its name and options). A cache found damaged (its files do not
    match its ``index.json``) is prepared again, with a warning: it is gptlab's own, derived from the corpus,
    so nothing is lost. A split with more unknown symbols than ``tokenizer.max_unknown_fraction`` is refused."""
    node = _tokenizer_node(tokenizer)
    options = tokenizers.options_of(node["name"], node["options"])
    folder = token_folder(spec.path)
    if folder is not None:
        return _token_files(spec, node, *folder)
    key_material = {
        "format": CACHE_FORMAT,
        "source": source_fingerprint(spec),
        "text_field": spec.text_field,
        "val_fraction": spec.val_fraction,
        "split_seed": spec.split_seed,
        # the threshold is checked at every open against the counts the cache keeps: not part of the key
        "tokenizer": {**node, "options": {k: v for k, v in node["options"].items() if k not in NOT_IN_KEY}},
        "max_tokens": spec.max_tokens,
    }
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(spec.cache_dir) / f"{spec.source}-{node['name']}-{key}"
    # the folder appears whole (a rename) or not at all: one that exists without its files is damaged
    opened = _open_cache(cache) if cache.is_dir() else None
    if isinstance(opened, tuple):
        log.info("Token cache hit: %s", cache)
    else:
        damage = opened if isinstance(opened, DamagedCache) else None
        if damage is not None:
            log.warning(
                "%s. Preparing it again from the corpus (nothing is lost: the cache is made from it).",
                damage.what,
            )
        _make_parent(spec, cache, damage)
        # One preparation per cache: the ranks of a DDP run (and concurrent runs) wait for the first one.
        # The kernel releases the lock of a killed process.
        with _locked(spec, cache, damage):
            opened = _open_cache(cache) if cache.is_dir() else None
            if not isinstance(opened, tuple):  # still missing or damaged: this process prepares it
                if opened is not None:
                    _remove_damaged(spec, cache, opened)
                with _stopped_by_sigterm():
                    _build_cache(spec, node, cache, key_material)
                opened = _open_cache(cache)
                if not isinstance(opened, tuple):
                    raise opened
    meta, splits = opened
    tok = tokenizers.from_spec(meta["tokenizer_spec"])
    tokenizers.check_unknowns(tok, meta["splits"], options, spec.describe())
    return PreparedCorpus(splits["train"], splits["val"], splits["train"].dtype, tok, meta)


# Tokenizer options that do not change the tokens, so not part of a cache's key.
NOT_IN_KEY = ("max_unknown_fraction",)


def _open_cache(cache: Path) -> tuple[dict[str, Any], dict[str, TokenShards]] | DamagedCache:
    """A cache's meta and checked splits, or what is wrong with it."""
    try:
        meta = json.loads((cache / "meta.json").read_text())
        if not isinstance(meta, dict) or not {"tokenizer_spec", "splits"} <= set(meta):
            raise ValueError("its keys tokenizer_spec and splits are missing")
    except FileNotFoundError:
        return DamagedCache(cache, "meta.json", "is missing")
    except (OSError, ValueError) as e:
        return DamagedCache(cache, "meta.json", f"cannot be read ({type(e).__name__}: {e})")
    try:
        return meta, read_index(cache)
    except DamagedCache as e:
        return e


def _make_parent(spec: DataSpec, cache: Path, damage: DamagedCache | None = None) -> None:
    """Create the folder of the caches, or say which folder cannot be written and how to choose another."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(spec, cache.parent, e, damage) from None


def _unwritable(spec: DataSpec, folder: Path, e: OSError, damage: DamagedCache | None = None) -> DataError:
    fix = (
        "Make it writable, or put the caches elsewhere with paths.cache_dir=<a writable folder> (or "
        "data.cache_dir=<folder> for the token caches alone)."
    )
    if damage is not None:
        return DataError(
            f"{damage.what}. It cannot be prepared again here: {folder} cannot be written ({e.strerror or e}). "
            f"Delete the damaged cache as a user who may (`rm -r {damage.folder}`) and run again, or put the "
            "caches elsewhere with paths.cache_dir=<a writable folder>."
        )
    return DataError(
        f"The token cache folder {folder} cannot be written ({e.strerror or e}): the tokens of "
        f"{spec.describe()} are written there before training. {fix}"
    )


@contextmanager
def _locked(spec: DataSpec, cache: Path, damage: DamagedCache | None = None) -> Iterator[None]:
    try:
        lock = open(cache.parent / f"{cache.name}.lock", "w")
    except OSError as e:
        raise _unwritable(spec, cache.parent, e, damage) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("Another process is preparing %s: waiting for it", cache)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _remove_damaged(spec: DataSpec, cache: Path, damage: DamagedCache) -> None:
    """Move a damaged cache out of the way (a rename: a process still reading it keeps its files), then
    delete it."""
    aside = cache.parent / f"{cache.name}.damaged-{socket.gethostname()}-{os.getpid()}"
    try:
        os.replace(cache, aside)
    except OSError as e:
        raise _unwritable(spec, cache.parent, e, damage) from None
    shutil.rmtree(aside, ignore_errors=True)


def _token_files(spec: DataSpec, node: dict, layout: str, splits: dict[str, TokenShards]) -> PreparedCorpus:
    """nanoGPT's or llm.c's token files, used as they are."""
    cls = tokenizers.TOKENIZERS.get(node["name"])
    if cls.fitted:
        raise ConfigError(
            f"data.path={spec.path!r} holds {layout} token files (GPT-2 ids), but tokenizer={node['name']} "
            "learns its vocabulary from text: train on them with tokenizer=gpt2."
        )
    tok = tokenizers.build(node["name"], options=tokenizers.options_of(node["name"], node["options"]))
    val = splits["val"].array()
    if len(val) and int(val.max()) >= tok.vocab_size:
        raise DataError(
            f"{splits['val'].shards[0].path} holds token id {int(val.max())}, beyond the {tok.vocab_size} ids of "
            f"tokenizer={tok.name}: these files were made with another tokenizer."
        )
    meta = {
        "source": f"{layout} token files in {spec.path}",
        "token_files": layout,
        "tokenizer_spec": tok.spec(),
        "splits": {k: {"tokens": len(v), "shards": len(v.shards)} for k, v in splits.items()},
    }
    log.info("%s: %d train / %d val tokens, used as they are", meta["source"], len(splits["train"]), len(val))
    return PreparedCorpus(splits["train"], splits["val"], np.dtype(np.uint16), tok, meta)


def _remove_stale(cache: Path) -> None:
    """Temporary folders of this cache's earlier preparations that did not finish (killed, preempted, the
    machine rebooted), on this host or another (a requeued job lands on another node of the cluster).

    Called holding the cache's lock, the one a preparation holds from before it makes its temporary folder
    until it has renamed or removed it: so no live preparation owns any of them, whatever its host. The
    host and process id in the name are not asked: another host's processes cannot be seen from here, and
    a process id of a dead preparation may since belong to another process."""
    for tmp in cache.parent.glob(f"{cache.name}.tmp-*"):
        if tmp.is_dir():
            log.info("Removing %s, left by a preparation that did not finish", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`PreparationStopped` while a cache is prepared, so that the work folder goes
    as it does on Ctrl-C (by default SIGTERM ends the process at once, leaving it). The handler found is
    put back after: training installs its own later."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def stop(signum: int, frame: Any) -> None:
        raise PreparationStopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _build_cache(spec: DataSpec, node: dict, cache: Path, key_material: dict) -> None:
    t0 = time.perf_counter()
    log.info("Preparing %s with tokenizer=%s -> %s", spec.describe(), node["name"], cache)
    ds = load_documents(spec)
    field = spec.text_field
    lengths, places = scan(ds, field)
    keep = lengths > 0
    n_docs = int(keep.sum())
    if n_docs == 0:
        raise DataError(f"The corpus {spec.describe()} holds no text: every document is empty.")
    cls = tokenizers.TOKENIZERS.get(node["name"])
    options = tokenizers.options_of(node["name"], node["options"])
    single, is_val, training_texts = _split_validation(spec, ds, field, lengths, keep, n_docs)
    # a fitted vocabulary (word, char) comes from the training split alone, with an id for the symbols of
    # the validation split it lacks
    if cls.fitted:
        held_out = single[1:] if single is not None else _documents(ds, field, keep & is_val)
        tok = cls.fit(training_texts, options).covering(held_out)
    else:
        tok = cls.create(options)
    dtype = token_dtype(tok.vocab_size)
    total_chars = int(lengths.sum())
    num_proc = spec.num_proc or (min(os.cpu_count() or 1, 8) if total_chars > 50_000_000 else 1)

    _make_parent(spec, cache)
    _remove_stale(cache)
    tmp = cache.parent / f"{cache.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        jobs = _tokenize_jobs(ds, field, lengths, places, is_val, single, total_chars, num_proc)
        result = run_tokenize_jobs(
            jobs, tok, dtype, tmp, num_proc, n_docs, spec.max_tokens, desc=f"Tokenizing {spec.describe()}"
        )
        meta = _write_index_and_meta(tmp, spec, key_material, tok, dtype, result, t0)
        try:
            os.replace(tmp, cache)  # atomic: the cache appears whole or not at all
        except OSError:  # another process finished the same cache first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        written = _folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(spec, cache.parent, written) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log_corpus(meta, len(result.train_shards))


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*") if f.is_file())


def _no_space(spec: DataSpec, folder: Path, written: int) -> DataError:
    """A disk (or quota) that filled while a token cache was written: how far it got, the room there is
    now (the unfinished cache removed), and where else the caches can go."""
    free = shutil.disk_usage(folder).free
    return DataError(
        f"No space left on {folder} while writing the token cache of {spec.describe()}: the disk filled after "
        f"{written / 1e6:.1f} MB of tokens, and the whole cache needs more than that ({free / 1e6:.1f} MB free "
        "there now). Nothing was kept: the unfinished cache was removed. Free space there, or put the token "
        "caches on another disk with data.cache_dir=<a folder with room> (or paths.cache_dir=<folder> for "
        "every cache)."
    )


def _split_validation(
    spec: DataSpec, ds: Any, field: str, lengths: np.ndarray, keep: np.ndarray, n_docs: int
) -> tuple[list[str] | None, np.ndarray, Any]:
    """The validation split: (the two halves of a single document or None, is_val per row, training texts)."""
    single: list[str] | None = None
    is_val = np.zeros(len(lengths), dtype=bool)
    if n_docs == 1:
        single = list(split_single_document(next(_documents(ds, field, keep)), spec.val_fraction))
        log.info("One document: its last %.0f%% is the validation split.", 100 * spec.val_fraction)
        training_texts: Any = single[:1]
    else:
        is_val[keep] = split_documents(lengths[keep], spec.val_fraction, spec.split_seed)
        training_texts = _documents(ds, field, keep & ~is_val)
    return single, is_val, training_texts


def _tokenize_jobs(
    ds: Any,
    field: str,
    lengths: np.ndarray,
    places: list[BatchPlace] | None,
    is_val: np.ndarray,
    single: list[str] | None,
    total_chars: int,
    num_proc: int,
) -> Iterator[TokenizeJob]:
    """The pool's jobs: one job of a single document's two halves, else runs of documents sized for ``num_proc``."""
    if single is not None:
        return iter([TokenizeJob(0, np.ones(2, dtype=bool), np.array([False, True]), texts=single)])
    task_chars = int(np.clip(total_chars // (num_proc * 8), MIN_TASK_CHARS, MAX_TASK_CHARS))
    return _jobs(ds, field, lengths, places, is_val, task_chars)


def _write_index_and_meta(
    tmp: Path,
    spec: DataSpec,
    key_material: dict,
    tok: Any,
    dtype: np.dtype,
    result: TokenizeResult,
    t0: float,
) -> dict[str, Any]:
    """Write the shards' ``index.json`` and the cache's ``meta.json`` into ``tmp``; returns the meta."""
    write_index(tmp, dtype, {"train": result.train_shards, "val": [("val.bin", result.val_tokens)]})
    meta = {
        "source": spec.describe(),
        "key": key_material,
        "tokenizer_spec": tok.spec(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "splits": result.splits,
        "unigram_entropy_nats": unigram_entropy(result.counts),  # the validation split's (PreparedCorpus)
        "characters": result.characters,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _log_corpus(meta: dict[str, Any], n_train_shards: int) -> None:
    """Log the prepared corpus: documents and tokens per split, shards, throughput and unigram entropy."""
    log.info(
        "Corpus: %s train / %s val documents, %s / %s tokens in %d shard(s), %.1f MB/s of text, unigram "
        "entropy %.3f nats (of the validation split)",
        f"{meta['splits']['train']['documents']:,}",  # counts with thousands separators, as the run's others
        f"{meta['splits']['val']['documents']:,}",
        f"{meta['splits']['train']['tokens']:,}",
        f"{meta['splits']['val']['tokens']:,}",
        n_train_shards,
        meta["characters"] / 1e6 / max(meta["seconds"], 1e-9),
        meta["unigram_entropy_nats"],
    )


def _jobs(
    ds: Any,
    field: str,
    lengths: np.ndarray,
    places: list[BatchPlace] | None,
    is_val: np.ndarray,
    task_chars: int,
) -> Iterator[TokenizeJob]:
    """Runs of consecutive documents of about ``task_chars`` characters, in corpus order. A dataset on disk
    is handed out as the places of its record batches (each process reads its own); one in memory (the
    small embedded corpus) as texts."""
    keep = lengths > 0
    if places is not None:
        task, start, row, chosen, chars = 0, 0, 0, [], 0
        for place in places:
            chosen.append(place)
            chars += int(lengths[row : row + place.rows].sum())
            row += place.rows
            if chars >= task_chars:
                yield TokenizeJob(task, keep[start:row], is_val[start:row], places=chosen, field=field)
                task, start, chosen, chars = task + 1, row, [], 0
        if chosen:
            yield TokenizeJob(task, keep[start:row], is_val[start:row], places=chosen, field=field)
        return
    texts: list[str] = []
    flags: list[bool] = []
    chars, task = 0, 0
    for i, text in enumerate(_documents(ds, field, np.ones(len(keep), dtype=bool))):
        if keep[i]:
            texts.append(text)
            flags.append(bool(is_val[i]))
            chars += len(text)
            if chars >= task_chars:
                yield TokenizeJob(task, np.ones(len(texts), dtype=bool), np.array(flags), texts=texts)
                texts, flags, chars, task = [], [], 0, task + 1
    if texts:
        yield TokenizeJob(task, np.ones(len(texts), dtype=bool), np.array(flags), texts=texts)


def validation_tokens(
    spec: DataSpec, tokenizer: str | dict[str, Any]
) -> tuple[np.ndarray, tokenizers.Tokenizer]:
    """The validation split of any corpus as one array, with its tokenizer: a prepared cache's, a token
    folder's, or a stream's held-out documents (for evaluations after training)."""
    if spec.streaming:
        from gptlab.data.streaming import held_out_shards

        node = _tokenizer_node(tokenizer)
        tok = tokenizers.build(node["name"], options=tokenizers.options_of(node["name"], node["options"]))
        return held_out_shards(spec, tok).array(), tok
    prepared = prepare(spec, tokenizer)
    return prepared.val.array(), prepared.tokenizer


def num_windows(n_tokens: int, window: int, stride: int) -> int:
    """How many windows of ``window`` tokens start every ``stride`` tokens within ``n_tokens``."""
    if n_tokens < window:
        return 0
    return (n_tokens - window) // stride + 1


__all__ = [
    "DataSpec",
    "PreparedCorpus",
    "prepare",
    "validation_tokens",
    "num_windows",
    "split_documents",
    "token_counts",
]
