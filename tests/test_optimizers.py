"""optim=adamw|muon, optim.schedule=cosine|wsd: the parameter split, Muon's update, the schedules' shapes, the
errors, and runs through the command line."""

from __future__ import annotations

import copy
import csv
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY, run_train
from omegaconf import OmegaConf

from gptlab.config import parse_gpt
from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.registry import Choice
from gptlab.tasks.gpt import run
from gptlab.training import optimizers
from gptlab.training.module import GPTLitModule
from gptlab.training.optimizers import (
    AdamWOptions,
    MuonOptions,
    MuonWithAdamW,
    ScheduleOptions,
    build_optimizer,
    lr_factor,
    param_groups,
    parse_optim,
    schedule_of,
)

CONF = Path(__file__).parents[1] / "conf"
OLD_CHECKPOINT = Path(__file__).parent / "data" / "e9c3ad3_rope_rmsnorm_swiglu.ckpt"
CPU2 = ["trainer.accelerator=cpu", "trainer.devices=2"]
QUIET = ["callbacks.sample_generation.max_new_tokens=0", "trainer.log_every_n_steps=1"]


def tiny_model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16, pos="learned", **kw))


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Jordan et al.'s quintic Newton-Schulz iteration towards the orthogonal factor of g: X <- a X + (b S +
    c S^2) X with S = X X^T, from X = g / ||g||_F, on the wide orientation, in bfloat16 with fused
    multiply-adds as their reference computes it."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = torch.addmm(x, torch.addmm(s, s, s, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).float()


# ---- the options: one source for the defaults ----------------------------------------------------------


@pytest.mark.parametrize("name", optimizers.names())
def test_each_optimizers_yaml_states_exactly_its_options_defaults(make_cfg, name):
    # The defaults are the Options dataclasses'; conf/optim/<name>.yaml lists the same keys (so that Hydra takes
    # optim.<key>=... without +) with the same values. A default changed in one place and not the other, or a
    # key in one and not the other, fails here.
    node = OmegaConf.to_container(make_cfg(f"optim={name}").optim)
    defaults = dataclasses.asdict(optimizers.get(name).Options())
    assert node == {"name": name, **{k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}}
    assert parse_optim(node) == Choice(name, optimizers.get(name).Options())


def test_every_optimizer_has_a_yaml_and_cites_its_paper():
    assert optimizers.names() == sorted(p.stem for p in (CONF / "optim").glob("*.yaml"))
    for name in optimizers.names():
        assert re.search(r"(19|20)\d\d", optimizers.get(name).__doc__ or ""), f"{name}: no paper cited"


def test_muons_options_extend_adamws_and_its_yaml_does_not_repeat_them():
    assert issubclass(MuonOptions, AdamWOptions) and issubclass(AdamWOptions, ScheduleOptions)
    adamw, muon = dataclasses.asdict(AdamWOptions()), dataclasses.asdict(MuonOptions())
    assert {key: muon[key] for key in adamw} == adamw  # every AdamW option, with AdamW's default
    assert set(muon) - set(adamw) == {"muon_lr", "momentum", "nesterov", "ns_steps", "adjust_lr_fn"}
    own = yaml.safe_load((CONF / "optim" / "muon.yaml").read_text())
    assert own["defaults"] == ["adamw", "_self_"] and not set(own) & set(adamw)  # taken from adamw.yaml


def test_the_default_run_has_the_optimizer_of_the_readmes_run(make_cfg):
    # `python train.py`, whose final validation loss the README quotes (4.7997), and every study in
    # docs/studies.md: AdamW at 4e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices only, 30 steps
    # of warmup, then cosine to 0.1 x lr at step 320.
    settings = parse_gpt(make_cfg())
    assert settings.optim == Choice(
        "adamw",
        AdamWOptions(
            lr=4e-3,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            warmup_steps=30,
            schedule="cosine",
            min_lr_ratio=0.1,
        ),
    )
    optimizer = build_optimizer(tiny_model(), settings.optim)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [
        (g["group"], g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in optimizer.param_groups
    ] == [
        ("matrices", 4e-3, 0.1, (0.9, 0.95), 1e-8),
        ("gains_biases", 4e-3, 0.0, (0.9, 0.95), 1e-8),
    ]
    assert settings.trainer["max_steps"] == 320
    factor = schedule_of(settings.optim, 320)
    assert factor(0) == pytest.approx(1 / 30) and factor(29) == factor(30) == 1.0
    assert factor(175) == pytest.approx(0.55) and factor(320) == pytest.approx(0.1)  # halfway; the end


def test_a_checkpoint_from_an_earlier_version_reads_as_todays_default_optimizer():
    # written at e9c3ad3 with the merged dict of that time: no name, no schedule keys
    saved = torch.load(OLD_CHECKPOINT, map_location="cpu", weights_only=False)["hyper_parameters"]["optim"]
    assert "name" not in saved and "schedule" not in saved
    assert parse_optim(saved) == Choice("adamw", AdamWOptions())


def test_a_bad_optimizer_key_is_refused_at_config_time_with_the_closest_name(make_cfg, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        run(make_cfg(*TINY, "optim=muon", "+optim.muon_rl=0.01", "logger=csv", f"paths.output_dir={out}"))
    message = str(refused.value)
    assert message.startswith(
        "optim=muon does not take option(s) optim.muon_rl. Its options: optim.warmup_steps"
    )
    assert message.endswith("Did you mean optim.muon_lr?")
    assert not (out / "checkpoints").exists() and not (out / "csv").exists()  # nothing started
    with pytest.raises(
        ConfigError, match=r"optim=adamw does not take option\(s\) optim.muon_lr\..*Choose optim=muon"
    ):
        parse_gpt(make_cfg(*TINY, "+optim.muon_lr=0.01"))


def test_the_module_takes_the_parsed_options_and_saves_them_as_plain_values():
    choice = parse_optim({"name": "muon", "lr": 1e-3})
    module = GPTLitModule(model=tiny_model().config, optim=choice)
    assert module.optim is choice  # not parsed again
    assert module.hparams["optim"] == choice.node() and module.hparams["optim"]["betas"] == (0.9, 0.95)
    again = GPTLitModule(model=tiny_model().config, optim=module.hparams["optim"])  # as from a checkpoint
    assert again.optim == choice


# ---- the parameter groups and the update ----------------------------------------------------------------


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = tiny_model()
    adamw, muon = param_groups(model, parse_optim({"name": "muon"}))
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in muon for p in g["params"]}
    adamw_names = {names[id(p)] for g in adamw for p in g["params"]}
    assert muon_names == {
        f"transformer.h.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert "transformer.wte.weight" in adamw_names and "transformer.pos.wpe.weight" in adamw_names
    assert "transformer.ln_f.weight" in adamw_names and "transformer.h.0.attn.c_attn.bias" in adamw_names
    assert not muon_names & adamw_names
    assert len(muon_names) + len(adamw_names) == len(list(model.parameters()))  # the tied head once


def test_standard_adamw_keeps_the_two_groups_older_checkpoints_hold():
    # An optimizer state saved before optim=muon and muP (every matrix, then every vector) still loads.
    model = tiny_model()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    old = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}], lr=1e-3
    )
    x = torch.randint(0, 50, (4, 16))
    model(x, x)[1].backward()
    old.step()
    optimizer = build_optimizer(model, parse_optim({"lr": 1e-3}))
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(matrices), len(vectors)]
    optimizer.load_state_dict(copy.deepcopy(old.state_dict()))
    assert optimizer.state[matrices[0]]["step"] == 1


def test_a_muon_step_is_the_newton_schulz_orthogonalised_nesterov_momentum():
    model = tiny_model()
    mu, lr, wd = 0.95, 0.05, 0.1
    optimizer = build_optimizer(model, parse_optim({"name": "muon", "muon_lr": lr, "weight_decay": wd}))
    assert isinstance(optimizer, MuonWithAdamW)
    w = model.transformer.h[1].mlp.c_fc.weight  # (64, 16): a tall matrix
    buffer = torch.zeros_like(w)
    for step in range(2):  # the second step tells Nesterov's momentum from the plain one
        x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(x, x)[1].backward()
        before, grad = w.detach().clone(), w.grad.detach().clone()
        optimizer.step()
        # Momentum as an average, B <- mu B + (1 - mu) g; Nesterov's look-ahead g + mu (B - g); the rate
        # scaled by sqrt(max(1, rows / cols)); decoupled weight decay lr * wd. (Written as lerps: bfloat16
        # iterations amplify the last bit of their input, so the test forms it with the same float32 ops.)
        buffer = buffer.lerp(grad, 1 - mu)
        update = newton_schulz(grad.lerp(buffer, mu))
        expected = before * (1 - lr * wd) - lr * math.sqrt(max(1, w.shape[0] / w.shape[1])) * update
        torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-6)
    # the update is near-orthogonal: singular values of order one (Jordan's coefficients leave them in
    # about [0.7, 1.2] where the input's are not tiny), whatever the gradient's scale
    s = torch.linalg.svdvals(update)
    assert s.max() < 1.5 and s.median() > 0.5
    plain = newton_schulz(buffer)  # without the look-ahead: a different step
    assert (plain - update).abs().max() > 1e-2


