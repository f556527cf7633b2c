"""Word2vec's update without autograd: a batch of windows becomes a few matrix products and in-place updates
of only the rows it touched.

A batch holds G windows. Each has up to C input rows of the word-vector table (its context words, -1 where
a slot is empty) and M output rows (the target's and its noise words', or the inner nodes on its Huffman
path), with labels and a mask. Skip-gram scores every input row against every output row of its window,
``S = X U^T`` (G, C, M), as word2vec.c pairs the centre word (output) with each context word (input) and
as HogBatch batches a window (Ji et al. 2016, "Parallelizing Word2Vec in Shared and Distributed Memory");
CBOW scores the mean of the inputs, ``h``, against the outputs (Mikolov et al. 2013a). With
``G = label - sigma(S)``, the gradient ascent step is ``X += lr G U`` and ``U += lr G^T X``, all computed from
the values before the step (the gradient of the batch's summed log-likelihood), and added into the tables
with ``index_add_``: one SGD step of the autograd reference (``gptlab.word2vec.model``) on the same batch.

Skip-gram's steps are bounded per row (:func:`row_scales`). A row used k times in a batch (a frequent word as
a context word in k slots, or as the target or a noise word of k windows) receives the sum of k steps, all
computed at its old value, where word2vec.c's sequential SGD applies each to the vector the previous one
moved, and the sigmoid's gradient shrinks as the scores move: the sum cannot see that. With ``lr k`` well
above 1 it overshoots. On the embedded corpus (vocabulary 1,406), a batch of 2,048 windows uses a noise word
up to ~400 times; with one worker, by step 4 the largest summed step of a row was 2.6x the largest row's norm
and by step 16 the largest norm had grown from 0.03 to 32; with two, the loss per pair ended at 1,257 against
2.7 at batches of 256 (4.1 at the start). So each use of a row is scaled by ``min(1, 1 / (lr k W))``: the
row's summed step has a learning rate of at most ``1 / (k W)``, the plain step's total at ``lr k W = 1``, where
``W`` is the number of workers stepping on the same tables at once (Hogwild: their batches land on the shared rows together; with two workers at
batches of 4,096 the bound without ``W`` still diverged in one run of three). A row used fewer than
``1 / (lr W)`` times (40 at lr 0.025, one worker) takes the plain sum, so small batches train as before, and as
the learning rate decays the bound lets go.

CBOW's steps (numpy, torch, and the C loop of :mod:`gptlab.word2vec.native`) are bounded the same way. Unbounded,
CBOW trained at batches of 4,096 at lr 0.025 (embedded corpus, two workers, 2 epochs: 3.05 per pair, 2.86 at
256) but diverged from lr 0.05, word2vec.c's CBOW default (281 per pair at 4,096; 7e17 at lr 0.1; with one
worker at lr 0.1, 9e20), and at 8,192 from 0.05. A context slot takes the window's whole gradient of ``h``,
as a skip-gram input use takes its window's: the input rows' bound is skip-gram's. An output row's use is one
pair (the window's ``h``) where a skip-gram output use carries its window's C context words, so it is bounded
from C times as many uses (``pairs``). Both are needed: the input rows' bound alone still diverged at lr 0.2,
a bound from 20 or 40 uses on both at lr 0.1. Bounded, those runs ended at 2.90 to 3.21 per pair; the cost
is at batches of 4,096 and more at lr 0.025, where the unbounded step had not diverged: on gensim's Lee corpus
x3 (3 epochs, two workers) the top-10 neighbours' agreement with gensim's vectors went from 0.475 to 0.242 at
4,096 (0.520 to 0.515 at 256, 0.531 to 0.497 at 1,024); on the embedded corpus, 22 steps of 4,096 no longer
leave the start (4.15 per pair). ``Word2VecOptions.large_batch_warning`` says so before such a run.

The full softmax's step is bounded the same way (:func:`_softmax_step`: an output row's uses are the sizes of
its coefficients over the batch's pairs); unbounded, it diverged from batches of 1,024 at lr 0.025.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gptlab.word2vec.objectives import Targets


@dataclass
class WindowBatch:
    """``inputs`` (G, C) input rows, -1 for an empty slot; ``target`` (G,) the word each window predicts;
    ``outputs`` its rows, labels and mask (G, M); ``words``: corpus words the batch covers (before
    subsampling); ``progress``: the share of the whole training done before it."""

    inputs: np.ndarray
    target: np.ndarray
    outputs: Targets
    words: float
    progress: float


@dataclass
class StepBlock:
    """The batches of consecutive steps laid end to end, for a step function that takes several at once:
    step i's windows are rows ``bounds[i]:bounds[i + 1]`` of ``inputs`` (G, C) and of ``outputs`` (G, M);
    ``words`` and ``progress`` (one per step) as in :class:`WindowBatch`."""

    inputs: np.ndarray
    outputs: Targets
    bounds: np.ndarray  # (n + 1,)
    words: list[float]
    progress: list[float]


class Tables:
    """The two tables of vectors, plain tensors (no autograd): ``input`` (V, dim), the word vectors kept
    and evaluated, small and random at the start; ``output`` (rows, dim), word2vec.c's ``syn1neg`` / ``syn1``,
    zero at the start."""

    def __init__(
        self, vocab_size: int, output_rows: int, dim: int, seed: int, device: str | torch.device = "cpu"
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input = ((torch.rand(vocab_size, dim, generator=generator) - 0.5) / dim).to(device)
        self.output = torch.zeros(output_rows, dim, device=device)

    @property
    def device(self) -> torch.device:
        return self.input.device

    def share(self) -> None:
        """Move both CPU tables into anonymous shared memory (``MAP_SHARED``), so that processes forked
        afterwards update the same rows (Hogwild across processes)."""
        self.input, self.output = _shared_copy(self.input), _shared_copy(self.output)


def _shared_copy(table: torch.Tensor) -> torch.Tensor:
    import mmap

    buffer = mmap.mmap(-1, max(table.numel() * table.element_size(), 1))
    array = np.frombuffer(buffer, dtype=np.float32, count=table.numel()).reshape(tuple(table.shape))
    array[...] = table.numpy()
    return torch.from_numpy(array)


def _tensors(batch: WindowBatch, device: torch.device):
    t = batch.outputs
    to = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    return to(batch.inputs), to(t.rows), to(t.labels), to(t.mask), to(batch.target)


def sgd_step(
    tables: Tables,
    batch: WindowBatch,
    lr: float,
    mode: str,
    softmax: bool = False,
    with_loss: bool = False,
    workers: int = 1,
) -> float | None:
    """One SGD step on the batch, in place. Returns the batch's summed loss (negative log-likelihood, before
    the step) when ``with_loss``. ``workers``: how many workers step on the same tables at once (Hogwild),
    for skip-gram's per-row bound (:func:`row_scales`). On a CPU the gathers and products run in numpy (its stacked matmul is
    about 3x torch's ``bmm`` on these small matrices here), the scatter-adds in torch."""
    if tables.device.type == "cpu" and not softmax:
        return numpy_step(tables, batch, lr, mode, with_loss, workers)
    return torch_step(tables, batch, lr, mode, softmax, with_loss, workers)


