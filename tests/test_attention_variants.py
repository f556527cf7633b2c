"""The attention variants (model/attention_variants.py), each by what it does: a window's reach, QK-norm's
statistics, the logit cap's bound, the output gate's and the value residual's arithmetic; that they hold under every positional scheme, over a KV cache, past the
training context and under muP; that each is one override, checked at config time, recorded with the model
and shown in its card. Qwen3's and Gemma 2's logits through ``model.init_from`` are in test_parity.py."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from conftest import CPU_AND_CUDA, TINY, assert_cached_decoding_is_the_whole_pass

import gptlab
from gptlab.errors import ConfigError
from gptlab.model import positional
from gptlab.model.attention import AttentionBias, causal_block_mask, dense_bias_attention
from gptlab.model.attention_variants import (
    AttentionGate,
    AttentionOptions,
    ValueResidual,
    softcapped_attention,
)
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

SCHEMES = positional.names()  # learned, sinusoidal, rope, xpos, alibi, relative, fire, nope
ALL_ON = {"qk_norm": "rmsnorm", "window": 4, "window_pattern": "LG", "logit_softcap": 5.0}
GATED_RESIDUAL = {"gate": "elementwise", "value_residual": "learnable"}


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **kw})


def model_of(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny(**kw)).eval()


@pytest.mark.parametrize("pos", SCHEMES)
@torch.no_grad()
def test_a_token_sees_exactly_its_window_under_every_scheme(pos):
    """Two local layers of window 4: the last token's output reaches back 2 * (4 - 1) = 6 tokens. Changing the
    token 7 back leaves it bit for bit; changing the token 6 back moves it."""
    # Weights large enough that a token two hops back moves the output well above rounding.
    model = model_of(pos=pos, init_std=0.3, attention={"window": 4})
    idx = torch.randint(0, 61, (1, 24))
    last = model(idx)[0][0, -1]

    def with_token(back: int) -> torch.Tensor:
        changed = idx.clone()
        changed[0, -1 - back] = (changed[0, -1 - back] + 1) % 61
        return model(changed)[0][0, -1]

    assert torch.equal(with_token(7), last)
    assert (with_token(6) - last).abs().max() > 1e-4
    # A global layer (pattern LG: the second layer) sees the whole past again.
    model = model_of(pos=pos, init_std=0.3, attention={"window": 4, "window_pattern": "LG"})
    last = model(idx)[0][0, -1]
    changed = idx.clone()
    changed[0, 0] = (changed[0, 0] + 1) % 61
    assert (model(changed)[0][0, -1] - last).abs().max() > 1e-4


def test_the_pattern_repeats_over_the_depth():
    options = AttentionOptions(window=16, window_pattern="LLG")
    assert [options.layer_window(i) for i in range(6)] == [16, 16, None, 16, 16, None]
    assert [AttentionOptions(window=8).layer_window(i) for i in range(3)] == [8, 8, 8]
    assert AttentionOptions().layer_window(0) is None


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@torch.no_grad()
def test_qk_norm_gives_each_heads_queries_and_keys_unit_rms_times_the_gain(kind, monkeypatch):
    """What reaches the rotation (RoPE acts after QK-norm) is, per head and position, the norm's output:
    (x - bias) / gain has RMS 1 (and, for LayerNorm, mean 0) over the head dimension."""
    model = model_of(pos="rope", n_kv_head=2, attention={"qk_norm": kind})
    for p in model.transformer.h[0].attn.q_norm.parameters():
        p.uniform_(0.5, 2.0)  # gains (and biases) away from their init, so that they show
    seen = []
    scheme = model.transformer.pos
    original = scheme.rotate
    monkeypatch.setattr(scheme, "rotate", lambda q, k, p: seen.append((q, k)) or original(q, k, p))
    model(torch.randint(0, 61, (2, 20)))
    q, k = seen[0]
    assert q.shape == (2, 4, 20, 8) and k.shape == (2, 2, 20, 8)
    attn = model.transformer.h[0].attn
    for x, norm in ((q, attn.q_norm.norm), (k, attn.k_norm.norm)):
        bias = getattr(norm, "bias", None)  # LayerNorm's; RMSNorm has none
        unit = x - bias if bias is not None else x
        unit = unit / norm.weight
        rms = unit.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)
        if kind == "layernorm":
            torch.testing.assert_close(unit.mean(-1), torch.zeros_like(rms), rtol=0, atol=1e-5)
    assert not torch.allclose(q.pow(2).mean(-1).sqrt(), torch.ones(()))  # the gain is really applied


def test_qk_norm_composes_with_mup_at_its_scale():
    """Under muP the scores are q.k * sqrt(base_head_dim) / head_dim: with QK-norm, the capped (explicit)
    route with a cap too high to bite equals SDPA's route, so both use muP's scale; and at the base width the
    muP model is the standard one."""
    torch.manual_seed(0)
    kw = dict(n_embd=64, n_head=4, param="mup", mup_base_width=32)
    plain = GPT(tiny(**kw, attention={"qk_norm": "rmsnorm"})).eval()
    capped = GPT(tiny(**kw, attention={"qk_norm": "rmsnorm", "logit_softcap": 1e6})).eval()
    capped.load_state_dict(plain.state_dict())
    assert plain.transformer.h[0].attn.scale == pytest.approx(math.sqrt(32 / 4) / 16)
    idx = torch.randint(0, 61, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(capped(idx)[0], plain(idx)[0], rtol=0, atol=1e-5)
    base = GPT(tiny(n_embd=32, param="mup", mup_base_width=32, attention={"qk_norm": "rmsnorm"}))
    standard = GPT(tiny(n_embd=32, attention={"qk_norm": "rmsnorm"}))
    standard.load_state_dict(base.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(base(idx)[0], standard(idx)[0], rtol=0, atol=1e-6)


@torch.no_grad()
def test_the_cap_bounds_every_score_and_equals_the_direct_formula():
    """With v the identity the output is the attention weights themselves: the log-weights of the keys a
    query sees are cap * tanh(q.k / sqrt(d) / cap) up to the row's constant, and so never spread by more than
    2 * cap, however large q.k is. Masked keys get exactly zero."""
    torch.manual_seed(0)
    T, d, cap = 12, 12, 2.0
    q, k = 30 * torch.randn(1, 2, T, d), 30 * torch.randn(1, 2, T, d)  # raw scores in the hundreds
    v = torch.eye(T).expand(1, 2, T, T)
    allowed = torch.ones(T, T).tril().bool()[None]
    weights = softcapped_attention(q, k, v, allowed, cap, 0.0, False, None)  # (1, 2, T, T)
    raw = q @ k.transpose(-2, -1) / math.sqrt(d)
    assert raw.abs().max() > 50 * cap
    direct = cap * torch.tanh(raw / cap)
    log_w = weights.clamp_min(1e-30).log()
    for i in range(T):
        seen = slice(0, i + 1)
        spread = log_w[..., i, seen].amax(-1) - log_w[..., i, seen].amin(-1)
        assert (spread <= 2 * cap + 1e-4).all()
        centred = log_w[..., i, seen] - log_w[..., i, seen].mean(-1, keepdim=True)
        expected = direct[..., i, seen] - direct[..., i, seen].mean(-1, keepdim=True)
        torch.testing.assert_close(centred, expected, rtol=0, atol=1e-4)
        assert (weights[..., i, i + 1 :] == 0).all()


@pytest.mark.parametrize("pos", ["nope", "alibi"])
@torch.no_grad()
def test_flex_attentions_window_and_cap_equal_the_dense_route(pos):
    """The CUDA route's block mask (causal and windowed) and score_mod (the cap, then the bias) give the dense
    route's output; FlexAttention's forward also runs, unfused, on a CPU. Also after cached keys."""
    from torch.nn.attention.flex_attention import flex_attention

    scheme = model_of(pos=pos, block_size=64).transformer.pos
    g = torch.Generator().manual_seed(0)
    for T, Tk in ((40, 40), (24, 56)):
        qp, kp = torch.arange(Tk - T, Tk), torch.arange(Tk)
        q = 4 * torch.randn(2, 4, T, 16, generator=g)
        k, v = (4 * torch.randn(2, 2, Tk, 16, generator=g) for _ in range(2))
        dense = AttentionBias.build(scheme, qp, kp, use_flex=False, window=8, softcap=3.0)
        expected = dense_bias_attention(q, k, v, dense.mask, 0.0, True, None, dense.softcap)
        flex = AttentionBias.build(scheme, qp, kp, use_flex=True, window=8, softcap=3.0)
        assert flex.block_mask is causal_block_mask(T, Tk, "cpu", 8)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            out = flex_attention(
                q, k, v, score_mod=flex.score_mod, block_mask=flex.block_mask, enable_gqa=True
            )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", SCHEMES)
@torch.no_grad()
def test_kv_cache_decoding_equals_the_whole_sequence_with_every_variant_on(pos):
    """Windowed (alternating with global) + QK-norm + capped + gated + value residual (gates and learned
    lambdas moved off their init): the logits of a prompt, a chunk and then one token at a time over the
    cache equal one pass over the whole sequence, well past the window (each layer caches its values mixed
    with the first layer's, so a step needs the first layer's values of its own tokens only); greedy
    generation with and without the cache gives the same tokens."""
    model = moved_from_init(model_of(pos=pos, n_kv_head=2, attention={**ALL_ON, **GATED_RESIDUAL}))
    assert_cached_decoding_is_the_whole_pass(model, new_tokens=8)


@pytest.mark.parametrize("pos", ["rope", "alibi", "relative", "fire"])
@torch.no_grad()
def test_a_local_layers_cache_holds_its_window_alone_and_decodes_as_the_whole_sequence(pos):
    """Window 4 on layers LLG, 30 tokens: a prompt longer than the window, a chunk of 5 and then one token at a
    time. Each local layer's cache ends holding the last 4 positions, the global layer all 30, and every
    step's logits equal one pass over the whole sequence (the kept keys keep their absolute positions for
    the rotation and for the biases); greedy generation with and without the cache gives the same tokens."""
    window, total = 4, 30
    model = model_of(pos=pos, n_layer=3, n_kv_head=2, attention={"window": window, "window_pattern": "LLG"})
    idx = torch.randint(0, 61, (2, total), generator=torch.Generator().manual_seed(1))
    whole = model(idx)[0]
    cache = gptlab.model.KVCache.empty(model.config.n_layer)
    steps = [model(idx[:, :7], cache=cache)[0], model(idx[:, 7:12], cache=cache)[0]]
    steps += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(12, total)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    held = [tuple(k.shape) + tuple(v.shape) for k, v in cache.layers]  # type: ignore[misc]
    assert held == [(2, 2, window, 8) * 2, (2, 2, window, 8) * 2, (2, 2, total, 8) * 2]
    prompt = idx[:, :3]
    with_cache = model.generate(prompt, total - 3, use_cache=True)
    assert torch.equal(with_cache, model.generate(prompt, total - 3, use_cache=False))


def test_a_sequence_through_flex_attention_is_padded_to_a_multiple_of_its_block():
    from gptlab.model.attention import flex_padded_length

    assert [flex_padded_length(n) for n in (1, 127, 128, 129, 1000)] == [128, 128, 128, 256, 1024]
    # Never past a position table (pos=learned): a table of 200 positions runs 129..200 at 200.
    assert [flex_padded_length(n, 200) for n in (5, 150, 200)] == [128, 200, 200]
    assert (
        model_of(pos="alibi").takes_flex_attention
        and model_of(pos="rope", attention=ALL_ON).takes_flex_attention
    )
    assert not model_of(pos="rope").takes_flex_attention  # every layer takes SDPA's fused causal kernel


@pytest.mark.slow  # one compilation of FlexAttention, 20-40 s on a CPU
@pytest.mark.parametrize("device", CPU_AND_CUDA)
@torch.no_grad()
def test_decoding_without_a_cache_through_flex_attention_compiles_once_not_per_token(device, monkeypatch):
    """Greedy decoding without a KV cache runs the whole sequence at each of its 21 lengths (3 to 23): through
    compiled FlexAttention (forced on a CPU, where it runs forward only) that is one compiled graph, not one
    per length (torch._dynamo's count), and the tokens and logits are the dense SDPA route's."""
    from torch._dynamo.utils import counters

    from gptlab.model import attention

    torch.manual_seed(0)
    model = GPT(tiny(pos="alibi", n_layer=1, n_head=4, n_embd=64, block_size=256)).to(device).eval()
    prompt = torch.randint(0, 61, (2, 3), device=device)
    monkeypatch.setattr(attention, "flex_attention_available", lambda device, head_dim=64: True)
    torch._dynamo.reset()
    counters.clear()
    flex_tokens = model.generate(prompt, 20, use_cache=False)
    flex_logits = model(flex_tokens)[0]
    assert counters["stats"]["unique_graphs"] == 1
    monkeypatch.setattr(attention, "flex_attention_available", lambda device, head_dim=64: False)
    assert torch.equal(flex_tokens, model.generate(prompt, 20, use_cache=False))
    torch.testing.assert_close(flex_logits, model(flex_tokens)[0], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_one_local_layer_at_8x_context_is_its_window_alone():
    """Length: a one-layer model with window 8 and a relative scheme, run at 8 times its training context
    (the length study's longest), gives each position the logits of the 8 tokens ending there alone."""
    model = model_of(pos="rope", n_layer=1, block_size=16, attention={"window": 8, "qk_norm": "rmsnorm"})
    idx = torch.randint(0, 61, (1, 128))
    long = model(idx)[0]
    for end in (8, 77, 128):
        alone = model(idx[:, end - 8 : end])[0][0, -1]
        torch.testing.assert_close(long[0, end - 1], alone, rtol=0, atol=1e-5)


def test_the_length_study_runs_a_windowed_model_at_8x():
    import numpy as np

    from gptlab.evaluation.length import evaluate_lengths
    from gptlab.evaluation.options import LengthEvalOptions

    model = model_of(pos="rope", block_size=16, attention={"window": 8, "window_pattern": "LG"})
    tokens = np.random.default_rng(0).integers(0, 61, 16 * 8 * 2 + 1)
    result = evaluate_lengths(model, tokens, 16, LengthEvalOptions(factors=[1, 8], rope_scalings=[]))
    losses = [entry["loss"] for entry in result["variants"]["rope"].values()]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


# ---- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["attention.qk_norm=l2"], "attention.qk_norm='l2' must be one of 'none', 'layernorm', 'rmsnorm'"),
        (["attention.window=0"], "attention.window=0 must be a positive number of positions"),
        (["attention.window_pattern=LGX"], "must be a string of L (local) and G (global) layers"),
        (["attention.window_pattern=LG"], "attention.window is null: set the local layers' window too"),
        (["attention.window=8", "attention.window_pattern=G"], "has no local layer"),
        (["attention.logit_softcap=-1"], "attention.logit_softcap=-1.0 must be positive"),
        (["+attention.windw=8"], "Did you mean attention.window?"),
        (
            ["attention.gate=scalar"],
            "attention.gate='scalar' must be one of 'none', 'elementwise', 'headwise'",
        ),
        (
            ["attention.value_residual=yes"],
            "attention.value_residual='yes' must be one of 'none', 'fixed', 'learnable'",
        ),
        (
            ["attention=value_residual", "model.n_layer=1"],
            "attention.value_residual=fixed mixes the first layer's values into the later layers', and "
            "model.n_layer=1 has no later layer: use model.n_layer=2 or more, or attention.value_residual=none",
        ),
    ],
)
def test_bad_values_are_refused_at_config_time_with_the_allowed_ones(make_cfg, overrides, message):
    with pytest.raises(ConfigError) as err:
        gptlab.build_model_config(make_cfg(*overrides))
    assert message in str(err.value)


