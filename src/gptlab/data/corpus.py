"""Corpora: load documents -> split train/val by document -> tokenize -> flat token files, cached.

Every source goes through Hugging Face ``datasets``: the embedded default corpus (the Python reference
text of the standard library's ``pydoc_data.topics``, real English prose that needs no network), local
files (txt, jsonl/json, parquet, csv, a file, a glob or a folder) and hub datasets by name.

The token files are flat arrays (uint16 while the vocabulary fits, else uint32) with ``<|endoftext|>``
after every document, written once per (corpus, split, tokenizer) fingerprint under the cache folder, so a
second run with the same data starts at once.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data import tokenizers
from gptlab.errors import ConfigError, DataError

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
BUILTIN_CORPORA = ("pydoc_topics",)
FILE_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


@dataclass
class DataSpec:
    """Where the documents come from and how they are split. Exactly one source: ``name`` (a hub dataset),
    ``path`` (local files), or neither (the embedded corpus ``builtin``)."""

    builtin: str = "pydoc_topics"
    path: str | list[str] | None = None
    name: str | None = None
    config_name: str | None = None
    split: str = "train"
    revision: str | None = None
    text_field: str = "text"
    val_fraction: float = 0.1
    split_seed: int = 1234
    num_proc: int | None = None  # processes for tokenisation; None: chosen from the corpus size
    cache_dir: str = "outputs/cache/tokens"

    def __post_init__(self) -> None:
        if self.path is not None and self.name is not None:
            raise ConfigError(
                f"data.path={self.path!r} and data.name={self.name!r} are both set: choose one source "
                "(data.path for local files, data.name for a Hugging Face hub dataset)."
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be between 0 and 1 (e.g. 0.1).")
        if self.path is None and self.name is None and self.builtin not in BUILTIN_CORPORA:
            raise ConfigError(
                f"data.builtin={self.builtin!r} is not an embedded corpus. Choose one of {list(BUILTIN_CORPORA)}, "
                "or set data.path=<file or glob> or data.name=<hub dataset>."
            )

    @property
    def source(self) -> str:
        return "hub" if self.name else "files" if self.path else "builtin"

    def describe(self) -> str:
        if self.name:
            return f"hub dataset {self.name!r}" + (f" ({self.config_name})" if self.config_name else "")
        if self.path:
            return f"local files {self.path!r}"
        return f"embedded corpus {self.builtin!r}"


@dataclass
class PreparedCorpus:
    train_path: Path
    val_path: Path
    dtype: np.dtype
    tokenizer: tokenizers.Tokenizer
    meta: dict[str, Any]

    @property
    def unigram_entropy(self) -> float:
        return float(self.meta["unigram_entropy_nats"])


# ---- loading ---------------------------------------------------------------------------------------


def builtin_documents(name: str) -> list[str]:
    if name == "pydoc_topics":
        from pydoc_data import topics

        return [topics.topics[key] for key in sorted(topics.topics)]
    raise ConfigError(f"Unknown embedded corpus {name!r}; choose one of {list(BUILTIN_CORPORA)}.")


def resolve_files(path: str | list[str]) -> list[str]:
    patterns = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if os.path.isdir(pattern):
            matches = sorted(
                f
                for f in glob.glob(os.path.join(pattern, "**", "*"), recursive=True)
                if os.path.isfile(f) and Path(f).suffix.lower() in FILE_BUILDERS
            )
        else:
            matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise DataError(
                f"data.path={pattern!r} matches no file. Check the path (relative paths are taken from "
                f"{os.getcwd()}), or give a glob such as data.path='corpus/*.txt'."
            )
        files.extend(matches)
    for f in files:
        try:
            with open(f, "rb") as handle:
                handle.read(1)
        except OSError as e:
            raise DataError(
                f"Data file {f!r} cannot be read ({e.strerror or e}): fix its permissions or the link, or remove "
                "it from data.path."
            ) from e
        if os.path.getsize(f) == 0:
            raise DataError(
                f"Data file {f!r} is empty: give a file with text in it, or remove it from data.path."
            )
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = suffixes - set(FILE_BUILDERS)
    if unknown:
        raise DataError(
            f"data.path={path!r} includes files of type {sorted(unknown)}; supported: {sorted(FILE_BUILDERS)}."
        )
    builders = {FILE_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise DataError(
            f"data.path={path!r} mixes file formats {sorted(builders)}: give files of one format."
        )
    return files


def load_documents(spec: DataSpec):
    """The corpus as a ``datasets.Dataset`` with one document per row in a ``text`` column."""
    import datasets

    if spec.source == "builtin":
        ds = datasets.Dataset.from_dict({"text": builtin_documents(spec.builtin)})
    elif spec.source == "files":
        files = resolve_files(spec.path)
        builder = FILE_BUILDERS[Path(files[0]).suffix.lower()]
        kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
        except UnicodeDecodeError as e:
            raise DataError(
                f"A file in data.path={spec.path!r} is not UTF-8 text ({e.reason} at byte {e.start}). "
                "Convert it, e.g. `iconv -f latin1 -t utf-8 in.txt > out.txt`."
            ) from e
        except Exception as e:  # datasets wraps decoding errors of its builders
            if isinstance(e.__cause__, UnicodeDecodeError) or "utf-8" in str(e).lower():
                raise DataError(
                    f"A file in data.path={spec.path!r} is not UTF-8 text: {e}. Convert it to UTF-8."
                ) from e
            raise DataError(f"Could not read data.path={spec.path!r} as {builder}: {e}") from e
    else:
        try:
            ds = datasets.load_dataset(spec.name, spec.config_name, split=spec.split, revision=spec.revision)
        except Exception as e:
            offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
            raise DataError(
                f"Could not load the Hugging Face hub dataset data.name={spec.name!r}"
                + (f" (config {spec.config_name!r})" if spec.config_name else "")
                + f": {type(e).__name__}: {e}. The hub needs network access"
                + (" and HF_HUB_OFFLINE is set" if offline else "")
                + "; on a machine without it, download the data elsewhere and train on local files with "
                "data.path=<file, glob or folder> (txt, jsonl, parquet or csv), or use the embedded corpus "
                "(leave data.name unset)."
            ) from e
    if spec.text_field not in ds.column_names:
        raise DataError(
            f"The corpus {spec.describe()} has no column {spec.text_field!r} (columns: {ds.column_names}). "
            f"Set data.text_field to the column that holds the text."
        )
    if spec.text_field != "text":
        ds = (
            ds.rename_column(spec.text_field, "text")
            if "text" not in ds.column_names
            else ds.map(lambda b: {"text": b[spec.text_field]}, batched=True)
        )
    ds = ds.select_columns(["text"]).filter(
        lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True
    )
    if len(ds) == 0:
        raise DataError(f"The corpus {spec.describe()} holds no text: every document is empty.")
    return ds


# ---- split ------------------------------------------------------------------------------------------


def split_documents(lengths: list[int], val_fraction: float, seed: int) -> np.ndarray:
    """A deterministic document-level split: a seeded permutation of the documents, taken into validation
    until it holds ``val_fraction`` of the characters. Returns a boolean ``is_val`` per document. The split
    depends on the corpus alone, so every tokenizer and model sees the same validation text."""
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    is_val = np.zeros(len(lengths_arr), dtype=bool)
    if len(lengths_arr) < 2:
        return is_val  # one document: split_single_document cuts its tail instead
    target = val_fraction * lengths_arr.sum()
    taken = 0
    for i in np.random.default_rng(seed).permutation(len(lengths_arr)):
        if taken >= target or is_val.sum() == len(lengths_arr) - 1:
            break
        is_val[i] = True
        taken += lengths_arr[i]
    return is_val


def split_single_document(text: str, val_fraction: float) -> tuple[str, str]:
    """One long document: its last ``val_fraction`` (cut at a line or word boundary) is validation."""
    cut = int(len(text) * (1 - val_fraction))
    boundary = text.rfind("\n", 0, cut)
    if boundary < cut * 0.9:
        boundary = text.rfind(" ", 0, cut)
    cut = boundary if boundary > 0 else cut
    return text[:cut], text[cut:]


# ---- tokenize and cache -----------------------------------------------------------------------------


def source_fingerprint(spec: DataSpec) -> dict[str, Any]:
    if spec.source == "builtin":
        digest = hashlib.sha256("\x00".join(builtin_documents(spec.builtin)).encode()).hexdigest()
        return {"builtin": spec.builtin, "sha256": digest}
    if spec.source == "files":
        return {"files": [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in resolve_files(spec.path)]}
    return {"hub": spec.name, "config": spec.config_name, "split": spec.split, "revision": spec.revision}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def _write_tokens(ds, path: Path, dtype: np.dtype, eot_id: int) -> int:
    total = int(sum(ds["n_tokens"])) + len(ds)
    out = np.memmap(path, dtype=dtype, mode="w+", shape=(max(total, 1),))
    offset = 0
    for batch in ds.iter(batch_size=1024):
        for ids in batch["ids"]:
            out[offset : offset + len(ids)] = ids
            offset += len(ids)
            out[offset] = eot_id
            offset += 1
    out.flush()
    del out
    return total


def _iter_tokens(path: Path, dtype: np.dtype) -> Iterator[np.ndarray]:
    arr = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(arr), 1 << 22):
        yield np.asarray(arr[start : start + (1 << 22)])


def unigram_entropy(paths: list[Path], dtype: np.dtype, vocab_size: int) -> float:
    """The entropy, in nats, of the corpus's token frequencies: the loss of a model that ignores context."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        for chunk in _iter_tokens(path, dtype):
            counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def prepare(spec: DataSpec, tokenizer_name: str) -> PreparedCorpus:
    """Return the tokenized corpus, building and caching it on the first call for this fingerprint."""
    key_material = {
        "format": CACHE_FORMAT,
        "source": source_fingerprint(spec),
        "text_field": spec.text_field,
        "val_fraction": spec.val_fraction,
        "split_seed": spec.split_seed,
        "tokenizer": tokenizer_name,
    }
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(spec.cache_dir) / f"{spec.source}-{tokenizer_name}-{key}"
    meta_path = cache / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        tok = tokenizers.from_spec(meta["tokenizer_spec"])
        log.info("Token cache hit: %s", cache)
        return PreparedCorpus(cache / "train.bin", cache / "val.bin", np.dtype(meta["dtype"]), tok, meta)
    return _build_cache(spec, tokenizer_name, cache, key_material)