def numpy_step(
    tables: Tables, batch: WindowBatch, lr: float, mode: str, with_loss: bool = False, workers: int = 1
) -> float | None:
    """``torch_step`` for the sigmoid objectives on a CPU, the same arithmetic on numpy views of the tables,
    with few temporaries (the elementwise work is done in place)."""
    t = batch.outputs
    if mode == "cbow":
        return _numpy_cbow_step(tables, batch, lr, with_loss, workers)
    w_in, w_out = tables.input.numpy(), tables.output.numpy()
    present = batch.inputs >= 0  # (G, C)
    idx = np.maximum(batch.inputs, 0)
    dim = w_in.shape[1]
    u = w_out.take(t.rows, axis=0)  # (G, M, d)
    x = w_in.take(idx, axis=0)  # (G, C, d)
    scores = np.matmul(x, u.transpose(0, 2, 1))  # (G, C, M)
    mask = present[:, :, None] * t.mask[:, None, :]  # (G, C, M)
    labels = t.labels[:, None, :]
    loss = _np_loss(scores, labels, mask) if with_loss else None
    grad = _step_sizes(scores, labels, mask, lr)  # (G, C, M)
    d_x = np.matmul(grad, u)  # (G, C, d)
    d_u = np.matmul(grad.transpose(0, 2, 1), x)  # (G, M, d)
    d_x *= row_scales(idx, present, lr, workers)[:, :, None]
    d_u *= row_scales(t.rows, t.mask, lr, workers)[:, :, None]
    # index_add_ without alpha: with one it scales a copy of the source first (about 2.5x slower here)
    tables.input.index_add_(0, torch.from_numpy(idx.reshape(-1)), torch.from_numpy(d_x.reshape(-1, dim)))
    tables.output.index_add_(0, torch.from_numpy(t.rows.reshape(-1)), torch.from_numpy(d_u.reshape(-1, dim)))
    return loss


