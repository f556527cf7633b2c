"""The order of training: epochs of chunks of the corpus, each subsampled and cut into batches of
``batch_size`` centre words with their windows.

Batch i of chunk c of epoch e is a pure function of (seed, e, c, i): a resumed run continues with exactly the
batches (windows and noise words) the uninterrupted run would have seen, without any loader state in the
checkpoint. Only one chunk's plan is held at a time, so memory does not grow with the corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from gptlab.word2vec import sampling
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.corpus import WordCorpus
from gptlab.word2vec.fast import WindowBatch
from gptlab.word2vec.objectives import Objective

CHUNK_POSITIONS = 1 << 20


class Schedule:
    def __init__(
        self,
        corpus: WordCorpus,
        options: Word2VecOptions,
        objective: Objective,
        seed: int,
        max_steps: int | None = None,
        chunk_positions: int = CHUNK_POSITIONS,
    ) -> None:
        self.corpus = corpus
        self.options = options
        self.objective = objective
        self.seed = seed
        self.max_steps = max_steps
        self.chunks = corpus.chunks(chunk_positions)
        self.keep_prob = sampling.keep_probabilities(corpus.vocab.counts, options.sample)
        self._plan: sampling.EpochPlan | None = None
        self._block: Block | None = None
        self._batches: dict[tuple[int, int], int] = {}

    def plan(self, epoch: int, chunk: int) -> sampling.EpochPlan:
        p = self._plan
        if p is None or p.epoch != epoch or p.chunk != chunk:
            start, stop = self.chunks[chunk]
            o = self.options
            p = sampling.plan_chunk(
                self.corpus.read(start, stop),
                self.keep_prob,
                o.window,
                o.batch_size,
                self.seed,
                epoch,
                chunk,
                start,
            )
            self._plan = p
            self._block = None
            self._batches[epoch, chunk] = p.n_batches
        return p

    @staticmethod
    def block_key(item: tuple[int, int, int, int]) -> tuple[int, int, int]:
        """(epoch, chunk, block) of a step (step, epoch, chunk, index)."""
        return item[1], item[2], item[3] // sampling.SORT_BLOCK_BATCHES

    def block(self, epoch: int, chunk: int, block: int) -> Block:
        """Batches ``block * SORT_BLOCK_BATCHES`` .. of a chunk: their windows in the order they are trained,
        context words and the objective's draws (noise words, from (seed, epoch, chunk, block)). Only the
        blocks a worker trains are built by it.

        The order: skip-gram's windows by radius, so that a batch holds windows of one or two radii and its
        context matrix is only as wide as they need; then (both modes) by the objective's width, a target's
        path length under hierarchical softmax. The order of updates inside a block of a few thousand
        words is as arbitrary as Hogwild's."""
        b = self._block
        if b is None or b.key != (epoch, chunk, block):
            plan = self.plan(epoch, chunk)
            size = sampling.SORT_BLOCK_BATCHES * self.options.batch_size
            start = block * size
            stop = min(start + size, len(plan.ids))
            key = np.zeros(stop - start, dtype=np.int64)
            if self.options.mode == "skipgram":
                key += plan.radius[start:stop]
            width = self.objective.width(plan.ids[start:stop])
            if width is not None:
                key = key * (int(width.max(initial=0)) + 1) + width
            order = start + np.argsort(key, kind="stable")
            context = sampling.context_matrix(plan, start, stop, self.options.window)[order - start]
            rng = np.random.default_rng([self.seed, epoch, chunk, block, 1])
            assert plan.span is not None
            b = Block(
                (epoch, chunk, block),
                context,
                plan.ids[order],
                plan.radius[order],
                plan.span[order],
                self.objective.draw(len(order), rng),
            )
            self._block = b
        return b

    def batches_in(self, epoch: int, chunk: int) -> int:
        if (epoch, chunk) not in self._batches:
            self.plan(epoch, chunk)
        return self._batches[epoch, chunk]

    def batch_counts(self) -> dict[tuple[int, int], int]:
        """The batches of every (epoch, chunk) planned so far."""
        return dict(self._batches)

    def record_batches(self, counts: dict[tuple[int, int], int]) -> None:
        """Batch counts planned elsewhere (by a worker process: the same plans, the same counts)."""
        self._batches.update(counts)

    def locate(self, step: int) -> tuple[int, int, int]:
        """(epoch, chunk, batch index) of optimizer step ``step``; (epochs, 0, 0) past the end."""
        epoch, chunk = 0, 0
        while True:
            if not self.max_steps and epoch >= self.options.epochs:
                return epoch, 0, 0
            n = self.batches_in(epoch, chunk)
            if step < n:
                return epoch, chunk, step
            step -= n
            chunk += 1
            if chunk == len(self.chunks):
                epoch, chunk = epoch + 1, 0
                if step and all(self._batches.get((epoch - 1, c)) == 0 for c in range(len(self.chunks))):
                    raise RuntimeError("an epoch of the corpus holds no batch")

    def steps(self, start: int) -> Iterator[tuple[int, int, int, int]]:
        """(step, epoch, chunk, index) from optimizer step ``start`` to the end of training."""
        epoch, chunk, index = self.locate(start)
        step = start
        while (self.max_steps and step < self.max_steps) or (
            not self.max_steps and epoch < self.options.epochs
        ):
            n = self.batches_in(epoch, chunk)
            while index < n and not (self.max_steps and step >= self.max_steps):
                yield step, epoch, chunk, index
                step += 1
                index += 1
            index, chunk = 0, chunk + 1
            if chunk == len(self.chunks):
                epoch, chunk = epoch + 1, 0

    def progress(self, step: int, plan: sampling.EpochPlan, index: int) -> float:
        """The share of training done before this batch: corpus position over epochs (word2vec.c's decay by
        words processed), or step over max_steps."""
        if self.max_steps:
            return step / self.max_steps
        assert plan.positions is not None
        start = index * self.options.batch_size
        position = int(plan.positions[start]) if start < len(plan.positions) else self.corpus.n_raw
        return min((plan.epoch + position / max(self.corpus.n_raw, 1)) / self.options.epochs, 1.0)

    def batch(self, step: int, epoch: int, chunk: int, index: int) -> WindowBatch:
        o = self.options
        plan = self.plan(epoch, chunk)
        block, within = divmod(index, sampling.SORT_BLOCK_BATCHES)
        b = self.block(epoch, chunk, block)
        start = within * o.batch_size
        stop = min(start + o.batch_size, len(b.ids))
        # only the middle columns the batch's largest radius reaches (its windows are of one or two radii)
        r = int(b.radius[start:stop].max())
        ctx = b.context[start:stop, o.window - r : o.window + r].astype(np.int64)  # (n, 2r)
        target = b.ids[start:stop]
        draws = None if b.draws is None else b.draws[start:stop]
        return WindowBatch(
            ctx,
            target,
            self.objective.outputs(target, draws),
            float(b.span[start:stop].sum()),
            self.progress(step, plan, index),
        )


@dataclass
class Block:
    """A block of a chunk's batches, its windows in the order they are trained (by radius)."""

    key: tuple[int, int, int]  # (epoch, chunk, block)
    context: np.ndarray  # (n, 2 * window) int32
    ids: np.ndarray  # (n,)
    radius: np.ndarray  # (n,)
    span: np.ndarray  # (n,)
    draws: np.ndarray | None  # (n, ...)
