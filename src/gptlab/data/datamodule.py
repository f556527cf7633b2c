"""The LightningDataModule: sliding windows over the flat token files.

A window is ``block_size + 1`` consecutive tokens; the input is its first ``block_size`` tokens and the
target the same window shifted by one. Windows start every ``stride`` tokens: ``stride == block_size``
tiles the corpus, a smaller stride overlaps windows (more, correlated samples), a larger one skips text.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from gptlab.data import corpus
from gptlab.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens from a flat token file, starting every ``stride`` tokens."""

    def __init__(self, path, dtype: np.dtype, block_size: int, stride: int) -> None:
        self.path, self.dtype = str(path), np.dtype(dtype)
        self.block_size, self.stride = block_size, stride
        self.n_tokens = len(np.memmap(self.path, dtype=self.dtype, mode="r"))
        self._tokens: np.ndarray | None = None  # opened lazily, once per worker process

    def __len__(self) -> int:
        return corpus.num_windows(self.n_tokens, self.block_size + 1, self.stride)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.stride
        window = torch.from_numpy(self._tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]  # input (block_size,), target (block_size,)


class GPTDataModule(L.LightningDataModule):
    def __init__(
        self,
        spec: corpus.DataSpec,
        tokenizer: str,
        block_size: int,
        batch_size: int,
        stride: int | None = None,
        val_stride: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("data.batch_size", batch_size), ("model.block_size", block_size)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer.")
        for name, value in (("data.stride", stride), ("data.val_stride", val_stride)):
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(
                    f"{name}={value!r} must be a positive integer, or null for model.block_size."
                )
        self.spec = spec
        self.tokenizer_name = tokenizer
        self.block_size = block_size
        self.batch_size = batch_size
        self.stride = stride or block_size
        self.val_stride = val_stride or block_size
        self.num_workers = num_workers
        self.seed = seed
        self.corpus: corpus.PreparedCorpus | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def prepare_data(self) -> None:
        if self.corpus is None:  # builds the token cache once (local rank 0); a second call finds it set up
            corpus.prepare(self.spec, self.tokenizer_name)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        self.corpus = corpus.prepare(self.spec, self.tokenizer_name)
        self.train_set = TokenWindows(self.corpus.train_path, self.corpus.dtype, self.block_size, self.stride)
        self.val_set = TokenWindows(self.corpus.val_path, self.corpus.dtype, self.block_size, self.val_stride)
        window = self.block_size + 1
        if len(self.train_set) == 0:
            raise DataError(
                f"The training split of {self.spec.describe()} has {self.train_set.n_tokens} tokens, fewer than "
                f"one window of model.block_size + 1 = {window}. Use more text or a smaller model.block_size "
                f"(at most {max(1, self.train_set.n_tokens - 1)})."
            )
        if len(self.val_set) == 0:
            raise DataError(
                f"The validation split of {self.spec.describe()} has {self.val_set.n_tokens} tokens, fewer than "
                f"one window of {window}. Raise data.val_fraction (now {self.spec.val_fraction}), use more "
                f"text, or lower model.block_size (at most {max(1, self.val_set.n_tokens - 1)})."
            )
        log.info(
            "Windows of %d tokens: %d train (stride %d), %d validation (stride %d)",
            window,
            len(self.train_set),
            self.stride,
            len(self.val_set),
            self.val_stride,
        )

    def train_dataloader(self) -> DataLoader:
        from lightning.pytorch.strategies import ParallelStrategy
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        # A stateful loader: a resumed run continues from the same batch, not from the epoch's start. Under a
        # distributed strategy the sampler must be stateful too (Lightning's own DistributedSampler has no
        # position to restore); each rank then takes every world_size-th sample of the same seeded permutation.
        drop_last = len(self.train_set) >= self.batch_size
        options: dict[str, Any] = {"shuffle": True, "generator": torch.Generator().manual_seed(self.seed)}
        trainer = self.trainer
        if trainer is not None and isinstance(trainer.strategy, ParallelStrategy):
            sampler = StatefulDistributedSampler(
                self.train_set,
                num_replicas=trainer.world_size,
                rank=trainer.global_rank,
                shuffle=True,
                seed=self.seed,
                drop_last=drop_last,
            )
            options = {"sampler": sampler}
        return StatefulDataLoader(
            self.train_set,
            batch_size=self.batch_size,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            **options,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )
