"""The architecture space: every activation and norm is what its paper says, grouped-query attention,
bias, dropout and initialisation behave, every combination the tests sample is causal, and every choice
trains through the CLI."""

import csv
import math
import re

import pytest
import torch
from conftest import CONF, TINY, run_train

from gptlab.errors import ConfigError
from gptlab.model import activations, norms, positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT, MLP, Block, KVCache, mlp_hidden_width

ACTIVATION_YAMLS = sorted(p.stem for p in (CONF / "activation").glob("*.yaml"))
NORM_YAMLS = sorted(p.stem for p in (CONF / "norm").glob("*.yaml"))

# The formulas as the papers write them, independent of the classes under test.
PHI = lambda x: 0.5 * (1 + torch.erf(x / math.sqrt(2)))  # noqa: E731  the standard normal CDF
SIGMA = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
FORMULAS = {
    "relu": lambda x: torch.where(x > 0, x, 0.0),
    "gelu": lambda x: x * PHI(x),
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    "sigmoid": SIGMA,
    "silu": lambda x: x * SIGMA(x),
    "relu2": lambda x: torch.where(x > 0, x, 0.0) ** 2,
}
GATED = {  # f(gate) * value, gate the first half
    "swiglu": lambda g, v: g * SIGMA(g) * v,
    "geglu": lambda g, v: g * PHI(g) * v,
    "reglu": lambda g, v: torch.where(g > 0, g, 0.0) * v,
}


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32), **kw})


def test_every_registered_choice_has_a_yaml_and_cites_its_paper():
    assert activations.names() == ACTIVATION_YAMLS
    assert norms.names() == NORM_YAMLS
    assert {"relu", "gelu", "gelu_tanh", "sigmoid", "silu", "relu2", "swiglu", "geglu", "reglu"} <= set(
        ACTIVATION_YAMLS
    )
    assert {"layernorm", "rmsnorm"} <= set(NORM_YAMLS)
    for registry in (activations, norms):
        for name in registry.names():
            doc = registry.get(name).__doc__ or ""
            assert re.search(r"(19|20)\d\d", doc), f"{name}: the docstring cites no paper"


@pytest.mark.parametrize("name", ACTIVATION_YAMLS)
def test_each_activation_computes_its_papers_formula(name):
    x = torch.randn(3, 5, 64, dtype=torch.float64) * 3
    act = activations.get(name)()
    if name in FORMULAS:
        torch.testing.assert_close(act(x), FORMULAS[name](x))
    elif name in GATED:
        assert activations.is_gated(name)
        gate, value = x.chunk(2, dim=-1)
        torch.testing.assert_close(act(x), GATED[name](gate, value))
    else:
        pytest.fail(f"activation {name} has no reference formula in this test")


def test_gated_mlps_keep_the_4x_mlps_parameters_and_mlp_ratio_overrides():
    for n_embd in (768, 4096):
        plain = MLP(tiny(n_embd=n_embd, n_head=8, activation="gelu"))
        gated = MLP(tiny(n_embd=n_embd, n_head=8, activation="swiglu"))
        # Shazeer 2020: hidden 2/3 * 4 * d, here rounded up to a multiple of 64.
        assert gated.c_proj.in_features == 64 * math.ceil(8 * n_embd / 3 / 64)
        assert gated.c_fc.out_features == 2 * gated.c_proj.in_features
        n_plain = sum(p.numel() for p in plain.parameters())
        n_gated = sum(p.numel() for p in gated.parameters())
        assert abs(n_gated / n_plain - 1) < 0.01
    assert mlp_hidden_width(tiny(activation="swiglu", mlp_ratio=2.5)) == 80
    assert mlp_hidden_width(tiny(activation="relu", mlp_ratio=2)) == 64


def test_rmsnorm_is_zhang_and_sennrichs_and_layernorm_bias_is_optional():
    x = torch.randn(2, 7, 32) * 5 + 3
    rms = norms.build(tiny(norm="rmsnorm").norm, 32)
    with torch.no_grad():
        rms.weight.copy_(torch.linspace(0.5, 2, 32))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * rms.weight
    torch.testing.assert_close(rms(x), expected)
    assert [n for n, _ in rms.named_parameters()] == ["weight"]

    def norm_of(**kw):
        return norms.build(tiny(**kw).norm, 32)

    assert norm_of().bias is not None  # follows model.bias=true
    assert norm_of(bias=False).bias is None
    assert norm_of(bias=False, norm={"name": "layernorm", "bias": True}).bias is not None
    assert norm_of(norm={"name": "layernorm", "bias": False}).bias is None
    with pytest.raises(ConfigError, match=r"norm=rmsnorm does not take option\(s\) norm.bias"):
        GPT(tiny(norm={"name": "rmsnorm", "bias": True}))


@pytest.mark.parametrize("norm", NORM_YAMLS)
def test_post_norm_normalises_after_the_residual_add(norm):
    torch.manual_seed(0)
    block = Block(tiny(norm=norm, norm_placement="post"), layer=0)
    x, positions = torch.randn(2, 8, 32) * 4 + 1, torch.arange(8)
    pos = positional.get("nope")(n_head=4, head_dim=8, block_size=16)
    # The original transformer (Vaswani et al. 2017): LayerNorm(x + Sublayer(x)), twice.
    h = block.ln_1(x + block.attn(x, pos, positions, None)[0])
    y, _ = block(x, pos, positions)
    torch.testing.assert_close(y, block.ln_2(h + block.mlp(h)))
    scale = y.pow(2).mean(-1) if norm == "rmsnorm" else y.var(-1, unbiased=False)
    torch.testing.assert_close(scale, torch.ones(2, 8), rtol=0, atol=1e-3)


