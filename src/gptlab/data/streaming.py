"""Streaming: documents read through ``datasets``' streaming mode (an IterableDataset: hub files or local
files read lazily, nothing downloaded or converted ahead) and tokenized on the fly into windows.

- Each rank reads its own part of the stream (``datasets.distributed.split_dataset_by_node``: whole files
  when their number divides by the world size, else every world_size-th document).
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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

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


def validation_tokens(spec: DataSpec, tokenizer: tokenizers.Tokenizer) -> TokenShards:
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
        self.stream = self._open()
        self._stream_state: dict | None = None  # the stream's state after the last document in the buffer
        self._buffer = np.zeros(0, dtype=np.int64)  # tokens read but not yet fully used by a window
        self._epoch = 0

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this stream was given no length")
        return self.length

    def __iter__(self):
        spec, tok, window = self.spec, self.tokenizer, self.window
        while True:
            yielded = False
            buffer = self._buffer
            for example in self.stream:
                text = example["text"]
                if not _usable(text) or held_out(text, spec.split_seed, spec.val_fraction):
                    continue
                ids = np.asarray(tok.encode(text) + [tok.eot_id], dtype=np.int64)
                buffer = np.concatenate([buffer, ids])
                self._stream_state = self.stream.state_dict()
                while len(buffer) >= window:
                    chunk = torch.from_numpy(buffer[:window].copy())
                    buffer = buffer[window - 1 :]
                    self._buffer = buffer
                    yielded = True
                    yield chunk[:-1], chunk[1:]  # input (window - 1,), target (window - 1,)
                self._buffer = buffer
            if not yielded and self._stream_state is None:
                raise DataError(
                    f"The stream of {spec.describe()} gives no training window of {window} tokens (rank "
                    f"{self.rank} of {self.world_size}): use more text or a smaller model.block_size."
                )
            # the stream has ended: read it again from its start (a fresh stream, so that a state loaded on
            # resume does not apply to the next pass)
            self._epoch += 1
            self._buffer, self._stream_state = np.zeros(0, dtype=np.int64), None
            self.stream = self._open()

    def _open(self) -> Any:
        from datasets.distributed import split_dataset_by_node

        stream = load_stream(self.spec)
        return split_dataset_by_node(stream, self.rank, self.world_size) if self.world_size > 1 else stream

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
        if self._stream_state is not None:
            self.stream.load_state_dict(self._stream_state)
