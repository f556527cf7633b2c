"""Word2vec with negative sampling, in plain torch (no Lightning).

Two tables of vectors: ``input`` (the word vectors that are kept and evaluated) and ``output`` (the vectors
words have as predictions; word2vec.c's ``syn1neg``). A pair (input word t, output word c) is scored by
v_t . u_c. A full softmax would normalise that score over the whole vocabulary, which costs V dot products per
pair; negative sampling (Mikolov et al. 2013, "Distributed Representations of Words and Phrases and their
Compositionality") instead maximises

    log sigma(v_t . u_c) + sum_{k=1..K} log sigma(-v_t . u_k),    u_k drawn from the noise distribution,

K + 1 dot products per pair. Skip-gram (Mikolov et al. 2013, "Efficient Estimation of Word Representations in
Vector Space") predicts each context word from the centre word; CBOW predicts the centre word from the average
of the context vectors, h = (1/n) sum_i x_i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Word2Vec(nn.Module):
    """Both tables are sparse embeddings: a step touches only the rows of the words in its batch."""

    def __init__(self, vocab_size: int, dim: int, mode: str = "skipgram") -> None:
        super().__init__()
        if mode not in ("cbow", "skipgram"):
            raise ValueError(f"mode={mode!r}: choose cbow or skipgram")
        self.mode = mode
        self.input = nn.Embedding(vocab_size, dim, sparse=True)
        self.output = nn.Embedding(vocab_size, dim, sparse=True)
        # word2vec.c's initialisation: small random word vectors, zero output vectors.
        nn.init.uniform_(self.input.weight, -0.5 / dim, 0.5 / dim)
        nn.init.zeros_(self.output.weight)

    @property
    def vectors(self) -> torch.Tensor:
        """(V, dim) the word vectors."""
        return self.input.weight

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """(N, dim): the centre word's vector (skip-gram, inputs (N,)) or the mean of the context vectors (CBOW,
        inputs (N, 2 * window), -1 for an empty slot)."""
        if self.mode == "skipgram":
            return self.input(inputs)
        present = inputs >= 0  # (N, C)
        x = self.input(inputs.clamp(min=0)) * present.unsqueeze(-1)  # (N, C, dim)
        total = x.sum(1)  # (N, dim)
        n = present.sum(1, keepdim=True).clamp(min=1).to(total.dtype)  # (N, 1)
        # The value is the mean; the gradient reaches every context vector undivided, as word2vec.c and gensim
        # apply it (cbow_mean=1), so that CBOW's learning rate means the same as theirs.
        return total / n + (total - total.detach()) * (1 - 1 / n)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """Negative-sampling loss per example (N,): inputs as in ``hidden``, targets (N,), negatives (N, K).
        A negative that happens to be the target is skipped, as word2vec.c skips it."""
        h = self.hidden(inputs)  # (N, dim)
        candidates = torch.cat([targets.unsqueeze(1), negatives], dim=1)  # (N, 1 + K)
        u = self.output(candidates)  # (N, 1 + K, dim)
        scores = torch.bmm(u, h.unsqueeze(2)).squeeze(2)  # (N, 1 + K)
        positive = F.logsigmoid(scores[:, 0])
        negative = F.logsigmoid(-scores[:, 1:]) * (negatives != targets.unsqueeze(1))
        return -(positive + negative.sum(1))
