"""The corpus word2vec trains on, in bounded memory: every corpus the GPT task reads, as one flat sequence of
integer ids with document boundaries, read in chunks.

- Text (the embedded corpus, ``data.path`` txt / jsonl / json / parquet / csv files, hub datasets): documents
  are streamed (local ``.txt`` files read in blocks, the others record batch by record batch from ``datasets``'
  Arrow files) and cut into words by the project's word tokenizer. Each new word gets a provisional id in
  order of first appearance; the corpus is kept as one int32 array of those ids (4 bytes a word, never a
  Python list of strings), a reserved id marking the end of each document.
- Token folders (nanoGPT's ``train.bin``/``val.bin``, llm.c's ``*_train_*.bin``/``*_val_*.bin``): the GPT-2
  token ids are the words. The files are read through their memmaps as they are (nothing is copied), both
  splits in turn (word2vec has no held-out loss); ``<|endoftext|>`` ends a document and is not a word. A
  token's word is its byte-level string in GPT-2's own vocabulary file (``Ġking`` for " king", ``Ċ`` for a
  newline), so every vocabulary entry is unique, has no whitespace, and maps back to its token id.

Either way a lookup table turns a read chunk into vocabulary ids (most frequent word first, as word2vec.c and
gensim order them), ``OUT_OF_VOCABULARY`` for words under ``min_count`` (left out before windows are taken,
as in word2vec.c) and ``BOUNDARY`` at document ends.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.shards import TokenShards, token_folder
from gptlab.data.sources import DataSpec
from gptlab.errors import ConfigError, DataError
from gptlab.word2vec import sampling
from gptlab.word2vec.config import Word2VecOptions

log = logging.getLogger(__name__)

OUT_OF_VOCABULARY = -1
BOUNDARY = -2
_END = 0  # the provisional id of a document's end in a text corpus
TEXT_BLOCK_CHARS = 1 << 20  # a local .txt file is read this many characters at a time


def data_spec(data: Any) -> DataSpec:
    """The corpus spec from the ``data`` node, without the GPT loader's options (batch size, windows)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(data, DictConfig):
        data = OmegaConf.to_container(data, resolve=True)
    known = {f.name for f in fields(DataSpec)}
    return DataSpec(**{k: v for k, v in dict(data).items() if k in known})


class ArraySource:
    """An in-memory array read as ``TokenShards`` is."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.array[start:stop]


@dataclass
class WordCorpus:
    """``source``: raw ids (provisional word ids, or GPT-2 token ids), read ``[start, stop)`` at a time;
    ``lookup``: raw id -> vocabulary id, ``OUT_OF_VOCABULARY`` or ``BOUNDARY``."""

    vocab: sampling.Vocabulary
    sources: list[Any]
    lookup: np.ndarray
    kind: str  # "text" or "tokens"
    description: str

    def __post_init__(self) -> None:
        self.lengths = [len(s) for s in self.sources]
        self.starts = np.cumsum([0, *self.lengths])

    @property
    def n_raw(self) -> int:
        """Positions of the flat sequence, words outside the vocabulary and boundaries included."""
        return int(self.starts[-1])

    @property
    def words(self) -> int:
        """Words in the vocabulary: what one epoch trains on, before subsampling."""
        return int(self.vocab.counts.sum())

    def chunks(self, size: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges of at most ``size`` positions that tile the sequence, never crossing from
        one file (or split) to the next."""
        out = []
        for k in range(len(self.sources)):
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            out += [(s, min(s + size, hi)) for s in range(lo, hi, size)]
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Vocabulary ids (and the two markers) of positions ``[start, stop)``, within one of ``chunks``."""
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = int(self.starts[k])
        raw = self.sources[k].read(start - offset, stop - offset)
        return self.lookup[raw.astype(np.int64, copy=False)]


# ---- text corpora ------------------------------------------------------------------------------------


def _text_files(spec: DataSpec) -> list[str] | None:
    """The files of ``data.path`` when they are plain text (read here directly, in blocks), else None."""
    if spec.source != "files":
        return None
    from gptlab.data.sources import resolve_files

    assert spec.path is not None
    files = resolve_files(spec.path)
    if all(Path(f).suffix.lower() in (".txt", ".text", ".md") for f in files):
        return files
    return None


def _text_file_blocks(path: str) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) blocks of a text file, cut at whitespace: one file is one document, as the GPT
    task reads it."""
    try:
        with open(path, encoding="utf-8") as f:
            carry = ""
            while True:
                block = f.read(TEXT_BLOCK_CHARS)
                if not block:
                    break
                text = carry + block
                cut = max(text.rfind(" "), text.rfind("\n"))
                if cut <= 0:
                    carry = text
                    continue
                carry = text[cut:]
                yield text[:cut], False
            yield carry, True
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}). Convert it, e.g. "
            "`iconv -f latin1 -t utf-8 in.txt > out.txt`."
        ) from e


def text_blocks(spec: DataSpec) -> Iterator[tuple[str, bool]]:
    """Every document of a text corpus as (text, ends_document) blocks, streamed."""
    files = _text_files(spec)
    if files is not None:
        for path in files:
            yield from _text_file_blocks(path)
        return
    from gptlab.data.sources import iter_batches, load_documents

    ds = load_documents(spec)
    for column, _ in iter_batches(ds, "text"):
        for text in column.to_pylist():
            if text and text.strip():
                yield text, True