def test_the_variants_are_recorded_with_the_model_and_old_configs_read_as_plain_attention():
    config = tiny(pos="alibi", attention=ALL_ON)
    saved = config.to_dict()
    assert saved["attention"] == {**AttentionOptions().node(), **ALL_ON}
    assert GPTConfig.from_dict(saved) == config
    saved.pop("attention")  # a checkpoint from before the node
    assert GPTConfig.from_dict(saved).attention == AttentionOptions()


def test_the_model_card_names_the_variants_and_stays_as_it_was_without_them():
    from gptlab.planning import model_card

    line = model_card(tiny(attention=ALL_ON), short=True).splitlines()[0]
    assert line.endswith("; attention: qk-norm rmsnorm, window 4 on layers LG, logit cap 5")
    assert "attention" not in model_card(tiny(), short=True).splitlines()[0]
    # QK-norm's gains are counted: the card's count is the built model's.
    from gptlab.model.counting import parameter_counts

    for kind in ("rmsnorm", "layernorm"):
        config = tiny(attention={"qk_norm": kind})
        assert parameter_counts(config)["total"] == GPT(config).parameter_counts()["total"]


def test_a_local_layer_counts_the_attention_flops_of_the_keys_it_reaches():
    """Training FLOPs per token: 12 h_total T per global layer, 12 h_total min(T, window) per local one."""
    from gptlab.model.counting import flops_per_token

    full = flops_per_token(tiny(n_layer=4), 64)
    local = flops_per_token(tiny(n_layer=4, attention={"window": 16, "window_pattern": "LLLG"}), 64)
    assert full["attention"] == 12 * 4 * 32 * 64
    assert local["attention"] == 12 * 32 * (16 + 16 + 16 + 64)
    assert local["dense"] == full["dense"]
    # A window longer than the context reaches every key: nothing changes.
    assert flops_per_token(tiny(n_layer=4, attention={"window": 128}), 64) == full


