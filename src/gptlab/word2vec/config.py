"""The options of ``task=word2vec`` (the ``word2vec:`` node of the config), checked before any work."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, fields
from typing import Any

from gptlab.errors import ConfigError
from gptlab.registry import check_keys

MODES = ("cbow", "skipgram")
OPTIMIZERS = ("sgd", "sparse_adam")
OBJECTIVES = ("negative", "hierarchical", "softmax")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("processes", "threads")
# The largest batch_size x lr whose vectors stay close to small batches': 1,024 at lr 0.025. Measured on gensim's
# Lee corpus x3 (two workers, 3 epochs), the top-10 neighbours' overlap with gensim's vectors: skip-gram 0.49 at
# 256, 0.41 at 1,024, 0.20 at 4,096; CBOW 0.51, 0.50, 0.24 (gptlab.word2vec.fast: the per-row bound binds
# more of each batch as batch_size x lr grows).
LARGE_BATCH_LR = 1024 * 0.025


def _closest(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    """The hint for a mistyped choice: the allowed value closest to it (``cbw``: "Did you mean
    word2vec.mode=cbow?"), or nothing when none is close."""
    close = difflib.get_close_matches(str(value), allowed, n=1)
    return f" Did you mean word2vec.{key}={close[0]}?" if close else ""


@dataclass
class Word2VecOptions:
    mode: str = "skipgram"
    objective: str = "negative"
    dim: int = 100
    window: int = 5
    negatives: int = 5
    min_count: int = 5
    sample: float = 1e-3
    lr: float = 0.025
    lr_min: float = 0.0001
    optimizer: str = "sgd"
    epochs: int = 5
    max_steps: int | None = None
    batch_size: int = 256
    lowercase: bool = True
    keep_punctuation: bool = False
    noise_power: float = 0.75
    checkpoint_every: int = 5000
    threads: int | None = None
    parallel: str = "processes"
    device: str = "auto"
    native: bool = True
    evaluate: bool = True
    plot_words: list[str] | None = None
    neighbour_words: list[str] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                f"word2vec.mode={self.mode!r} is not one of {MODES} (e.g. word2vec.mode=skipgram)."
                + _closest("mode", self.mode, MODES)
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"word2vec.objective={self.objective!r} is not one of {OBJECTIVES} (e.g. word2vec.objective=negative)."
                + _closest("objective", self.objective, OBJECTIVES)
            )
        if self.device not in DEVICES:
            raise ConfigError(
                f"word2vec.device={self.device!r} is not one of {DEVICES} (auto: a CUDA GPU when there is one "
                "and word2vec.batch_size is 1,024 or more, else the CPU)."
                + _closest("device", self.device, DEVICES)
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"word2vec.optimizer={self.optimizer!r} is not one of {OPTIMIZERS} (e.g. word2vec.optimizer=sgd)."
                + _closest("optimizer", self.optimizer, OPTIMIZERS)
            )
        for name in ("dim", "window", "min_count", "batch_size", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                default = next(f.default for f in fields(self) if f.name == name)
                raise ConfigError(
                    f"word2vec.{name}={value!r} must be a positive integer (e.g. word2vec.{name}={default})."
                )
        if not isinstance(self.negatives, int) or self.negatives < 1:
            raise ConfigError(
                f"word2vec.negatives={self.negatives!r} must be a positive integer (5-20 for small corpora, "
                "2-5 for large ones, as Mikolov et al. 2013 suggest)."
            )
        if not self.sample >= 0:
            raise ConfigError(
                f"word2vec.sample={self.sample!r} must be >= 0 (1e-3 to 1e-5 subsamples frequent words; 0: off)."
            )
        if not (self.lr > 0 and 0 <= self.lr_min <= self.lr):
            raise ConfigError(
                f"word2vec.lr={self.lr!r} and word2vec.lr_min={self.lr_min!r}: need 0 <= lr_min <= lr and lr > 0 "
                "(word2vec's defaults: lr=0.025 for skip-gram, 0.05 for CBOW, lr_min=0.0001)."
            )
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(
                f"word2vec.threads={self.threads!r} must be a positive integer (worker threads), or null for every core."
            )
        if self.parallel not in PARALLEL:
            raise ConfigError(
                f"word2vec.parallel={self.parallel!r} is not one of {PARALLEL} (processes: forked workers on shared tables)."
                + _closest("parallel", self.parallel, PARALLEL)
            )
        if not isinstance(self.native, bool):
            raise ConfigError(
                f"word2vec.native={self.native!r} must be true (CBOW's C step where a C compiler is found) or false."
            )
        steps = self.max_steps
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ConfigError(
                f"word2vec.max_steps={steps!r} must be a positive integer, or null to train epochs."
            )
        if steps is None and (not isinstance(self.epochs, int) or self.epochs < 1):
            raise ConfigError(
                f"word2vec.epochs={self.epochs!r} must be a positive integer (or set word2vec.max_steps)."
            )

    def large_batch_warning(self) -> str | None:
        """What a batch this large does at this learning rate, with a batch size that avoids it; None where
        ``batch_size * lr`` is at most :data:`LARGE_BATCH_LR`. Not refused: the run trains (the per-row bound
        keeps it from diverging, :func:`gptlab.word2vec.fast.row_scales`), but its vectors drift from what
        small batches give, as the bound binds more of each batch's rows (for the SGD step with the sigmoid
        objectives, where that drift was measured; the full softmax's step is bounded too, its drift unmeasured)."""
        if self.optimizer != "sgd" or self.objective == "softmax":
            return None
        if self.batch_size * self.lr <= LARGE_BATCH_LR:
            return None
        product = f"batch_size x lr = {self.batch_size * self.lr:g}, above {LARGE_BATCH_LR:g}"
        measured = (
            "each step holds back the rows a batch uses most, so that the run does not diverge, and the vectors "
            "drift from what small batches give: measured against gensim's on its Lee corpus at lr 0.025, the "
            "neighbours' agreement fell from 0.49 at 256 to 0.41 at 1,024 and 0.20 at 4,096 for skip-gram, and "
            "from 0.51 to 0.50 and 0.24 for CBOW"
        )
        if self.lr > LARGE_BATCH_LR:  # no batch is small enough: the rate itself is the cause
            fix = f"Lower word2vec.lr (at most {LARGE_BATCH_LR / self.batch_size:g} at this batch size)."
        else:
            keeps = 1 << (int(LARGE_BATCH_LR / self.lr).bit_length() - 1)  # the largest power of two within
            fix = f"word2vec.batch_size={keeps} keeps them close."
        return (
            f"word2vec.batch_size={self.batch_size} at word2vec.lr={self.lr:g} ({product}): {measured}. {fix}"
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Word2VecOptions:
        check_keys(values, [f.name for f in fields(cls)], "word2vec", "word2vec")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