def test_the_muon_optimizer_saves_and_restores_its_state_as_one_optimizer():
    model = tiny_model()
    optim = parse_optim({"name": "muon"})
    optimizer = build_optimizer(model, optim)
    x = torch.randint(0, 50, (4, 16))
    for _ in range(2):
        optimizer.zero_grad()
        model(x, x)[1].backward()
        optimizer.step()
    state = copy.deepcopy(optimizer.state_dict())  # a state_dict holds the live tensors
    clone = tiny_model()
    clone.load_state_dict(model.state_dict())
    again = build_optimizer(clone, optim)
    again.load_state_dict(state)
    for opt, m in ((optimizer, model), (again, clone)):
        opt.zero_grad()
        m(x, x)[1].backward()
        opt.step()
    for (name, a), b in zip(model.named_parameters(), clone.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_wsd_warms_up_holds_the_peak_then_decays_over_the_last_fraction():
    steps, warmup = 100, 10
    wsd = [lr_factor(s, warmup, steps, 0.1, "wsd", 0.2, "1-sqrt") for s in range(steps + 1)]
    linear = [lr_factor(s, warmup, steps, 0.0, "wsd", 0.2, "linear") for s in range(steps + 1)]
    assert wsd[0] == pytest.approx(0.1) and wsd[9] == pytest.approx(1.0)  # linear warmup
    assert all(f == 1.0 for f in wsd[10:81])  # stable until the last 20 steps
    assert wsd[100] == pytest.approx(0.1) and linear[100] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(wsd[80:], wsd[81:]))  # non-increasing decay
    assert linear[90] == pytest.approx(0.5)  # halfway through a linear decay to 0
    # 1 - sqrt falls fast, then slowly: below the linear decay to the same floor in between
    sqrt0 = [lr_factor(s, warmup, steps, 0.0, "wsd", 0.2, "1-sqrt") for s in range(steps + 1)]
    assert sqrt0[90] == pytest.approx(1 - math.sqrt(0.5)) and all(
        a <= b for a, b in zip(sqrt0[81:100], linear[81:100])
    )
    cosine = [lr_factor(s, warmup, steps, 0.1) for s in range(steps + 1)]
    assert cosine[50] < 1.0 and cosine[100] == pytest.approx(0.1)  # cosine decays from the warmup on


