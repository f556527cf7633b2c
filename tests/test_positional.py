"""Positional schemes: each matches its paper's definition, runs past the training context where it can, and
every YAML under conf/pos/ trains through the CLI."""

import math

import pytest
import torch
from conftest import CONF, run_train

from gptlab.errors import ConfigError
from gptlab.model import positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT, KVCache
from gptlab.runs.layout import last_checkpoint

POS_YAMLS = sorted(p.stem for p in (CONF / "pos").glob("*.yaml"))
UNBOUNDED = [name for name in positional.names() if positional.get(name).extrapolates]


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **kw})


def test_every_registered_scheme_has_a_yaml_and_cites_a_paper():
    assert set(POS_YAMLS) == set(positional.names())
    assert {"learned", "sinusoidal", "rope", "alibi", "relative", "nope", "fire", "xpos"} <= set(POS_YAMLS)
    for name in positional.names():
        doc = positional.get(name).__doc__
        assert doc and any(str(year) in doc for year in range(2017, 2025)), name


def test_sinusoidal_table_equals_the_formula_also_past_block_size():
    d, base = 12, 500.0
    model = GPT(tiny(pos={"name": "sinusoidal", "base": base, "scale": 1.0}, n_embd=d, n_head=2))
    x = torch.zeros(1, 40, d)
    pe = model.transformer.pos.embed(x, torch.arange(40))[0]  # 40 > block_size: computed, not looked up
    default = GPT(tiny(pos={"name": "sinusoidal", "base": base}, n_embd=d, n_head=2)).transformer.pos
    torch.testing.assert_close(default.embed(x, torch.arange(40))[0], pe / math.sqrt(d))  # the paper's ratio
    for p in (0, 1, 7, 15, 16, 39):
        for i in range(d // 2):
            angle = p / base ** (2 * i / d)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def rope_score(pos_module, q: torch.Tensor, k: torch.Tensor, i: int, j: int) -> float:
    """q . k after rotating q to position i and k to position j; q, k: (head_dim,)."""
    qi, _ = pos_module.rotate(q.view(1, 1, 1, -1), q.view(1, 1, 1, -1), torch.tensor([i]))
    _, kj = pos_module.rotate(k.view(1, 1, 1, -1), k.view(1, 1, 1, -1), torch.tensor([j]))
    return float((qi * kj).sum())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"rotary_fraction": 0.5},
        {"scaling": "yarn", "scale_factor": 4.0},
        {"scaling": "ntk", "scale_factor": 2.0},
    ],
)
def test_rope_score_depends_only_on_the_distance(options):
    torch.manual_seed(0)
    pos = GPT(tiny(pos={"name": "rope", **options})).transformer.pos
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    for i, j in [(5, 2), (9, 9), (30, 1)]:
        reference = rope_score(pos, q, k, i, j)
        for shift in (1, 17, 1000):
            assert rope_score(pos, q, k, i + shift, j + shift) == pytest.approx(reference, rel=1e-9, abs=1e-9)
    # ...and it does depend on the distance
    assert rope_score(pos, q, k, 5, 2) != pytest.approx(rope_score(pos, q, k, 5, 3), abs=1e-6)


def test_xpos_score_depends_only_on_the_distance_and_decays_with_it():
    torch.manual_seed(0)
    config = tiny(pos={"name": "xpos", "scale_base": 8.0})
    xpos = GPT(config).transformer.pos
    rope = GPT(tiny(pos="rope")).transformer.pos
    q = torch.randn(8, dtype=torch.float64)
    for i, j in [(5, 2), (30, 1)]:
        reference = rope_score(xpos, q, q, i, j)
        assert rope_score(xpos, q, q, i + 40, j + 40) == pytest.approx(reference, rel=1e-9)
    # each pair's contribution is RoPE's times zeta_i^(distance / scale_base) < 1
    qi, _ = xpos.rotate(q.view(1, 1, 1, -1), q.view(1, 1, 1, -1), torch.tensor([12]))
    ri, _ = rope.rotate(q.view(1, 1, 1, -1), q.view(1, 1, 1, -1), torch.tensor([12]))
    zeta = (torch.arange(0, 8, 2, dtype=torch.float64) / 8 + 0.4) / 1.4
    torch.testing.assert_close(qi.flatten(), ri.flatten() * torch.cat([zeta, zeta]) ** (12 / 8.0))


