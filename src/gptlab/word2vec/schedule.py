"""The order of training: epochs of chunks of the corpus, each subsampled and cut into batches of
``batch_size`` centre words with their windows.

Batch i of chunk c of epoch e is a pure function of (seed, e, c, i): a resumed run continues with exactly the
batches (windows and noise words) the uninterrupted run would have seen, without any loader state in the
checkpoint. Only one chunk's plan is held at a time, so memory does not grow with the corpus.

The runners train a round of steps: in this process, in threads, or in forked processes on tables in shared
memory (Hogwild).
"""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gptlab.word2vec import sampling
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.corpus import WordCorpus
from gptlab.word2vec.fast import StepBlock, Tables, WindowBatch
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
            context = sampling.context_matrix(plan, start, stop, self.options.window)
            # CBOW with negative sampling has no key: its windows stay in text order, and are not copied
            order: slice | np.ndarray = slice(start, stop)
            if self.options.mode == "skipgram" or width is not None:
                order = start + np.argsort(key, kind="stable")
                context = context[order - start]
            rng = np.random.default_rng([self.seed, epoch, chunk, block, 1])
            assert plan.span is not None
            b = Block(
                (epoch, chunk, block),
                context,
                plan.ids[order],
                plan.radius[order],
                plan.span[order],
                self.objective.draw(stop - start, rng),
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

    def batches(self, items: list[tuple[int, int, int, int]]) -> StepBlock:
        """The batches of consecutive steps of one block (as :meth:`block_key` groups them), laid end to end
        for a step function that takes several at once (CBOW's C step). Each batch holds :meth:`batch`'s
        windows, outputs, words and progress; its context keeps every column (those past a window's radius
        are empty slots, which CBOW skips)."""
        _, epoch, chunk, first = items[0]
        block, within = divmod(first, sampling.SORT_BLOCK_BATCHES)
        if [item[3] for item in items] != list(range(first, first + len(items))) or (
            within + len(items) > sampling.SORT_BLOCK_BATCHES
        ):
            raise ValueError("Schedule.batches takes consecutive steps of one block")
        plan = self.plan(epoch, chunk)
        b = self.block(epoch, chunk, block)
        size = self.options.batch_size
        edges = [min((within + i) * size, len(b.ids)) for i in range(len(items) + 1)]
        lo, hi = edges[0], edges[-1]
        return StepBlock(
            b.context[lo:hi].astype(np.int64),
            self.objective.outputs(b.ids[lo:hi], None if b.draws is None else b.draws[lo:hi]),
            np.array(edges, dtype=np.int64) - lo,
            [float(b.span[s:e].sum()) for s, e in zip(edges, edges[1:])],
            [self.progress(step, plan, index) for step, _, _, index in items],
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


# ---- runners: who trains the steps of a round ------------------------------------------------------------

Step = tuple[int, int, int, int]  # (step, epoch, chunk, index)
# (step, its loss per pair when logged, the corpus words it covered, the share of training done before it)
StepResult = tuple[int, float | None, float, float]


class Trains(Protocol):
    """What a runner needs of the trainer: its schedule and tables, and one step."""

    schedule: Schedule
    tables: Tables

    def work(self, item: Step) -> StepResult: ...

    def work_steps(self, items: list[Step]) -> list[StepResult]: ...

    def run_batch(self, step: int, batch: WindowBatch) -> StepResult: ...


Logged = list[tuple[int, float, float]]  # (step, loss per pair, progress) of the logged steps of a round


class _Steps:
    """The schedule's steps from ``start``, handed out a round at a time."""

    def __init__(self, schedule: Schedule, start: int) -> None:
        self.items = schedule.steps(start)
        self.held: Step | None = None
        self.next_step = start

    def until(self, stop: int) -> list[Step]:
        """The steps before ``stop``; ``next_step`` then is where the schedule stands (< stop at its end)."""
        out = []
        item = self.held if self.held is not None else next(self.items, None)
        while item is not None and item[0] < stop:
            out.append(item)
            item = next(self.items, None)
        self.held = item
        self.next_step = out[-1][0] + 1 if out else self.next_step
        if item is not None:
            self.next_step = item[0]
        return out


class SerialRunner:
    """The steps one after the other, in this process."""

    round_steps = 64

    def __init__(self, trainer: Trains, start: int) -> None:
        self.trainer, self.steps = trainer, _Steps(trainer.schedule, start)

    def run(self, start: int, stop: int) -> tuple[int, float, Logged]:
        items = self.steps.until(stop)
        results: list[StepResult] = []
        for _, block in itertools.groupby(items, key=self.trainer.schedule.block_key):
            results += self.trainer.work_steps(list(block))
        return _collect(results, self.steps.next_step)

    def close(self) -> None:
        pass


class ThreadRunner(SerialRunner):
    """Worker threads on the shared tables (Hogwild): batches are built under a lock (the schedule holds
    one chunk's plan at a time), the updates run in parallel where numpy and torch release the GIL."""

    def __init__(self, trainer: Trains, start: int, threads: int) -> None:
        super().__init__(trainer, start)
        self.round_steps = threads * 8
        self.pool = ThreadPoolExecutor(threads)
        self.lock = threading.Lock()

    def run(self, start: int, stop: int) -> tuple[int, float, Logged]:
        def work(item: tuple[int, int, int, int]) -> StepResult:
            with self.lock:
                batch = self.trainer.schedule.batch(*item)
            return self.trainer.run_batch(item[0], batch)

        items = self.steps.until(stop)
        return _collect(self.pool.map(work, items), self.steps.next_step)

    def close(self) -> None:
        self.pool.shutdown()


class ProcessRunner:
    """Hogwild (Recht et al. 2011) across forked processes, as word2vec.c runs threads (Mikolov et al.
    2013): the tables live in shared memory and every worker updates them without locks. The workers claim
    the blocks of batches of each round one at a time from a shared counter (a worker that falls behind, on
    a shared machine, takes fewer) and build their own batches (each plan is a pure function of (seed,
    epoch, chunk)), so that no Python work is serialised by a lock or the GIL."""

    def __init__(self, trainer: Trains, start: int, workers: int) -> None:
        import multiprocessing

        self.round_steps = 256 * workers
        self.trainer = trainer
        trainer.tables.share()
        context = multiprocessing.get_context("fork")
        self.claims = context.Value("q", 0)
        self.connections, self.processes = [], []
        for _ in range(workers):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker, args=(trainer, self.claims, start, child, parent), daemon=True
            )
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)

    def run(self, start: int, stop: int) -> tuple[int, float, Logged]:
        self.claims.value = 0  # the workers are idle between rounds
        for connection in self.connections:
            connection.send((start, stop))
        reached, words, logged = stop, 0.0, []
        for connection in self.connections:
            try:
                got = connection.recv()
            except EOFError:
                raise RuntimeError(
                    "a word2vec worker process ended unexpectedly (see its error above)"
                ) from None
            reached = min(reached, got[0])
            words += got[1]
            logged += got[2]
            self.trainer.schedule.record_batches(got[3])
        return reached, words, logged

    def close(self) -> None:
        for connection in self.connections:
            try:
                connection.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()


