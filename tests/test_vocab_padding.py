"""model.vocab_multiple: the token table and the output layer stored with the vocabulary rounded up to a multiple
of 64 rows (aligned products on a GPU), and every number what the unpadded model gives.

A padded and an unpadded model with the same first rows give the same logits, losses and gradients on every
``loss.impl`` that runs here, with the z-loss and the softcap; the padding rows get no gradient, are never
sampled, and are read by nothing: filled with large values, they change no number. Checkpoints saved with the
vocabulary's rows (before the padding) load, resume and generate."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from gptlab import planning, torch_features
from gptlab.errors import ConfigError
from gptlab.model import counting
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss, chunked_loss_terms
from gptlab.runs.checkpoints import load_checkpoint, model_config_dict, model_weights
from gptlab.runs.trained import load_run

V = 97  # stored as 128 rows
OLD = Path(__file__).parent / "data" / "e9c3ad3_rope_rmsnorm_swiglu.ckpt"  # saved before the padding
needs_torch_lce = pytest.mark.skipif(
    not torch_features.has("linear_cross_entropy"), reason="the installed torch has no F.linear_cross_entropy"
)


def config(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=V, block_size=16, n_layer=2, n_head=2, n_embd=32), **kw})


def pair(**kw) -> tuple[GPT, GPT]:
    """(unpadded, padded) models from the same seed."""
    torch.manual_seed(0)
    plain = GPT(config(vocab_multiple=1, **kw))
    torch.manual_seed(0)
    padded = GPT(config(**kw))
    return plain, padded


def spoil_padding(model: GPT, value: float = 50.0) -> None:
    """Fill the padding rows with large values: were they read anywhere, the numbers would move."""
    with torch.no_grad():
        for name in model.vocab_rows:
            model.get_parameter(name)[V:] = value


def batch(n: int = 3, t: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (n, t), generator=g)
    targets = torch.randint(0, V, (n, t), generator=g)
    targets[0, :3] = -1  # ignored targets count for nothing either way
    return idx, targets


def gradients(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_the_padded_model_draws_the_unpadded_models_weights_and_zero_padding():
    for tie in (True, False):
        plain, padded = pair(tie_weights=tie)
        assert padded.transformer.wte.weight.shape == (128, 32) and padded.lm_head.weight.shape == (128, 32)
        assert (padded.lm_head.weight is padded.transformer.wte.weight) == tie
        ours, theirs = padded.state_dict(), plain.state_dict()
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            rows = ours[key][:V] if key in padded.vocab_rows else ours[key]
            assert torch.equal(rows, value), key  # the same RNG draws, value for value
            if key in padded.vocab_rows:
                assert not ours[key][V:].any(), key


@pytest.mark.parametrize(
    "impl, z_loss, softcap",
    [
        ("plain", 0.0, None),
        ("chunked", 0.0, None),
        ("plain", 1e-2, None),
        ("chunked", 1e-2, None),
        ("plain", 0.0, 5.0),
        ("chunked", 1e-2, 5.0),
        pytest.param("torch", 0.0, None, marks=needs_torch_lce),
    ],
)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_padded_and_unpadded_give_the_same_logits_losses_and_gradients(impl, z_loss, softcap, tie):
    plain, padded = pair(tie_weights=tie)
    spoil_padding(padded)
    loss = HeadLoss(impl, chunk_rows=7, z_loss=z_loss, final_softcap=softcap)
    idx, targets = batch()
    results = []
    for model in (plain, padded):
        model.final_softcap = softcap
        _, objective = model(idx, targets, head_loss=loss)
        assert objective is not None
        objective.backward()
        logits, _ = model(idx)
        assert logits is not None and logits.shape == (3, 16, V)
        results.append((objective, logits, gradients(model)))
    (want_loss, want_logits, want_grads), (got_loss, got_logits, got_grads) = results
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        got = got_grads[name]
        if name in padded.vocab_rows:
            assert not got[V:].any(), f"{name}: the padding rows got a gradient"
            got = got[:V]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_the_half_precision_chunks_take_every_stored_row_and_give_the_vocabularys_numbers(fused):
    """The GPU's case, forced here: bf16 products with the padded weight (aligned), then the vocabulary's
    columns alone; the loss and gradients of the first V rows, the padding's gradient 0."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(45, 32, generator=g, requires_grad=True)
    weight = torch.randn(V, 32, generator=g).mul_(0.5)
    padded = torch.cat([weight, torch.full((128 - V, 32), 50.0)]).requires_grad_()
    weight.requires_grad_()
    targets = torch.randint(0, V, (45,), generator=g)
    targets[::4] = -1
    options = dict(chunk_rows=16, z_loss=1e-2, softcap=5.0, matmul_dtype=torch.bfloat16, fused=fused)
    want = chunked_loss_terms(hidden, weight, targets, **options)
    want_hidden, want_weight = torch.autograd.grad(want.loss, [hidden, weight])
    got = chunked_loss_terms(hidden, padded, targets, vocab_size=V, **options)
    got_hidden, got_weight = torch.autograd.grad(got.loss, [hidden, padded])
    for name in ("loss", "cross_entropy", "lse_square"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7)
    assert not got_weight[V:].any()
    # the same bf16 operands and products; the fp32 sums of the products may run in another order
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_weight[:V], want_weight, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "sampling",
    [dict(), dict(temperature=1.0), dict(temperature=1.5, top_k=5), dict(temperature=1.0, top_p=0.9)],
)
def test_generation_never_returns_a_padding_id(sampling):
    plain, padded = pair()
    spoil_padding(padded, 1e3)  # were their logits in the softmax, the padding ids would win every draw
    prompt = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(2))
    outputs = []
    for model in (plain, padded):
        generator = torch.Generator().manual_seed(3)
        outputs.append(model.generate(prompt, 12, generator=generator, **sampling))
    assert int(outputs[1].max()) < V
    assert torch.equal(outputs[1], outputs[0])