def test_rope_rotates_only_its_fraction_and_keeps_norms():
    pos = GPT(tiny(pos={"name": "rope", "rotary_fraction": 0.25})).transformer.pos  # head_dim 8 -> 2
    assert pos.rotary_dim == 2
    q = torch.randn(1, 4, 6, 8)
    rq, _ = pos.rotate(q, q, torch.arange(6))
    torch.testing.assert_close(rq[..., 2:], q[..., 2:])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))


def test_rope_context_scalings_follow_their_definitions():
    d, base, s, L = 8, 10000.0, 4.0, 1024
    plain, _ = positional.rope_inverse_frequencies(d, base)
    torch.testing.assert_close(
        plain, torch.tensor([base ** (-i / d) for i in range(0, d, 2)], dtype=torch.float64)
    )
    linear, _ = positional.rope_inverse_frequencies(d, base, "linear", s, L)
    torch.testing.assert_close(linear, plain / s)
    ntk, _ = positional.rope_inverse_frequencies(d, base, "ntk", s, L)
    assert ntk[0] == plain[0] and ntk[-1] == pytest.approx(float(plain[-1]) / s)  # NTK: lowest freq / s
    yarn, temperature = positional.rope_inverse_frequencies(d, base, "yarn", s, L)
    assert temperature == pytest.approx(0.1 * math.log(s) + 1)
    turns = L * plain / (2 * math.pi)  # rotations of each pair over the training context
    assert turns.max() > 32 and turns.min() < 1  # the three regimes all occur
    for f, y, r in zip(plain, yarn, turns):
        if r > 32:  # fast dimensions are kept
            assert y == f
        elif r < 1:  # slow ones are interpolated
            assert y == pytest.approx(float(f) / s)
        else:
            assert float(f) / s <= y <= f
    assert positional.rope_inverse_frequencies(d, base, "yarn", 1.0, L)[1] == 1.0  # factor 1: as trained


def test_alibi_slopes_follow_the_paper():
    assert positional.alibi_slopes(8).tolist() == pytest.approx([2.0**-k for k in range(1, 9)])
    # Not a power of two: the 8-head slopes, then every other slope of the 16-head sequence 2^(-k/2).
    assert positional.alibi_slopes(12).tolist() == pytest.approx(
        [2.0**-k for k in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    )
    assert positional.alibi_slopes(6).tolist() == pytest.approx(
        [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    )


def test_alibi_bias_is_minus_slope_times_distance():
    pos = GPT(tiny(pos="alibi", n_head=8, n_embd=32)).transformer.pos
    bias = pos.bias(torch.arange(10, 14), torch.arange(0, 14))  # (8, 4, 14)
    assert bias.shape == (8, 4, 14)
    assert bias[0, 3, 13].item() == 0.0
    assert bias[2, 1, 4].item() == pytest.approx(-(2.0**-3) * (11 - 4))


def test_t5_buckets_are_monotone_causal_and_saturate_at_max_distance():
    buckets, max_distance = 32, 128
    distance = torch.arange(0, 600)
    b = positional.t5_relative_buckets(-distance, buckets, max_distance)  # key j = i - distance
    assert torch.equal(b[:16], torch.arange(16))  # exact buckets below num_buckets / 2
    assert bool((b[1:] >= b[:-1]).all())
    assert bool((b[max_distance:] == buckets - 1).all()) and b[max_distance - 1] <= buckets - 1
    assert set(b.tolist()) == set(range(buckets))  # every bucket is used
    future = positional.t5_relative_buckets(torch.arange(1, 50), buckets, max_distance)
    assert bool((future == 0).all())  # causal: keys after the query share bucket 0 (masked anyway)


def test_relative_bias_is_learned_per_head_and_shared_by_layers():
    torch.manual_seed(0)
    model = GPT(tiny(pos={"name": "relative", "num_buckets": 8, "max_distance": 32}))
    table = model.transformer.pos.relative_attention_bias.weight
    assert table.shape == (8, 4)
    q, k = torch.arange(20, 60), torch.arange(60)  # queries after cached keys, past max_distance
    buckets = positional.t5_relative_buckets(k[None, :] - q[:, None], 8, 32)  # (40, 60)
    torch.testing.assert_close(model.transformer.pos.bias(q, k), table[buckets].permute(2, 0, 1))
    _, loss = model(torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16)))
    loss.backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