def _build_cache(spec: DataSpec, tokenizer_name: str, cache: Path, key_material: dict) -> PreparedCorpus:
    import datasets

    log.info("Preparing %s with tokenizer=%s -> %s", spec.describe(), tokenizer_name, cache)
    ds = load_documents(spec)
    lengths = [len(t) for t in ds["text"]]
    if len(ds) == 1:
        train_text, val_text = split_single_document(ds[0]["text"], spec.val_fraction)
        train_ds = datasets.Dataset.from_dict({"text": [train_text]})
        val_ds = datasets.Dataset.from_dict({"text": [val_text]})
        log.info("One document: its last %.0f%% is the validation split.", 100 * spec.val_fraction)
    else:
        is_val = split_documents(lengths, spec.val_fraction, spec.split_seed)
        train_ds = ds.select(np.flatnonzero(~is_val).tolist())
        val_ds = ds.select(np.flatnonzero(is_val).tolist())
    # word and char tokenizers take their vocabulary from the training split only.
    tok = tokenizers.build(tokenizer_name, train_ds["text"] if tokenizer_name != "gpt2" else None)
    dtype = token_dtype(tok.vocab_size)

    num_proc = spec.num_proc
    if num_proc is None:
        num_proc = min(os.cpu_count() or 1, 8) if sum(lengths) > 50_000_000 else None

    def encode(batch: dict[str, list[str]]) -> dict[str, list]:
        ids = tok.encode_batch(batch["text"])
        return {"ids": ids, "n_tokens": [len(x) for x in ids]}

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".tmp-", dir=cache.parent))
    try:
        counts = {}
        for split, part in (("train", train_ds), ("val", val_ds)):
            encoded = part.map(
                encode,
                batched=True,
                batch_size=256,
                remove_columns=["text"],
                num_proc=num_proc,
                desc=f"Tokenizing {split}",
            )
            counts[split] = {
                "documents": len(part),
                "tokens": _write_tokens(encoded, tmp / f"{split}.bin", dtype, tok.eot_id),
            }
        meta = {
            "source": spec.describe(),
            "key": key_material,
            "tokenizer_spec": tok.spec(),
            "vocab_size": tok.vocab_size,
            "dtype": dtype.name,
            "splits": counts,
            "unigram_entropy_nats": unigram_entropy(
                [tmp / "train.bin", tmp / "val.bin"], dtype, tok.vocab_size
            ),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, cache)  # atomic: a crash leaves no half-written cache behind
        except OSError:  # another process finished the same cache first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = json.loads((cache / "meta.json").read_text())
    log.info(
        "Corpus: %d train / %d val documents, %d / %d tokens, unigram entropy %.3f nats",
        meta["splits"]["train"]["documents"],
        meta["splits"]["val"]["documents"],
        meta["splits"]["train"]["tokens"],
        meta["splits"]["val"]["tokens"],
        meta["unigram_entropy_nats"],
    )
    return PreparedCorpus(
        cache / "train.bin", cache / "val.bin", dtype, tokenizers.from_spec(meta["tokenizer_spec"]), meta
    )


def num_windows(n_tokens: int, window: int, stride: int) -> int:
    """How many windows of ``window`` tokens start every ``stride`` tokens within ``n_tokens``."""
    if n_tokens < window:
        return 0
    return (n_tokens - window) // stride + 1


__all__ = ["DataSpec", "PreparedCorpus", "prepare", "num_windows", "split_documents"]
