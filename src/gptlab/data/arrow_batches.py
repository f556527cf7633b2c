"""Reading a ``datasets.Dataset``'s text column batch by batch, in bounded memory.

A dataset on disk is a list of Arrow stream files that ``datasets`` memory-maps. Iterating the memory map
would leave every page of the corpus resident in the process that read it (and count in its memory), so
the files are read with ordinary reads instead, one record batch at a time. The byte offset of every
batch is noted on the first pass, so that a tokenizing process can later read exactly its own batches
(``read_batch``) and the main process hands it only their places, never the texts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
