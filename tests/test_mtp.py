"""Multi-token prediction (mtp.depth, model/mtp.py): off, the model and its loss are today's to the bit; each
extra head's loss is the cross-entropy of the k-shifted targets written out here; targets beyond the window
and in another document are ignored; every head trains the trunk; val/loss stays the next-token loss;
generation takes the next-token head; a tiny run learns and resumes exactly; counts; every refusal; the heads'
blocks are checkpointed, compiled and sharded as the trunk's."""

from __future__ import annotations

import csv
import math
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptlab.errors import ConfigError
from gptlab.model import counting
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss, RecordingHeadLoss
from gptlab.model.mtp import MTPOptions, shifted_targets
from tests.conftest import CPU_AND_CUDA, TINY

V, T, B = 61, 12, 3
SMALL = dict(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=16)
IMPLS = ["plain", "chunked"]


def model_of(seed: int = 0, **options) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**SMALL, **options))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def recorded(model: GPT, x, y, impl: str = "plain", doc_ids=None, mtp: bool = True):
    head = RecordingHeadLoss.of(HeadLoss(impl))
    _, objective = model(x, y, head_loss=head, doc_ids=doc_ids, mtp=mtp)
    return objective, [terms.loss for terms in head.calls]


def cross_entropy_by_hand(logits: torch.Tensor, kept: list[tuple[int, int, int]]) -> torch.Tensor:
    """The mean of -log softmax(logits[b, i])[target] over the (b, i, target) listed."""
    terms = [-torch.log_softmax(logits[b, i].double(), dim=-1)[t] for b, i, t in kept]
    return torch.stack(terms).mean()


def logits_of(model: GPT, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.transformer.ln_f(hidden))[..., :V]


def trunk_and_final(model: GPT, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and the output of the model's last layer, caught by hooks on an ordinary forward pass."""
    caught = {}
    last = model.transformer.h[-1]

    def catch_input(module, args):
        caught["trunk"] = args[0]

    def catch_output(module, args, out):
        caught["final"] = out[0]

    pre = last.register_forward_pre_hook(catch_input)
    post = last.register_forward_hook(catch_output)
    model(x)
    pre.remove()
    post.remove()
    return caught["trunk"], caught["final"]


# ---- off: today's model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_depth_zero_is_todays_model_and_loss_to_the_bit(impl):
    x, y = batch()
    today, off = model_of(), model_of(mtp={"depth": 0})
    assert off.mtp is None and GPTConfig(**SMALL).mtp == MTPOptions()
    assert today.state_dict().keys() == off.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(today.state_dict().values(), off.state_dict().values()))
    base, calls = recorded(today, x, y, impl, mtp=False)
    with_flag, calls_off = recorded(off, x, y, impl, mtp=True)
    assert torch.equal(base, with_flag) and len(calls) == len(calls_off) == 1
    # with extra heads, the model's own weights draw what they draw without them; its next-token loss is the same
    on = model_of(mtp={"depth": 2})
    for name, tensor in today.state_dict().items():
        assert torch.equal(tensor, on.state_dict()[name]), name
    assert {k for k in on.state_dict() if k not in today.state_dict()} == {
        k for k in on.state_dict() if k.startswith("mtp.blocks.")
    }
    next_token, _ = recorded(on, x, y, impl, mtp=False)
    assert torch.equal(next_token, base)


