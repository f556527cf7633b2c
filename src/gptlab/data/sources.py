"""Where documents come from: the corpus spec (``conf/data``), and reading it through Hugging Face
``datasets``: the embedded default corpus (the Python reference text of the standard library's
``pydoc_data.topics``, real English prose that needs no network), local files (txt, jsonl/json, parquet,
csv: a file, a glob or a folder) and hub datasets by name, either whole (an Arrow table on disk) or as a
stream (``datasets``' IterableDataset, for corpora larger than the disk). The rest of the ``data`` node is the
loader's (`LoaderOptions`); `parse_data` reads the node into both.

A dataset on disk is read back batch by batch, in bounded memory (`iter_batches`, `read_batch`): it is a list
of Arrow stream files that ``datasets`` memory-maps, and iterating the memory map would leave every page of
the corpus resident in the process that read it (and count in its memory), so the files are read with
ordinary reads instead, one record batch at a time. The byte offset of every batch is noted on the first
pass, so that a tokenizing process can later read exactly its own batches and the main process hands it only
their places (`BatchPlace`), never the texts.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptlab.errors import ConfigError, DataError
from gptlab.registry import build_options, check_keys

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
    ``path`` (local files, or a folder of already tokenized ``.bin`` files), or neither (the embedded corpus
    ``builtin``)."""

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
    max_tokens: int | None = None  # cap on the training tokens a prepared cache takes
    streaming: bool = False  # read and tokenize on the fly instead of preparing a cache
    val_tokens: int = 1_000_000  # streaming: tokens of held-out documents that make the validation set

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
        for key in ("max_tokens", "val_tokens", "num_proc"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"data.{key}={value!r} must be a positive integer (or null).")
        if not isinstance(self.streaming, bool):
            raise ConfigError(f"data.streaming={self.streaming!r} must be true or false.")
        if self.streaming and self.max_tokens is not None:
            raise ConfigError(
                f"data.max_tokens={self.max_tokens} caps a prepared cache; a stream (data.streaming=true) is read "
                "for as many tokens as trainer.max_steps takes. Drop one of the two."
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


@dataclass(frozen=True)
class LoaderOptions:
    """The ``data`` node's loader keys: sliding windows of ``block_size`` tokens every ``stride`` tokens
    (null: the model's context, and windows that tile the corpus), ``batch_size`` windows a step;
    ``document_mask``: attention stays inside each document of a window, positions restart at each one."""

    batch_size: int = 8
    block_size: int | None = None
    stride: int | None = None
    val_stride: int | None = None
    num_workers: int = 0
    document_mask: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(
                f"data.batch_size={self.batch_size!r} must be a positive integer (e.g. data.batch_size=8)."
            )
        if self.num_workers < 0:  # 0 loads in the training process itself
            raise ConfigError(
                f"data.num_workers={self.num_workers!r} must be 0 or a positive integer (e.g. data.num_workers=0)."
            )
        for key in ("block_size", "stride", "val_stride"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(
                    f"data.{key}={value!r} must be a positive integer, or null for model.block_size."
                )


LOADER_KEYS = tuple(f.name for f in dataclasses.fields(LoaderOptions))


def parse_data(node: Any) -> tuple[DataSpec, LoaderOptions]:
    """The ``data`` node (Hydra's, or plain values as a run directory's config holds them): the corpus
    (DataSpec) and the loader's keys, each checked."""
    if node is not None and not isinstance(node, dict):  # Hydra's node: its values, interpolations resolved
        from omegaconf import OmegaConf

        node = OmegaConf.to_container(node, resolve=True)
    spec_keys = tuple(f.name for f in dataclasses.fields(DataSpec))
    values = dict(node or {})
    check_keys(values, spec_keys + LOADER_KEYS, "data", "data")
    spec = build_options(DataSpec, {k: v for k, v in values.items() if k in spec_keys}, "data", "data")
    loader = build_options(
        LoaderOptions, {k: v for k, v in values.items() if k in LOADER_KEYS}, "data", "data"
    )
    return spec, loader


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
            f"data.path={path!r} includes files of type {sorted(unknown)}; supported: {sorted(FILE_BUILDERS)}, "
            "or a folder of nanoGPT's train.bin/val.bin or llm.c's *_train_*.bin/*_val_*.bin token files."
        )
    builders = {FILE_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise DataError(
            f"data.path={path!r} mixes file formats {sorted(builders)}: give files of one format."
        )
    return files


def _hub_error(spec: DataSpec, e: Exception) -> DataError:
    offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
    return DataError(
        f"Could not load the Hugging Face hub dataset data.name={spec.name!r}"
        + (f" (config {spec.config_name!r})" if spec.config_name else "")
        + f": {type(e).__name__}: {e}. The hub needs network access"
        + (" and HF_HUB_OFFLINE is set" if offline else "")
        + "; on a machine without it, download the data elsewhere and train on local files with "
        "data.path=<file, glob or folder> (txt, jsonl, parquet or csv), or use the embedded corpus "
        "(leave data.name unset)."
    )


def _load(spec: DataSpec, streaming: bool):
    import datasets

    if spec.source == "builtin":
        ds = datasets.Dataset.from_dict({"text": builtin_documents(spec.builtin)})
        return ds.to_iterable_dataset() if streaming else ds
    if spec.source == "hub":
        try:
            return datasets.load_dataset(
                spec.name, spec.config_name, split=spec.split, revision=spec.revision, streaming=streaming
            )
        except Exception as e:
            raise _hub_error(spec, e) from e
    assert spec.path is not None  # source == "files"
    files = resolve_files(spec.path)
    builder = FILE_BUILDERS[Path(files[0]).suffix.lower()]
    kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **kwargs)
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
        # datasets wraps a builder's error in "An error occurred while generating the dataset": the cause is
        # what names the problem (a JSON line that does not parse, and its row)
        causes: list[str] = []
        cause = e.__cause__
        while cause is not None and len(causes) < 3:
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        because = f" ({'; '.join(causes)})" if causes else ""
        raise DataError(f"Could not read data.path={spec.path!r} as {builder}: {e}{because}") from e


def _text_column(spec: DataSpec, ds: Any) -> Any:
    columns = ds.column_names
    if columns is not None and spec.text_field not in columns:
        raise DataError(
            f"The corpus {spec.describe()} has no column {spec.text_field!r} (columns: {columns}). "
            f"Set data.text_field to the column that holds the text."
        )
    feature = (ds.features or {}).get(spec.text_field)  # None where a stream does not know its types yet
    dtype = getattr(feature, "dtype", type(feature).__name__) if feature is not None else None
    if dtype is not None and dtype not in (*TEXT_TYPES, "null"):  # all null: "holds no text", later
        text_columns = [
            name for name, f in (ds.features or {}).items() if getattr(f, "dtype", None) in TEXT_TYPES
        ]
        hint = f" (its text columns: {text_columns})" if text_columns else ""
        raise DataError(
            f"The column {spec.text_field!r} of the corpus {spec.describe()} holds {dtype} values, not text. "
            f"Set data.text_field to the column that holds the text{hint}."
        )
    ds = ds.select_columns([spec.text_field])
    return ds.rename_column(spec.text_field, "text") if spec.text_field != "text" else ds


# The Arrow types of a text column as `datasets` names them.
TEXT_TYPES = ("string", "large_string")


def load_documents(spec: DataSpec):
    """The corpus as a ``datasets.Dataset`` (Arrow on disk, memory-mapped) with one document per row in a
    ``text`` column. Empty documents are still in it: preparation skips them while it reads."""
    return _text_column(spec, _load(spec, streaming=False))


def load_stream(spec: DataSpec):
    """The corpus as a ``datasets.IterableDataset`` (read lazily, nothing downloaded or converted ahead)
    with a ``text`` column."""
    return _text_column(spec, _load(spec, streaming=True))


def source_fingerprint(spec: DataSpec) -> dict[str, Any]:
    if spec.source == "builtin":
        digest = hashlib.sha256("\x00".join(builtin_documents(spec.builtin)).encode()).hexdigest()
        return {"builtin": spec.builtin, "sha256": digest}
    if spec.source == "files":
        assert spec.path is not None
        return {"files": [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in resolve_files(spec.path)]}
    return {"hub": spec.name, "config": spec.config_name, "split": spec.split, "revision": spec.revision}


# Reading a dataset's text column batch by batch.

ROWS = 4096  # documents per batch of an in-memory dataset


@dataclass(frozen=True)
class BatchPlace:
    """Where one record batch of the text column lies: the file, the byte offset of its message, its rows."""

    file: str
    offset: int
    rows: int


def on_disk(ds: Any) -> bool:
    return bool(ds.cache_files) and getattr(ds, "_indices", None) is None


def iter_batches(ds: Any, field: str) -> Iterator[tuple[Any, BatchPlace | None]]:
    """The text column as Arrow arrays, in order, each with its place on disk (None in memory)."""
    import pyarrow as pa

    if not on_disk(ds):
        for table in ds.with_format("arrow").iter(batch_size=ROWS):
            yield table.column("text"), None
        return
    for entry in ds.cache_files:
        name = entry["filename"]
        with pa.OSFile(name) as source:
            reader = pa.ipc.open_stream(source)
            while True:
                offset = source.tell()
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                yield batch.column(field), BatchPlace(name, offset, batch.num_rows)


_schemas: dict[str, Any] = {}


def read_batch(place: BatchPlace, field: str) -> Any:
    """The text column of the record batch at ``place``."""
    import pyarrow as pa

    if place.file not in _schemas:
        with pa.OSFile(place.file) as source:
            _schemas[place.file] = pa.ipc.open_stream(source).schema
    with pa.OSFile(place.file) as source:
        source.seek(place.offset)
        batch = pa.ipc.read_record_batch(pa.ipc.read_message(source), _schemas[place.file])
    if batch.num_rows != place.rows:
        raise RuntimeError(f"{place.file} changed while it was being read (offset {place.offset})")
    return batch.column(field)
