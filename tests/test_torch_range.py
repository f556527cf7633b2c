"""gptlab on an older torch than the one this suite installs: the choices that need a newer release are refused at
config time with the release they need and the choice that runs instead, and ``auto`` takes only what is there.

An older torch is simulated by removing the newer functions from the installed one (``older_torch``); the real
thing (a torch 2.11 environment running ``python train.py``) is in the README's install section."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from packaging.version import Version

from gptlab import torch_features
from gptlab.config import parse_gpt
from gptlab.errors import ConfigError
from gptlab.model import attention
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss, refusal
from gptlab.tasks.gpt import run

# What torch 2.8 lacks of what gptlab can use: the chunked linear cross-entropy (2.13) and Muon (2.9).
# FlexAttention (2.5) is removed too, as on a build without it.
REMOVED = [
    ("torch.nn.functional", "linear_cross_entropy"),
    ("torch.nn", "LinearCrossEntropyOptions"),
    ("torch.optim", "Muon"),
    ("torch.nn.attention.flex_attention", "flex_attention"),
    ("torch.nn.attention.flex_attention", "create_block_mask"),
]


@pytest.fixture
def older_torch(monkeypatch):
    import importlib

    for module, name in REMOVED:
        monkeypatch.delattr(importlib.import_module(module), name, raising=False)  # absent already
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")


def test_each_feature_is_here_exactly_when_the_installed_release_is_its_release_or_newer():
    # The table's releases agree with the installed torch (2.13 in this suite: every feature; 2.11: no
    # linear_cross_entropy): a feature list out of step with torch shows up here.
    installed = Version(torch_features.installed_version())
    for name, feature in torch_features.FEATURES.items():
        assert feature.available() == (installed >= Version(feature.since)), (name, feature.missing())
        assert (torch_features.missing_message(name, "x", "y") is None) == feature.available()


def test_an_older_torch_lacks_them_and_says_which_attributes(older_torch):
    assert not any(torch_features.has(name) for name in torch_features.FEATURES)
    assert torch_features.FEATURES["linear_cross_entropy"].missing() == [
        "torch.nn.functional.linear_cross_entropy",
        "torch.nn.LinearCrossEntropyOptions",
    ]
    assert torch_features.installed_version() == "2.8.0"


def test_loss_impl_torch_on_an_older_torch_is_refused_at_config_time(make_cfg, older_torch):
    with pytest.raises(ConfigError) as refused:
        parse_gpt(make_cfg(*TINY, "loss.impl=torch"))
    assert str(refused.value) == (
        "loss.impl=torch needs torch's chunked output layer + cross-entropy (F.linear_cross_entropy with "
        "nn.LinearCrossEntropyOptions), new in torch 2.13; the installed torch 2.8.0+cu128 lacks "
        "torch.nn.functional.linear_cross_entropy, torch.nn.LinearCrossEntropyOptions. Install torch>=2.13, "
        "or use loss.impl=auto (here: chunked), which gives the plain head's loss and gradients without holding "
        "the logits."
    )
    with pytest.raises(RuntimeError, match="loss.impl=torch needs"):
        HeadLoss("torch").resolve("cpu")  # a HeadLoss built outside a run is refused at its first call


def test_optim_muon_on_an_older_torch_is_refused_before_anything_starts(make_cfg, older_torch, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        run(make_cfg(*TINY, "optim=muon", "logger=csv", f"paths.output_dir={out}"))
    assert str(refused.value) == (
        "optim=muon needs torch.optim.Muon, new in torch 2.9; the installed torch 2.8.0+cu128 lacks "
        "torch.optim.Muon. Install torch>=2.9 (gptlab supports it: pyproject's range), or use optim=adamw."
    )
    assert not (out / "checkpoints").exists() and not list(tmp_path.glob("**/*.bin"))


def test_auto_takes_what_an_older_torch_has(make_cfg, older_torch):
    # the loss: chunked (pure torch) on CPU and on CUDA, never torch's
    assert parse_gpt(make_cfg(*TINY)).loss.resolve("cpu") == "chunked"
    assert HeadLoss("auto").resolve("cuda", installed=set()) == "chunked"
    assert HeadLoss("auto").resolve("cuda", installed={"cut_cross_entropy"}) == "chunked"
    assert refusal("chunked", "cuda", set()) is None
    # attention: without FlexAttention a bias scheme takes the dense SDPA route on CUDA too
    assert not attention.flex_attention_available(torch.device("cuda"), head_dim=64)
    model = GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=1, n_head=2, n_embd=32, pos="alibi"))
    idx = torch.randint(0, 61, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.skipif(
    not all(map(torch_features.has, torch_features.FEATURES)), reason="the installed torch lacks a feature"
)
def test_with_the_features_present_auto_and_flex_are_unchanged():
    assert attention.flex_attention_available(torch.device("cuda"), head_dim=64)
    assert not attention.flex_attention_available(torch.device("cpu"), head_dim=64)
    assert HeadLoss("auto").resolve("cuda", installed={"cut_cross_entropy", "liger_kernel"}) == "chunked"
    assert HeadLoss("torch").resolve("cpu") == "torch"