def test_training_keeps_the_padding_zero_and_the_vocabularys_rows_the_unpadded_models():
    plain, padded = pair()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (plain, padded)]
    loss = HeadLoss("chunked", chunk_rows=16)
    for step in range(3):
        idx, targets = batch(seed=10 + step)
        for model, optimizer in zip((plain, padded), optimizers):
            optimizer.zero_grad()
            _, objective = model(idx, targets, head_loss=loss)
            assert objective is not None
            objective.backward()
            optimizer.step()
    table = padded.transformer.wte.weight.detach()
    assert not table[V:].any()
    torch.testing.assert_close(table[:V], plain.transformer.wte.weight.detach(), rtol=1e-5, atol=1e-7)


def test_a_checkpoint_of_the_vocabularys_rows_loads_padded_and_a_padded_one_loads_unpadded(caplog):
    plain, padded = pair()
    with torch.no_grad():
        plain.transformer.wte.weight.mul_(3.0)  # other weights than the padded model's own
    idx, _ = batch()
    with caplog.at_level(logging.INFO, logger="gptlab.model.gpt"):
        padded.load_state_dict(plain.state_dict())
        padded.load_state_dict(plain.state_dict())
    assert padded.transformer.wte.weight.shape == (128, 32) and not padded.transformer.wte.weight[V:].any()
    torch.testing.assert_close(padded(idx)[0], plain(idx)[0], rtol=0, atol=0)
    told = [r.getMessage() for r in caplog.records if "rows saved" in r.getMessage()]
    assert len(told) <= 1  # said once per shape in a process, if at all
    # and back: the padding cut, being zeros
    _, fresh = pair()
    torch.manual_seed(5)
    unpadded = GPT(config(vocab_multiple=1))
    unpadded.load_state_dict(padded.state_dict())
    torch.testing.assert_close(unpadded(idx)[0], plain(idx)[0], rtol=0, atol=0)
    # rows beyond the vocabulary that are not zero are no padding: refused by the size check, not dropped
    spoil_padding(fresh)
    with pytest.raises(RuntimeError, match="size mismatch for transformer.wte.weight"):
        unpadded.load_state_dict(fresh.state_dict())


def test_a_run_saved_before_the_padding_loads_padded_and_generates_the_same_tokens():
    trained = load_run(OLD)
    checkpoint = load_checkpoint(OLD)
    values = model_config_dict(checkpoint, OLD)
    assert "vocab_multiple" not in values  # written before the option existed
    unpadded = GPT(GPTConfig.from_dict({**values, "vocab_multiple": 1}))
    unpadded.load_state_dict(model_weights(checkpoint, OLD))
    unpadded.eval()
    vocab = trained.model.config.vocab_size
    assert model_weights(checkpoint, OLD)["transformer.wte.weight"].size(0) == vocab
    assert trained.model.transformer.wte.weight.size(0) == trained.model.config.padded_vocab_size > vocab
    prompt = torch.tensor([trained.tokenizer.encode("def ")])
    outputs = [
        m.generate(prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(0))
        for m in (unpadded, trained.model)
    ]
    assert torch.equal(outputs[0], outputs[1]) and int(outputs[1].max()) < vocab


@pytest.mark.parametrize("value", [0, -64, 2.5, "64", True])
def test_a_bad_vocab_multiple_is_refused_with_the_fix(value):
    with pytest.raises(
        ConfigError, match=rf"model.vocab_multiple={value!r} must be a positive integer.*1 for no"
    ):
        config(vocab_multiple=value)


def test_counts_are_the_vocabularys_and_the_padding_is_reported_apart():
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert gpt2.padded_vocab_size == 50304 == 64 * 786
    counts = counting.parameter_counts(gpt2)
    assert counts["total"] == 124_439_808 and counts["padding"] == 47 * 768
    with torch.device("meta"):
        assert GPT(gpt2).parameter_counts() == {k: counts[k] for k in GPT(gpt2).parameter_counts()}
    unpadded = GPTConfig(
        vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, vocab_multiple=1
    )
    assert counting.flops_per_token(gpt2) == counting.flops_per_token(unpadded)  # the model's FLOPs, V rows
    assert counting.parameter_counts(config(tie_weights=False))["padding"] == 2 * (128 - V) * 32
    card = planning.model_card(gpt2)
    assert (
        "Parameters: total 124,439,808 (124.44M), embedding 39,383,808, non-embedding 85,056,000; and 36,096 of "
        "padding, zero and never trained (the vocabulary stored as 50304 rows: model.vocab_multiple=64)"
    ) in card
    assert "of padding" not in planning.model_card(unpadded)