@pytest.mark.parametrize(
    ("optim", "max_steps", "message"),
    [
        (
            {"schedule": "linear"},
            None,
            r"optim.schedule='linear' must be one of cosine, wsd \(e.g. optim.schedule=cosine\)",
        ),
        ({"name": "sgd"}, None, r"Unknown optimizer 'sgd'. Choose one of: adamw, muon"),
        ({"name": "adamx"}, None, r"Unknown optimizer 'adamx'.*Did you mean optim=adamw\?"),
        ({"decay_shape": "sqrt"}, None, r"optim.decay_shape='sqrt' must be one of linear, 1-sqrt"),
        ({"lrr": 1e-3}, None, r"optim=adamw does not take option\(s\) optim.lrr\..*Did you mean optim.lr\?"),
        (
            {"betas": [0.9]},
            None,
            r"optim.betas=\[0.9\] must be a list of 2 numbers \(e.g. optim.betas=\[0.9,0.95\]\)",
        ),
        ({"betas": [0.9, 1.0]}, None, r"optim.betas=\[0.9, 1.0\] must be two numbers in \[0, 1\)"),
        (
            {"warmup_steps": 2.5},
            None,
            r"optim.warmup_steps=2.5 must be an integer \(e.g. optim.warmup_steps=30\)",
        ),
        ({"decay_fraction": 1.5}, None, r"optim.decay_fraction=1.5 must be in \(0, 1\]"),
        ({"schedule": "wsd", "warmup_steps": 90, "decay_fraction": 0.2}, 100, r"exceed the run"),
        (
            {"muon_lr": 0.02},
            None,
            r"optim=adamw does not take option\(s\) optim.muon_lr.*Choose optim=muon for Muon's options",
        ),
        ({"name": "muon", "adjust_lr_fn": "x"}, None, r"optim.adjust_lr_fn='x' must be one of original"),
        ({"name": "muon", "nesterov": "yes"}, None, r"optim.nesterov='yes' must be true or false"),
        ({"name": "muon", "momentum": 1.0}, None, r"optim.momentum=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_optim_options_name_the_value_and_the_fix(optim, max_steps, message):
    with pytest.raises(ConfigError, match=message):
        parse_optim(optim, max_steps)


def test_muon_under_deepspeed_is_refused_with_the_reason_and_the_alternatives():
    with pytest.raises(
        ConfigError, match=r"optim=muon cannot run under strategy=deepspeed.*flat 1-D.*strategy=fsdp"
    ):
        parse_optim({"name": "muon"}, strategy="deepspeed")
    parse_optim({"name": "muon"}, strategy="fsdp")
    parse_optim({"name": "adamw"}, strategy="deepspeed")


def _csv(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_muon_with_wsd_trains_through_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        [
            *TINY,
            *QUIET,
            "tokenizer=char",
            "optim=muon",
            "optim.schedule=wsd",
            "optim.decay_fraction=0.5",
            "optim.warmup_steps=2",
            "trainer.max_steps=12",
            "trainer.val_check_interval=6",
            "logger=csv",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    rows = _csv(run_dir)
    loss = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    lr = [float(r["lr"]) for r in rows if r.get("lr")]
    muon_lr = [float(r["lr/muon"]) for r in rows if r.get("lr/muon")]
    assert loss[-1] < loss[0] - 0.5  # it trained
    # WSD: the peak held from the end of the warmup to the start of the decay (step 6), then decaying.
    assert lr[0] == pytest.approx(2e-3) and lr[1:7] == [pytest.approx(4e-3)] * 6
    assert lr[-1] < lr[7] < 4e-3
    assert muon_lr[3] == pytest.approx(0.02)  # Muon's own rate, on the same schedule


# Muon on FSDP2's sharded parameters over two processes, trained and resumed to the same curve: the FSDP test of
# tests/test_strategies.py runs under optim=muon.


def test_a_warmup_that_outlasts_the_run_is_named_with_the_rate_it_reaches(make_cfg, caplog):
    """optim.warmup_steps=30 in a run of 10 steps: the rate rises to a third of optim.lr and never decays.
    Said once, before the data, with the fix; a warmup that ends before the last step says nothing, and the
    smoke preset (debug=fast) fits its warmup in its steps."""
    import logging

    from gptlab.training.optimizers import AdamWOptions

    message = AdamWOptions(warmup_steps=30).warmup_outlasts(10)
    assert message == (
        "optim.warmup_steps=30 is not shorter than trainer.max_steps=10: the learning rate rises for the whole "
        "run, to 33% of optim.lr=0.004 (0.00133) at its last step, and never decays. Use optim.warmup_steps "
        "below 10 (e.g. optim.warmup_steps=1), or more steps."
    )
    assert AdamWOptions(warmup_steps=10).warmup_outlasts(10) is not None  # peaks only at the last step
    assert AdamWOptions(warmup_steps=9).warmup_outlasts(10) is None
    fast = parse_gpt(make_cfg("debug=fast"))
    assert fast.optim.options.warmup_outlasts(fast.trainer["max_steps"]) is None

    # the run says it before anything else is checked or made: here a model too large for this machine is
    # refused next, and the warning was already given, once
    with (
        caplog.at_level(logging.WARNING, logger="gptlab"),
        pytest.raises(ConfigError, match="Nothing fits on this device"),
    ):
        run(make_cfg("model=gpt3", "optim.warmup_steps=30", "trainer.max_steps=10"))
    assert [r.getMessage() for r in caplog.records].count(message) == 1
