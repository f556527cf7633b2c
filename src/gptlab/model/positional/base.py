"""The interface every positional scheme implements, and the registry that finds a scheme by name.

Schemes act in three different places, so every scheme implements the same three hooks, each a no-op by
default, and the model always calls all three:

- ``embed(x, positions)``: add a position vector to the token embeddings (learned, sinusoidal);
- ``rotate(q, k, positions)``: transform queries and keys inside attention (rotary schemes);
- ``bias(q_positions, k_positions)``: an additive attention bias per head (ALiBi, T5 relative buckets, FIRE).

A scheme's options are its ``Options`` dataclass; the registry builds them from the ``pos`` config node and
checks every key and type. Code that uses a scheme asks its capabilities (``extrapolates``,
``max_positions``, ``is_rotary``, ``context_scalings``, ``scaled(...)``), never its name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.registry import NoOptions, Registry, build_options

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig

REGISTRY: Registry[type[PositionalEncoding]] = Registry("positional encoding", "pos")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names

#: FlexAttention's score_mod: (score, batch, head, q_idx, kv_idx) -> score.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


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

    def __init__(self, config: GPTConfig, options: Any = None) -> None:
        super().__init__()
        self.config = config
        if options is None:
            options = build_options(self.Options, config.pos_options, f"pos={config.pos}", "pos")
        self.check_config(config, options)
        self.options = options

    @classmethod
    def check_config(cls, config: GPTConfig, options: Any) -> None:
        """Checks that need the model's shape as well as the options (e.g. an even head dimension)."""

    @property
    def max_positions(self) -> int | None:
        """The largest number of positions the scheme can represent, or None when any position works."""
        return None if self.extrapolates else self.config.block_size

    # ---- the three hooks ------------------------------------------------------------------------
    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, T, n_embd) token embeddings; positions: (T,) absolute positions."""
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q: (B, n_head, T, head_dim), k: (B, n_kv_head, T, head_dim), both at ``positions``."""
        return q, k

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """An additive attention bias of shape (n_head, Tq, Tk), or None for no bias. It depends on the
        positions only, so the model computes it once per forward pass and every layer shares it."""
        return None

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
                f"pos={self.config.pos} has no context scaling {method!r} (it has: {have}). Evaluate the "
                "context-scaling study with a scheme that has one, e.g. pos=rope."
            )
        if factor < 1:
            raise ConfigError(f"context scale factor {factor} must be >= 1 (1 leaves the scheme as trained)")
        yield self

    def check_positions(self, end: int) -> None:
        """Raise a clear error when positions up to ``end`` (exclusive) are out of the scheme's range."""
        limit = self.max_positions
        if limit is not None and end > limit:
            raise ValueError(
                f"pos={self.config.pos} has a table of {limit} positions, but a sequence needs "
                f"{end}. Keep sequences within model.block_size={limit}, raise model.block_size "
                f"before training, or train with a scheme that extrapolates (pos=sinusoidal, pos=nope)."
            )


def check(config: GPTConfig) -> Any:
    """The typed options of ``config``'s scheme; raises a ConfigError for an unknown scheme, option or a
    value the scheme cannot take with this model shape."""
    scheme = get(config.pos)
    options = REGISTRY.build_options(config.pos, config.pos_options)
    scheme.check_config(config, options)
    return options


def build(config: GPTConfig) -> PositionalEncoding:
    """The configured scheme, its options checked."""
    return get(config.pos)(config, check(config))