def tokenized_documents(spec: DataSpec, options: Word2VecOptions) -> Iterator[list[str]]:
    """The documents as lists of words, as this task sees them (for the gensim comparison, which needs
    them as lists). Streams: a document of many blocks comes as several lists."""
    for text, _ in text_blocks(spec):
        yield sampling.tokenize(text, options.lowercase, options.keep_punctuation)


def read_text(spec: DataSpec, options: Word2VecOptions) -> WordCorpus:
    index: dict[str, int] = {}
    parts: list[np.ndarray] = []
    documents = 0
    for text, ends in text_blocks(spec):
        words = sampling.tokenize(text, options.lowercase, options.keep_punctuation)
        for w in dict.fromkeys(words):  # new words get the next ids, in order of first appearance
            if w not in index:
                index[w] = len(index) + 1  # 0 is _END
        ids = np.fromiter(map(index.__getitem__, words), dtype=np.int32, count=len(words))
        if ends:
            ids = np.append(ids, np.int32(_END))
            documents += 1
        if len(ids):
            parts.append(ids)
    raw = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    del parts
    counts = np.bincount(raw, minlength=len(index) + 1)
    counts[_END] = 0
    keys = np.empty(len(index) + 1, dtype=object)
    keys[_END] = ""
    for w, i in index.items():
        keys[i] = w
    vocab, lookup = _vocabulary(keys, counts, options.min_count, documents)
    lookup[_END] = BOUNDARY
    return WordCorpus(vocab, [ArraySource(raw)], lookup, "text", spec.describe())


# ---- token folders -----------------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte (its vocabulary file writes tokens with these): printable
    Latin-1 bytes stand for themselves, the others (space, control bytes) for the characters from U+0100 on,
    in byte order. A space is "Ġ" (U+0120), a newline "Ċ" (U+010A)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = [""] * 256
    extra = 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def gpt2_token_strings() -> list[str]:
    """Every GPT-2 token as the string of GPT-2's vocabulary file (``Ġking``)."""
    from gptlab.data.tokenizers import GPT2Tokenizer

    encoding = GPT2Tokenizer.create(GPT2Tokenizer.Options()).encoding
    alphabet = _byte_level_alphabet()
    return [
        "".join(alphabet[b] for b in encoding.decode_single_token_bytes(i)) for i in range(encoding.n_vocab)
    ]


def read_token_folder(spec: DataSpec, options: Word2VecOptions, layout: str, splits: dict) -> WordCorpus:
    vocab_size, eot = 50257, 50256
    sources: list[TokenShards] = [splits["train"], splits["val"]]
    counts = np.zeros(vocab_size, dtype=np.int64)
    documents = 0
    for shards in sources:
        for chunk in shards.chunks():
            if len(chunk) and int(chunk.max()) >= vocab_size:
                raise DataError(
                    f"data.path={spec.path!r} holds token id {int(chunk.max())}, beyond GPT-2's {vocab_size}: "
                    "word2vec reads nanoGPT / llm.c folders of GPT-2 token ids."
                )
            counts += np.bincount(chunk, minlength=vocab_size)
    documents = int(counts[eot])
    counts[eot] = 0
    keys = np.array(gpt2_token_strings(), dtype=object)
    vocab, lookup = _vocabulary(keys, counts, options.min_count, documents)
    lookup[eot] = BOUNDARY
    return WordCorpus(
        vocab, sources, lookup, "tokens", f"{layout} token files in {spec.path} (GPT-2 token ids)"
    )


# ---- both --------------------------------------------------------------------------------------------


def _vocabulary(
    keys: np.ndarray, counts: np.ndarray, min_count: int, documents: int
) -> tuple[sampling.Vocabulary, np.ndarray]:
    """The frequency-sorted vocabulary of the raw ids counted at least ``min_count`` times (ties by the
    word), and the lookup from raw id to vocabulary id."""
    kept = np.flatnonzero(counts >= min_count)
    if len(kept) == 0:
        raise DataError(
            f"No word occurs word2vec.min_count={min_count} times in the corpus ({int(counts.sum())} words, "
            f"{int((counts > 0).sum())} distinct, {documents} documents): lower word2vec.min_count or give "
            "more text."
        )
    order = sorted(kept.tolist(), key=lambda i: (-int(counts[i]), keys[i]))
    lookup = np.full(len(counts), OUT_OF_VOCABULARY, dtype=np.int64)
    lookup[order] = np.arange(len(order))
    words = [str(keys[i]) for i in order]
    return sampling.Vocabulary(words, counts[order].astype(np.int64)), lookup


def read_corpus(spec: DataSpec, options: Word2VecOptions) -> WordCorpus:
    """The configured corpus as a ``WordCorpus``. Streaming hub corpora are refused: word2vec passes over
    the corpus once per epoch and needs its vocabulary first."""
    if spec.streaming:
        raise ConfigError(
            "data.streaming=true reads the corpus once, on the fly; word2vec counts its vocabulary first and "
            "passes over the corpus every epoch. Use data.streaming=false (the corpus is prepared on disk)."
        )
    folder = token_folder(spec.path)
    corpus = read_token_folder(spec, options, *folder) if folder else read_text(spec, options)
    log.info(
        "word2vec corpus %s: %d positions, %d words in a vocabulary of %d (min_count=%d)",
        corpus.description,
        corpus.n_raw,
        corpus.words,
        len(corpus.vocab),
        options.min_count,
    )
    return corpus


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


__all__ = ["WordCorpus", "read_corpus", "tokenized_documents", "data_spec", "peak_rss_mib"]
