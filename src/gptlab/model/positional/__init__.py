"""Positional encodings: how the model learns where each token stands, one small class per scheme.

``base`` holds the interface (three hooks: ``embed``, ``rotate``, ``bias``) and the registry; the schemes
live by family in ``absolute`` (learned, sinusoidal, nope), ``rotary`` (rope, xpos) and ``bias`` (alibi,
relative, fire). A new scheme is one class in its family's file, registered by name, plus one YAML under
``conf/pos/``; ``positional.get(name)`` and ``positional.names()`` find it.
"""

from gptlab.model.positional.absolute import (
    LearnedPositionalEncoding,
    NoPositionalEncoding,
    SinusoidalPositionalEncoding,
    sinusoidal_table,
)
from gptlab.model.positional.base import (
    REGISTRY,
    BiasRows,
    PositionalEncoding,
    ScoreMod,
    build,
    get,
    names,
    register,
)
from gptlab.model.positional.bias import (
    ALiBiPositionalEncoding,
    FIREPositionalEncoding,
    T5RelativePositionalEncoding,
    alibi_slopes,
    t5_relative_buckets,
)
from gptlab.model.positional.rotary import (
    ROPE_SCALINGS,
    RotaryPositionalEncoding,
    XPosPositionalEncoding,
    rope_inverse_frequencies,
    rotary_dim,
    rotate_half,
)

__all__ = [
    "REGISTRY",
    "ROPE_SCALINGS",
    "ALiBiPositionalEncoding",
    "BiasRows",
    "FIREPositionalEncoding",
    "LearnedPositionalEncoding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "RotaryPositionalEncoding",
    "ScoreMod",
    "SinusoidalPositionalEncoding",
    "T5RelativePositionalEncoding",
    "XPosPositionalEncoding",
    "alibi_slopes",
    "build",
    "get",
    "names",
    "register",
    "rope_inverse_frequencies",
    "rotary_dim",
    "rotate_half",
    "sinusoidal_table",
    "t5_relative_buckets",
]


def _import_every_family() -> None:
    """Import every module of this package, so that a scheme in a new file registers itself."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_family()