@torch.no_grad()
def test_fire_inputs_are_normalised_to_the_unit_interval_at_any_length():
    pos = GPT(tiny(pos="fire")).transformer.pos
    q = torch.arange(0, 200)
    c = pos.log_c.exp()
    distance = (q[:, None] - q[None, :]).clamp_min(0).float()
    normalised = (
        torch.log1p(c * distance)
        / torch.log1p(c * torch.maximum(q.float(), pos.log_threshold.exp()))[:, None]
    )
    assert float(normalised.min()) >= 0 and float(normalised.max()) <= 1
    bias = pos.bias(q, q)
    assert bias.shape == (4, 200, 200) and torch.isfinite(bias).all()
    # the bias is the MLP of the normalised distance, also where every query is within the threshold L
    # (there the scheme runs the MLP once per distance)
    torch.testing.assert_close(bias, pos.mlp(normalised[..., None]).permute(2, 0, 1))
    within = q[:16]  # threshold L = block_size = 16
    torch.testing.assert_close(
        pos.bias(within, within),
        pos.mlp(
            (torch.log1p(c * distance[:16, :16]) / torch.log1p(c * pos.log_threshold.exp()))[..., None]
        ).permute(2, 0, 1),
    )


@pytest.mark.parametrize("pos", UNBOUNDED)
def test_every_unbounded_scheme_runs_at_twice_the_training_context_with_cache_parity(pos):
    torch.manual_seed(0)
    model = GPT(tiny(pos=pos)).eval()
    idx = torch.randint(0, 61, (2, 32))  # 2 x block_size
    full, _ = model(idx)
    assert torch.isfinite(full).all()
    cache = KVCache.empty(model.config.n_layer)
    pieces = [model(idx[:, :10], cache=cache)[0], model(idx[:, 10:20], cache=cache)[0]]
    pieces += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(20, 32)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)


ROTARY = [name for name in positional.names() if positional.get(name).is_rotary]


@pytest.mark.parametrize("pos", ROTARY)
@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn"])
def test_scaled_rotary_keeps_cache_parity_changes_the_output_and_restores_it(pos, scaling):
    torch.manual_seed(0)
    model = GPT(tiny(pos=pos)).eval()
    scheme = model.transformer.pos
    assert scaling in scheme.context_scalings
    idx = torch.randint(0, 61, (1, 40))
    plain, _ = model(idx)
    with scheme.scaled(2.5, scaling):
        scaled, _ = model(idx)
        cache = KVCache.empty(model.config.n_layer)
        pieces = [model(idx[:, :30], cache=cache)[0]] + [
            model(idx[:, t : t + 1], cache=cache)[0] for t in range(30, 40)
        ]
    assert not torch.allclose(plain, scaled)
    torch.testing.assert_close(torch.cat(pieces, dim=1), scaled, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model(idx)[0], plain)  # as trained again after the block


def test_schemes_without_context_scaling_refuse_it_by_name():
    scheme = GPT(tiny(pos="alibi")).transformer.pos
    assert scheme.context_scalings == ()
    with pytest.raises(ConfigError, match=r"pos=alibi has no context scaling 'yarn' \(it has: none\)"):
        with scheme.scaled(2.0, "yarn"):
            pass


def test_learned_table_says_it_cannot_run_past_its_table():
    model = GPT(tiny(pos="learned"))
    with pytest.raises(ValueError, match="table of 16 positions"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(n_embd=66, n_head=2), r"pos=rope needs an even head dimension .* = 33"),
        (
            dict(pos={"name": "rope", "scaling": "dynamic"}),
            r"pos.scaling='dynamic' must be one of 'none', 'linear', 'ntk', 'yarn'",
        ),
        (
            dict(pos={"name": "rope", "rotary_fraction": 0}),
            r"pos.rotary_fraction=0(\.0)? must be in \(0, 1\]",
        ),
        (dict(pos={"name": "rope", "rotary_fraction": 0.1}), r"leaves no pair to rotate"),
        (dict(pos={"name": "rope", "scale_factor": 0.5}), r"pos.scale_factor=0.5 must be a number >= 1"),
        (
            dict(pos={"name": "rope", "theta": 5}),
            r"pos=rope does not take option\(s\) pos.theta. Its options: pos.base",
        ),
    ],
)
def test_bad_rope_options_are_refused_with_the_fix(kw, message):
    with pytest.raises(ConfigError, match=message):
        GPT(tiny(**{"pos": "rope", **kw}))