@pytest.mark.parametrize(
    "overrides,card",
    [
        (["attention=qk_norm"], "attention: qk-norm rmsnorm"),
        (["attention=sliding_window", "attention.window=8"], "attention: window 8 on layers L"),
        (["attention=gemma2", "attention.window=8", "attention.qk_norm=layernorm"], "window 8 on layers LG"),
    ],
)
def test_each_preset_trains_in_a_tiny_run_and_its_checkpoint_keeps_it(
    make_cfg, tmp_path, caplog, overrides, card
):
    from gptlab.runs.trained import load_run
    from gptlab.tasks.gpt import run

    run_dir = tmp_path / "run"
    args = [*TINY, "tokenizer=char", "pos=rope", "trainer.max_steps=4", "logger=csv", *overrides]
    with caplog.at_level(logging.INFO):
        run(make_cfg(*args, f"paths.output_dir={run_dir}"))
    assert card in caplog.text  # the model card at the start of the run
    trained = load_run(run_dir)
    expected = gptlab.build_model_config(make_cfg(*args)).attention
    assert trained.model.config.attention == expected and not expected.is_default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
@pytest.mark.parametrize("pos", ["rope", "alibi"])
def test_flex_attention_trains_windows_and_caps_as_the_dense_route_on_cuda(pos, monkeypatch):
    """On CUDA a windowed, capped model trains through compiled FlexAttention (the window a block mask, the
    cap in the score_mod): its loss and every gradient equal the dense SDPA route's."""
    from gptlab.model import attention

    torch.manual_seed(0)
    config = tiny(
        pos=pos, n_head=4, n_kv_head=2, n_embd=128, block_size=256, attention={**ALL_ON, "window": 48}
    )
    flex_model = GPT(config).cuda()
    dense_model = GPT(config).cuda()
    dense_model.load_state_dict(flex_model.state_dict())
    idx = torch.randint(0, 61, (2, 256), device="cuda")
    assert attention.flex_attention_available(idx.device, config.head_dim)
    _, flex_loss = flex_model(idx, idx)
    flex_loss.backward()
    monkeypatch.setattr(attention, "flex_attention_available", lambda device, head_dim=64: False)
    _, dense_loss = dense_model(idx, idx)
    dense_loss.backward()
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-5)
    dense_grads = dict(dense_model.named_parameters())
    for name, p in flex_model.named_parameters():
        torch.testing.assert_close(p.grad, dense_grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)


