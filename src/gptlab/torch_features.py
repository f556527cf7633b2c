"""What the installed torch has, for the choices that need a recent one.

gptlab supports a range of torch releases (pyproject: ``torch>=2.11,<2.16``): a GPU machine keeps the CUDA
build it came with. A few choices use functions that only newer releases have; each is listed here once, with
the release that added it, and is looked up by attribute (not by version number), so that a build with a
backport, or a nightly, is judged by what it actually has:

- ``loss.impl=torch``: ``F.linear_cross_entropy`` with ``nn.LinearCrossEntropyOptions`` (the chunked path):
  torch 2.13;
- ``optim=muon``: ``torch.optim.Muon``: torch 2.9;
- FlexAttention for the bias schemes on CUDA: ``torch.nn.attention.flex_attention`` (``flex_attention``,
  ``create_block_mask``): torch 2.5.

``auto`` choices take only what is here (:func:`has`); an explicit choice that needs what is missing is refused
at config time (:func:`require`), naming the release it needs and the choice that runs instead.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from gptlab.errors import ConfigError


@dataclass(frozen=True)
class TorchFeature:
    """A piece of torch that a choice needs: ``attributes`` are dotted paths under ``torch`` that must all
    exist; ``since`` is the first torch release that has them."""

    name: str
    what: str
    since: str
    attributes: tuple[str, ...]

    def missing(self) -> list[str]:
        """The attributes the installed torch lacks (``torch.``-prefixed); empty when it has the feature."""
        return [f"torch.{path}" for path in self.attributes if not _resolves(path)]

    def available(self) -> bool:
        return not self.missing()


def _resolves(path: str) -> bool:
    """Whether ``torch.<path>`` exists, importing submodules on the way (``nn.attention.flex_attention`` is
    not imported by ``import torch``)."""
    obj: object = torch
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            try:
                importlib.import_module("torch." + ".".join(parts[: i + 1]))
            except ImportError:
                return False
            if not hasattr(obj, part):
                return False
        obj = getattr(obj, part)
    return True


FEATURES: dict[str, TorchFeature] = {
    feature.name: feature
    for feature in (
        TorchFeature(
            "linear_cross_entropy",
            "torch's chunked output layer + cross-entropy (F.linear_cross_entropy with "
            "nn.LinearCrossEntropyOptions)",
            "2.13",
            ("nn.functional.linear_cross_entropy", "nn.LinearCrossEntropyOptions"),
        ),
        TorchFeature("muon", "torch.optim.Muon", "2.9", ("optim.Muon",)),
        TorchFeature(
            "flex_attention",
            "FlexAttention (torch.nn.attention.flex_attention)",
            "2.5",
            ("nn.attention.flex_attention.flex_attention", "nn.attention.flex_attention.create_block_mask"),
        ),
    )
}


def installed_version() -> str:
    """The installed torch's version without the build tag (``2.11.0+cu130`` -> ``2.11.0``)."""
    return torch.__version__.split("+")[0]


def has(name: str) -> bool:
    """Whether the installed torch has the feature ``name`` (a key of ``FEATURES``)."""
    return FEATURES[name].available()


def missing_message(name: str, choice: str, alternative: str) -> str | None:
    """Why ``choice`` cannot run on the installed torch, with the release it needs and ``alternative``;
    None when the feature is here."""
    feature = FEATURES[name]
    missing = feature.missing()
    if not missing:
        return None
    return (
        f"{choice} needs {feature.what}, new in torch {feature.since}; the installed torch "
        f"{torch.__version__} lacks {', '.join(missing)}. Install torch>={feature.since} (gptlab supports "
        f"it: pyproject's range), or use {alternative}."
    )


def require(name: str, choice: str, alternative: str) -> None:
    """Refuse ``choice`` (as typed, e.g. ``loss.impl=torch``) with a ConfigError when the installed torch
    lacks the feature ``name``; ``alternative`` is the choice that runs instead."""
    message = missing_message(name, choice, alternative)
    if message is not None:
        raise ConfigError(message)
