"""Adding a variant is its class and its YAML, nothing else: a throwaway positional scheme, activation, norm
(with an option of its own) and strategy, written outside gptlab as a user would (a module named in
``plugins=`` and a config folder added with ``hydra.searchpath``), train through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from conftest import ROOT, TINY, run_train

from gptlab.runs.layout import last_checkpoint

VARIANTS = '''
"""Throwaway variants: one class each, registered by name."""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.errors import ConfigError
from gptlab.model import activations, norms
from gptlab.model.positional import PositionalEncoding, register
from gptlab.parallel.strategies import STRATEGIES, StrategyChoice


@norms.register("scalenorm")
class ScaleNorm(norms.Norm):
    """g * x / ||x||, one learned scalar g (Nguyen & Salazar 2019, "Transformers without Tears")."""

    @dataclass(frozen=True)
    class Options(norms.NormOptions):
        init_scale: float | None = None  # the option of its own: g's start; None: sqrt(dim)

        def __post_init__(self):
            super().__post_init__()
            if self.init_scale is not None and self.init_scale <= 0:
                raise ConfigError(f"norm.init_scale={self.init_scale} must be positive")

    def __init__(self, dim, options=None):
        super().__init__(dim, options)
        self.g = nn.Parameter(torch.tensor(self.options.init_scale or math.sqrt(dim)))

    def forward(self, x):
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(self.options.eps)


@activations.register("mish")
class Mish(activations.Activation):
    """x * tanh(softplus(x)) (Misra 2019, "Mish: A Self Regularized Non-Monotonic Activation Function")."""

    def forward(self, x):
        return F.mish(x)


@register("clipped")
class ClippedRelativeBias(PositionalEncoding):
    """A learned bias per head for each distance up to max_distance, clipped beyond it (after Shaw et al.
    2018, "Self-Attention with Relative Position Representations")."""

    @dataclass(frozen=True)
    class Options:
        max_distance: int = 16

    def __init__(self, options=None, *, n_head, head_dim, block_size):
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        self.table = nn.Embedding(self.options.max_distance + 1, n_head)

    def bias(self, q_positions, k_positions):
        distance = (q_positions[:, None] - k_positions[None, :]).clamp(0, self.options.max_distance)
        return self.table(distance).permute(2, 0, 1)


@STRATEGIES.register("one_device")
class OneDevice(StrategyChoice):
    """Everything on one named device (Lightning's SingleDeviceStrategy)."""

    name = "one_device"

    @dataclass(frozen=True)
    class Options:
        device: str = "cpu"

    def build(self, trainer_cfg):
        from lightning.pytorch.strategies import SingleDeviceStrategy

        return SingleDeviceStrategy(device=torch.device(self.options.device))
'''

YAMLS = {
    "norm/scalenorm.yaml": "name: scalenorm\nplacement: pre\neps: 1.0e-5\ninit_scale: 2.0\n",
    "activation/mish.yaml": "name: mish\n",
    "pos/clipped.yaml": "name: clipped\nmax_distance: 8\n",
    "strategy/one_device.yaml": "name: one_device\ndevice: cpu\n",
}


def test_a_variant_of_each_family_is_its_class_and_its_yaml(tmp_path):
    (tmp_path / "my_variants.py").write_text(textwrap.dedent(VARIANTS))
    for name, text in YAMLS.items():
        (tmp_path / "my_conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "my_conf" / name).write_text(text)
    run = tmp_path / "run"
    proc = run_train(
        [
            *TINY,
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "plugins=[my_variants]",
            f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
            "pos=clipped",
            "activation=mish",
            "norm=scalenorm",
            "norm.init_scale=3.0",
            "strategy=one_device",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}"},
    )
    assert "Final validation loss" in proc.stdout
    assert json.loads((run / "result.json").read_text())["finished"]
    saved = torch.load(last_checkpoint(run), map_location="cpu", weights_only=False)
    model = saved["hyper_parameters"]["model"]
    assert model["pos"] == {"name": "clipped", "max_distance": 8}
    assert model["activation"] == {"name": "mish"}
    assert model["norm"] == {"name": "scalenorm", "eps": 1e-5, "init_scale": 3.0}
    assert saved["state_dict"]["model.transformer.h.0.ln_1.g"].item() != 0
    assert saved["hyper_parameters"]["plugins"] == ["my_variants"]

    # The scripts that read a trained run import the run's plugins: generate.py, run where train.py was run
    # (the module is found in the working directory, no PYTHONPATH needed) ...
    script = [
        sys.executable,
        str(ROOT / "scripts" / "generate.py"),
        f"ckpt={run}",
        "prompt=The",
        "max_new_tokens=3",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    generated = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.startswith("The")
    # ... and where the module cannot be found, it says which module the run needs and how to give it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = subprocess.run(script, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2  # a refusal, as train.py gives for the same plugins
    assert "plugins=[my_variants] cannot be imported" in missing.stderr
    assert "put the module on PYTHONPATH" in missing.stderr

    # A key the norm does not take is refused at config time, naming its options.
    refused = run_train(
        [
            *TINY,
            "plugins=[my_variants]",
            f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]",
            "norm=scalenorm",
            "+norm.init_scal=3.0",
            f"hydra.run.dir={tmp_path / 'refused'}",
        ],
        tmp_path,
        check=False,
        env={"PYTHONPATH": f"{tmp_path}:{__import__('os').environ.get('PYTHONPATH', '')}"},
    )
    assert refused.returncode == 2
    assert "norm=scalenorm does not take option(s) norm.init_scal" in refused.stderr
    assert "Did you mean norm.init_scale?" in refused.stderr
