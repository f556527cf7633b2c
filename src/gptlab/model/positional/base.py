"""The interface every positional scheme implements, and the registry that finds a scheme by name.

Schemes act in three different places, so every scheme implements the same three hooks, each a no-op by
default, and the model always calls all three:

- ``embed(x, positions)``: add a position vector to the token embeddings (learned, sinusoidal);
- ``rotate(q, k, positions)``: transform queries and keys inside attention (rotary schemes);
- ``bias(q_positions, k_positions)``: an additive attention bias per head (ALiBi, T5 relative buckets, FIRE).
  The dense attention route reads it a block of query rows at a time through ``bias_rows``, which by default
  calls ``bias`` on each block's positions; a scheme whose rows share work (a table per distance) overrides it.

A scheme is built from its own options (its ``Options`` dataclass, which the registry builds from the ``pos``
config node, checking every key and type) and the attention shape it serves:
``RotaryPositionalEncoding(options, n_head=4, head_dim=32, block_size=256)``. Code that uses a scheme asks its
capabilities (``extrapolates``, ``max_positions``, ``is_rotary``, ``context_scalings``, ``scaled(...)``),
never its name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.registry import NoOptions, Registry

REGISTRY: Registry[type[PositionalEncoding]] = Registry("positional encoding", "pos")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names

#: FlexAttention's score_mod: (score, batch, head, q_idx, kv_idx) -> score.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
#: A bias a block of query rows at a time: (start, end, keys) -> the (n_head, end - start, keys) bias of
#: queries start..end-1 over the first ``keys`` keys (``PositionalEncoding.bias_rows``).
BiasRows = Callable[[int, int, int], Tensor]


class PositionalEncoding(nn.Module):
    """Base class: every hook is the identity, so a scheme overrides only the places it acts."""

    #: The scheme's options under ``pos.*`` (besides ``name``), as a dataclass with defaults.
    Options: ClassVar[type] = NoOptions
    #: False when the scheme has a table of ``block_size`` positions and cannot run past it.
    extrapolates: ClassVar[bool] = True
    #: True when the scheme rotates queries and keys (RoPE and its relatives).
    is_rotary: ClassVar[bool] = False
    #: The context-scaling methods ``scaled`` accepts (stretching the scheme for longer contexts).
    context_scalings: ClassVar[tuple[str, ...]] = ()

    #: The name the ``pos`` config node chooses it by (set by the registry).
    choice_name: ClassVar[str] = ""

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__()
        options = options if options is not None else self.Options()
        self.check_shape(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        self.options = options
        self.n_head, self.head_dim, self.block_size = n_head, head_dim, block_size
        self.n_embd = n_head * head_dim  # the width of the vectors ``embed`` adds

    @classmethod
    def check_shape(cls, options: Any, *, n_head: int, head_dim: int, block_size: int) -> None:
        """Checks that need the attention shape as well as the options (e.g. an even head dimension); the
        model config runs them when it is made, before any weight exists."""

    @property
    def max_positions(self) -> int | None:
        """The largest number of positions the scheme can represent, or None when any position works."""
        return None if self.extrapolates else self.block_size

    # ---- the three hooks ------------------------------------------------------------------------
    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, T, n_embd) token embeddings; positions: (T,) absolute positions, or (B, T) each token's
        position in its document (document masking: positions restart at each document)."""
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q: (B, n_head, T, head_dim), k: (B, n_kv_head, T, head_dim), both at ``positions``: (T,), or
        (B, T) per token as in ``embed``."""
        return q, k

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """An additive attention bias of shape (n_head, Tq, Tk), or None for no bias. It depends on the
        positions only, so the model computes it once per forward pass and every layer shares it."""
        return None

    def bias_rows(self, q_positions: Tensor, k_positions: Tensor) -> BiasRows | None:
        """``bias(q_positions, k_positions)`` one block of query rows at a time, for the dense attention route,
        which never holds the whole (n_head, Tq, Tk) bias: a function (start, end, keys) -> the bias of
        queries ``start..end-1`` over the first ``keys`` keys. What every block shares (a table per
        distance) is computed once, here, for every layer and block of the forward pass; by default each
        block calls ``bias`` on its own positions. None when the scheme has no bias."""
        if not self.has_bias:
            return None

        def rows(start: int, end: int, keys: int) -> Tensor:
            bias = self.bias(q_positions[start:end], k_positions[:keys])
            assert bias is not None  # has_bias: the scheme implements bias
            return bias

        return rows

    def score_mod(self, q_positions: Tensor, k_positions: Tensor) -> ScoreMod | None:
        """The same bias as a FlexAttention ``score_mod`` (q_idx, kv_idx index ``q_positions``,
        ``k_positions``). By default it reads the dense bias; a scheme with a closed form overrides it."""
        bias = self.bias(q_positions, k_positions)
        if bias is None:
            return None

        def add_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + bias[h, q_idx, kv_idx]

        return add_bias

    # ---- capabilities ---------------------------------------------------------------------------
    @property
    def has_bias(self) -> bool:
        """Whether the scheme adds an attention bias (it implements ``bias``)."""
        return type(self).bias is not PositionalEncoding.bias

    def position_vectors(self, n: int) -> Tensor | None:
        """The (n, n_embd) vectors ``embed`` adds at positions 0..n-1, or None when it adds none."""
        return None

    @contextmanager
    def scaled(self, factor: float, method: str) -> Iterator[PositionalEncoding]:
        """Within the block, the scheme is stretched by ``method`` for a context ``factor`` times the
        training one; afterwards it is as trained. ``factor`` 1 changes nothing."""
        if method not in self.context_scalings:
            have = ", ".join(self.context_scalings) or "none"
            raise ConfigError(
                f"pos={self.choice_name} has no context scaling {method!r} (it has: {have}). Evaluate the "
                "context-scaling study with a scheme that has one, e.g. pos=rope."
            )
        if factor < 1:
            raise ConfigError(f"context scale factor {factor} must be >= 1 (1 leaves the scheme as trained)")
        yield self

    @staticmethod
    def end_of(positions: Tensor) -> int:
        """One past the largest of ``positions``: (T,) increasing ones, or (B, T) per-document ones."""
        return int(positions[-1] if positions.dim() == 1 else positions.max()) + 1

    def check_positions(self, end: int) -> None:
        """Raise a clear error when positions up to ``end`` (exclusive) are out of the scheme's range."""
        limit = self.max_positions
        if limit is not None and end > limit:
            raise ValueError(
                f"pos={self.choice_name} has a table of {limit} positions, but a sequence needs "
                f"{end}. Keep sequences within model.block_size={limit}, raise model.block_size "
                f"before training, or train with a scheme that extrapolates (pos=sinusoidal, pos=nope)."
            )


def build(choice: Any, *, n_head: int, head_dim: int, block_size: int) -> PositionalEncoding:
    """The chosen scheme (a :class:`~gptlab.registry.Choice`) for this attention shape."""
    return get(choice.name)(choice.options, n_head=n_head, head_dim=head_dim, block_size=block_size)
