"""The LightningDataModule of ``task=word2vec``: the project's corpora, as words, in word2vec batches.

A batch is ``batch_size`` consecutive centre words of the subsampled corpus with their windows (as word2vec.c
hands out its text), so the epoch has a fixed number of batches once its subsampling is drawn, and batch i of
epoch e is a pure function of (seed, e, i). A resumed run therefore continues with exactly the batches the
uninterrupted run would have seen, without any loader state in the checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from gptlab.data.sources import DataSpec, load_documents
from gptlab.word2vec import sampling
from gptlab.word2vec.config import Word2VecOptions

log = logging.getLogger(__name__)


def corpus_documents(spec: DataSpec) -> list[str]:
    """Every document's text of the configured corpus (``data=``, ``data.path=``, the embedded default): the one
    place the word2vec task reads the project's corpora. Word2vec trains on all of it: it has no held-out
    loss, and gensim, which it is compared with, trains on all of it too."""
    return [text for text in load_documents(spec)["text"] if text and text.strip()]


def tokenized_documents(spec: DataSpec, options: Word2VecOptions) -> list[list[str]]:
    """The documents as lists of words, exactly as both this task and the gensim comparison see them."""
    return [
        sampling.tokenize(text, options.lowercase, options.keep_punctuation)
        for text in corpus_documents(spec)
    ]


class WordBatches(IterableDataset):
    """One epoch of batches per iteration, starting where training stands (``position()``: the optimizer steps
    done so far), so that an epoch interrupted by a checkpoint resumes at the right batch."""

    def __init__(self, data: Word2VecDataModule, position: Callable[[], int]) -> None:
        self.data = data
        self.position = position

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        epoch, index = self.data.locate(self.position())
        options = self.data.options
        if not options.max_steps and epoch >= options.epochs:
            return  # resumed from the checkpoint of the last step: nothing is left
        plan = self.data.plan(epoch)
        for i in range(index, plan.n_batches):
            b = self.data.batch(plan, i)
            yield (
                torch.from_numpy(b.inputs),
                torch.from_numpy(b.targets),
                torch.from_numpy(b.negatives),
                torch.tensor(b.words, dtype=torch.float64),
                torch.tensor(b.progress, dtype=torch.float64),
            )


class Word2VecDataModule(L.LightningDataModule):
    def __init__(self, spec: DataSpec, options: Word2VecOptions, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.options = options
        self.seed = seed
        self.vocab: sampling.Vocabulary | None = None
        self._plans: dict[int, sampling.EpochPlan] = {}
        self._batches_per_epoch: list[int] = []

    def setup(self, stage: str | None = None) -> None:
        if self.vocab is not None:
            return
        o = self.options
        documents = tokenized_documents(self.spec, o)
        self.vocab = sampling.Vocabulary.build(documents, o.min_count)
        self.ids, self.docs = self.vocab.encode(documents)
        self.keep_prob = sampling.keep_probabilities(self.vocab.counts, o.sample)
        self.cdf = sampling.noise_cdf(self.vocab.counts, o.noise_power)
        total = sum(len(d) for d in documents)
        log.info(
            "word2vec corpus %s: %d documents, %d words, %d in a vocabulary of %d (min_count=%d); "
            "%.0f%% of the words kept per epoch on average (sample=%g)",
            self.spec.describe(),
            len(documents),
            total,
            len(self.ids),
            len(self.vocab),
            o.min_count,
            100 * float(self.keep_prob[self.ids].mean()) if len(self.ids) else 0.0,
            o.sample,
        )

    @property
    def corpus_words(self) -> int:
        """Words of the corpus in the vocabulary: what one epoch covers, before subsampling."""
        return len(self.ids)

    def plan(self, epoch: int) -> sampling.EpochPlan:
        if epoch not in self._plans:
            self._plans = {
                epoch: sampling.plan_epoch(
                    self.ids,
                    self.docs,
                    self.keep_prob,
                    self.options.window,
                    self.options.batch_size,
                    self.seed,
                    epoch,
                )
            }
        return self._plans[epoch]

    def batches_in_epoch(self, epoch: int) -> int:
        while len(self._batches_per_epoch) <= epoch:
            self._batches_per_epoch.append(self.plan(len(self._batches_per_epoch)).n_batches)
        return self._batches_per_epoch[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch index) of optimizer step ``step``."""
        epoch = 0
        while step >= self.batches_in_epoch(epoch):
            step -= self.batches_in_epoch(epoch)
            epoch += 1
        return epoch, step

    def batch(self, plan: sampling.EpochPlan, index: int) -> sampling.Batch:
        o = self.options
        return sampling.make_batch(
            plan,
            index,
            mode=o.mode,
            window=o.window,
            batch_words=o.batch_size,
            cdf=self.cdf,
            negatives=o.negatives,
            seed=self.seed,
            corpus_words=self.corpus_words,
            epochs=0 if o.max_steps else o.epochs,
        )

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer

        def position() -> int:
            return trainer.global_step if trainer is not None else 0

        return DataLoader(WordBatches(self, position), batch_size=None, num_workers=0)


__all__ = ["Word2VecDataModule", "corpus_documents", "tokenized_documents", "WordBatches"]