# ---- the output gate and the value residual ---------------------------------------------------------------


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def moved_from_init(model: GPT) -> GPT:
    """Gates and lambdas away from their init (zero, 0.5), so that a mistake in either shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("value_residual.lambdas"):
                p.uniform_(0.2, 1.5)
    return model


def attention_by_hand(attn, x: torch.Tensor, first_values: torch.Tensor | None = None) -> torch.Tensor:
    """Causal multi-head attention written out (no positional scheme), with the variants as the papers write
    them: V' = lambda1 V + lambda2 V_1, and Y' = Y * sigmoid(X W_theta) before the output projection."""
    B, T, C = x.shape
    H, Hkv, d = attn.n_head, attn.n_kv_head, attn.head_dim
    q, k, v = attn.c_attn(x).split([H * d, Hkv * d, Hkv * d], dim=-1)
    q = q.view(B, T, H, d).transpose(1, 2)
    k = k.view(B, T, Hkv, d).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = v.view(B, T, Hkv, d).transpose(1, 2)
    if first_values is not None:
        lambdas = attn.value_residual.lambdas
        l1, l2 = (0.5, 0.5) if lambdas is None else (float(lambdas[0]), float(lambdas[1]))
        v = l1 * v + l2 * first_values
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2)  # (B, T, H, d)
    if attn.gate is not None:
        y = y * torch.sigmoid(x @ attn.gate.weight.T).view(B, T, H, -1)
    return attn.c_proj(y.reshape(B, T, C))


def test_the_gate_is_sigmoid_of_the_layer_input_times_each_heads_output_by_hand():
    """Two heads of two dimensions, one token whose input is x = (1, -2). Elementwise: four gates, one per
    head dimension; headwise: one per head, shared by its dimensions."""
    x = torch.tensor([[[1.0, -2.0]]])  # (B, T, n_embd)
    y = torch.tensor([[[[2.0, 4.0], [6.0, 8.0]]]])  # (B, T, n_head, head_dim)
    elementwise = AttentionGate("elementwise", n_embd=2, n_head=2, head_dim=2)
    assert not elementwise.weight.any()  # zero-initialised: every gate sigmoid(0) = 0.5
    torch.testing.assert_close(elementwise(y, x), y / 2)
    with torch.no_grad():
        elementwise.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    # x W^T = (1, -2, -1, 0): one score per head dimension
    expected = [[2 * sigmoid(1), 4 * sigmoid(-2)], [6 * sigmoid(-1), 8 * sigmoid(0)]]
    torch.testing.assert_close(elementwise(y, x), torch.tensor([[expected]]))
    headwise = AttentionGate("headwise", n_embd=2, n_head=2, head_dim=2)
    assert headwise.weight.shape == (2, 2)
    with torch.no_grad():
        headwise.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    expected = [[2 * sigmoid(1), 4 * sigmoid(1)], [6 * sigmoid(-2), 8 * sigmoid(-2)]]
    torch.testing.assert_close(headwise(y, x), torch.tensor([[expected]]))


def test_the_value_residual_mixes_the_first_layers_values_by_hand():
    v, first = torch.tensor([2.0, 4.0]), torch.tensor([6.0, 0.0])
    torch.testing.assert_close(ValueResidual("fixed")(v, first), torch.tensor([4.0, 2.0]))  # 0.5 / 0.5
    learnable = ValueResidual("learnable")
    assert learnable.lambdas is not None and learnable.lambdas.tolist() == [0.5, 0.5]
    with torch.no_grad():
        learnable.lambdas.copy_(torch.tensor([0.25, 2.0]))
    torch.testing.assert_close(learnable(v, first), torch.tensor([0.25 * 2 + 2.0 * 6, 0.25 * 4 + 0.0]))
    assert not list(ValueResidual("fixed").parameters())


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
@pytest.mark.parametrize("value_residual", ["fixed", "learnable"])
@torch.no_grad()
def test_the_model_gates_after_sdpa_and_mixes_the_first_layers_values_as_the_papers_write(
    gate, value_residual
):
    """A 3-layer GQA model (no positional scheme) against attention written out: the first layer attends over
    its own values and hands them on, each later layer over lambda1 V_n + lambda2 V_1, and every layer's
    output is gated by its own input (the normed hidden state) before the output projection."""
    model = moved_from_init(
        model_of(
            pos="nope", n_layer=3, n_kv_head=2, attention={"gate": gate, "value_residual": value_residual}
        )
    )
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    x = model.transformer.wte(idx)
    first_values = None
    for i, block in enumerate(model.transformer.h):
        h = block.ln_1(x)
        if i == 0:
            kv = block.attn.n_kv_head * block.attn.head_dim
            first_values = block.attn.c_attn(h)[..., -kv:].view(2, 12, 2, -1).transpose(1, 2)
        x = x + attention_by_hand(block.attn, h, first_values if i > 0 else None)
        x = x + block.mlp(block.ln_2(x))
    expected = model.lm_head(model.transformer.ln_f(x))[..., : model.config.vocab_size]  # the padding cut
    torch.testing.assert_close(model(idx)[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
@torch.no_grad()
def test_at_its_zero_init_the_gate_is_todays_model_with_each_attention_output_halved(gate):
    """The zero gate draws nothing from the generator: at one seed every other weight is the ungated model's,
    and the gated model's logits are the ungated model's with each attention output projection halved."""
    plain, gated = model_of(n_kv_head=2), model_of(n_kv_head=2, attention={"gate": gate})
    plain_state, gated_state = plain.state_dict(), gated.state_dict()
    gates = {f"transformer.h.{i}.attn.gate.weight" for i in range(2)}
    assert set(gated_state) - set(plain_state) == gates
    assert all(torch.equal(gated_state[name], value) for name, value in plain_state.items())
    assert not any(gated_state[name].any() for name in gates)
    idx = torch.randint(0, 61, (2, 16))
    for block in plain.transformer.h:
        block.attn.c_proj.weight.mul_(0.5)
    torch.testing.assert_close(gated(idx)[0], plain(idx)[0], rtol=0, atol=1e-6)


def test_the_gate_and_the_lambdas_are_counted_and_grouped_as_the_optimizers_and_mup_need():
    """The card's count is the built model's; the gate's projection is in the FLOPs per token as a matrix of
    the layer; under muP it is a hidden matrix (Adam's rate lr / m, zero-initialised at every width) and the
    lambdas are gains (no weight decay, the plain rate); under optim=muon the gate is Muon's."""
    from gptlab.model.config import hidden_lr_scale
    from gptlab.model.counting import flops_per_token, parameter_counts
    from gptlab.training.optimizers import build_optimizer, param_groups, parse_optim

    for attention in (
        {"gate": "elementwise"},
        {"gate": "headwise", "value_residual": "learnable"},
        {"value_residual": "fixed"},
    ):
        for n_kv_head in (None, 1):
            config = tiny(n_layer=3, n_kv_head=n_kv_head, attention=attention)
            assert parameter_counts(config)["total"] == GPT(config).parameter_counts()["total"], attention
    plain, gated = (
        flops_per_token(tiny(n_layer=3), 64),
        flops_per_token(tiny(n_layer=3, attention={"gate": "elementwise"}), 64),
    )
    assert gated["dense"] - plain["dense"] == 6 * 3 * 32 * 32  # 6 x layers x n_embd x (n_head x head_dim)
    headwise = flops_per_token(tiny(n_layer=3, attention={"gate": "headwise"}), 64)
    assert headwise["dense"] - plain["dense"] == 6 * 3 * 32 * 4
    assert parameter_counts(tiny(n_layer=3, attention={"value_residual": "learnable"}))["total"] == (
        parameter_counts(tiny(n_layer=3))["total"] + 2 * 2
    )

    torch.manual_seed(0)
    wide = GPT(tiny(n_layer=3, n_embd=128, param="mup", mup_base_width=32, attention=GATED_RESIDUAL))
    assert not wide.transformer.h[0].attn.gate.weight.any()
    optimizer = build_optimizer(wide, parse_optim({"lr": 1e-2}), hidden_lr_scale(wide.config))
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    gate_group = group_of[id(wide.transformer.h[1].attn.gate.weight)]
    assert gate_group["group"] == "hidden" and gate_group["lr"] == pytest.approx(1e-2 / 4)
    lambdas_group = group_of[id(wide.transformer.h[1].attn.value_residual.lambdas)]
    assert lambdas_group["group"] == "gains_biases" and lambdas_group["weight_decay"] == 0.0
    assert lambdas_group["lr"] == 1e-2
    assert wide.transformer.h[0].attn.value_residual is None  # the first layer has nothing to mix
    _, muon_groups = param_groups(wide, parse_optim({"name": "muon"}))
    muon_ids = {id(p) for g in muon_groups for p in g["params"]}
    assert id(wide.transformer.h[2].attn.gate.weight) in muon_ids


def test_the_model_card_names_the_gate_and_the_value_residual():
    from gptlab.planning import model_card

    line = model_card(tiny(attention=GATED_RESIDUAL), short=True).splitlines()[0]
    assert line.endswith("; attention: elementwise output gate, value residual learnable")


@pytest.mark.parametrize(
    "overrides,card",
    [
        (["attention=gated"], "attention: elementwise output gate"),
        (
            ["attention=value_residual", "attention.value_residual=learnable", "attention.gate=headwise"],
            "attention: headwise output gate, value residual learnable",
        ),
    ],
)
def test_the_gated_and_value_residual_presets_train_to_a_lower_loss_and_their_checkpoint_keeps_them(
    make_cfg, tmp_path, caplog, overrides, card
):
    """Through the run path of `python train.py`: 10 steps of a 2-layer model log a finite training loss at
    every step, the last steps' lower than the first's, and the run loads back with the variant on."""
    import csv

    from gptlab.runs.trained import load_run
    from gptlab.tasks.gpt import run

    run_dir = tmp_path / "run"
    args = [*TINY, "model.n_layer=2", "tokenizer=char", "pos=rope", "trainer.max_steps=10"]
    args += ["optim.warmup_steps=2", "trainer.val_check_interval=10", "trainer.log_every_n_steps=1"]
    args += ["logger=csv", "callbacks.sample_generation=null", *overrides]
    with caplog.at_level(logging.INFO):
        run(make_cfg(*args, f"paths.output_dir={run_dir}"))
    assert card in caplog.text  # the model card at the start of the run
    metrics = next(run_dir.glob("csv/**/metrics.csv"))
    losses = [float(r["train/loss"]) for r in csv.DictReader(open(metrics)) if r.get("train/loss")]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    trained = load_run(run_dir)
    expected = gptlab.build_model_config(make_cfg(*args)).attention
    assert trained.model.config.attention == expected and not expected.is_default