# ---- each head's loss against the cross-entropy written out -----------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_each_parallel_heads_loss_is_the_k_shifted_cross_entropy_of_its_own_layer(impl):
    model = model_of(mtp={"depth": 3, "weight": 0.5})
    x, y = batch()
    objective, losses = recorded(model, x, y, impl)
    assert len(losses) == 4
    for k in range(1, 4):
        # head k is another last layer on the same trunk: the model with its last layer swapped for head k
        swapped = model_of(mtp={"depth": 3, "weight": 0.5})
        swapped.load_state_dict(model.state_dict())
        swapped.transformer.h[-1].load_state_dict(model.mtp.blocks[k - 1].state_dict())
        logits, _ = swapped(x)
        kept = [(b, i, int(y[b, i + k])) for b in range(B) for i in range(T - k)]
        expected = cross_entropy_by_hand(logits, kept)
        torch.testing.assert_close(losses[k].double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(objective, losses[0] + 0.5 * sum(losses[1:]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_each_sequential_modules_loss_is_the_k_shifted_cross_entropy_of_its_chain(impl):
    model = model_of(mtp={"depth": 2, "style": "sequential", "weight": 0.3})
    x, y = batch()
    objective, losses = recorded(model, x, y, impl)
    _, previous = trunk_and_final(model, x)
    tokens = torch.cat([x, y[:, -1:]], dim=1)  # tokens[:, j]: the window's j-th token, the last target last
    heads = model.mtp
    positions = torch.arange(T)
    for k in range(1, 3):
        ahead = torch.zeros_like(x)
        ahead[:, : T + 1 - k] = tokens[:, k:]
        mixed = torch.cat(
            [heads.norm_hidden[k - 1](previous), heads.norm_embed[k - 1](model.transformer.wte(ahead))],
            dim=-1,
        )
        previous, _ = heads.blocks[k - 1](heads.proj[k - 1](mixed), model.transformer.pos, positions)
        kept = [(b, i, int(y[b, i + k])) for b in range(B) for i in range(T - k)]
        expected = cross_entropy_by_hand(logits_of(model, previous), kept)
        torch.testing.assert_close(losses[k].double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(objective, losses[0] + 0.3 * (losses[1] + losses[2]), rtol=1e-6, atol=1e-6)


# ---- ignored targets --------------------------------------------------------------------------------------


def test_targets_beyond_the_window_and_in_another_document_are_ignored():
    targets = torch.tensor([[10, 11, 12, 13, 14, 15], [20, -1, 22, 23, 24, 25]])
    assert shifted_targets(targets, 2, None).tolist() == [[12, 13, 14, 15, -1, -1], [22, 23, 24, 25, -1, -1]]
    # documents of the inputs (an end-of-text token starts the next one): the next-token target at j belongs
    # to doc_ids[j], so position i keeps targets[i + k] where doc_ids[i + k] == doc_ids[i]
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2]])
    assert shifted_targets(targets, 1, docs).tolist() == [[11, 12, -1, 14, 15, -1], [-1, 22, 23, 24, -1, -1]]
    assert shifted_targets(targets, 2, docs).tolist() == [[12, -1, -1, 15, -1, -1], [-1, 23, 24, -1, -1, -1]]
    assert shifted_targets(targets, 6, docs).eq(-1).all()


@pytest.mark.parametrize("style", ["parallel", "sequential"])
def test_a_head_scores_only_its_documents_targets_and_adds_nothing_where_it_has_none(style):
    from gptlab.data.datamodule import document_ids

    eot = 0
    model = model_of(mtp={"depth": 2, "style": style})
    x, y = batch()
    x = x.clamp_min(1)
    x[0, 4] = x[1, 7] = x[2, 2] = x[2, 9] = eot
    docs = document_ids(x, eot)
    _, with_docs = recorded(model, x, y, doc_ids=docs)
    _, without = recorded(model, x, y, doc_ids=None)
    # the positions i whose target one token after the next lies in their own document, chosen here by hand
    kept = [(b, i) for b in range(B) for i in range(T - 1) if docs[b, i + 1] == docs[b, i]]
    assert 0 < len(kept) < B * (T - 1)
    # head 1's loss is the mean over those positions of each one's loss alone (that target the only one kept)
    per_target = []
    for b, i in kept:
        alone = torch.full_like(y, -1)
        alone[b, i + 1] = y[b, i + 1]
        _, one = recorded(model, x, alone, doc_ids=docs)
        per_target.append(one[1])
    torch.testing.assert_close(with_docs[1], torch.stack(per_target).mean(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(with_docs[1], without[1])
    # every document one token long: no head has a target, the objective is the next-token loss, finite
    x_all = torch.zeros_like(x)
    objective, losses = recorded(model, x_all, y, doc_ids=document_ids(x_all, eot))
    assert len(losses) == 1 and torch.isfinite(objective) and torch.equal(objective, losses[0])
    objective.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the heads took part (a zero gradient for each of their weights, as distributed data parallel expects)
    assert all(p.grad is not None and not p.grad.any() for p in model.mtp.parameters())


# ---- gradients --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["parallel", "sequential"])
def test_every_head_sends_gradients_to_the_trunk_and_its_own_weights_alone(style):
    model = model_of(mtp={"depth": 2, "style": style})
    x, y = batch()
    _, losses = recorded(model, x, y)
    trunk = [model.transformer.wte.weight, model.transformer.h[0].attn.c_attn.weight]
    own = [block.mlp.c_fc.weight for block in model.mtp.blocks]
    for k in (1, 2):
        grads = torch.autograd.grad(losses[k], trunk + own, retain_graph=True, allow_unused=True)
        assert all(g is not None and g.abs().sum() > 0 for g in grads[: len(trunk)]), k
        assert grads[len(trunk) + k - 1].abs().sum() > 0
        later = grads[len(trunk) + k :]  # a later head's layer takes no part in head k's loss
        assert all(g is None or g.abs().sum() == 0 for g in later)
    # the next-token loss does not train the extra heads
    grads = torch.autograd.grad(losses[0], own, allow_unused=True)
    assert all(g is None for g in grads)


# ---- evaluation and generation ------------------------------------------------------------------------------


def test_evaluation_and_generation_take_the_next_token_head_alone():
    model = model_of(mtp={"depth": 2})
    x, y = batch()
    head = RecordingHeadLoss.of(HeadLoss("plain"))
    _, loss = model(x, y, head_loss=head)  # without mtp=True: evaluation's call
    assert len(head.calls) == 1
    logits, plain = model(x, y)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    without = model_of(mtp={"depth": 2})
    without.load_state_dict(model.state_dict())
    without.mtp = None
    prompt = x[:1, :4]
    assert torch.equal(model.generate(prompt, 6), without.generate(prompt, 6))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    sampled = model.generate(prompt, 6, temperature=1.0, generator=g1)
    assert torch.equal(sampled, without.generate(prompt, 6, temperature=1.0, generator=g2))


def test_the_modules_validation_loss_is_the_next_token_cross_entropy(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from gptlab.training.module import GPTLitModule

    torch.manual_seed(0)
    module = GPTLitModule(model={**SMALL, "mtp": {"depth": 2}}, loss={"impl": "plain"})
    x, y = batch()
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=tmp_path, enable_model_summary=False,
    )  # fmt: skip
    (metrics,) = trainer.validate(module, loader, verbose=False)
    with torch.no_grad():
        logits, _ = module.model(x)
        objective, _ = recorded(module.model, x, y)
    expected = F.cross_entropy(logits.flatten(0, 1).double(), y.flatten())
    assert metrics["val/loss"] == pytest.approx(float(expected), rel=1e-5)
    assert objective > expected * 1.5  # what the heads add: not in val/loss


# ---- a run ------------------------------------------------------------------------------------------------


def csv_rows(run_dir):
    with open(next(run_dir.glob("csv/**/metrics.csv"))) as f:
        return list(csv.DictReader(f))


def test_with_a_z_loss_each_heads_term_is_logged_and_the_objective_is_their_sum(make_cfg, tmp_path):
    """Every output call adds its z-loss to what the step differentiates: the next-token head's is train/z_loss,
    head k's train/mtp_z_loss_<k>, and the logged parts add up to train/objective."""
    from gptlab.tasks.gpt import run

    out = tmp_path / "run"
    overrides = [*TINY, "tokenizer=char", "logger=csv", "trainer.max_steps=3", "trainer.log_every_n_steps=1"]
    run(make_cfg(*overrides, "mtp.depth=2", "mtp.weight=0.5", "loss.z_loss=0.01", f"paths.output_dir={out}"))
    rows = [r for r in csv_rows(out) if r.get("train/objective")]
    assert len(rows) == 3
    for r in rows:
        heads = [float(r[f"train/mtp_loss_{k}"]) + float(r[f"train/mtp_z_loss_{k}"]) for k in (1, 2)]
        assert all(float(r[f"train/mtp_z_loss_{k}"]) > 0 for k in (1, 2))
        parts = float(r["train/loss"]) + float(r["train/z_loss"]) + 0.5 * sum(heads)
        assert float(r["train/objective"]) == pytest.approx(parts, rel=1e-5)


def test_a_tiny_run_learns_and_logs_each_head_apart(make_cfg, tmp_path, capsys):
    from gptlab.runs.trained import load_run
    from gptlab.tasks.gpt import run

    out = tmp_path / "run"
    overrides = [*TINY, "tokenizer=char", "logger=csv", "trainer.max_steps=24", "trainer.log_every_n_steps=1"]
    cfg = make_cfg(*overrides, "mtp.depth=2", "mtp.weight=0.5", f"paths.output_dir={out}")
    metrics = run(cfg)
    rows = [r for r in csv_rows(out) if r.get("train/objective")]
    assert len(rows) == 24
    for r in rows:  # the objective is the next-token loss plus the weighted extra losses, each logged apart
        extra = float(r["train/mtp_loss_1"]) + float(r["train/mtp_loss_2"])
        assert float(r["train/objective"]) == pytest.approx(float(r["train/loss"]) + 0.5 * extra, rel=1e-5)
    for key in ("train/loss", "train/mtp_loss_1", "train/mtp_loss_2"):
        first = sum(float(r[key]) for r in rows[:4]) / 4
        last = sum(float(r[key]) for r in rows[-4:]) / 4
        assert last < first - 0.3, (key, first, last)
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] < math.log(100)
    assert f"Final validation loss {metrics['val/loss']:.4f} nats" in capsys.readouterr().out
    trained = load_run(out)  # the checkpoint holds the heads; generation runs without them
    assert trained.model.mtp is not None and trained.model.config.mtp.depth == 2
    assert trained.model.generate(torch.zeros(1, 2, dtype=torch.long), 4).shape == (1, 6)
    # resumed under another depth or weight: another model and objective, refused by name before training
    from gptlab.errors import CheckpointError
    from gptlab.runs.resume import inspect_checkpoint

    ckpt = out / "checkpoints" / "last.ckpt"
    config = trained.model.config
    for other, named in (({"depth": 1, "weight": 0.5}, "mtp.depth=2"), ({"depth": 2}, "mtp.weight=0.5")):
        changed = GPTConfig.from_dict({**config.to_dict(), "mtp": other})
        with pytest.raises(CheckpointError, match=rf"is from a different model: .*Resume with .*{named}"):
            inspect_checkpoint(ckpt, changed)
    inspect_checkpoint(ckpt, config)


@pytest.fixture
def ctrl_c():
    """SIGINT raises KeyboardInterrupt here, also where the suite runs in the background; put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_stopped_run_resumes_to_the_same_weights_bit_for_bit(tmp_path, monkeypatch, ctrl_c):
    import gptlab
    from gptlab.training.callbacks import ValidateAtLastStep

    common = [*TINY, "tokenizer=char", "logger=csv", f"paths.root_dir={tmp_path}"]
    common += ["mtp.depth=1", "mtp.style=sequential", "mtp.weight=0.3"]
    original = ValidateAtLastStep.on_train_batch_end

    def stop_after_step_3(self, trainer, *rest):
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        original(self, trainer, *rest)

    with monkeypatch.context() as patched:
        patched.setattr(ValidateAtLastStep, "on_train_batch_end", stop_after_step_3)
        stopped = gptlab.train(*common, run_dir=tmp_path / "stopped")
    assert stopped.stopped and stopped.step < 8
    resumed = gptlab.train(*common, "resume=auto", run_dir=tmp_path / "stopped")
    whole = gptlab.train(*common, run_dir=tmp_path / "whole")
    assert resumed.finished and resumed.step == whole.step == 8

    def weights(run_dir):
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]

    a, b = weights(resumed.run_dir), weights(whole.run_dir)
    assert a.keys() == b.keys() and any(k.startswith("model.mtp.") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert resumed.metrics["val/loss"] == whole.metrics["val/loss"]


# ---- counting ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["parallel", "sequential"])
def test_counts_include_the_extra_heads_and_give_them_apart(style):
    config = GPTConfig(**SMALL, mtp={"depth": 2, "style": style})
    base = GPTConfig(**SMALL)
    counts, built = counting.parameter_counts(config), GPT(config).parameter_counts()
    assert built == {k: counts[k] for k in built}
    model = GPT(config)
    assert counts["mtp"] == sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert counts["total"] == counting.parameter_counts(base)["total"] + counts["mtp"]
    assert counts["non_embedding"] - counts["mtp"] == counting.parameter_counts(base)["non_embedding"]
    # FLOPs: per head, a layer (6 x its matrices, its attention over T keys), the output layer once more, and
    # the sequential projection; the model's own parts as without heads
    h, f = 16, 64
    layer = h * 3 * h + h * h + h * f + f * h
    head = layer + V * h + (2 * h * h if style == "sequential" else 0)
    flops, without = counting.flops_per_token(config, T), counting.flops_per_token(base, T)
    assert flops["mtp"] == 2 * (6 * head + 6 * 2 * T * h)
    assert flops["training"] == without["training"] + flops["mtp"]
    assert {k: flops[k] for k in ("dense", "attention")} == {k: without[k] for k in ("dense", "attention")}
    assert counting.flops_per_token(base)["mtp"] == 0 and counting.parameter_counts(base)["mtp"] == 0


def test_with_mixture_of_experts_the_heads_blocks_route_count_and_balance_like_the_models():
    # the extra heads' blocks are the model's blocks: under mlp=moe they route, so their inactive experts are
    # not active parameters, and their routers get the balance and z losses as the trunk's do
    moe = {"name": "moe", "experts": 4, "top_k": 2}
    config = GPTConfig(**SMALL, mlp=moe, mtp={"depth": 1})
    model = GPT(config)
    counts = counting.parameter_counts(config)
    assert model.parameter_counts() == {k: counts[k] for k in model.parameter_counts()}
    without = counting.parameter_counts(GPTConfig(**SMALL, mlp=moe))
    inactive_per_layer = (without["total"] - without["active"]) // SMALL["n_layer"]
    assert inactive_per_layer > 0
    assert counts["total"] - counts["active"] == (SMALL["n_layer"] + 1) * inactive_per_layer
    x, y = batch()
    model(x, y, head_loss=HeadLoss(), mtp=True)
    routed = [m for m in model.modules() if type(m).__name__ == "MoE"]
    assert len(routed) == SMALL["n_layer"] + 1 and all(m.routing is not None for m in routed)
    losses = model.routing_losses()
    assert losses is not None and all(
        m.routing is None for m in routed
    )  # every layer's taken, the head's too


def test_a_checkpoints_config_keeps_the_heads():
    config = GPTConfig(**SMALL, mtp={"depth": 1, "style": "sequential", "weight": 0.1})
    assert GPTConfig.from_dict(config.to_dict()) == config
    old = GPTConfig(**SMALL).to_dict()
    del old["mtp"]  # saved before multi-token prediction existed
    assert GPTConfig.from_dict(old).mtp == MTPOptions()


def test_muon_takes_the_extra_heads_matrices_as_the_blocks():
    from gptlab.training.optimizers import split_parameters

    model = model_of(mtp={"depth": 1})
    hidden, _, _ = split_parameters(model)
    assert any(p is model.mtp.blocks[0].attn.c_attn.weight for p in hidden)


# ---- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mtp.depth=-1"], r"mtp.depth=-1 must be a whole number >= 0: the tokens each position predicts"),
        (["mtp.depth=1.5"], r"mtp.depth=1.5 must be"),
        (["mtp.depth=32"], r"mtp.depth=32 predicts the token 32 after the next one, but a window of "
         r"model.block_size=32 tokens has no such target at any position. Use mtp.depth below 32"),
        (["mtp.depth=8", "data.block_size=8"], r"a window of data.block_size=8 tokens has no such target"),
        (["mtp.depth=1", "mtp.weight=-0.3"], r"mtp.weight=-0.3 is negative"),
        (["mtp.depth=1", "mtp.weight=0"], r"mtp.weight=0 with mtp.depth=1: the extra heads would cost"),
        (["mtp.weight=nan"], r"mtp.weight=nan must be a finite number"),
        (["mtp.style=medusa"], r"mtp.style='medusa' must be one of"),
        (["+mtp.heads=2"], r"mtp.heads"),
        (["mtp.depth=1", "model.param=mup"], r"mtp.depth=1 with model.param=mup: the extra heads' init"),
        (["mtp.depth=1", "+model.init_from=/some/gpt2"], r"mtp.depth=1 with model.init_from=/some/gpt2: the "
         r"checkpoint holds the next-token model alone"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_at_config_time(make_cfg, tmp_path, overrides, message):
    from gptlab.config import parse_gpt

    cfg = make_cfg(*TINY, *overrides, f"paths.output_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=message):
        parse_gpt(cfg)
    assert not (tmp_path / "run").exists()


def test_a_model_built_in_python_refuses_the_same(monkeypatch):
    with pytest.raises(ConfigError, match=r"mtp.depth=12 predicts the token 12 after the next one"):
        GPTConfig(**SMALL, mtp={"depth": 12})
    with pytest.raises(ConfigError, match=r"mtp.depth=True must be a whole number"):
        MTPOptions(depth=True)
    assert isinstance(model_of(mtp={"depth": 11}).mtp.blocks[0], nn.Module)


def test_the_model_card_and_the_memory_estimate_count_the_heads():
    from gptlab.planning import activation_bytes_per_token, memory_per_device, model_card

    config = GPTConfig(**SMALL, mtp={"depth": 2})
    base = GPTConfig(**SMALL)
    card = model_card(config, short=True)
    mtp = counting.parameter_counts(config)["mtp"]
    assert (
        f"; of these, {mtp:,} in the 2 extra head(s) of multi-token prediction (mtp.style=parallel)" in card
    )
    assert "multi-token prediction" not in model_card(base, short=True)
    # each head keeps at least a layer's activations, and its own output layer and loss until the backward
    per_layer = activation_bytes_per_token(
        GPTConfig(**{**SMALL, "n_layer": 3}), 4
    ) - activation_bytes_per_token(base, 4)
    assert activation_bytes_per_token(config, 4) >= activation_bytes_per_token(base, 4) + 2 * per_layer
    # under activation checkpointing the heads' layers are checkpointed as the trunk's: each keeps its input
    # (the parallel heads share the trunk's) and its final norm's input, far from a layer's activations
    for style, kept in (("parallel", 1), ("sequential", 6)):
        heads = GPTConfig(**SMALL, mtp={"depth": 2, "style": style})
        added = activation_bytes_per_token(heads, 4, True) - activation_bytes_per_token(base, 4, True)
        assert added == 2 * kept * 4 * SMALL["n_embd"] < per_layer, style
    assert memory_per_device(config).head == 3 * memory_per_device(base).head


def test_what_the_module_reports_as_loss_and_flops_is_the_next_token_models(tmp_path):
    import copy

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from gptlab.training.module import GPTLitModule

    torch.manual_seed(0)
    module = GPTLitModule(model={**SMALL, "mtp": {"depth": 2}}, loss={"impl": "plain"})
    before = copy.deepcopy(module.model)
    x, y = batch()
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=1, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=B))
    next_token, _ = recorded(before, x, y, mtp=False)
    objective, _ = recorded(before, x, y)
    # the spike detector's train/loss (the step's, read before the update) is the next-token loss, not the
    # objective it is part of
    torch.testing.assert_close(module.last_train_loss, next_token.detach())
    assert objective > next_token * 1.5
    flops = counting.flops_per_token(module.model_config, T)
    module.train()
    assert module.flops_per_batch == int(flops["training"] * B * T)
    module.eval()  # validation runs the next-token model alone
    assert module.flops_per_batch == int((flops["training"] - flops["mtp"]) * B * T / 3)


# ---- the output paths under bf16 autocast, on the CPU and on CUDA --------------------------------------------


ON_CUDA = CPU_AND_CUDA[1].marks  # gpu, and skipped without a CUDA device
OUTPUT_PATHS = [
    ("cpu", "chunked", None),  # the kernels below are CUDA's
    *(
        pytest.param("cuda", impl, package, marks=ON_CUDA, id=f"cuda-{impl}")
        for impl, package in [("chunked", None), ("liger", "liger_kernel"), ("cce", "cut_cross_entropy")]
    ),
]


@pytest.mark.parametrize("style", ["parallel", "sequential"])
@pytest.mark.parametrize(("device", "impl", "package"), OUTPUT_PATHS)
def test_every_output_path_gives_the_plain_heads_objective_and_gradients_under_bf16(
    device, impl, package, style
):
    """The extra head's loss goes through ``loss.impl``'s output path as the next-token loss does: under bf16
    autocast (training's dtype on a GPU) the objective L_next + L_1 equals the plain head's under the same
    autocast, and every gradient is held to test_gpu.py's bounds against the fp32 plain head: within twice
    the plain head's own bf16 error (``chunked``, ``liger``), Cut Cross-Entropy within its bf16 tile sums'
    0.4. On CUDA at GPT-2's vocabulary; on the CPU (``chunked`` alone) at a small one, where bf16 products
    are slow."""
    if package is not None:
        pytest.importorskip(package)
    vocab, width, batch_size, context = (50257, 256, 8, 128) if device == "cuda" else (499, 32, 4, 16)
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=vocab,
        block_size=context,
        n_layer=2,
        n_head=4,
        n_embd=width,
        mtp={"depth": 1, "style": style},
    )
    model = GPT(config).to(device)
    idx = torch.randint(0, vocab, (batch_size, context), device=device)
    targets = torch.randint(0, vocab, (batch_size, context), device=device)

    def objective_and_grads(impl: str, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        head = RecordingHeadLoss.of(HeadLoss(impl))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            _, objective = model(idx, targets, head_loss=head, mtp=True)
        assert len(head.calls) == 2  # the next-token head and the extra one, both through the path
        objective.backward()
        return objective.detach().float(), {n: p.grad.double() for n, p in model.named_parameters()}

    _, reference = objective_and_grads("plain", autocast=False)
    plain_objective, plain_grads = objective_and_grads("plain", autocast=True)
    objective, grads = objective_and_grads(impl, autocast=True)
    torch.testing.assert_close(objective, plain_objective, rtol=1e-3, atol=1e-3)
    assert any(name.startswith("mtp.") for name in reference)  # the extra head's own weights are compared

    def error(got: dict[str, torch.Tensor], name: str) -> float:
        want = reference[name]
        return float((got[name] - want).norm() / want.norm().clamp_min(1e-30))

    for name in reference:
        plain_error, path_error = error(plain_grads, name), error(grads, name)
        assert plain_error < 2e-2, f"plain under autocast, {name}: {plain_error:.2e} from fp32"
        bound = 0.4 if impl == "cce" else 2 * plain_error + 1e-3
        assert path_error < bound, f"{name}: {path_error:.2e} from fp32 (plain: {plain_error:.2e})"


# ---- activation checkpointing, compile and FSDP: the heads' blocks are blocks -------------------------------


def objective_and_grads(model: GPT, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    _, objective = model(x, y, head_loss=HeadLoss("plain"), mtp=True)
    objective.backward()
    return objective.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def calls_of_each_heads_mlp(model: GPT) -> list[int]:
    """For each extra head's block, how many times its MLP has run."""
    calls = [0 for _ in model.mtp.blocks]
    for k, block in enumerate(model.mtp.blocks):
        block.mlp.register_forward_pre_hook(lambda module, args, k=k: calls.__setitem__(k, calls[k] + 1))
    return calls


@pytest.mark.parametrize("style", ["parallel", "sequential"])
def test_activation_checkpointing_recomputes_the_heads_blocks_and_keeps_the_objective_and_gradients(style):
    """The heads' blocks are checkpointed as the trunk's are (each one's forward runs again in the backward
    pass), and the objective and every gradient are those of the plain model, to the bit on the CPU in fp32."""
    from gptlab.parallel import ParallelOptions, parallelize

    plain = model_of(mtp={"depth": 2, "style": style})
    wrapped = model_of(mtp={"depth": 2, "style": style})
    parallelize(wrapped, ParallelOptions(activation_checkpointing=True).resolved("cpu"))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    calls = calls_of_each_heads_mlp(wrapped)
    x, y = batch()
    want, want_grads = objective_and_grads(plain, x, y)
    got, got_grads = objective_and_grads(wrapped, x, y)
    assert calls == [2, 2]  # the forward pass, then the recomputation
    assert torch.equal(got, want)
    assert got_grads.keys() == want_grads.keys()
    assert any(name.startswith("mtp.blocks.1.") for name in got_grads)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name


@pytest.mark.parametrize("style", ["parallel", "sequential"])
def test_compile_compiles_the_heads_blocks_and_keeps_the_objective(style, monkeypatch):
    """compile=true (and compile=auto on CUDA) compiles the heads' blocks as the trunk's: on the CPU through
    AOTAutograd's eager backend (the same graphs without code generation), the heads' blocks run inside a
    compiled graph, the objective and gradients equal eager's within fp32's rounding, and the evaluations'
    `uncompiled_blocks` runs them eagerly."""
    from torch._dynamo.backends.registry import lookup_backend

    from gptlab.parallel import ParallelOptions, parallelize, transforms, uncompiled_blocks

    runs: list[int] = []  # one entry per run of a compiled graph

    def counting_aot_eager(graph, inputs):
        compiled = lookup_backend("aot_eager")(graph, inputs)

        def run(*args):
            runs.append(1)
            return compiled(*args)

        return run

    monkeypatch.setattr(transforms, "BLOCK_BACKEND", counting_aot_eager)
    torch._dynamo.reset()
    eager = model_of(mtp={"depth": 2, "style": style})
    compiled = model_of(mtp={"depth": 2, "style": style})
    parallelize(compiled, ParallelOptions(compile=True))
    assert all(block._compiled_call_impl is not None for block in compiled.mtp.blocks)
    x, y = batch()
    want, want_grads = objective_and_grads(eager, x, y)
    got, got_grads = objective_and_grads(compiled, x, y)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # the graphs one training step runs, against a pass of the trunk alone: the heads' two blocks ran compiled
    runs.clear()
    objective_and_grads(compiled, x, y)
    with_heads = len(runs)
    runs.clear()
    compiled(x, y, head_loss=HeadLoss("plain"), mtp=False)
    assert with_heads == len(runs) * 2 > 0  # two blocks of the trunk, two of the heads
    runs.clear()
    with uncompiled_blocks(compiled):
        objective_and_grads(compiled, x, y)
    assert runs == []
    assert all(block._compiled_call_impl is not None for block in compiled.mtp.blocks)


def test_under_fsdp_each_heads_block_is_a_unit_of_its_own():
    """FSDP2 sharding (strategy=fsdp; transforms.shard, which parallelize applies in each rank) wraps each
    head's block as one unit, as each trunk block is: the root unit holds none of their parameters. A
    one-rank process group in this process: the wrapping is what is checked, not the communication (the
    two-process runs are tests/test_strategies.py's)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from gptlab.parallel.transforms import model_blocks, shard

    model = model_of(mtp={"depth": 2, "style": "sequential"})
    plain = model_of(mtp={"depth": 2, "style": "sequential"})
    names = {module: name for name, module in model.named_modules()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        strategy = SimpleNamespace(
            device_mesh={"data_parallel": mesh}, hybrid=False, cpu_offload=False, reshard_after_forward=True
        )
        shard(model, strategy)
        blocks = model_blocks(model)
        assert blocks[-2:] == list(model.mtp.blocks)
        assert all(isinstance(block, FSDPModule) for block in blocks) and isinstance(model, FSDPModule)

        def unit_parameters(unit: nn.Module) -> set[str]:
            group = unit._get_fsdp_state()._fsdp_param_group
            return {f"{names[p._module_info.module]}.{p._module_info.param_name}" for p in group.fsdp_params}

        for k, block in enumerate(model.mtp.blocks):
            assert unit_parameters(block) == {
                f"mtp.blocks.{k}.{name}" for name, _ in plain.mtp.blocks[k].named_parameters()
            }
        root = unit_parameters(model)
        assert not any(name.startswith(("transformer.h.", "mtp.blocks.")) for name in root), root
        assert "mtp.proj.0.weight" in root  # the sequential modules' projections stay with the root
        # and the sharded model trains as the plain one
        x, y = batch()
        got, _ = objective_and_grads(model, x, y)
        want, _ = objective_and_grads(plain, x, y)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()
