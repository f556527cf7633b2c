"""model.param=standard|mup: muP's scalings, its coordinate check, and its errors."""

from __future__ import annotations

import math

import pytest
import torch

from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig, hidden_lr_scale
from gptlab.model.gpt import GPT
from gptlab.training.coord_check import coordinate_check
from gptlab.training.optimizers import build_optimizer, parse_optim


def config(**kw) -> GPTConfig:
    values = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=64, mup_base_width=32)
    return GPTConfig(**{**values, **kw})


def test_at_its_base_width_a_mup_model_is_the_standard_model():
    x = torch.randint(0, 61, (2, 16))
    torch.manual_seed(0)
    standard = GPT(config(n_embd=32))
    torch.manual_seed(0)
    mup = GPT(config(n_embd=32, param="mup"))
    torch.testing.assert_close(standard(x)[0], mup(x)[0])
    assert hidden_lr_scale(mup.config) == 1.0


def test_mup_scales_hidden_init_and_rates_logits_and_attention_with_width():
    torch.manual_seed(0)
    wide = GPT(config(n_embd=256, param="mup"))  # m = 256 / 32 = 8
    std = wide.transformer.h[0].mlp.c_fc.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(8), rel=0.05)  # variance ~ 1 / fan_in
    assert wide.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)  # embeddings unchanged
    assert wide.output_mult == 1 / 8
    head_dim, base_head_dim = 256 / 4, 32 / 4
    assert wide.transformer.h[0].attn.scale == pytest.approx(math.sqrt(base_head_dim) / head_dim)
    optimizer = build_optimizer(wide, parse_optim({"lr": 1e-2}), hidden_lr_scale(wide.config))
    rates = {g["group"]: g["lr"] for g in optimizer.param_groups}
    assert rates == {"hidden": pytest.approx(1e-2 / 8), "embeddings_head": 1e-2, "gains_biases": 1e-2}


def test_the_coordinate_check_is_flat_in_width_under_mup_and_grows_in_the_standard_parametrisation():
    result = coordinate_check(widths=(32, 64, 128), steps=3, lr=1e-2, n_layer=1, context=16, batch_size=4)
    for layer in ("block0.attn", "block0.mlp", "logits"):
        assert abs(result.slope("mup", layer)) < 0.25, (layer, result.slope("mup", layer))
    for layer in ("block0.attn", "block0.mlp"):  # Adam's updates of size lr add up over a growing fan-in
        assert result.slope("standard", layer) > 0.7, (layer, result.slope("standard", layer))
    assert result.slope("standard", "logits") > 0.3
    assert set(result.to_dict()["mean_abs_activation"]["mup"]["logits"]) == {"32", "64", "128"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"param": "mu-p"}, r"model.param='mu-p' is not one of standard, mup"),
        (
            {"param": "mup", "mup_base_width": 30},
            r"model.mup_base_width=30 is not divisible by model.n_head=4.*=32",
        ),
        ({"param": "mup", "mup_base_width": 0}, r"model.mup_base_width=0 must be a positive integer"),
    ],
)
def test_bad_parametrisation_options_name_the_value_and_the_fix(values, message):
    with pytest.raises(ConfigError, match=message):
        config(**values)
