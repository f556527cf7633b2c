"""Document masking (``data.document_mask=true``): attention stays inside each document of a packed window,
and the positions a scheme embeds or rotates by restart at each document. What a user relies on: a token's
loss does not move when another document of its window changes, a document gets the logits it would get
alone at the start of a window, and a run trains with it under several schemes and with sliding windows."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

import gptlab
from gptlab.data.datamodule import DocumentIds, GPTDataModule, document_ids
from gptlab.data.sources import DataSpec
from gptlab.errors import ConfigError
from gptlab.model import positional
from gptlab.model.attention import AttentionBias, dense_bias_attention, document_block_mask
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT, document_positions

SCHEMES = positional.names()  # learned, sinusoidal, rope, xpos, alibi, relative, fire, nope
EOT = 60  # the end-of-text id of these windows


def model_of(**kw) -> GPT:
    torch.manual_seed(0)
    base = dict(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_embd=32, init_std=0.3)
    return GPT(GPTConfig(**{**base, **kw})).eval()


def packed(first: list[int], second: list[int]) -> torch.Tensor:
    """One window ``first EOT second``: the tail of a document, then the next one, which the EOT starts."""
    return torch.tensor([first + [EOT] + second])


def per_token_loss(model: GPT, idx: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    logits, _ = model(idx[:, :-1], doc_ids=None if doc_ids is None else doc_ids[:, :-1])
    return F.cross_entropy(logits[0], idx[0, 1:], reduction="none")


def test_an_end_of_text_token_starts_the_next_document_and_positions_restart_there():
    tokens = torch.tensor([[5, 6, EOT, 7, 8, 9, EOT], [EOT, 1, 2, 3, 4, 5, 6]])
    ids = document_ids(tokens, EOT)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 1, 2], [1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6]]
    # The loader's collate function adds them to each (input, target) batch.
    x, y, ids = DocumentIds(EOT)([(tokens[0, :-1], tokens[0, 1:]), (tokens[1, :-1], tokens[1, 1:])])
    assert torch.equal(ids, document_ids(x, EOT)) and torch.equal(y, tokens[:, 1:])


@pytest.mark.parametrize("pos", SCHEMES)
@pytest.mark.parametrize("attention", [{}, {"window": 6, "window_pattern": "LG", "logit_softcap": 5.0}])
@torch.no_grad()
def test_a_tokens_loss_does_not_change_when_another_document_in_its_window_changes(pos, attention):
    """Window ``A EOT B``: with document masking, changing A leaves every loss of the targets predicted from
    B's tokens (the EOT's target, B's first token, onwards) bit for bit; without it they all move."""
    model = model_of(pos=pos, attention=attention)
    g = torch.Generator().manual_seed(1)
    a, b = (
        torch.randint(0, EOT, (12,), generator=g).tolist(),
        torch.randint(0, EOT, (20,), generator=g).tolist(),
    )
    other_a = [(t + 7) % EOT for t in a]  # every token of A changed, its length kept
    window, changed = packed(a, b), packed(other_a, b)
    second = slice(len(a), None)  # targets whose input is the EOT or a token of B
    masked = per_token_loss(model, window, document_ids(window, EOT))[second]
    masked_changed = per_token_loss(model, changed, document_ids(changed, EOT))[second]
    assert torch.equal(masked, masked_changed)
    plain = per_token_loss(model, window, None)[second]
    plain_changed = per_token_loss(model, changed, None)[second]
    assert ((plain - plain_changed).abs() > 1e-6).all()


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope", "xpos", "alibi", "relative"])
@torch.no_grad()
def test_a_document_gets_the_logits_it_gets_alone_at_the_start_of_a_window(pos):
    """Positions restart: ``A EOT B`` gives B's part (from its EOT on) the logits of ``EOT B`` alone."""
    model = model_of(pos=pos)
    g = torch.Generator().manual_seed(2)
    a, b = (
        torch.randint(0, EOT, (9,), generator=g).tolist(),
        torch.randint(0, EOT, (15,), generator=g).tolist(),
    )
    window = packed(a, b)
    logits, _ = model(window, doc_ids=document_ids(window, EOT))
    alone, _ = model(torch.tensor([[EOT] + b]))
    torch.testing.assert_close(logits[0, len(a) :], alone[0], rtol=1e-5, atol=1e-5)
    # Without document masking B's logits are not its own: A is in their context.
    unmasked, _ = model(window)
    assert (unmasked[0, len(a) :] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("pos", ["alibi", "nope"])
@torch.no_grad()
def test_a_window_longer_than_a_query_block_is_masked_in_every_block(pos):
    """Past QUERY_BLOCK (256) queries the CPU route attends in blocks of queries, each with its slice of the
    (B, 1 or n_head, T, T) mask: a document deep in a long window still sees only itself."""
    model = model_of(pos=pos, block_size=512)
    g = torch.Generator().manual_seed(4)
    a, b = (
        torch.randint(0, EOT, (150,), generator=g).tolist(),
        torch.randint(0, EOT, (200,), generator=g).tolist(),
    )
    window = packed(a, b)
    logits, _ = model(window, doc_ids=document_ids(window, EOT))
    alone, _ = model(torch.tensor([[EOT] + b]))
    torch.testing.assert_close(logits[0, len(a) :], alone[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_without_document_ids_a_window_is_one_sequence_and_a_cache_is_refused():
    """The default path is unchanged: one document's ids give plain causal attention's logits."""
    model = model_of(pos="rope")
    idx = torch.randint(0, EOT, (2, 20))
    plain, _ = model(idx)
    one_document, _ = model(idx, doc_ids=torch.zeros_like(idx))
    torch.testing.assert_close(one_document, plain, rtol=1e-5, atol=1e-5)
    from gptlab.model.attention import KVCache

    with pytest.raises(ValueError, match="decoding continues one document"):
        model(idx, cache=KVCache.empty(2), doc_ids=torch.zeros_like(idx))


@pytest.mark.parametrize("pos", ["alibi", "relative", "fire"])
@pytest.mark.parametrize("window", [None, 6])
def test_a_bias_and_the_document_mask_built_per_block_give_the_whole_masks_output_and_gradients(
    pos, window, monkeypatch
):
    """The dense route builds the mask of the per-head bias and the per-window documents one block of
    queries at a time (blocks of 16 here, so that a window of 40 takes three): the output and the gradients
    of q, k, v and the scheme's own parameters equal those of one SDPA call over the whole (B, n_head, T, T)
    mask with the bias at -inf outside each document, to fp32 rounding (the scheme's gradients are summed
    block by block, and a head's summed bias gradient is about 0: softmax's gradient sums to 0 in each row). ALiBi's bias, which has no gradient, is built per block outside a training step only."""
    import torch.nn.functional as F

    from gptlab.model import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    scheme = model_of(pos=pos).transformer.pos
    g = torch.Generator().manual_seed(0)
    T = 40
    tokens = torch.randint(0, EOT, (2, T), generator=g)
    tokens[0, 13], tokens[0, 31], tokens[1, 22] = EOT, EOT, EOT
    ids = document_ids(tokens, EOT)
    positions = torch.arange(T)
    inputs = [
        torch.randn(2, 4, T, 16, generator=g),
        *(torch.randn(2, 2, T, 16, generator=g) for _ in range(2)),
    ]
    upstream = torch.randn(2, 4, T, 16, generator=g)

    def output_and_grads(per_block: bool) -> list[torch.Tensor]:
        scheme.zero_grad()
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        with torch.set_grad_enabled(pos != "alibi"):  # ALiBi's bias per block: outside a training step
            built = AttentionBias.build(scheme, positions, positions, False, window, None, ids)
        assert isinstance(built.mask, attention.DenseMask)
        if per_block:
            out = dense_bias_attention(q, k, v, built.mask, 0.0, True)
        else:
            whole = built.mask.whole()
            assert whole.shape == (2, 4, T, T)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=whole, enable_gqa=True)
        (out * upstream).sum().backward()
        grads = [q.grad, k.grad, v.grad] + [p.grad for p in scheme.parameters()]
        return [out.detach()] + [grad for grad in grads if grad is not None]

    blocks, whole = output_and_grads(True), output_and_grads(False)
    if pos == "alibi":  # in a training step SDPA keeps the mask in every layer: one whole mask is built
        built = AttentionBias.build(scheme, positions, positions, False, window, None, ids)
        assert isinstance(built.mask, torch.Tensor) and built.mask.shape == (2, 4, T, T)
    assert len(blocks) == len(whole) == 4 + len(list(scheme.parameters()))
    for got, expected in zip(blocks, whole):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pos", ["nope", "alibi"])
@torch.no_grad()
def test_the_flex_attention_document_block_mask_equals_the_dense_route(pos):
    """The CUDA route's per-window block mask (documents, causality, window) gives the dense route's output;
    FlexAttention's forward also runs, unfused, on a CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    scheme = model_of(pos=pos).transformer.pos
    g = torch.Generator().manual_seed(0)
    T = 40
    tokens = torch.randint(0, EOT + 1, (2, T), generator=g)
    tokens[:, 0], tokens[0, 13], tokens[1, 30] = 3, EOT, EOT
    ids = document_ids(tokens, EOT)
    positions = torch.arange(T)
    q = 4 * torch.randn(2, 4, T, 16, generator=g)
    k, v = (4 * torch.randn(2, 2, T, 16, generator=g) for _ in range(2))
    for window in (None, 8):
        dense = AttentionBias.build(scheme, positions, positions, False, window, None, ids)
        expected = dense_bias_attention(q, k, v, dense.mask, 0.0, True, None, dense.softcap)
        flex = AttentionBias.build(scheme, positions, positions, True, window, None, ids)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            out = flex_attention(
                q, k, v, score_mod=flex.score_mod, block_mask=flex.block_mask, enable_gqa=True
            )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert document_block_mask(ids).shape[0] == 2  # one mask per window


# ---- data and runs ---------------------------------------------------------------------------------------


def test_the_loaders_batches_carry_the_document_ids_of_their_inputs(tmp_path):
    """Short documents, so that every window of 16 characters spans several: each training and validation
    batch is (input, target, document ids), the ids counting the end-of-text tokens up to each input token;
    without document_mask a batch stays (input, target)."""
    for i in range(40):
        (tmp_path / f"{i:02d}.txt").write_text(f"document {i} is short.")
    spec = DataSpec(path=str(tmp_path / "*.txt"), cache_dir=str(tmp_path / "cache"), val_fraction=0.2)
    dm = GPTDataModule(spec, "char", block_size=16, batch_size=4, document_mask=True)
    dm.setup("fit")
    eot = dm.tokenizer.eot_id
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        x, y, ids = next(iter(loader))
        assert ids.shape == x.shape == y.shape
        assert torch.equal(ids, (x == eot).cumsum(dim=1)) and int(ids.max()) >= 1
    plain = GPTDataModule(spec, "char", block_size=16, batch_size=4)
    plain.setup("fit")
    assert len(next(iter(plain.val_dataloader()))) == 2


def test_document_mask_must_be_true_or_false(make_cfg):
    with pytest.raises(ConfigError, match="data.document_mask"):
        gptlab.build_datamodule(make_cfg("data.document_mask=sometimes"))


@pytest.mark.parametrize(
    "overrides",
    [["pos=learned"], ["pos=rope", "attention=sliding_window", "attention.window=8"]],
)
def test_a_tiny_run_trains_with_document_masking(make_cfg, tmp_path, caplog, overrides):
    """A real run with data.document_mask=true: it trains and validates, its card says so, and its run config
    records the choice."""
    from omegaconf import OmegaConf

    from gptlab.tasks.gpt import DOCUMENT_MASK_LINE, run

    run_dir = tmp_path / "run"
    args = [*TINY, "tokenizer=char", "trainer.max_steps=4", "logger=csv", "data.document_mask=true"]
    with caplog.at_level(logging.INFO):
        metrics = run(make_cfg(*args, *overrides, f"paths.output_dir={run_dir}"))
    assert DOCUMENT_MASK_LINE in caplog.text
    assert all(torch.isfinite(torch.tensor(float(v))) for k, v in metrics.items() if "loss" in k)
    saved = OmegaConf.load(run_dir / "config_resolved.yaml")
    assert saved.data.document_mask is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
@pytest.mark.parametrize("pos", ["rope", "alibi"])
def test_flex_attention_trains_document_masks_as_the_dense_route_on_cuda(pos, monkeypatch):
    """On CUDA a document-masked, windowed model trains through compiled FlexAttention (a block mask per
    window): its loss and every gradient equal the dense SDPA route's, for two batches of other documents."""
    from gptlab.model import attention

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=61,
        block_size=256,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=128,
        pos=pos,
        attention={"window": 48, "window_pattern": "LG"},
    )
    flex_model = GPT(config).cuda()
    dense_model = GPT(config).cuda()
    dense_model.load_state_dict(flex_model.state_dict())
    assert attention.flex_attention_available(torch.device("cuda"), config.head_dim)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, EOT + 1, (2, 256), generator=g).cuda() for _ in range(2)]
    for idx in batches:
        idx[:, ::37] = EOT  # documents of at most 37 tokens, so that every window holds several
    flex_losses = []
    for idx in batches:
        _, loss = flex_model(idx, idx, doc_ids=document_ids(idx, EOT))
        loss.backward()
        flex_losses.append(loss.detach())
    monkeypatch.setattr(attention, "flex_attention_available", lambda device, head_dim=64: False)
    for idx, flex_loss in zip(batches, flex_losses):
        _, dense_loss = dense_model(idx, idx, doc_ids=document_ids(idx, EOT))
        dense_loss.backward()
        torch.testing.assert_close(flex_loss, dense_loss.detach(), rtol=1e-4, atol=1e-5)
    dense_grads = dict(dense_model.named_parameters())
    for name, p in flex_model.named_parameters():
        torch.testing.assert_close(p.grad, dense_grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)
