"""Token files: flat arrays of token ids, one or many (shards), read through numpy memmaps.

Three layouts are read as they are:

- gptlab's prepared caches: ``index.json`` lists the shards of each split (``train_000000.bin``, ...,
  ``val.bin``: flat uint16 while the vocabulary fits, else uint32), written in parallel, one per writer;
- nanoGPT's ``train.bin``/``val.bin`` (flat uint16 GPT-2 ids, as its ``prepare.py`` scripts write them);
- llm.c's ``*_train_*.bin``/``*_val_*.bin`` shards: a header of 256 int32 (magic 20240520, version 1,
  the token count), then the uint16 tokens.

A split's shards read as one sequence: a window that crosses a shard boundary is cut from both files.

Every file is checked when it is opened, before any step: its size against the token count its index or
header gives, and, for gptlab's caches, its CRC-32 against the one ``index.json`` recorded when it was
written (bytes overwritten in place keep the size). Measured here on one loaded core: zlib's CRC-32 of a
file in the page cache takes about 2 s a GB (0.2 ms for the embedded corpus's 0.3 MB of GPT-2 tokens, against
4 s to tokenize it), so a cache's checksums are all verified while its files total at most ``VERIFY_BYTES``;
above that the validation split's are (it is read whole anyway) and the training shards' sizes only, as the
log says.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.errors import DataError

log = logging.getLogger(__name__)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id: uint16 up to 65,536 ids (GPT-2's 50,257), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


INDEX = "index.json"
LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256
# The most bytes of token files whose checksums are verified at every open (about 2 s here).
VERIFY_BYTES = 1 << 30


class DamagedCache(DataError):
    """A gptlab token cache whose files do not match its ``index.json`` (or whose index cannot be read)."""

    def __init__(self, folder: Path, file: str, problem: str) -> None:
        self.folder, self.file, self.problem = Path(folder), file, problem
        self.what = f"The token cache {folder} is damaged: {file} {problem}"
        super().__init__(
            f"{self.what}. Delete the folder (`rm -r {folder}`); the next run prepares it again from the corpus."
        )


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


def file_crc32(path: str | Path, offset: int = 0) -> int:
    """CRC-32 of a file's bytes from ``offset`` on, read in pieces of 16 MiB."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while piece := f.read(1 << 24):
            crc = zlib.crc32(piece, crc)
    return crc


def write_index(folder: Path, dtype: np.dtype, splits: dict[str, list[tuple[str, int]]]) -> None:
    """``index.json``: the dtype, and per split its files with their token counts and CRC-32s."""
    index = {
        "dtype": np.dtype(dtype).name,
        "splits": {
            k: [{"file": f, "tokens": n, "crc32": file_crc32(folder / f)} for f, n in v]
            for k, v in splits.items()
        },
    }
    (folder / INDEX).write_text(json.dumps(index, indent=1))


def _parse_index(folder: Path) -> tuple[np.dtype, dict[str, list[dict[str, Any]]]]:
    path = folder / INDEX
    try:
        index = json.loads(path.read_text())
        dtype = np.dtype(index["dtype"])
        splits = index["splits"]
        for split in ("train", "val"):
            for entry in splits[split]:
                if (
                    not isinstance(entry["file"], str)
                    or not isinstance(entry["tokens"], int)
                    or entry["tokens"] < 0
                ):
                    raise ValueError(f"a bad entry {entry!r}")
    except FileNotFoundError:
        raise DamagedCache(folder, INDEX, "is missing") from None
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise DamagedCache(folder, INDEX, f"cannot be read ({type(e).__name__}: {e})") from None
    return dtype, splits


def read_index(folder: Path, verify_bytes: int = VERIFY_BYTES) -> dict[str, TokenShards]:
    """The splits of a gptlab cache, after checking every file against ``index.json``: present, of the size
    its token count gives, and of the recorded CRC-32 (all files while they total at most ``verify_bytes``,
    else the validation split's). Raises :class:`DamagedCache` naming the file and what is wrong."""
    folder = Path(folder)
    dtype, splits = _parse_index(folder)
    total = 0
    for entries in splits.values():
        for entry in entries:
            path = folder / entry["file"]
            expected = entry["tokens"] * dtype.itemsize
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise DamagedCache(folder, entry["file"], "is missing") from None
            except OSError as e:
                raise DamagedCache(folder, entry["file"], f"cannot be read ({e.strerror or e})") from None
            if size != expected:
                raise DamagedCache(
                    folder,
                    entry["file"],
                    f"has {size} bytes where {INDEX} says {entry['tokens']} tokens of {dtype.name} "
                    f"({expected} bytes): it was {'truncated' if size < expected else 'appended to'}",
                )
            total += size
    verified = [s for s in ("val", "train") if s == "val" or total <= verify_bytes]
    for split in verified:
        for entry in splits.get(split, []):
            try:
                crc = file_crc32(folder / entry["file"]) if "crc32" in entry else None
            except OSError as e:
                raise DamagedCache(folder, entry["file"], f"cannot be read ({e.strerror or e})") from None
            if crc is not None and crc != entry["crc32"]:
                raise DamagedCache(
                    folder,
                    entry["file"],
                    f"does not have the CRC-32 {INDEX} recorded when it was written: bytes in it were "
                    "overwritten (by another program, or a failing disk)",
                )
    if "train" not in verified:
        log.info(
            "Token cache %s: %.1f GB, the training shards' sizes checked, their checksums not (more than %.1f GB "
            "a start)",
            folder,
            total / 1e9,
            verify_bytes / 1e9,
        )
    return {
        split: TokenShards([Shard(str(folder / s["file"]), s["tokens"]) for s in entries], dtype)
        for split, entries in splits.items()
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
            f"{size} bytes: the shard is truncated or was written by another tool. Write it again with the "
            "preparation script that made it, or move it out of the folder."
        )
    return Shard(path, n_tokens, offset)


def _nanogpt_file(path: Path) -> Shard:
    size = path.stat().st_size
    if size % 2:
        raise DataError(
            f"{path} has {size} bytes, not a whole number of uint16 tokens (2 bytes each): it is truncated or "
            "is not a token file. Write it again with the preparation script that made it (nanoGPT's "
            "data/<name>/prepare.py)."
        )
    return Shard(str(path), size // 2)


def token_folder(path: str | list[str] | None) -> tuple[str, dict[str, TokenShards]] | None:
    """The splits of a folder of the anchors' token files, with their layout's name, or None when
    ``path`` is not such a folder."""
    if not isinstance(path, str):
        return None
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        return None
    present = [name for name in ("train.bin", "val.bin") if (folder / name).is_file()]
    if len(present) == 1:
        missing = "val.bin" if present == ["train.bin"] else "train.bin"
        raise DataError(
            f"data.path={path!r} holds nanoGPT's {present[0]} but no {missing}: training needs both splits "
            f"(nanoGPT's prepare.py writes both). Write {folder / missing} with the same script."
        )
    if len(present) == 2:
        return "nanoGPT", {
            split: TokenShards([_nanogpt_file(folder / f"{split}.bin")], "uint16")
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
