"""The LightningModule of ``task=word2vec``: the negative-sampling loss, word2vec's linearly decaying learning
rate, words per second, and the vocabulary saved in every checkpoint."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning as L
import torch

from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.model import Word2Vec


class Word2VecLitModule(L.LightningModule):
    def __init__(self, word2vec: dict[str, Any], vocab_size: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.options = Word2VecOptions.from_dict(dict(word2vec))
        self.model = Word2Vec(vocab_size, self.options.dim, self.options.mode)
        self.vocab_words: list[str] | None = None  # saved with each checkpoint
        self.vocab_counts: list[int] | None = None
        self._times: deque[tuple[float, float]] = deque(maxlen=20)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        o = self.options
        if o.optimizer == "sparse_adam":
            return torch.optim.SparseAdam(self.model.parameters(), lr=o.lr)
        # word2vec's own update: plain SGD on the summed loss of the batch's pairs, the step per pair as in
        # word2vec.c, with the learning rate decayed linearly (set in training_step).
        return torch.optim.SGD(self.model.parameters(), lr=o.lr)

    def learning_rate(self, progress: float) -> float:
        """word2vec's schedule: linear from lr at the start to lr_min at the end of training."""
        o = self.options
        if o.max_steps:
            progress = self.global_step / o.max_steps
        return o.lr - (o.lr - o.lr_min) * min(max(progress, 0.0), 1.0)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        inputs, targets, negatives, words, progress = batch
        lr = self.learning_rate(float(progress))
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one optimizer
        for group in optimizer.optimizer.param_groups:
            group["lr"] = lr
        losses = self.model(inputs, targets, negatives)  # (N,)
        n = max(len(losses), 1)
        self._times.append((time.perf_counter(), float(words)))
        self.log("train/loss", losses.detach().sum() / n, prog_bar=True, batch_size=n)
        self.log("train/lr", lr, batch_size=n)
        if len(self._times) > 1:
            (t0, _), (t1, _) = self._times[0], self._times[-1]
            covered = sum(w for _, w in list(self._times)[1:])
            if t1 > t0:
                self.log("train/words_per_second", covered / (t1 - t0), prog_bar=True, batch_size=n)
        return losses.sum()

    def on_train_epoch_start(self) -> None:
        self._times.clear()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.vocab_words is not None:
            assert self.vocab_counts is not None  # set together with vocab_words
            checkpoint["word2vec_vocab"] = {
                "words": list(self.vocab_words),
                "counts": list(self.vocab_counts),
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        vocab = checkpoint.get("word2vec_vocab")
        if vocab:
            self.vocab_words, self.vocab_counts = list(vocab["words"]), list(vocab["counts"])
