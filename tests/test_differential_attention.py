"""Differential attention (``attention.differential=true``, model/attention_variants.py DifferentialAttention;
Ye et al. 2024, "Differential Transformer"): the paper's arithmetic by hand, its lambda_init per layer, the model
against the attention written out, the KV cache, the counts, the refusals at config time, and a training run
through the run path. That the variant off leaves today's model is test_parity.py's (unchanged) and the check
of the weights below."""

from __future__ import annotations

import csv
import logging
import math

import pytest
import torch
from conftest import TINY, assert_cached_decoding_is_the_whole_pass

import gptlab
from gptlab.errors import ConfigError
from gptlab.model.attention_variants import AttentionOptions, DifferentialAttention
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

DIFFERENTIAL = {"differential": True}


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=61, block_size=64, n_layer=2, n_head=4, n_embd=32, pos="nope")
    return GPTConfig(**{**base, **kw})


def model_of(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny(**kw)).eval()


def moved_from_init(model: GPT) -> GPT:
    """The lambda vectors larger and the head norms' gains away from 1, so that a mistake in either shows."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".differential.lambda_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.4)
            elif name.endswith("differential.norm.weight"):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
    return model


def test_one_token_by_hand():
    """Head dimension 2: each half one dimension. lambda = exp(0.5 * 0.4) - exp(0 * 1) + 0.2 in the first
    layer; the head's output (3, 1) - lambda (1, 1), normalised to unit RMS, times the gain and 1 - 0.2."""
    diff = DifferentialAttention(layer=0, head_dim=2)
    with torch.no_grad():
        for name, value in (("lambda_q1", 0.5), ("lambda_k1", 0.4), ("lambda_q2", 0.0), ("lambda_k2", 1.0)):
            getattr(diff, name).fill_(value)
        diff.norm.weight.copy_(torch.tensor([1.0, 2.0]))
    lam = math.exp(0.2) - 1.0 + 0.2
    assert float(diff.lambda_().detach()) == pytest.approx(lam)
    y1 = torch.tensor([3.0, 1.0]).view(1, 1, 1, 2)  # (B, heads, T, head_dim)
    y2 = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    a, b = 3.0 - lam, 1.0 - lam
    rms = math.sqrt((a * a + b * b) / 2 + DifferentialAttention.EPS)
    expected = torch.tensor([a / rms * 1.0, b / rms * 2.0]) * 0.8
    torch.testing.assert_close(diff(y1, y2).view(2), expected)
    # q and k split into the first and the second half of each head
    first, second = diff.split(torch.arange(8.0).view(1, 2, 1, 4))
    assert first.flatten().tolist() == [0, 1, 4, 5] and second.flatten().tolist() == [2, 3, 6, 7]


def test_lambda_init_per_layer_is_the_papers_formula():
    """lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), l the 1-based layer: 0.2 in the first layer, rising to 0.8;
    each layer of a model holds its own, and its vectors are drawn N(0, 0.1^2), each layer's differently."""
    for layer in range(24):
        l = layer + 1  # noqa: E741 - the paper's name
        assert DifferentialAttention.initial_lambda(layer) == pytest.approx(
            0.8 - 0.6 * math.exp(-0.3 * (l - 1))
        )
    assert DifferentialAttention.initial_lambda(0) == pytest.approx(0.2)
    assert DifferentialAttention.initial_lambda(11) == pytest.approx(0.8 - 0.6 * math.exp(-3.3))
    model = model_of(n_layer=4, attention=DIFFERENTIAL)
    inits = [block.attn.differential.lambda_init for block in model.transformer.h]
    assert inits == [DifferentialAttention.initial_lambda(i) for i in range(4)]
    assert inits == sorted(inits) and inits[0] == pytest.approx(0.2)
    vectors = torch.stack([block.attn.differential.lambda_q1.detach() for block in model.transformer.h])
    assert vectors.shape == (4, 4)  # head_dim / 2 = 4
    assert 0.03 < float(vectors.std()) < 0.3 and not torch.equal(vectors[0], vectors[1])


