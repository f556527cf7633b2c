"""loss.z_loss (PaLM) and loss.final_softcap (Gemma 2): the values and gradients against a direct computation
on the plain and chunked heads, the cap's bound wherever the model produces logits, the refusals at config
time, and a tiny training run with each."""

import csv
import json

import pytest
import torch
import torch.nn.functional as F

from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss, chunked_loss_terms, plain_loss_terms
from gptlab.training.module import GPTLitModule
from tests.conftest import TINY

TOL = dict(rtol=1e-5, atol=1e-6)


def problem(n=37, c=16, v=101, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g, requires_grad=True)
    # large weights: logits well past the cap, log Z far from 0
    weight = torch.randn(v, c, generator=g).mul_(3.0).requires_grad_()
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -1  # ignored rows count in neither term
    return hidden, weight, b, targets


def direct(hidden, weight, bias, targets, z_loss, cap):
    """The objective written out: cross-entropy of the (capped) logits + z_loss * mean of logsumexp^2."""
    logits = F.linear(hidden, weight, bias)
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    kept = targets != -1
    lse = torch.logsumexp(logits[kept], dim=-1)
    cross_entropy = F.cross_entropy(logits[kept], targets[kept])
    return cross_entropy + z_loss * lse.square().mean(), cross_entropy, lse.square().mean()


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("impl", ["plain", "chunked-3", "chunked-8", "chunked-100"])
@pytest.mark.parametrize("z_loss,cap", [(1e-4, None), (0.1, None), (0.0, 5.0), (0.1, 5.0)])
@pytest.mark.parametrize("bias", [False, True])
def test_z_loss_and_softcap_equal_the_direct_formula_in_loss_and_gradients(impl, z_loss, cap, bias):
    hidden, weight, b, targets = problem(bias=bias)
    expected, expected_ce, expected_z = direct(hidden, weight, b, targets, z_loss, cap)
    if impl == "plain":
        terms = plain_loss_terms(hidden, weight, targets, b, -1, z_loss, cap)
    else:
        rows = int(impl.split("-")[1])
        terms = chunked_loss_terms(hidden, weight, targets, b, -1, rows, z_loss, cap)
    torch.testing.assert_close(terms.loss, expected, **TOL)
    torch.testing.assert_close(terms.cross_entropy, expected_ce, **TOL)
    if z_loss:
        assert terms.lse_square is not None
        torch.testing.assert_close(terms.lse_square, expected_z, **TOL)
        assert expected_z > 1.0  # the test's log Z is far from 0: the term is not vanishing
    else:
        assert terms.lse_square is None
    for got, want in zip(
        grads(terms.loss, (hidden, weight, b)), grads(expected, (hidden, weight, b)), strict=True
    ):
        # fp32 sums over chunks of rows in another order: rounding at the gradient's own scale (its largest
        # entries ~1.7; an AMD EPYC's kernels put one entry 1.4e-6 off, where 1e-6 alone was the bound)
        scale = float(want.abs().max().clamp_min(1.0))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale)


def test_the_cap_changes_the_loss_and_bounds_every_logit_the_model_produces():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(400.0)  # raw logits in the hundreds
    idx = torch.randint(0, 50, (2, 16))
    raw, _ = model(idx)
    assert raw.abs().max() > 30
    model.final_softcap = 30.0
    logits, loss = model(idx, idx)
    assert logits.abs().max() < 30
    torch.testing.assert_close(logits, 30.0 * torch.tanh(raw / 30.0))
    # the training heads see the same capped logits as the model's own forward
    for impl in ("plain", "chunked"):
        _, head = model(idx, idx, head_loss=HeadLoss(impl, chunk_rows=5, final_softcap=30.0))
        torch.testing.assert_close(head, loss, **TOL)
    with pytest.raises(ValueError, match="the loss caps logits at None but the model at 30.0"):
        model(idx, idx, head_loss=HeadLoss("chunked"))
    # generation with the KV cache scores the same capped logits as without it
    model.eval()
    prompt = idx[:, :4]
    with_cache = model.generate(prompt, 8, use_cache=True)
    without = model.generate(prompt, 8, use_cache=False)
    assert torch.equal(with_cache, without)


