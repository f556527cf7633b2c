"""The dense attention route (a bias, a window, a cap or documents on a CPU) builds its mask one block of
queries at a time (``DenseMask``): the model's logits and every gradient equal those of the whole mask built
at once and sliced per block, as the route did before, for every scheme that takes it, and a long
sequence's forward never allocates a tensor the size of the whole mask."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gptlab.data.datamodule import document_ids
from gptlab.model import attention, positional
from gptlab.model.attention import AttentionBias, DenseMask, KVCache
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.positional import PositionalEncoding

EOT = 60
LG = {"window": 6, "window_pattern": "LG"}  # a local layer of 6 positions, then a global one

# One case per kind of mask the route builds: each bias scheme (FIRE past its threshold too: rows of both of
# its forms), windows, a logit cap, grouped-query attention, and a window without any bias.
CASES: dict[str, dict[str, Any]] = {
    "alibi": dict(pos="alibi"),
    "relative": dict(pos="relative"),
    "fire": dict(pos="fire"),
    "fire past its threshold": dict(pos={"name": "fire", "init_threshold": 20}),
    "alibi, windows": dict(pos="alibi", attention=LG),
    "nope, windows": dict(pos="nope", attention=LG),
    "relative, windows and cap": dict(pos="relative", attention={**LG, "logit_softcap": 2.0}),
    "fire, grouped-query": dict(pos="fire", n_kv_head=2),
    "alibi, cap, grouped-query": dict(pos="alibi", n_kv_head=2, attention={"logit_softcap": 2.0}),
}


def model_of(**kw: Any) -> GPT:
    torch.manual_seed(0)
    base = dict(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_embd=32, init_std=0.3)
    return GPT(GPTConfig(**{**base, **kw}))


@contextmanager
def whole_masks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the block the route gets each mask whole, built at once, and slices it per block of queries:
    the route as it was before the blocks built their own rows."""
    build = AttentionBias.build.__func__  # type: ignore[attr-defined]

    def whole(cls, *args, **kwargs):  # noqa: ANN001, ANN202
        bias = build(cls, *args, **kwargs)
        if bias is not None and isinstance(bias.mask, DenseMask):
            bias.mask = bias.mask.whole()
        return bias

    with monkeypatch.context() as patch:
        patch.setattr(AttentionBias, "build", classmethod(whole))
        yield