def test_bad_bias_scheme_options_are_refused():
    with pytest.raises(
        ConfigError, match=r"pos.max_distance=8 must be an integer larger than pos.num_buckets/2 = 16"
    ):
        GPT(tiny(pos={"name": "relative", "max_distance": 8}))
    with pytest.raises(ConfigError, match=r"pos=alibi does not take option\(s\) pos.base. Its options: none"):
        GPT(tiny(pos={"name": "alibi", "base": 10}))
    with pytest.raises(ConfigError, match=r"pos.hidden=0 must be a positive integer"):
        GPT(tiny(pos={"name": "fire", "hidden": 0}))


@pytest.mark.parametrize(
    "pos,options,message",
    [
        ("rope", {"base": "big"}, r"pos.base='big' must be a number \(got str\)"),
        ("rope", {"base": True}, r"pos.base=True must be a number \(got bool\)"),
        (
            "rope",
            {"scaling": "dynamic"},
            r"pos.scaling='dynamic' must be one of 'none', 'linear', 'ntk', 'yarn'",
        ),
        ("relative", {"num_buckets": 32.5}, r"pos.num_buckets=32.5 must be an integer \(got float\)"),
        ("fire", {"init_threshold": "x"}, r"pos.init_threshold='x' must be a number or null"),
        ("rope", {"bas": 500.0}, r"pos=rope does not take option\(s\) pos.bas\..*Did you mean pos.base\?"),
    ],
)
def test_every_option_is_type_checked_from_its_dataclass(pos, options, message):
    """Types come from each scheme's Options dataclass: the message names the key, the type and the value."""
    with pytest.raises(ConfigError, match=message):
        tiny(pos={"name": pos, **options})  # the config is checked whole when it is made


def test_options_are_typed_dataclasses_with_the_yamls_defaults():
    """Each scheme's YAML spells out the defaults of its Options dataclass (a key in one and not the other
    would be a silent difference between `python train.py` and `GPT(GPTConfig(...))`)."""
    import dataclasses

    from omegaconf import OmegaConf

    for name in positional.names():
        node = OmegaConf.to_container(OmegaConf.load(CONF / "pos" / f"{name}.yaml"))
        node.pop("name")
        options = positional.REGISTRY.build_options(name, node)
        assert dataclasses.is_dataclass(options), name
        assert options == positional.get(name).Options(), name
    rope = positional.REGISTRY.build_options("rope", {"base": 500})  # an int where a float is wanted
    assert rope.base == 500.0 and isinstance(rope.base, float)


def test_every_pos_yaml_trains_through_the_cli(tmp_path):
    """One multirun over every YAML in conf/pos/: each job trains a few steps and saves a checkpoint."""
    proc = run_train(
        [
            "-m",
            f"pos={','.join(POS_YAMLS)}",
            "tokenizer=char",
            "logger=csv",
            "model.n_layer=1",
            "model.n_head=2",
            "model.n_embd=16",
            "model.block_size=16",
            "data.batch_size=4",
            "trainer.max_steps=3",
            "trainer.val_check_interval=3",
            "trainer.limit_val_batches=1",
            "callbacks.sample_generation.max_new_tokens=2",
            f"paths.root_dir={tmp_path}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},  # tiny models: one thread is faster, and far faster on a busy machine
    )
    jobs = sorted((tmp_path / "sweep").glob("[0-9]*"), key=lambda p: int(p.name))
    assert len(jobs) == len(POS_YAMLS), proc.stdout[-2000:]
    for job, name in zip(jobs, POS_YAMLS):
        ckpt = torch.load(last_checkpoint(job), map_location="cpu", weights_only=False)
        assert ckpt["hyper_parameters"]["model"]["pos"]["name"] == name
        assert ckpt["global_step"] == 3
        rows = (job / "csv" / "metrics.csv").read_text().splitlines()
        header = rows[0].split(",")
        losses = [r.split(",")[header.index("val/loss")] for r in rows[1:]]
        assert any(v and math.isfinite(float(v)) for v in losses)