def test_the_module_gives_the_model_the_cap_and_logs_the_cross_entropy_apart():
    config = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    module = GPTLitModule(model=config, loss={"impl": "chunked", "z_loss": 1e-2, "final_softcap": 3.0})
    assert module.model.final_softcap == 3.0
    assert module.hparams["loss"] == {
        "impl": "chunked",
        "chunk_rows": None,
        "z_loss": 1e-2,
        "final_softcap": 3.0,
    }


@pytest.mark.parametrize(
    "loss,expected",
    [
        (
            {"impl": "torch", "z_loss": 1e-4},
            r"loss.z_loss=0.0001 cannot be computed by loss.impl=torch: torch's F.linear_cross_entropy returns "
            r"only the mean loss.*Use loss.impl=chunked, plain or auto \(which takes chunked\), or loss.z_loss=0",
        ),
        (
            {"impl": "liger", "final_softcap": 30},
            r"loss.final_softcap=30 cannot be computed by loss.impl=liger: Liger-Kernel's fused kernel has "
            r"lse_square_scale and softcap arguments.*or loss.final_softcap=null",
        ),
        (
            {"impl": "cce", "z_loss": 1e-4, "final_softcap": 30},
            r"loss.z_loss=0.0001 and loss.final_softcap=30 cannot be computed by loss.impl=cce",
        ),
        ({"z_loss": -1e-4}, r"loss.z_loss=-0.0001 must be a number >= 0"),
        ({"z_loss": True}, r"loss.z_loss=True must be a number >= 0"),
        ({"final_softcap": 0}, r"loss.final_softcap=0 must be a positive number \(Gemma 2 used 30\) or null"),
    ],
)
def test_bad_combinations_are_refused_at_config_time(loss, expected):
    with pytest.raises(ConfigError, match=expected):
        HeadLoss.from_node(loss)


def test_auto_takes_a_head_that_computes_the_terms():
    assert HeadLoss("auto", z_loss=1e-4).resolve("cuda", installed={"cut_cross_entropy", "liger_kernel"}) == (
        "chunked"
    )


def test_a_run_refuses_the_combination_before_it_starts(make_cfg, tmp_path):
    from gptlab.config import parse_gpt

    cfg = make_cfg(*TINY, "loss.impl=torch", "loss.final_softcap=30", f"paths.output_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match="loss.final_softcap=30 cannot be computed by loss.impl=torch"):
        parse_gpt(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["loss.z_loss=1e-2", "loss.final_softcap=5"])
def test_a_tiny_run_trains_with_each_term(make_cfg, tmp_path, capsys, override):
    from gptlab.runs.trained import load_run
    from gptlab.tasks.gpt import run

    out = tmp_path / "run"
    cfg = make_cfg(*TINY, "tokenizer=char", "logger=csv", f"paths.output_dir={out}", override)
    metrics = run(cfg)
    printed = capsys.readouterr().out
    result = json.loads((out / "result.json").read_text())["metrics"]
    assert result["val/bpb"] == pytest.approx(metrics["val/bpb"]) and 0 < result["val/bpb"] < 10
    assert f"Final validation loss {metrics['val/loss']:.4f} nats" in printed
    assert f", {metrics['val/bpb']:.4f} bits per byte;" in printed
    with open(next(out.glob("csv/**/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("val/bpb") for r in rows)
    z_logged = [float(r["train/z_loss"]) for r in rows if r.get("train/z_loss")]
    if override.startswith("loss.z_loss"):
        # 1e-2 * log^2 Z, positive, and not folded into train/loss
        assert z_logged and all(z > 0 for z in z_logged)
    else:
        assert not z_logged
        trained = load_run(out)
        assert trained.model.final_softcap == 5.0
        logits, _ = trained.model(torch.zeros(1, 4, dtype=torch.long))
        assert logits.abs().max() < 5.0


def test_the_model_card_records_the_terms():
    from gptlab.planning import model_card

    config = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    card = model_card(config, short=True, loss=HeadLoss(z_loss=1e-4, final_softcap=30))
    assert "Loss: cross-entropy + z-loss 0.0001 x log^2 Z (PaLM; loss.z_loss" in card
    assert "final logits softcapped to 30 x tanh(logits / 30) (Gemma 2; loss.final_softcap" in card
    assert "Loss:" not in model_card(config, short=True, loss=HeadLoss())