def logits_and_grads(model: GPT, idx: torch.Tensor, doc_ids: torch.Tensor | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx[:, :-1], idx[:, 1:], doc_ids=doc_ids)
    assert logits is not None and loss is not None
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert any("pos" in name for name in grads) or not list(model.transformer.pos.parameters())
    return [logits.detach(), *grads.values()]


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        # fp32 rounding: a scheme's gradient is summed block by block instead of over the whole mask
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("documents", [False, True], ids=["one sequence", "documents"])
def test_a_training_step_with_masks_built_per_block_equals_the_whole_masks(case, documents, monkeypatch):
    """Blocks of 16 queries over a window of 48 (three blocks, the last two reaching past FIRE's threshold
    of 20 where it is set): the logits, the loss's gradient of every weight (the scheme's own included),
    with and without packed documents, equal those of the whole mask."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    model = model_of(**CASES[case]).train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, EOT, (2, 49), generator=g)
    if documents:
        idx[0, 11], idx[0, 30], idx[1, 25] = EOT, EOT, EOT
    doc_ids = document_ids(idx[:, :-1], EOT) if documents else None
    per_block = logits_and_grads(model, idx, doc_ids)
    with whole_masks(monkeypatch):
        whole = logits_and_grads(model, idx, doc_ids)
    assert_same(per_block, whole)


@pytest.mark.parametrize("case", ["alibi, windows", "relative, windows and cap", "fire past its threshold"])
@torch.no_grad()
def test_queries_after_cached_keys_with_masks_built_per_block_equal_the_whole_masks(case, monkeypatch):
    """A KV cache: a prompt fed in chunks (``GPT.prefill``, each chunk's queries the last of its keys), then
    one step; blocks of 16 queries over up to 56 keys, a local layer's cache holding its last 6."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    model = model_of(**CASES[case]).eval()
    idx = torch.randint(0, EOT, (2, 56), generator=torch.Generator().manual_seed(2))

    def prefill_and_step() -> list[torch.Tensor]:
        cache = KVCache.empty(model.config.n_layer)
        last = model.prefill(idx[:, :50], cache, chunk=40)  # chunks of 40 and 10 queries
        step, _ = model(idx[:, 50:], cache=cache)
        assert step is not None
        return [last, step]

    per_block = prefill_and_step()
    with whole_masks(monkeypatch):
        whole = prefill_and_step()
    assert_same(per_block, whole)


BIAS_SCHEMES: list[Any] = [
    name for name in positional.names() if positional.get(name).bias is not PositionalEncoding.bias
]


@pytest.mark.parametrize("pos", [*BIAS_SCHEMES, {"name": "fire", "init_threshold": 20}], ids=str)
@torch.no_grad()
def test_every_schemes_bias_rows_are_the_rows_of_its_whole_bias(pos):
    """``bias_rows(q, k)(start, end, keys)`` is ``bias(q, k)[:, start:end, :keys]`` for every bias scheme,
    for a whole window and for queries after cached keys (positions 24..55 over keys 8..55); FIRE also past
    its threshold, with rows of both its forms."""
    scheme = model_of(pos=pos).transformer.pos
    for q, k in ((torch.arange(48), torch.arange(48)), (torch.arange(24, 56), torch.arange(8, 56))):
        whole, rows = scheme.bias(q, k), scheme.bias_rows(q, k)
        offset = len(k) - len(q)
        for start, end in ((0, 16), (16, 32), (5, len(q))):
            keys = offset + end
            torch.testing.assert_close(
                rows(start, end, keys), whole[:, start:end, :keys], rtol=1e-6, atol=1e-6
            )


class LargestTensor(TorchDispatchMode):
    """The largest tensor (in bytes) that any operation makes while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.bytes:
                self.bytes, self.shape = t.numel() * t.element_size(), tuple(t.shape)
        return out


@pytest.mark.parametrize("case", ["alibi", "relative", "fire past its threshold", "alibi, windows"])
@torch.no_grad()
def test_a_long_sequences_forward_never_allocates_the_whole_mask(case):
    """T=1024 with 4 heads: the whole fp32 mask would be 4 x 1024 x 1024 x 4 B = 16 MiB. Every tensor the
    forward makes (each op's output, the mask's blocks and SDPA's scores included) is at most one block of
    QUERY_BLOCK queries over all the keys, 4 x 256 x 1024 x 4 B = 4 MiB (FIRE's hidden layer: 32 wide)."""
    T = 1024
    model = model_of(**CASES[case], block_size=T).eval()
    idx = torch.randint(0, EOT, (1, T), generator=torch.Generator().manual_seed(3))
    # FIRE's MLP past its threshold runs on each block's (rows, keys) pairs: its hidden layer of 32 is the
    # widest tensor there
    width = max(model.config.n_head, getattr(model.transformer.pos.options, "hidden", 0))
    block = width * attention.QUERY_BLOCK * T * 4
    with LargestTensor() as largest:
        logits, _ = model(idx)
    assert logits is not None and logits.shape == (1, T, 61)
    assert largest.bytes <= block, f"a tensor of {largest.shape} ({largest.bytes} bytes) was allocated"
    with LargestTensor() as whole:  # the measure sees the whole mask where it is built
        AttentionBias.build(model.transformer.pos, torch.arange(T), torch.arange(T), False).mask.whole()
    assert whole.bytes >= 4 * T * T  # (1 or 4, T, T): boolean, or fp32 floats


@contextmanager
def three_d_masks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the block SDPA gets the masks as (n_head or 1, rows, keys), as the route passed them before:
    its CPU kernel then takes its explicit route whatever the mask."""
    with monkeypatch.context() as patch:
        patch.setattr(attention, "fused_kernel_mask", lambda mask: mask)
        yield


FUSED = "ScaledDotProductFlashAttentionForCpuBackward0"  # the autograd node of SDPA's fused CPU kernel
EXPLICIT = "SafeSoftmaxBackward0"  # the softmax of SDPA's explicit route (the model has no other)


def sdpa_backward_nodes(out: torch.Tensor) -> list[str]:
    """The autograd nodes under ``out`` that SDPA's CPU routes leave, one per call: the fused kernel's, or the
    explicit route's softmax."""
    names, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [n for n in names if n in (FUSED, EXPLICIT)]


@pytest.mark.parametrize(
    ("case", "documents"),
    [
        *[(case, False) for case in ["alibi", "alibi, windows", "nope, windows", "relative"]],
        *[(case, False) for case in ["fire past its threshold", "fire, grouped-query"]],
        ("alibi", True),  # the whole (B, n_head, T, T) mask, sliced
        ("relative", True),
    ],
    ids=str,
)
def test_a_training_step_with_4d_masks_equals_the_3d_masks(case, documents, monkeypatch):
    """The masks passed 4-d, so that SDPA's CPU kernel takes its fused route where the mask needs no
    gradient: the logits and every gradient (the bias scheme's own parameters' included) equal those of the
    3-d masks and the explicit route, over three blocks of 16 queries. (With documents the masks were 4-d
    already.)"""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    model = model_of(**CASES[case]).train()
    idx = torch.randint(0, EOT, (2, 49), generator=torch.Generator().manual_seed(1))
    if documents:
        idx[0, 11], idx[0, 30], idx[1, 25] = EOT, EOT, EOT
    doc_ids = document_ids(idx[:, :-1], EOT) if documents else None
    four_d = logits_and_grads(model, idx, doc_ids)
    with three_d_masks(monkeypatch):
        three_d = logits_and_grads(model, idx, doc_ids)
    assert_same(four_d, three_d)


@pytest.mark.parametrize("case", ["alibi, windows", "relative, windows and cap", "fire, grouped-query"])
@torch.no_grad()
def test_queries_after_cached_keys_with_4d_masks_equal_the_3d_masks(case, monkeypatch):
    """A prompt fed in chunks after cached keys (``GPT.prefill``, the causal mask of a chunk without a bias
    too), then one step: the same logits with the masks passed 4-d as 3-d."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    model = model_of(**CASES[case]).eval()
    idx = torch.randint(0, EOT, (2, 56), generator=torch.Generator().manual_seed(2))

    def prefill_and_step() -> list[torch.Tensor]:
        cache = KVCache.empty(model.config.n_layer)
        last = model.prefill(idx[:, :50], cache, chunk=40)
        step, _ = model(idx[:, 50:], cache=cache)
        assert step is not None
        return [last, step]

    four_d = prefill_and_step()
    with three_d_masks(monkeypatch):
        three_d = prefill_and_step()
    assert_same(four_d, three_d)


@pytest.mark.parametrize(
    ("case", "fused"),
    [("alibi", True), ("nope, windows", True), ("fire, grouped-query", False), ("relative", False)],
)
def test_the_fused_kernel_is_taken_where_the_mask_needs_no_gradient_and_keeps_less(case, fused, monkeypatch):
    """Where the mask needs no gradient (ALiBi's, a window's booleans) every block of a training step takes
    SDPA's fused CPU kernel, and what the step keeps for its backward is less than the explicit route kept
    (the mask, not the batch's attention weights); a learned bias (``relative``, ``fire``) needs its gradient,
    which only the explicit route gives: those steps are as before, byte for byte."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    model = model_of(**CASES[case]).train()
    idx = torch.randint(0, EOT, (4, 48), generator=torch.Generator().manual_seed(3))

    def kept_for_backward() -> tuple[list[str], int]:
        kept: dict[tuple[int, int], int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            kept[(t.untyped_storage().data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, _ = model(idx)
        assert logits is not None
        return sdpa_backward_nodes(logits), sum(kept.values())

    nodes, kept = kept_for_backward()
    with three_d_masks(monkeypatch):
        nodes_3d, kept_3d = kept_for_backward()
    masked_blocks = nodes_3d.count(EXPLICIT)  # one per masked block
    assert masked_blocks >= 3  # three blocks of 16 queries in each masked layer
    if fused:
        assert EXPLICIT not in nodes
        assert nodes.count(FUSED) == nodes_3d.count(FUSED) + masked_blocks
        assert kept < kept_3d
    else:
        assert nodes == nodes_3d
        assert kept == kept_3d