def _numpy_cbow_step(
    tables: Tables, batch: WindowBatch, lr: float, with_loss: bool, workers: int = 1
) -> float | None:
    """CBOW's step: each window's hidden vector is the mean of its present context rows (``cbow_mean=1``),
    scored against its output rows; the whole gradient of the mean goes to every context word, as
    word2vec.c and gensim apply it, each use of a row bounded as skip-gram's (:func:`row_scales`). Only the
    present slots are gathered and updated (their (row, slot) pairs in row order, so that each window's slots
    are contiguous: embedding_bag's bags)."""
    t = batch.outputs
    window, slot = np.nonzero(batch.inputs >= 0)  # the present slots, window by window
    present = batch.inputs[window, slot]  # (P,)
    valid = torch.from_numpy(present)
    counts = np.bincount(window, minlength=len(batch.inputs))  # (G,); an empty bag's mean is zero
    offsets = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    # torch.embedding_bag itself (mode 1: mean), without the argument checks of F.embedding_bag
    hidden_t = torch.embedding_bag(tables.input, valid, torch.from_numpy(offsets), False, 1)[0]  # (G, d)
    hidden = hidden_t.numpy()
    u = tables.output.numpy().take(t.rows, axis=0)  # (G, M, d)
    scores = np.matmul(u, hidden[:, :, None])[:, :, 0]  # (G, M)
    loss = _np_loss(scores, t.labels, t.mask) if with_loss else None
    grad = _step_sizes(scores, t.labels, t.mask, lr)  # (G, M)
    d_hidden = np.matmul(grad[:, None, :], u)[:, 0, :]  # (G, d)
    # the outer products in torch: about 2x numpy's broadcast multiply on these shapes here
    d_u = torch.from_numpy(grad)[:, :, None] * hidden_t[:, None, :]  # (G, M, d)
    # an output row's use is one pair here, where skip-gram's carries its window's C context words
    d_u *= torch.from_numpy(row_scales(t.rows, t.mask, lr, workers, batch.inputs.shape[1]))[:, :, None]
    d_x = np.repeat(d_hidden, counts, axis=0)  # (P, d)
    d_x *= row_scales(present, np.ones(len(present), dtype=np.float32), lr, workers)[:, None]
    tables.input.index_add_(0, valid, torch.from_numpy(d_x))
    tables.output.index_add_(0, torch.from_numpy(t.rows.reshape(-1)), d_u.view(-1, d_u.shape[2]))
    return loss


def row_scales(rows: np.ndarray, used: np.ndarray, lr: float, workers: int = 1, pairs: int = 1) -> np.ndarray:
    """The factor each use of a row in a batch scales its step by, ``min(1, pairs / (lr k workers))`` where
    the row is used k times (``used``: 1 where a slot of ``rows`` is used, 0 where it is empty or masked), so
    that a row's summed step has a learning rate of at most ``pairs / (k workers)`` (see the module's
    docstring). ``pairs``: how many times fewer pairs a use carries than skip-gram's (1; CBOW's output rows:
    the context slots C, a use is one pair where skip-gram's is its window's C)."""
    uses = np.bincount(rows.reshape(-1), weights=used.reshape(-1))  # float64 counts
    return (1.0 / np.maximum(uses * (lr * workers / pairs), 1.0)).astype(np.float32)[rows]


