"""Word2vec as an autograd module: the reference the fast update (``gptlab.word2vec.fast``) is tested against,
and the path of ``word2vec.optimizer=sparse_adam``.

Two tables of vectors: ``input`` (the word vectors that are kept and evaluated) and ``output`` (the vectors
words, or Huffman inner nodes, have as predictions: word2vec.c's ``syn1neg`` / ``syn1``). Skip-gram
(Mikolov et al. 2013a, "Efficient Estimation of Word Representations in Vector Space") scores each context
word's input vector against the outputs of its window's target; CBOW scores the mean of the context vectors,
``h = (1/n) sum_i x_i``. The objectives (``gptlab.word2vec.objectives``): negative sampling and hierarchical
softmax are sums of ``log sigma(+-u . h)`` over labelled output rows (Mikolov et al. 2013b); the full
softmax is ``log p(t | h)`` over the whole vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Word2Vec(nn.Module):
    """Both tables are sparse embeddings: a step touches only the rows of its batch."""

    def __init__(
        self, vocab_size: int, dim: int, mode: str = "skipgram", output_rows: int | None = None
    ) -> None:
        super().__init__()
        if mode not in ("cbow", "skipgram"):
            raise ValueError(f"mode={mode!r}: choose cbow or skipgram")
        self.mode = mode
        self.input = nn.Embedding(vocab_size, dim, sparse=True)
        self.output = nn.Embedding(output_rows or vocab_size, dim, sparse=True)
        # word2vec.c's initialisation: small random word vectors, zero output vectors.
        nn.init.uniform_(self.input.weight, -0.5 / dim, 0.5 / dim)
        nn.init.zeros_(self.output.weight)

    @property
    def vectors(self) -> torch.Tensor:
        """(V, dim) the word vectors."""
        return self.input.weight

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """(G, dim) the mean of each window's context vectors (CBOW; inputs (G, C), -1 for an empty slot)."""
        present = inputs >= 0  # (G, C)
        x = self.input(inputs.clamp(min=0)) * present.unsqueeze(-1)  # (G, C, dim)
        total = x.sum(1)  # (G, dim)
        n = present.sum(1, keepdim=True).clamp(min=1).to(total.dtype)  # (G, 1)
        # The value is the mean; the gradient reaches every context vector undivided, as word2vec.c and gensim
        # apply it (cbow_mean=1), so that CBOW's learning rate means the same as theirs.
        return total / n + (total - total.detach()) * (1 - 1 / n)

    def forward(
        self,
        inputs: torch.Tensor,
        rows: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor,
        target: torch.Tensor | None = None,
        softmax: bool = False,
    ) -> torch.Tensor:
        """The summed loss (negative log-likelihood) of a batch of windows: inputs (G, C) with -1 for empty
        slots; rows, labels, mask (G, M) the output rows of each window's target (sigmoid objectives);
        ``softmax``: the full softmax over every output row instead, for ``target`` (G,)."""
        present = (inputs >= 0).to(self.input.weight.dtype)  # (G, C)
        if self.mode == "cbow":
            h = self.hidden(inputs)  # (G, dim)
            if softmax:
                assert target is not None
                return F.cross_entropy(h @ self.output.weight.T, target, reduction="sum")
            u = self.output(rows)  # (G, M, dim)
            scores = torch.bmm(u, h.unsqueeze(2)).squeeze(2)  # (G, M)
            return -(F.logsigmoid(scores * (2 * labels - 1)) * mask).sum()
        x = self.input(inputs.clamp(min=0))  # (G, C, dim)
        if softmax:
            assert target is not None
            logits = x @ self.output.weight.T  # (G, C, V)
            nll = F.cross_entropy(
                logits.flatten(0, 1), target.unsqueeze(1).expand_as(inputs).reshape(-1), reduction="none"
            )
            return (nll * present.reshape(-1)).sum()
        u = self.output(rows)  # (G, M, dim)
        scores = torch.bmm(x, u.transpose(1, 2))  # (G, C, M)
        pair_mask = present.unsqueeze(2) * mask.unsqueeze(1)
        return -(F.logsigmoid(scores * (2 * labels.unsqueeze(1) - 1)) * pair_mask).sum()
