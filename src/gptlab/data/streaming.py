"""Streaming: documents read through ``datasets``' streaming mode (an IterableDataset: hub files or local
files read lazily, nothing downloaded or converted ahead) and tokenized on the fly into windows.

- Every reader (each DataLoader worker of each rank: ``world_size x num_workers`` of them) reads its own
  part of the stream (``datasets.distributed.split_dataset_by_node`` over the readers: whole files when their
  number divides by the readers', else every n-th document, so that one file is split too). Each training
  document goes to exactly one reader in a pass; each reader cuts its documents into windows.
- A resumed run continues from the same document and token: the stream's ``state_dict()`` and the tokens
  carried over from the last document are the dataset's state, saved in the checkpoint through
  torchdata's ``StatefulDataLoader``. (No shuffle buffer: ``datasets`` drops its content on resume.)
- Validation is a fixed set of held-out documents: a document is held out when a seeded hash of its text
  falls below ``val_fraction``, the same decision on every rank and in every epoch; training skips held-out
  documents, and the first ``val_tokens`` tokens of them are the validation set, cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gptlab.data import tokenizers
from gptlab.data.shards import Shard, TokenShards
from gptlab.data.sources import DataSpec, load_stream, source_fingerprint
from gptlab.errors import DataError

log = logging.getLogger(__name__)


def held_out(text: str, seed: int, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode())
    return int.from_bytes(digest.digest(), "little") < fraction * 2**64


def _usable(text: Any) -> bool:
    return isinstance(text, str) and bool(text.strip())


def held_out_shards(spec: DataSpec, tokenizer: tokenizers.Tokenizer) -> TokenShards:
    """The held-out documents' first ``spec.val_tokens`` tokens (``<|endoftext|>`` after each), read from
    the start of the stream once and cached under ``spec.cache_dir`` as a flat token file."""
    from gptlab.data.shards import token_dtype

    material = {
        "source": source_fingerprint(spec),
        "text_field": spec.text_field,
        "val_fraction": spec.val_fraction,
        "split_seed": spec.split_seed,
        "val_tokens": spec.val_tokens,
        "tokenizer": tokenizer.fingerprint,
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(spec.cache_dir) / f"stream-val-{tokenizer.name}-{key}.bin"
    dtype = token_dtype(tokenizer.vocab_size)
    if not path.is_file():
        parts, n = [], 0
        for example in load_stream(spec):
            text = example["text"]
            if _usable(text) and held_out(text, spec.split_seed, spec.val_fraction):
                parts.append(np.asarray(tokenizer.encode(text) + [tokenizer.eot_id], dtype=dtype))
                n += len(parts[-1])
                if n >= spec.val_tokens:
                    break
        tokens = np.concatenate(parts)[: spec.val_tokens] if parts else np.zeros(0, dtype=dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tokens.tofile(tmp)
        os.replace(tmp, path)  # atomic: a killed run leaves no partial validation set
        log.info("Streaming validation set: %d tokens of held-out documents -> %s", len(tokens), path)
    return TokenShards([Shard(str(path), path.stat().st_size // dtype.itemsize)], dtype)


class StreamingWindows(IterableDataset):
    """Windows of ``window`` tokens (input and target shifted by one) cut from the documents of a stream,
    one after another, each starting at the last token of the one before (as ``TokenWindows`` with stride
    ``window - 1``). The stream is read again from its start when it ends (``epoch`` counts the passes),
    so every rank yields windows until training stops. Stateful: ``state_dict``/``load_state_dict``
    resume at the same token.

    Reader ``rank * num_workers + worker`` of ``world_size * num_workers`` takes its share of the documents
    (``reader_of``); the split is made where the iteration starts, in the DataLoader worker, so that every
    worker of every rank reads a different part. ``datasets``' own split by worker (whole files only, none
    for the second worker of a one-file corpus) is not used.

    ``length``: the windows a run will take (its steps x batch size). Declaring it makes the loader sized,
    which matters to Lightning: it reads one batch ahead of an unsized loader to find its end, so the
    loader state it saves would be one batch ahead of the weights."""

    def __init__(
        self,
        spec: DataSpec,
        tokenizer: tokenizers.Tokenizer,
        window: int,
        rank: int = 0,
        world_size: int = 1,
        length: int | None = None,
    ) -> None:
        self.spec, self.tokenizer, self.window, self.length = spec, tokenizer, window, length
        self.rank, self.world_size = rank, world_size
        load_stream(spec)  # a source that cannot be read fails here, not in a worker
        self._stream_state: dict | None = None  # the stream's state after the last document in the buffer
        self._buffer = np.zeros(0, dtype=np.int64)  # tokens read but not yet fully used by a window
        self._epoch = 0

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this stream was given no length")
        return self.length

    def reader_of(self) -> tuple[int, int, int]:
        """(this reader's index, the number of readers, the DataLoader worker): the readers are the
        ``num_workers`` workers (1 without workers) of each of the ``world_size`` ranks."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers, worker

    def _documents(self, reader: int, readers: int) -> Iterator[str]:
        """This reader's documents in one pass, from the state loaded on resume if there is one; the
        stream's state after each document is kept in ``_stream_state``."""
        from datasets.distributed import split_dataset_by_node

        stream = load_stream(self.spec)
        if readers > 1:
            stream = split_dataset_by_node(stream, reader, readers)
        if self._stream_state is not None:
            stream.load_state_dict(self._stream_state)
        # ``iter`` rather than ``__iter__``: inside a DataLoader worker, ``datasets`` would split the already
        # split stream again by worker, by whole files.
        for batch in stream.iter(batch_size=1):
            self._stream_state = stream.state_dict()
            yield batch["text"][0]

    def __iter__(self):
        spec, tok, window = self.spec, self.tokenizer, self.window
        reader, readers, worker = self.reader_of()
        while True:
            yielded = False
            buffer = self._buffer
            for text in self._documents(reader, readers):
                if not _usable(text) or held_out(text, spec.split_seed, spec.val_fraction):
                    continue
                ids = np.asarray(tok.encode(text) + [tok.eot_id], dtype=np.int64)
                buffer = np.concatenate([buffer, ids])
                while len(buffer) >= window:
                    chunk = torch.from_numpy(buffer[:window].copy())
                    buffer = buffer[window - 1 :]
                    self._buffer = buffer
                    yielded = True
                    yield chunk[:-1], chunk[1:]  # input (window - 1,), target (window - 1,)
                self._buffer = buffer
            if not yielded and not self._resumed_mid_pass:
                raise DataError(
                    f"The stream of {spec.describe()} gives no training window of {window} tokens to reader "
                    f"{reader} of {readers} (rank {self.rank} of {self.world_size}, DataLoader worker {worker}; "
                    "each reader takes every n-th document, or whole files when there are enough): use more "
                    "text, fewer data.num_workers, or a smaller model.block_size."
                )
            # the stream has ended: read it again from its start (a state loaded on resume applies to the
            # pass it was saved in only)
            self._epoch += 1
            self._buffer, self._stream_state = np.zeros(0, dtype=np.int64), None
            self._resumed_mid_pass = False

    _resumed_mid_pass = False  # a pass that began from a loaded state may have no window left to give

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self._stream_state,
            "buffer": torch.from_numpy(self._buffer.copy()),
            "epoch": self._epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._buffer = np.asarray(state["buffer"], dtype=np.int64)
        self._stream_state = state["stream"]
        self._resumed_mid_pass = self._stream_state is not None