def _worker(trainer: Trains, claims: Any, start: int, connection: Any, parent: Any) -> None:
    """A forked worker: trains the blocks it claims of each round it is sent, until told to stop (None) or
    the parent is gone. Signals are the parent's to handle (a Ctrl-C or a SIGTERM may reach the whole process
    group): it ends the run at the end of the round."""
    parent.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    steps = _Steps(trainer.schedule, start)

    def claim() -> int:
        with claims.get_lock():
            claims.value += 1
            return int(claims.value) - 1

    while True:
        try:
            message = connection.recv()
            if message is None:
                return
            # every worker cuts the round's steps into the same blocks, then trains those it claims
            items = steps.until(message[1])
            blocks = [list(b) for _, b in itertools.groupby(items, key=trainer.schedule.block_key)]
            results: list[StepResult] = []
            while (number := claim()) < len(blocks):
                results += trainer.work_steps(blocks[number])
            reached, words, logged = _collect(results, steps.next_step)
            connection.send((reached, words, logged, trainer.schedule.batch_counts()))
        except (EOFError, OSError):  # the parent is gone
            return


def _collect(results: Any, reached: int) -> tuple[int, float, Logged]:
    words, logged = 0.0, []
    for step, loss, covered, progress in results:
        words += covered
        if loss is not None:
            logged.append((step, loss, progress))
    return reached, words, logged


Runner = SerialRunner | ThreadRunner | ProcessRunner


def make_runner(trainer: Trains, start: int, workers: int, parallel: str) -> Runner:
    """One worker: this process; several: forked processes (``parallel="processes"``) or threads."""
    if workers > 1 and parallel == "processes":
        return ProcessRunner(trainer, start, workers)
    if workers > 1:
        return ThreadRunner(trainer, start, workers)
    return SerialRunner(trainer, start)
