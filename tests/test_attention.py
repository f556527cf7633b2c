"""Attention with a positional bias (ALiBi, T5 relative, FIRE): what the bias's blocks share is prepared once
per forward pass for every layer; FlexAttention's score_mods equal the dense route; the dense route in query
blocks equals one masked call. The CUDA training-step comparison runs under the `gpu` marker."""

import warnings

import pytest
import torch
from torch import Tensor

from gptlab.model import positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **kw})


BIASED = [
    name
    for name in positional.names()
    if GPT(tiny(pos=name)).transformer.pos.bias(torch.arange(2), torch.arange(2)) is not None
]


@pytest.mark.parametrize("pos", BIASED)
def test_the_bias_rows_are_prepared_once_per_forward_for_every_layer(pos, monkeypatch):
    model = GPT(tiny(pos=pos, n_layer=3))
    scheme = model.transformer.pos
    calls = []
    original = scheme.bias_rows  # what every block of every layer shares
    monkeypatch.setattr(scheme, "bias_rows", lambda q, k: calls.append(len(q)) or original(q, k))
    _, loss = model(torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16)))
    loss.backward()
    assert calls == [16]


def attention_inputs(n_head: int, n_kv_head: int, T: int, Tk: int, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    shape = lambda heads, n: (2, heads, n, 16)  # noqa: E731
    return [
        torch.randn(shape(h, n), generator=g, device=device)
        for h, n in ((n_head, T), (n_kv_head, Tk), (n_kv_head, Tk))
    ]


@pytest.mark.parametrize("pos", BIASED)
@torch.no_grad()
def test_flex_attention_score_mods_equal_the_dense_bias_route(pos):
    """FlexAttention's forward also runs (unfused) on CPU: each scheme's score_mod with the causal block
    mask gives the dense SDPA route's output, also for queries after cached keys (Tk > T). A wrong sign in
    ALiBi's -slope * (i - j) fails here."""
    from torch.nn.attention.flex_attention import flex_attention

    from gptlab.model.attention import AttentionBias, causal_block_mask, dense_bias_attention

    scheme = GPT(tiny(pos=pos, n_head=4, n_kv_head=2, n_embd=64, block_size=64)).transformer.pos
    for T, Tk in ((40, 40), (24, 56)):
        q_positions, k_positions = torch.arange(Tk - T, Tk), torch.arange(Tk)
        q, k, v = attention_inputs(4, 2, T, Tk)
        dense = AttentionBias.build(scheme, q_positions, k_positions, use_flex=False)
        expected = dense_bias_attention(q, k, v, dense.mask, 0.0, gqa=True)
        flex = AttentionBias.build(scheme, q_positions, k_positions, use_flex=True)
        assert flex.block_mask is causal_block_mask(T, Tk, "cpu")  # built once per shape
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile")  # unfused on CPU: fine here
            out = flex_attention(
                q, k, v, score_mod=flex.score_mod, block_mask=flex.block_mask, enable_gqa=True
            )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_the_dense_route_in_query_blocks_equals_one_masked_call(monkeypatch):
    """Queries in blocks, each over the keys up to its last query, are the same attention as one call over
    the whole square (forward and gradients, the bias's included)."""
    import torch.nn.functional as F

    from gptlab.model import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    scheme = GPT(tiny(pos="relative", block_size=64)).transformer.pos
    positions = torch.arange(56)
    q, k, v = (t.requires_grad_() for t in attention_inputs(4, 4, 56, 56))
    mask = attention.AttentionBias.build(scheme, positions, positions, use_flex=False).mask
    assert isinstance(mask, attention.DenseMask)
    blocked = attention.dense_bias_attention(q, k, v, mask, 0.0, gqa=False)
    params = [q, k, v, scheme.relative_attention_bias.weight]
    grads = torch.autograd.grad(blocked.square().sum(), params, retain_graph=True)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.whole())
    expected = torch.autograd.grad(whole.square().sum(), params)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
@pytest.mark.parametrize("pos", BIASED)
def test_flex_attention_training_step_equals_the_sdpa_route_on_cuda(pos, monkeypatch):
    """On CUDA the model trains bias schemes through compiled FlexAttention: its loss and every gradient
    (the scheme's own parameters included) equal the dense SDPA route's."""
    from gptlab.model import attention

    torch.manual_seed(0)
    config = tiny(pos=pos, n_head=4, n_kv_head=2, n_embd=128, block_size=256)
    flex_model = GPT(config).cuda()
    sdpa_model = GPT(config).cuda()
    sdpa_model.load_state_dict(flex_model.state_dict())
    idx = torch.randint(0, 61, (2, 256), device="cuda")
    assert attention.flex_attention_available(idx.device, config.head_dim)
    _, flex_loss = flex_model(idx, idx)
    flex_loss.backward()
    monkeypatch.setattr(attention, "flex_attention_available", lambda device, head_dim=64: False)
    _, sdpa_loss = sdpa_model(idx, idx)
    sdpa_loss.backward()
    torch.testing.assert_close(flex_loss, sdpa_loss, rtol=1e-4, atol=1e-5)
    sdpa_grads = dict(sdpa_model.named_parameters())
    for name, p in flex_model.named_parameters():
        torch.testing.assert_close(p.grad, sdpa_grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)


# Parameters whose gradient is 0 by the softmax's invariance to a constant added to every score of a row: the
# bias of FIRE's last MLP layer adds one constant to every score of a head. In fp32 on a CPU its gradient's norm
# was 7.7e-10 (the whole gradient's 6.9); in bf16 it is rounding noise (on an H100, FlexAttention's and SDPA's
# differed by 104% of it), so it is compared with the whole gradient instead.
SHIFT_INVARIANT = {"transformer.pos.mlp.2.bias"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
@pytest.mark.parametrize("pos", BIASED)
def test_flex_attention_at_gpt2s_head_size_in_bf16_compiles_and_equals_the_sdpa_route(pos, monkeypatch):
    """GPT-2's heads (64 dimensions) under bf16 autocast, as a bf16-mixed run trains: FlexAttention compiles
    with gptlab's tiles (FLEX_HALF_TILES; torch 2.11's own asked an H100 for more shared memory than it has)
    and its loss and gradients are the SDPA route's within bf16's rounding."""
    from gptlab.model import attention

    torch.manual_seed(0)
    config = tiny(pos=pos, n_head=4, n_embd=256, block_size=256)
    assert config.head_dim == 64
    flex_model = GPT(config).cuda()
    sdpa_model = GPT(config).cuda()
    sdpa_model.load_state_dict(flex_model.state_dict())
    idx = torch.randint(0, 61, (4, 256), device="cuda")

    def step(model: GPT) -> Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        return loss.detach().float()

    flex_loss = step(flex_model)
    monkeypatch.setattr(attention, "flex_attention_available", lambda device, head_dim=64: False)
    sdpa_loss = step(sdpa_model)
    assert abs(float(flex_loss - sdpa_loss)) < 2e-2
    sdpa_grads = dict(sdpa_model.named_parameters())
    total = torch.cat([p.grad.float().flatten() for p in sdpa_model.parameters()]).norm()
    for name, p in flex_model.named_parameters():
        want = sdpa_grads[name].grad.float()
        assert p.grad is not None
        if name in SHIFT_INVARIANT:  # exactly 0, rounding noise either way: small beside every other gradient
            assert float(p.grad.float().norm()) < 1e-4 * float(total), name
            continue
        error = float((p.grad.float() - want).norm() / want.norm().clamp_min(1e-12))
        assert error < 5e-2, f"{name}: relative gradient error {error:.2e}"