def attention_by_hand(attn, x: torch.Tensor, rope=None) -> torch.Tensor:
    """The paper's differential attention written out for one layer, over GQA; with ``rope`` the queries and
    keys are rotated, and each half takes the rotation pairs (j, j + d/2) of even j, or of odd j."""
    B, T, C = x.shape
    H, Hkv, d = attn.n_head, attn.n_kv_head, attn.head_dim
    q, k, v = attn.c_attn(x).split([H * d, Hkv * d, Hkv * d], dim=-1)
    q = q.view(B, T, H, d).transpose(1, 2)
    k = k.view(B, T, Hkv, d).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    v = v.view(B, T, Hkv, d).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    if rope is None:
        first, second = list(range(d // 2)), list(range(d // 2, d))
    else:
        q, k = rope.rotate(q, k, torch.arange(T))
        first = [j + h for j in range(0, d // 2, 2) for h in (0, d // 2)]
        second = [j + h for j in range(1, d // 2, 2) for h in (0, d // 2)]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)

    def softmax_map(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(d / 2)  # s = 1 / sqrt(the half width)
        return scores.masked_fill(future, float("-inf")).softmax(-1)

    diff = attn.differential
    lam = (
        torch.exp((diff.lambda_q1 * diff.lambda_k1).sum())
        - torch.exp((diff.lambda_q2 * diff.lambda_k2).sum())
        + diff.lambda_init
    )
    y = (softmax_map(q[..., first], k[..., first]) - lam * softmax_map(q[..., second], k[..., second])) @ v
    y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * diff.norm.weight  # headwise RMSNorm
    y = y * (1 - diff.lambda_init)
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("pos", ["nope", "rope"])
@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
@torch.no_grad()
def test_the_model_is_the_papers_differential_attention_written_out(n_kv_head, pos):
    """A 3-layer model (multi-head, grouped-query, multi-query) against the softmax written out: each
    layer's lambda_init its own, the two maps over the same whole-head values."""
    model = moved_from_init(model_of(n_layer=3, n_kv_head=n_kv_head, pos=pos, attention=DIFFERENTIAL))
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    x = model.transformer.wte(idx)
    rope = model.transformer.pos if pos == "rope" else None
    for block in model.transformer.h:
        x = x + attention_by_hand(block.attn, block.ln_1(x), rope)
        x = x + block.mlp(block.ln_2(x))
    expected = model.lm_head(model.transformer.ln_f(x))[..., : model.config.vocab_size]  # the padding cut
    torch.testing.assert_close(model(idx)[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos", ["rope", "xpos"])
@torch.no_grad()
def test_under_a_rotary_scheme_each_halfs_scores_depend_on_the_distance_alone(pos):
    """q.k of each half, rotated at positions (m, n), equals the same at (m + 37, n + 37): each half holds
    whole rotation pairs. The first and last head_dim / 2 dimensions would not (the check can fail)."""
    model = model_of(pos=pos, n_embd=64, attention=DIFFERENTIAL)  # head_dim 16
    scheme, diff = model.transformer.pos, model.transformer.h[0].attn.differential
    q, k = torch.randn(2, 1, 4, 16, generator=torch.Generator().manual_seed(1)).unbind(0)
    positions = torch.tensor([3, 5, 11, 12])

    def scores(shift: int, split) -> list[torch.Tensor]:
        rq, rk = scheme.rotate(q, k, positions + shift)
        return [a @ b.transpose(-2, -1) for a, b in zip(split(rq), split(rk), strict=True)]

    for here, there in zip(scores(0, diff.split), scores(37, diff.split), strict=True):
        torch.testing.assert_close(here, there, rtol=1e-4, atol=1e-4)
    plain_halves = scores(0, lambda x: x.chunk(2, dim=-1)), scores(37, lambda x: x.chunk(2, dim=-1))
    assert (plain_halves[0][0] - plain_halves[1][0]).abs().max() > 1e-2


@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "nope", "rope", "xpos"])
@torch.no_grad()
def test_kv_cache_decoding_equals_the_whole_sequence(pos):
    """With GQA, QK-norm, the output gate and the value residual on too: a prompt, a chunk and then one token
    at a time over the cache give the whole pass's logits, and greedy generation is the same with the cache
    and without."""
    attention = {**DIFFERENTIAL, "qk_norm": "rmsnorm", "gate": "headwise", "value_residual": "learnable"}
    model = moved_from_init(model_of(pos=pos, n_layer=3, n_kv_head=2, attention=attention))
    assert_cached_decoding_is_the_whole_pass(model, new_tokens=9)


@torch.no_grad()
def test_off_it_is_todays_model_and_on_every_other_weight_is_todays_at_one_seed():
    """differential=false is the default node; on, the model adds the lambda vectors and the head norms, and
    draws them without touching the global generator: every other weight is the plain model's."""
    assert AttentionOptions(differential=False).is_default
    assert not AttentionOptions(differential=True).is_default
    plain, diff = model_of(n_kv_head=2), model_of(n_kv_head=2, attention=DIFFERENTIAL)
    plain_state, diff_state = plain.state_dict(), diff.state_dict()
    added = {name for name in diff_state if ".differential." in name}
    assert set(diff_state) - set(plain_state) == added and len(added) == 2 * 5
    assert all(torch.equal(diff_state[name], value) for name, value in plain_state.items())
    idx = torch.randint(0, 61, (2, 16))
    assert not torch.allclose(diff(idx)[0], plain(idx)[0])
    # the plain model's forward pass is untouched by the variant's code path
    assert all(block.attn.differential is None for block in plain.transformer.h)


def test_counted_in_parameters_flops_and_the_model_card():
    """The counted parameters are the built model's (four lambda vectors of head_dim / 2 and a gain of
    head_dim per layer); the attention FLOPs are 3/2 of plain attention's (two half-width score products,
    together one full one, and two value products), the matrices' unchanged; the card names it."""
    from gptlab.model.counting import flops_per_token, parameter_counts
    from gptlab.planning import model_card

    for n_kv_head in (None, 1):
        config = tiny(n_layer=3, n_kv_head=n_kv_head, attention=DIFFERENTIAL)
        assert parameter_counts(config)["total"] == GPT(config).parameter_counts()["total"]
        plain_config = tiny(n_layer=3, n_kv_head=n_kv_head)
        assert parameter_counts(config)["total"] - parameter_counts(plain_config)["total"] == 3 * (4 * 4 + 8)
    plain = flops_per_token(tiny(n_layer=3), 64)
    diff = flops_per_token(tiny(n_layer=3, attention=DIFFERENTIAL), 64)
    assert plain["attention"] == 12 * 3 * 32 * 64
    assert diff["attention"] == 18 * 3 * 32 * 64
    assert diff["dense"] == plain["dense"]
    line = model_card(tiny(attention={**DIFFERENTIAL, "gate": "elementwise"}), short=True).splitlines()[0]
    assert line.endswith("; attention: elementwise output gate, differential")


def test_its_vectors_are_gains_for_the_optimizer():
    """The lambda vectors and the head norm's gain are vectors: no weight decay, the plain learning rate."""
    from gptlab.training.optimizers import build_optimizer, parse_optim

    model = model_of(n_layer=2, attention=DIFFERENTIAL)
    optimizer = build_optimizer(model, parse_optim({"lr": 1e-2, "weight_decay": 0.1}), 1.0)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if ".differential." in name:
            assert group_of[id(p)]["weight_decay"] == 0.0 and group_of[id(p)]["lr"] == 1e-2, name


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["attention=differential", "model.n_embd=36", "model.n_head=4"],
            "the head dimension (model.n_embd / model.n_head) is 9, odd",
        ),
        (
            ["attention=differential", "pos=rope", "pos.rotary_fraction=0.5"],
            "with pos=rope splits each head by its rotation pairs",
        ),
        (
            ["attention=differential", "pos=xpos", "model.n_embd=24", "model.n_head=4"],
            "pos.rotary_fraction=1 and head dimension 6",
        ),
        (["attention=differential", "pos=alibi"], "cannot take pos=alibi: a bias scheme's attention"),
        (["attention=differential", "pos=fire"], "cannot take pos=fire"),
        (["attention=differential", "attention.window=8"], "cannot take attention.window=8"),
        (
            ["attention=differential", "attention.logit_softcap=30"],
            "cannot take attention.logit_softcap=30.0",
        ),
        (
            ["attention=differential", "model.param=mup", "model.mup_base_width=32"],
            "cannot take model.param=mup",
        ),
        (["attention.differential=maybe"], "attention.differential"),
    ],
)
def test_what_it_cannot_combine_with_is_refused_at_config_time(make_cfg, overrides, message):
    with pytest.raises(ConfigError) as err:
        gptlab.build_model_config(make_cfg("pos=learned", *overrides))
    assert message in str(err.value)


def test_trains_through_the_run_path_to_a_falling_loss_and_its_checkpoint_keeps_it(
    make_cfg, tmp_path, caplog
):
    """Through the run path of `python train.py attention=differential`: 10 steps of a 2-layer model log a
    finite training loss at every step, the last steps' lower than the first's, and the run loads back with
    the variant on."""
    from gptlab.runs.trained import load_run
    from gptlab.tasks.gpt import run

    run_dir = tmp_path / "run"
    args = [*TINY, "model.n_layer=2", "tokenizer=char", "pos=learned", "trainer.max_steps=10"]
    args += ["optim.warmup_steps=2", "trainer.val_check_interval=10", "trainer.log_every_n_steps=1"]
    args += ["logger=csv", "callbacks.sample_generation=null", "attention=differential"]
    with caplog.at_level(logging.INFO):
        run(make_cfg(*args, f"paths.output_dir={run_dir}"))
    assert "attention: differential" in caplog.text  # the model card at the start of the run
    metrics = next(run_dir.glob("csv/**/metrics.csv"))
    losses = [float(r["train/loss"]) for r in csv.DictReader(open(metrics)) if r.get("train/loss")]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    trained = load_run(run_dir)
    assert trained.model.config.attention.differential
    lambdas = [
        float(block.attn.differential.lambda_q1.detach().abs().sum()) for block in trained.model.transformer.h
    ]
    assert all(math.isfinite(v) for v in lambdas)


@torch.no_grad()
def test_a_document_mask_on_a_cpu_keeps_each_document_to_itself():
    """data.document_mask's masked route (a CPU's): the second document of a packed window gives the logits it
    gives alone."""
    model = moved_from_init(model_of(pos="learned", n_kv_head=2, attention=DIFFERENTIAL))
    idx = torch.randint(0, 61, (1, 12))
    documents = torch.tensor([[0] * 5 + [1] * 7])
    packed = model(idx, doc_ids=documents)[0]
    torch.testing.assert_close(packed[:, 5:], model(idx[:, 5:])[0], rtol=0, atol=1e-5)


def test_flex_attentions_block_mask_is_refused_with_the_override_that_avoids_it():
    """On CUDA a document mask goes through FlexAttention, which the variant does not take: the first forward
    pass says so (a model built without a run's config, through the Python API; a run is refused when its config
    is read, below)."""
    from gptlab.model.attention import AttentionBias

    model = model_of(attention=DIFFERENTIAL)
    x = torch.randn(1, 4, 32)
    bias = AttentionBias(block_mask=object())  # what AttentionBias.build gives on CUDA
    with pytest.raises(ConfigError, match="cannot take data.document_mask=true on CUDA"):
        model.transformer.h[0].attn(x, model.transformer.pos, torch.arange(4), None, bias)


@pytest.mark.parametrize(("accelerator", "refused"), [("cuda", True), ("gpu", True), ("cpu", False)])
def test_a_document_mask_is_refused_before_the_data_where_the_run_trains_on_cuda(
    make_cfg, accelerator, refused
):
    """The run's trainer says where it trains: on CUDA the combination is refused when the config is parsed
    (the parse's own check; a machine without CUDA refuses trainer.accelerator=gpu itself, before it)."""
    from gptlab.config import check_document_mask, parse_model
    from gptlab.data.sources import parse_data

    cfg = make_cfg("pos=learned", "attention=differential", "data.document_mask=true")
    model, _, _ = parse_model(cfg)
    _, loader = parse_data(cfg.data)
    if not refused:
        check_document_mask(model, loader, {"accelerator": accelerator})
        return
    with pytest.raises(ConfigError, match="cannot take data.document_mask=true on CUDA"):
        check_document_mask(model, loader, {"accelerator": accelerator})
