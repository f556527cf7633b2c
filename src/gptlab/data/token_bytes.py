"""Bits per byte: a loss that does not depend on the tokenizer.

Nats per token are on a different scale for every vocabulary: a character model scores one character per
token, GPT-2's BPE about four. Bits per byte divides the summed loss of the scored tokens by the UTF-8 bytes of
the text those tokens cover, so runs with different tokenizers are compared on the same text:

    bpb = (nats per token x tokens) / (bytes x ln 2)

from summed nats and summed bytes over exactly the scored tokens (never a mean of per-window ratios).

A token's bytes come from its tokenizer (``Tokenizer.token_byte_lengths``): the bytes of its own text, and
the bytes of the separator the text holds before it when it follows another token of the same document (the
word tokenizer drops the spaces between words; its text is the one ``decode`` gives back). Special tokens cover
no text. Counting a window's bytes is then a gather and a sum over its targets, with the token before each
target (the input at the same position) saying whether the separator is there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gptlab.data.tokenizers import Tokenizer


@dataclass(frozen=True)
class TokenBytes:
    """Per-id byte counts of one tokenizer: ``lengths`` (V,) the bytes of each token's text, ``separators``
    (V,) the bytes before it inside a document, ``eot_id`` the document boundary."""

    lengths: Tensor
    separators: Tensor
    eot_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, device: torch.device | str = "cpu") -> TokenBytes:
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
        scored = targets != ignore_index
        ids = torch.where(scored, targets, 0)
        inside_document = inputs != self.eot_id
        per_token = self.lengths[ids] + self.separators[ids] * inside_document
        return (per_token * scored).sum()

    def count_array(self, inputs: np.ndarray, targets: np.ndarray) -> int:
        """``count`` for numpy arrays of ids (the length study's flat validation tokens)."""
        return int(
            self.count(torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)))
        )


def bits_per_byte(nats: float, n_bytes: float) -> float:
    """Summed nats of the scored tokens over the bytes they cover, in bits: nats / (bytes x ln 2). nan when
    the tokens cover no byte."""
    if n_bytes <= 0:
        return math.nan
    return nats / (n_bytes * math.log(2))
