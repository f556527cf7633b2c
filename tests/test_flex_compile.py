"""Compiled FlexAttention (the CUDA route of the bias schemes, windows and caps) compiles once per shape and
mask kind, not per layer or per forward pass, and never falls back to its uncompiled form silently. Forced on a
CPU, where FlexAttention runs forward only: the compiles are counted by the backend that torch.compile hands
each new graph (scripts/flex_recompiles.py's), and every output is the dense SDPA route's."""

from __future__ import annotations

import logging
import string
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import CPU_AND_CUDA, load_script

from gptlab.data.datamodule import document_ids
from gptlab.data.tokenizers import CharTokenizer
from gptlab.evaluation import length, passkey
from gptlab.model import attention
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

# Gemma 2's layout in small: local (window 16) and global layers alternating, scores capped.
GEMMA2 = {"window": 16, "window_pattern": "LG", "logit_softcap": 5.0}


@pytest.fixture(scope="module")
def script():
    yield load_script("flex_recompiles")
    sys.modules.pop("flex_recompiles", None)


def gemma2_like(pos: str, n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=61, block_size=64, n_layer=n_layer, n_head=2, n_embd=32, pos=pos, attention=GEMMA2
    )
    return GPT(config).eval()


def dense_logits(model: GPT, idx: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits on the dense SDPA route (FlexAttention off, as on a CPU)."""
    available = attention.flex_attention_available
    attention.flex_attention_available = lambda device, head_dim=64: False
    try:
        logits = model(idx, doc_ids=doc_ids)[0]
    finally:
        attention.flex_attention_available = available
    assert logits is not None
    return logits


# ALiBi's score_mod reads its slopes, T5's (and FIRE's, the base class's) a dense bias made per forward pass.
@pytest.mark.parametrize("pos", ["alibi", pytest.param("relative", marks=pytest.mark.slow)])  # 10-20 s each
@torch.no_grad()
def test_local_and_global_layers_compile_once_per_length_not_per_layer_or_pass(script, pos):
    """Four layers, local and global, capped, with a bias scheme, at sequence lengths in two buckets of 128
    (50 and 100 run at 128, 130 and 250 at 256): 2 lengths x 2 mask kinds = 4 compiles, whatever the depth,
    and a later pass in a bucket compiles nothing. (Dynamo's own eager backend: it compiles exactly when
    Inductor would; the real kernels are the slow test below.) Document masking adds one compile per mask
    kind, not one per batch of documents."""
    model = gemma2_like(pos)
    g = torch.Generator().manual_seed(1)
    batches = {T: torch.randint(0, 61, (2, T), generator=g) for T in (50, 130, 100, 250)}
    expected = {T: dense_logits(model, idx) for T, idx in batches.items()}
    documents = []
    for boundary in (10, 30):  # windows of 64 with end-of-text tokens (id 0): a different split each batch
        idx = torch.randint(1, 61, (2, 64), generator=g)
        idx[:, [boundary, 40]] = 0
        documents.append((idx, document_ids(idx, 0), dense_logits(model, idx, document_ids(idx, 0))))
    backend = script.CountingBackend("eager")
    with script.flex_forced(backend), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        compiles = []
        for T, idx in batches.items():
            torch.testing.assert_close(model(idx)[0], expected[T], rtol=1e-4, atol=1e-4)
            compiles.append(backend.compiles)
        assert compiles == [2, 4, 4, 4]
        for idx, doc_ids, dense in documents:
            torch.testing.assert_close(model(idx, doc_ids=doc_ids)[0], dense, rtol=1e-4, atol=1e-4)
        assert backend.compiles == 4 + 2


def study_figures(result: dict) -> dict:
    """What the length study reports at each factor, without its timing."""
    return {f: {k: v for k, v in e.items() if k != "seconds"} for f, e in result["variants"]["alibi"].items()}


def test_the_length_study_compiles_once_per_length_though_its_last_batch_is_smaller(script):
    """The study at 1x, 2x, 4x a context of 128 runs 8, 4, 2 windows a batch over 12, 6, 3 windows: at every
    length a full batch and a smaller last one. Its last batch is padded to the full size (copies of a window,
    never counted), so each length compiles one kernel, not two, and the figures are those of the unpadded
    batches, and the dense route's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, block_size=128, n_layer=1, n_head=2, n_embd=32, pos="alibi")).eval()
    tokens = np.random.default_rng(0).integers(0, 61, 1537)
    options = length.LengthEvalOptions(factors=[1, 2, 4], batch_tokens=1024, rope_scalings=[])
    dense = study_figures(length.evaluate_lengths(model, tokens, 128, options))
    assert [(e["windows"], 1024 // e["context"]) for e in dense.values()] == [(12, 8), (6, 4), (3, 2)]
    backend = script.CountingBackend("eager")
    with script.flex_forced(backend), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        padded = study_figures(length.evaluate_lengths(model, tokens, 128, options))
        assert backend.compiles == 3
        unpadded = [
            length.loss_by_position(model, tokens, f * 128, 1024, pad_last_batch=False) for f in (1, 2, 4)
        ]
        assert backend.compiles == 3 + 3  # the smaller last batches' own kernels, one per length
    for factor, (by_position, windows) in zip(("1", "2", "4"), unpadded, strict=True):
        assert padded[factor]["windows"] == windows
        assert padded[factor]["loss"] == float(by_position.mean())
        assert padded[factor]["loss_by_position"] == [round(float(v), 5) for v in by_position]
        assert padded[factor]["loss"] == pytest.approx(dense[factor]["loss"], rel=1e-5)
        np.testing.assert_allclose(
            padded[factor]["loss_by_position"], dense[factor]["loss_by_position"], atol=2e-5
        )


def passkey_figures(result: dict) -> dict:
    """What the passkey study reports in each cell, without its timing."""
    return {
        f: {b: {k: v for k, v in cell.items() if k != "seconds"} for b, cell in row.items()}
        for f, row in result["cells"].items()
    } | {"metrics": result["metrics"]}


def test_the_passkey_study_compiles_no_flex_attention_kernel_its_passes_read_a_kv_cache(script, monkeypatch):
    """The passkey study at 2x and 4x a context of 64 runs 4 and 2 prompts a batch over 5 a cell: a smaller
    last batch in every cell, and 7 greedy tokens after each prompt. Every pass (the prompt, the
    teacher-forced answer, each decoded token) reads a KV cache, which GPT.forward sends to the dense route
    even where FlexAttention is taken: none of them compiles a kernel, so its smaller last batches need no
    padding, and its figures are the dense route's. (A pass without a cache compiles at once: the route was
    forced.) Should cached passes ever take FlexAttention, this counts their compiles."""
    torch.manual_seed(0)
    chars = CharTokenizer.from_texts([string.printable])
    model = GPT(
        GPTConfig(
            vocab_size=chars.vocab_size,
            block_size=64,
            n_layer=2,
            n_head=2,
            n_embd=32,
            pos="alibi",
            attention=GEMMA2,
        )
    ).eval()
    options = passkey.PasskeyOptions(depths=2, trials=5, batch_tokens=512)
    batches: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda module, args: batches.append(tuple(args[0].shape)))
    dense = passkey_figures(passkey.evaluate_passkey(model, chars, 64, [2, 4], options))
    flex_calls: list[tuple[int, ...]] = []
    compiled = attention.compiled_flex_attention
    monkeypatch.setattr(
        attention,
        "compiled_flex_attention",
        lambda q, *rest: flex_calls.append(tuple(q.shape)) or compiled(q, *rest),
    )
    backend = script.CountingBackend("eager")
    with script.flex_forced(backend), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        batches.clear()
        forced = passkey_figures(passkey.evaluate_passkey(model, chars, 64, [2, 4], options))
        assert backend.compiles == 0 and flex_calls == []
        passes = list(batches)
        with torch.no_grad():
            model(torch.zeros(1, 64, dtype=torch.long))
        assert backend.compiles == 2  # without a cache: the local and the global layers' kernels
    # Per batch of B prompts of P tokens (the answer " NNNNN." takes the last 7 of each cell's length): the
    # prompt, the answer's first 6 tokens teacher-forced, 6 greedy tokens one at a time.
    cells = [[(4, 121), (1, 121)]] * 2 + [[(2, 249), (2, 249), (1, 249)]] * 2
    assert passes == [p for cell in cells for B, P in cell for p in [(B, P), (B, 6)] + [(B, 1)] * 6]
    assert forced == dense


@torch.no_grad()
def test_past_the_recompile_limit_flex_attention_warns_and_still_gives_the_result(script, caplog):
    """Past the limit (here 2 compiles) torch would run FlexAttention uncompiled with one line in its debug
    log; gptlab warns, once per shape, naming the cause and the fix, and the logits are still right."""
    model = gemma2_like("alibi", n_layer=2)
    idx = torch.randint(0, 61, (1, 200), generator=torch.Generator().manual_seed(0))
    expected = dense_logits(model, idx)
    backend = script.CountingBackend("eager")
    limit = attention.FLEX_RECOMPILE_LIMIT
    attention.FLEX_RECOMPILE_LIMIT = 2
    try:
        with (
            script.flex_forced(backend),
            torch._dynamo.config.patch(recompile_limit=2),
            warnings.catch_warnings(),
            caplog.at_level(logging.WARNING, logger="gptlab.model.attention"),
        ):
            warnings.filterwarnings("ignore", message=".*without torch.compile")
            model(idx[:, :100])  # the local and the global layer at 128: the limit's 2 compiles
            assert backend.compiles == 2 and not caplog.records
            logits = model(idx)[0]  # at 256: past the limit
            model(idx)  # the same shapes again: no second warning
    finally:
        attention.FLEX_RECOMPILE_LIMIT = limit
    assert backend.compiles == 2
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    warned = [r.getMessage() for r in caplog.records if r.name == "gptlab.model.attention"]
    assert len(warned) == 2  # the local and the global layer's shape at 256
    assert "(1, 2, 256, 16)" in warned[0] and "UNCOMPILED" in warned[0]
    assert "FLEX_RECOMPILE_LIMIT" in warned[0] and "eval_length.factors" in warned[0]


@pytest.mark.slow  # four Inductor compilations of FlexAttention's kernel, 15-30 s on a CPU
@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_inductors_flex_kernels_compile_once_per_length_mask_kind_and_grad_mode(script, device):
    """The real kernels (Inductor's FlexAttention template; on a CPU forward only): a local/global, capped
    ALiBi model of four layers at three lengths in two buckets compiles 2 x 2 kernels and gives the dense
    route's logits. On CUDA two training steps (forward and backward, at the training length) add one kernel
    per mask kind, and the loss is the dense route's."""
    model = gemma2_like("alibi").to(device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 61, (2, T), generator=g).to(device) for T in (60, 100, 200)]
    with torch.no_grad():
        expected = [dense_logits(model, idx) for idx in batches]
    backend = script.CountingBackend("inductor")
    with script.flex_forced(backend), torch.no_grad():
        for idx, logits in zip(batches, expected, strict=True):
            torch.testing.assert_close(model(idx)[0], logits, rtol=1e-4, atol=1e-4)
    assert backend.compiles == 4
    if device == "cuda":
        x = batches[2][:, :64]
        available = attention.flex_attention_available
        attention.flex_attention_available = lambda device, head_dim=64: False
        dense_loss = model.train()(x, x)[1]
        attention.flex_attention_available = available
        with script.flex_forced(backend):
            for _ in range(2):
                _, loss = model(x, x)
                loss.backward()
        torch.testing.assert_close(loss, dense_loss, rtol=1e-4, atol=1e-5)
        assert backend.compiles == 4 + 2


@torch.no_grad()
def test_the_last_positions_logits_alone_on_the_padded_flex_attention_route(script):
    """Without a cache FlexAttention runs a length padded to its bucket (50 tokens at 128): ``last_only``
    gives the 50th position's logits, not the padding's, as the dense route gives them."""
    model = gemma2_like("alibi", n_layer=2)
    idx = torch.randint(0, 61, (1, 50), generator=torch.Generator().manual_seed(0))
    expected = dense_logits(model, idx)[:, -1:]
    with script.flex_forced(script.CountingBackend("eager")), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        last = model(idx, last_only=True)[0]
    assert last is not None and last.shape == (1, 1, 61)
    torch.testing.assert_close(last, expected, rtol=1e-5, atol=1e-5)
