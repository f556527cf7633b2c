"""Token files: flat arrays of token ids, one or many (shards), read through numpy memmaps.

Three layouts are read as they are:

- gptlab's prepared caches: ``index.json`` lists the shards of each split (``train_000000.bin``, ...,
  ``val.bin``: flat uint16 while the vocabulary fits, else uint32), written in parallel, one per writer;
- nanoGPT's ``train.bin``/``val.bin`` (flat uint16 GPT-2 ids, as its ``prepare.py`` scripts write them);
- llm.c's ``*_train_*.bin``/``*_val_*.bin`` shards: a header of 256 int32 (magic 20240520, version 1,
  the token count), then the uint16 tokens.

A split's shards read as one sequence: a window that crosses a shard boundary is cut from both files.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptlab.errors import DataError


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 up to 65,536 ids (GPT-2's 50,257), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


INDEX = "index.json"
LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256


@dataclass(frozen=True)
class Shard:
    path: str
    n_tokens: int
    offset: int = 0  # bytes before the first token (llm.c's header)


class TokenShards:
    """The shards of one split as one sequence of ``len(self)`` token ids. Memmaps open lazily, so an
    instance pickles cheaply into DataLoader workers."""

    def __init__(self, shards: list[Shard], dtype: np.dtype | str) -> None:
        self.shards = [s for s in shards if s.n_tokens > 0]
        self.dtype = np.dtype(dtype)
        self.starts = np.cumsum([0] + [s.n_tokens for s in self.shards])  # (n_shards + 1,)
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def _open(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [
                np.memmap(s.path, dtype=self.dtype, mode="r", offset=s.offset, shape=(s.n_tokens,))
                for s in self.shards
            ]
        return self._maps

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split, across shard boundaries."""
        maps = self._open()
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        k = first
        while start < stop and k < len(maps):
            lo = start - int(self.starts[k])
            hi = min(stop, int(self.starts[k + 1])) - int(self.starts[k])
            parts.append(maps[k][lo:hi])
            start = int(self.starts[k]) + hi
            k += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chunks(self, size: int = 1 << 22):
        """The tokens in order, ``size`` at a time (for a pass over a split in bounded memory)."""
        for m in self._open():
            for start in range(0, len(m), size):
                yield np.asarray(m[start : start + size])

    def array(self) -> np.ndarray:
        """The whole split in memory (for the small validation split)."""
        return self.read(0, len(self)) if len(self) else np.zeros(0, dtype=self.dtype)


def write_index(folder: Path, dtype: np.dtype, splits: dict[str, list[tuple[str, int]]]) -> None:
    index = {
        "dtype": np.dtype(dtype).name,
        "splits": {k: [{"file": f, "tokens": n} for f, n in v] for k, v in splits.items()},
    }
    (folder / INDEX).write_text(json.dumps(index, indent=1))


def read_index(folder: Path) -> dict[str, TokenShards]:
    index = json.loads((folder / INDEX).read_text())
    return {
        split: TokenShards([Shard(str(folder / s["file"]), s["tokens"]) for s in shards], index["dtype"])
        for split, shards in index["splits"].items()
    }


# ---- the anchors' token files ------------------------------------------------------------------------


def _llmc_shard(path: str) -> Shard:
    header = np.fromfile(path, dtype=np.int32, count=LLMC_HEADER_INTS)
    size = os.path.getsize(path)
    if len(header) < 3 or header[0] != LLMC_MAGIC:
        raise DataError(
            f"{path} is not an llm.c token shard: its magic number is "
            f"{int(header[0]) if len(header) else 'missing'}, not {LLMC_MAGIC}. llm.c shards start with a "
            f"header of {LLMC_HEADER_INTS} int32 (magic, version, token count); for flat uint16 token files "
            "use nanoGPT's names train.bin and val.bin."
        )
    if header[1] != LLMC_VERSION:
        raise DataError(
            f"{path}: llm.c shard version {int(header[1])}; only version {LLMC_VERSION} (uint16 GPT-2 tokens) "
            "is read."
        )
    n_tokens, offset = int(header[2]), LLMC_HEADER_INTS * 4
    if size != offset + 2 * n_tokens:
        raise DataError(
            f"{path}: its header says {n_tokens} tokens ({offset + 2 * n_tokens} bytes) but the file has "
            f"{size} bytes: the shard is truncated or was written by another tool."
        )
    return Shard(path, n_tokens, offset)


def token_folder(path: str | list[str] | None) -> tuple[str, dict[str, TokenShards]] | None:
    """The splits of a folder of the anchors' token files, with their layout's name, or None when
    ``path`` is not such a folder."""
    if not isinstance(path, str):
        return None
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        return None
    if (folder / "train.bin").is_file() and (folder / "val.bin").is_file():
        return "nanoGPT", {
            split: TokenShards(
                [Shard(str(folder / f"{split}.bin"), (folder / f"{split}.bin").stat().st_size // 2)], "uint16"
            )
            for split in ("train", "val")
        }
    found = {split: sorted(glob.glob(str(folder / f"*_{split}_*.bin"))) for split in ("train", "val")}
    if found["train"] or found["val"]:
        for split, files in found.items():
            if not files:
                raise DataError(
                    f"data.path={path!r} holds llm.c {('val' if split == 'train' else 'train')} shards but no "
                    f"*_{split}_*.bin file: llm.c's preparation writes both (e.g. fineweb_val_000000.bin)."
                )
        return "llm.c", {
            split: TokenShards([_llmc_shard(f) for f in files], "uint16") for split, files in found.items()
        }
    return None


def unigram_entropy(counts: np.ndarray) -> float:
    """The entropy, in nats, of token frequencies: the loss of a model that ignores context."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def token_counts(tokens: TokenShards, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for chunk in tokens.chunks():
        counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    return counts