def torch_row_scales(
    rows: torch.Tensor, used: torch.Tensor, lr: float, workers: int = 1, pairs: int = 1
) -> torch.Tensor:
    """:func:`row_scales` in torch, on the tables' device."""
    uses = torch.bincount(rows.reshape(-1), weights=used.reshape(-1).to(torch.float32))
    return (1.0 / (uses * (lr * workers / pairs)).clamp(min=1.0)).to(torch.float32)[rows]


def _step_sizes(scores: np.ndarray, labels: np.ndarray, mask: np.ndarray, lr: float) -> np.ndarray:
    """``lr * mask * (label - sigma(s))``, computed in place of ``scores``."""
    s = np.clip(scores, -30.0, 30.0, out=scores)
    np.negative(s, out=s)
    np.exp(s, out=s)
    s += 1.0
    np.reciprocal(s, out=s)  # sigma(scores)
    np.subtract(labels, s, out=s)
    s *= mask
    s *= np.float32(lr)
    return s


def _np_loss(scores: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
    return float((np.logaddexp(0.0, -scores * (2 * labels - 1)) * mask).sum())


@torch.no_grad()
def torch_step(
    tables: Tables,
    batch: WindowBatch,
    lr: float,
    mode: str,
    softmax: bool = False,
    with_loss: bool = False,
    workers: int = 1,
) -> float | None:
    """The step in torch: on a GPU, for the full softmax, and as the CPU's cross-check."""
    inputs, rows, labels, mask, target = _tensors(batch, tables.device)
    present = inputs >= 0  # (G, C)
    idx = inputs.clamp(min=0)
    g_count, c_slots = idx.shape
    dim = tables.input.shape[1]
    x = tables.input.index_select(0, idx.reshape(-1)).view(g_count, c_slots, dim)  # (G, C, d)
    weight = present.to(x.dtype)  # (G, C)
    if mode == "cbow":
        n = weight.sum(1, keepdim=True).clamp(min=1)  # (G, 1)
        hidden = (torch.bmm(weight.unsqueeze(1), x) / n.unsqueeze(2)).squeeze(1)  # (G, d)
        if softmax:
            return _softmax_step(tables, hidden, target, lr, with_loss, idx, weight, workers)
        u = tables.output.index_select(0, rows.reshape(-1)).view(*rows.shape, dim)  # (G, M, d)
        scores = torch.bmm(u, hidden.unsqueeze(2)).squeeze(2)  # (G, M)
        loss = _sigmoid_loss(scores, labels, mask) if with_loss else None
        grad = (labels - torch.sigmoid(scores)) * (mask * lr)  # (G, M)
        d_hidden = torch.bmm(grad.unsqueeze(1), u).squeeze(1)  # (G, d)
        d_u = grad.unsqueeze(2) * hidden.unsqueeze(1)  # (G, M, d)
        # every context word receives the whole gradient of h, as word2vec.c and gensim (cbow_mean=1) apply it
        d_x = weight.unsqueeze(2) * d_hidden.unsqueeze(1)  # (G, C, d)
        d_x *= torch_row_scales(idx, weight, lr, workers).unsqueeze(2)
        d_u *= torch_row_scales(rows, mask, lr, workers, c_slots).unsqueeze(2)
        tables.input.index_add_(0, idx.reshape(-1), d_x.reshape(-1, dim))
        tables.output.index_add_(0, rows.reshape(-1), d_u.reshape(-1, dim))
        return loss
    if softmax:
        keep = present.reshape(-1)
        pairs = x.reshape(-1, dim)[keep]  # (P, d)
        pair_target = target.unsqueeze(1).expand(g_count, c_slots).reshape(-1)[keep]
        return _softmax_step(
            tables, pairs, pair_target, lr, with_loss, idx.reshape(-1)[keep], workers=workers
        )
    u = tables.output.index_select(0, rows.reshape(-1)).view(*rows.shape, dim)  # (G, M, d)
    scores = torch.bmm(x, u.transpose(1, 2))  # (G, C, M)
    pair_mask = weight.unsqueeze(2) * mask.unsqueeze(1)  # (G, C, M)
    loss = _sigmoid_loss(scores, labels.unsqueeze(1), pair_mask) if with_loss else None
    grad = (labels.unsqueeze(1) - torch.sigmoid(scores)) * (pair_mask * lr)
    d_x = torch.bmm(grad, u)  # (G, C, d)
    d_u = torch.bmm(grad.transpose(1, 2), x)  # (G, M, d)
    d_x *= torch_row_scales(idx, weight, lr, workers).unsqueeze(2)
    d_u *= torch_row_scales(rows, mask, lr, workers).unsqueeze(2)
    tables.input.index_add_(0, idx.reshape(-1), d_x.reshape(-1, dim))
    tables.output.index_add_(0, rows.reshape(-1), d_u.reshape(-1, dim))
    return loss


def _sigmoid_loss(scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    """-sum mask * log sigma(+-s): +s where the label is 1, -s where it is 0."""
    return float(-(F.logsigmoid(scores * (2 * labels - 1)) * mask).sum())


def _softmax_step(
    tables: Tables,
    hidden: torch.Tensor,
    target: torch.Tensor,
    lr: float,
    with_loss: bool,
    idx: torch.Tensor,
    weight: torch.Tensor | None = None,
    workers: int = 1,
) -> float | None:
    """The full softmax: ``hidden`` (P, d) against every output row; ``idx`` the input rows that made each
    hidden vector (P,) for skip-gram, (P, C) with ``weight`` for CBOW.

    Bounded per row as the sigmoid objectives' steps (:func:`row_scales`). Every pair steps every output row,
    by ``onehot - p`` times its hidden vector: a row's uses in the batch are the sum of those coefficients'
    sizes over the pairs (its count as a target, less its probability there, plus its probability where it is
    not the target: up to 2 a pair over all rows, as a negative-sampling pair's use of a row is at most 1),
    and its summed step is scaled by ``min(1, 1 / (lr uses W))``. The input rows take skip-gram's (CBOW's)
    bound from their count. Unbounded, skip-gram on the embedded corpus (vocabulary 1,406, one worker, lr
    0.025, 2 epochs) diverged from batches of 1,024 (8e22 per pair; 2.8e16 at 4,096) where 256 ended at 6.67."""
    logits = hidden @ tables.output.T  # (P, V)
    log_p = torch.log_softmax(logits, dim=1)
    loss = float(-log_p.gather(1, target.unsqueeze(1)).sum()) if with_loss else None
    grad = -log_p.exp_()  # d log p_t / d logits = onehot - p
    grad[torch.arange(len(target), device=grad.device), target] += 1
    uses = grad.abs().sum(0)  # (V,): each output row's share of the batch's pairs
    output_scales = 1.0 / (uses * (lr * workers)).clamp(min=1.0)
    grad.mul_(lr)
    d_hidden = grad @ tables.output  # (P, d)
    tables.output.add_((grad.T @ hidden).mul_(output_scales.unsqueeze(1)))
    dim = hidden.shape[1]
    if weight is None:
        d_hidden *= torch_row_scales(idx, torch.ones_like(idx, dtype=d_hidden.dtype), lr, workers).unsqueeze(
            1
        )
        tables.input.index_add_(0, idx, d_hidden)
    else:
        d_x = weight.unsqueeze(2) * d_hidden.unsqueeze(1)
        d_x *= torch_row_scales(idx, weight, lr, workers).unsqueeze(2)
        tables.input.index_add_(0, idx.reshape(-1), d_x.reshape(-1, dim))
    return loss