@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_grouped_query_attention_equals_multi_head_with_shared_keys_and_values(n_kv_head):
    """GQA (Ainslie et al. 2023) / MQA (Shazeer 2019): an MHA model whose K/V heads are copies within each
    group of query heads computes the same function."""
    torch.manual_seed(0)
    gqa = GPT(tiny(n_kv_head=n_kv_head)).eval()
    mha = GPT(tiny()).eval()
    state = gqa.state_dict()
    group, hd = 4 // n_kv_head, 8
    for i in range(2):
        for kind in ("weight", "bias"):
            key = f"transformer.h.{i}.attn.c_attn.{kind}"
            q, k, v = state[key].split([32, n_kv_head * hd, n_kv_head * hd])
            k = k.unflatten(0, (n_kv_head, hd)).repeat_interleave(group, 0).flatten(0, 1)
            v = v.unflatten(0, (n_kv_head, hd)).repeat_interleave(group, 0).flatten(0, 1)
            state[key] = torch.cat([q, k, v])
    mha.load_state_dict(state)
    idx = torch.randint(0, 97, (2, 20))
    full = gqa(idx)[0]
    torch.testing.assert_close(full, mha(idx)[0], rtol=1e-5, atol=1e-5)
    # fewer parameters, and the KV cache (which stores n_kv_head heads) gives the same logits
    assert gqa.parameter_counts()["total"] < mha.parameter_counts()["total"]
    cache = KVCache.empty(2)
    steps = [gqa(idx[:, :12], cache=cache)[0]] + [
        gqa(idx[:, t : t + 1], cache=cache)[0] for t in range(12, 20)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.layers[0][0].shape[1] == n_kv_head


def test_bias_off_dropout_and_gpt2_scaled_init():
    no_bias = GPT(tiny(bias=False))
    assert not [n for n, _ in no_bias.named_parameters() if n.endswith("bias")]

    torch.manual_seed(0)
    model = GPT(tiny(dropout=0.5))
    idx = torch.randint(0, 97, (2, 16))
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])  # dropout draws a new mask each call
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])

    big = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=8, n_head=4, n_embd=256))
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in big.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in big.transformer.h])
    # GPT-2 (Radford et al. 2019): residual projections start at 0.02 / sqrt(2 * n_layer).
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    assert fc.std().item() == pytest.approx(0.02, rel=0.02)


def sampled_combinations():
    """Every activation once, each with a different norm, placement, key/value heads, positional scheme and
    attention variants."""
    pos_names = positional.names()
    for i, act in enumerate(ACTIVATION_YAMLS):
        yield dict(
            activation=act,
            norm=NORM_YAMLS[i % len(NORM_YAMLS)],
            norm_placement=("pre", "post", "sandwich")[(i // 2) % 3],
            attention=(
                {},
                {"qk_norm": "rmsnorm"},
                {"window": 4, "window_pattern": "LG", "logit_softcap": 5.0},
            )[(i // 3) % 3],
            n_kv_head=(None, 2, 1)[i % 3],
            bias=i % 4 != 3,
            tie_weights=i % 5 != 4,
            pos=pos_names[i % len(pos_names)],
        )


@pytest.mark.parametrize("combo", list(sampled_combinations()), ids=lambda c: c["activation"])
def test_sampled_combinations_are_causal(combo):
    torch.manual_seed(0)
    model = GPT(tiny(**combo)).eval()
    idx = torch.randint(0, 97, (2, 24))
    logits, _ = model(idx)
    for t in (0, 11, 22):
        changed = idx.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + torch.randint(0, 96, changed[:, t + 1 :].shape)) % 97
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(logits2[:, t + 1 :], logits[:, t + 1 :])


def test_every_activation_trains_through_the_cli_in_one_sweep(tmp_path):
    """`python train.py -m activation=<every choice> norm=rmsnorm`: one job per activation, each logs a finite
    training loss; the pre-norm LayerNorm default trains in the other CLI tests."""
    sweep = tmp_path / "sweep"
    args = ["-m", f"activation={','.join(ACTIVATION_YAMLS)}", "norm=rmsnorm", *TINY]
    args += ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    args += ["trainer.log_every_n_steps=1", "logger=csv", "callbacks.sample_generation=null"]
    args += ["callbacks.model_checkpoint=null", f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={sweep}"]
    proc = run_train(args, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert out.count("Training FLOPs per token") == len(ACTIVATION_YAMLS)  # the card, once per job
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == len(ACTIVATION_YAMLS)
    seen = set()
    for job in jobs:
        resolved = (job / "config_resolved.yaml").read_text()
        seen.add(re.search(r"activation:\n  name: (\S+)", resolved).group(1))
        rows = list(csv.DictReader(open(next(job.glob("csv/**/metrics.csv"), job / "csv" / "metrics.csv"))))
        losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        assert losses and all(math.isfinite(v) for v in losses), job
    assert seen == set(ACTIVATION_YAMLS)


def test_bad_architecture_values_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"n_head=4 is not divisible by model.n_kv_head=3.*multi-query"):
        tiny(n_kv_head=3)
    with pytest.raises(ConfigError, match=r"Unknown norm 'rms'.*rmsnorm"):
        GPT(tiny(norm="rms"))
    with pytest.raises(ConfigError, match=r"Did you mean activation=swiglu"):
        GPT(tiny(activation="swiglue"))
