"""The Mixture-of-Experts feed-forward layer (``mlp=moe``, model/feedforward.py): the layer against every expert
run on every token and masked by the top-k weights, where its gradients go, Switch's load-balancing loss and
ST-MoE's z-loss by their formulas, the counts (total and active parameters, FLOPs from the active ones), the
KV cache, activation checkpointing, torch.compile and bf16, Muon's grouping, every refusal at config time, and
a run through the run path: a falling loss, the auxiliary losses logged apart from train/loss, and an exact
resume."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU_AND_CUDA, ROOT, TINY, assert_cached_decoding_is_the_whole_pass
from torch import Tensor

from gptlab.config import parse_gpt
from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.counting import flops_per_token, parameter_counts
from gptlab.model.feedforward import MoE
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss
from gptlab.runs.layout import last_checkpoint


def tiny(mlp: dict | str = "moe", **kw) -> GPTConfig:
    node = {"name": mlp} if isinstance(mlp, str) else {"name": "moe", **mlp}
    base = dict(vocab_size=61, block_size=32, n_layer=2, n_head=2, n_embd=32, mlp=node)
    return GPTConfig(**{**base, **kw})


def moe_layer(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    model = GPT(tiny(**kw))
    layer = model.transformer.h[0].mlp
    assert isinstance(layer, MoE)
    with torch.no_grad():  # a router far from uniform, so that the choice of experts matters
        layer.router.weight.normal_(0.0, 0.5)
    return layer


def every_expert_on_every_token(layer: MoE, x: Tensor) -> Tensor:
    """The slow obvious way: every expert on every token, each output times the token's weight for that
    expert (0 where it is not among the token's top_k), summed; plus the shared experts."""
    options = layer.options
    tokens = x.reshape(-1, x.size(-1))
    probs = F.softmax(tokens @ layer.router.weight.T, dim=-1)
    top = probs.topk(options.top_k, dim=-1)
    weights = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
    if options.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(layer.experts):
        hidden = expert.act(
            tokens @ expert.c_fc.weight.T + (expert.c_fc.bias if expert.c_fc.bias is not None else 0)
        )
        y = hidden @ expert.c_proj.weight.T + (expert.c_proj.bias if expert.c_proj.bias is not None else 0)
        out = out + weights[:, e : e + 1] * y
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.reshape(x.shape)


@pytest.mark.parametrize(
    "options,activation,bias",
    [
        ({}, "gelu", True),
        ({"top_k": 1, "renormalize": False}, "swiglu", False),
        ({"experts": 4, "top_k": 4, "shared_experts": 1}, "geglu", True),
        ({"experts": 5, "top_k": 3, "renormalize": False, "expert_hidden": 24}, "relu", False),
    ],
)
def test_the_layer_equals_every_expert_on_every_token_masked_by_the_top_k_weights(options, activation, bias):
    layer = moe_layer(mlp=options, activation=activation, bias=bias)
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(layer(x), every_expert_on_every_token(layer, x), rtol=1e-5, atol=1e-6)


def test_gradients_reach_the_router_and_only_the_chosen_experts():
    """Two tokens, both routed to the same two experts: those two and the router get a gradient; the other
    experts run over an empty batch, so their gradient is there (DDP reduces every parameter) and zero."""
    layer = moe_layer(mlp={"experts": 6, "top_k": 2})
    x = torch.randn(1, 1, 32).expand(1, 2, 32).clone()  # the same token twice: the same two experts
    chosen = set(layer.router(x[0, :1]).topk(2, dim=-1).indices.flatten().tolist())
    layer(x).square().sum().backward()
    assert float(layer.router.weight.grad.abs().sum()) > 0
    for e, expert in enumerate(layer.experts):
        for name, p in expert.named_parameters():
            assert p.grad is not None, (e, name)
            assert (float(p.grad.abs().sum()) > 0) == (e in chosen), (e, name, chosen)


def test_load_balancing_loss_is_one_at_a_uniform_router_and_n_when_one_expert_takes_everything():
    """Switch's N sum_i f_i P_i: 1 when every probability is 1/N (whatever the ties choose); N when one
    expert takes every token with probability ~1. The z-loss is mean logsumexp(logits)^2: log(N)^2 at zero
    logits."""
    uniform = moe_layer(mlp={"experts": 4, "top_k": 1, "renormalize": False})
    with torch.no_grad():
        uniform.router.weight.zero_()
    uniform(torch.randn(2, 8, 32))
    routing = uniform.routing
    assert routing is not None
    assert routing.balance.item() == pytest.approx(1.0)
    assert routing.z.item() == pytest.approx(math.log(4) ** 2)
    # ties go to the first expert: a uniform router is not a balanced one
    assert float(routing.load_max) == 1.0
    two = moe_layer(mlp={"experts": 4, "top_k": 2})  # f_i: shares of the top_k assignments, summing to 1
    with torch.no_grad():
        two.router.weight.zero_()
    two(torch.randn(2, 8, 32))
    assert two.routing.balance.item() == pytest.approx(1.0) and float(two.routing.load_max) == 0.5

    collapsed = moe_layer(mlp={"experts": 4, "top_k": 1, "renormalize": False})
    with torch.no_grad():
        collapsed.router.weight.zero_()
        collapsed.router.weight[2] = 100.0
    x = torch.rand(2, 8, 32) + 0.5  # positive inputs: expert 2's logit is far above the others'
    collapsed(x)
    routing = collapsed.routing
    assert routing.balance.item() == pytest.approx(4.0, rel=1e-4)
    assert float(routing.load_max) == 1.0 and float(routing.load_cv) == pytest.approx(math.sqrt(3))
    logits = x.reshape(-1, 32) @ collapsed.router.weight.T
    assert routing.z.item() == pytest.approx(float(torch.logsumexp(logits, -1).square().mean()), rel=1e-5)


def test_the_model_adds_each_loss_times_its_coefficient_averaged_over_the_layers():
    torch.manual_seed(0)
    model = GPT(tiny(mlp={"balance_coef": 0.5, "z_loss_coef": 0.25}, n_layer=3))
    idx = torch.randint(0, 61, (2, 16))
    model(idx)
    layers = [block.mlp.routing for block in model.transformer.h]
    losses = model.routing_losses()
    assert losses is not None
    balance = sum(float(r.balance) for r in layers) / 3
    z = sum(float(r.z) for r in layers) / 3
    assert float(losses.objective) == pytest.approx(0.5 * balance + 0.25 * z, rel=1e-6)
    assert model.routing_losses() is None  # taken: a later call never reads a stale pass
    assert GPT(tiny("dense")).routing_losses() is None


def test_the_models_loss_is_the_cross_entropy_alone():
    """What validation reads (val/loss) and what train/loss logs: the routing losses are returned apart and
    added by the training step only."""
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 61, (2, 16))
    logits, loss = model(idx, idx)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), idx.flatten()))
    assert float(model.routing_losses().objective) > 0


def test_counts_active_parameters_and_flops_from_them():
    moe, dense = tiny(), tiny("dense")
    counts = parameter_counts(moe)
    assert counts["total"] > counts["active"]
    assert {k: counts[k] for k in GPT(moe).parameter_counts()} == GPT(moe).parameter_counts()
    # every expert chosen: every parameter active
    everything = parameter_counts(tiny({"experts": 4, "top_k": 4, "shared_experts": 1}))
    assert everything["active"] == everything["total"]
    # the default expert width is the dense width / top_k: a token's experts hold the dense MLP's matrices,
    # and the FLOPs differ from the dense model's by the router's product alone, h E a layer
    extra = flops_per_token(moe)["training"] - flops_per_token(dense)["training"]
    assert extra == 6 * moe.n_layer * moe.n_embd * 8
    # the FLOPs follow the active weights: twice the experts, the same FLOPs but the router's
    wider = flops_per_token(tiny({"experts": 16}))["training"] - flops_per_token(moe)["training"]
    assert wider == 6 * moe.n_layer * moe.n_embd * 8


def test_the_model_card_shows_both_counts_and_the_experts():
    from gptlab.planning import model_card

    card = model_card(tiny({"shared_experts": 1}), short=True)
    counts = parameter_counts(tiny({"shared_experts": 1}))
    assert "MoE 8 experts x 64 wide + 1 shared, top-2 (renormalised weights)" in card
    assert f"total {counts['total']:,}" in card and f"active per token {counts['active']:,}" in card
    assert "active per token" not in model_card(tiny("dense"), short=True)


@torch.no_grad()
def test_kv_cache_generation_equals_the_whole_pass():
    torch.manual_seed(0)
    model = GPT(tiny({"shared_experts": 1}, pos="rope")).eval()
    assert_cached_decoding_is_the_whole_pass(model, new_tokens=6)


def test_activation_checkpointing_compile_and_bf16_give_the_plain_models_numbers():
    """Activation checkpointing (as gptlab.parallel applies it, non-reentrant, per block): the same loss and
    gradients, the routing losses' included. torch.compile of each block (Dynamo's tracing, graph breaks
    allowed; the eager backend, so that the test does not pay for code generation): the same output and
    routing. bf16 autocast: finite, and close."""
    from torch.distributed._composable import checkpoint

    def loss_and_grads(model: GPT, idx: Tensor) -> tuple[Tensor, list[Tensor]]:
        model.zero_grad()
        _, loss = model(idx, idx)
        routing = model.routing_losses()
        total = loss + routing.objective
        total.backward()
        return total.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    torch.manual_seed(0)
    plain = GPT(tiny({"z_loss_coef": 0.5, "balance_coef": 0.5}))
    idx = torch.randint(0, 61, (2, 16))
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    loss, grads = loss_and_grads(plain, idx)

    checkpointed = GPT(plain.config)
    checkpointed.load_state_dict(state)
    for block in checkpointed.transformer.h:
        checkpoint(block, use_reentrant=False)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed, idx)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    assert len(grads_ckpt) == len(grads)
    for a, b in zip(grads_ckpt, grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    torch._dynamo.reset()
    compiled = GPT(plain.config)
    compiled.load_state_dict(state)
    for block in compiled.transformer.h:
        block.compile(backend="eager")
    loss_compiled, grads_compiled = loss_and_grads(compiled, idx)
    torch.testing.assert_close(loss_compiled, loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_compiled, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = plain(idx)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), plain(idx)[0], rtol=0.1, atol=0.1)


def test_muon_takes_each_expert_matrix_apart_and_the_router_goes_to_adamw(make_cfg):
    from gptlab.training.optimizers import param_groups, parse_optim

    torch.manual_seed(0)
    model = GPT(tiny({"shared_experts": 1}))
    optim = parse_optim({"name": "muon"})
    adamw_groups, muon_groups = param_groups(model, optim)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in muon_groups for p in g["params"]}
    adamw = {names[id(p)]: g["group"] for g in adamw_groups for p in g["params"]}
    for i in range(2):
        for e in range(8):
            assert f"transformer.h.{i}.mlp.experts.{e}.c_fc.weight" in muon
            assert f"transformer.h.{i}.mlp.experts.{e}.c_proj.weight" in muon
        assert f"transformer.h.{i}.mlp.shared.c_fc.weight" in muon
        assert adamw[f"transformer.h.{i}.mlp.router.weight"] == "embeddings_head"
    assert all(p.dim() == 2 for g in muon_groups for p in g["params"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mlp.top_k=9"], "mlp.top_k=9 is more than mlp.experts=8: a token cannot go to more experts than"),
        (["mlp.top_k=0"], "mlp.top_k=0 must be at least 1"),
        (["mlp.experts=0", "mlp.top_k=1"], "mlp.experts=0 must be at least 1"),
        (["mlp.top_k=1"], "mlp.top_k=1 with mlp.renormalize=true weights every token's one expert by 1"),
        (["mlp.expert_hidden=0"], "mlp.expert_hidden=0 must be a positive width"),
        (["mlp.shared_experts=-1"], "mlp.shared_experts=-1 must be 0 or more"),
        (["mlp.balance_coef=-0.01"], "mlp.balance_coef=-0.01 must be 0 or more"),
        (
            ["mlp.balance_scope=globl"],
            "mlp.balance_scope='globl' must be one of 'micro_batch', 'global' (got str). Did you mean "
            "mlp.balance_scope=global?",
        ),
        (
            ["mlp.balance_scope=global", "mlp.balance_coef=0"],
            "mlp.balance_scope=global with mlp.balance_coef=0: there is no load-balancing loss whose expert",
        ),
        (["model.param=mup"], "mlp=moe cannot take model.param=mup"),
        (
            ["model.init_from=/nowhere"],
            "but mlp=moe builds other weights. Use mlp=dense with model.init_from",
        ),
        (["mlp.top_k=two"], "mlp.top_k='two' must be an integer"),
        (["+mlp.capacity_factor=1.25"], "mlp=moe does not take option(s) mlp.capacity_factor"),
    ],
)
def test_what_it_cannot_honour_is_refused_at_config_time(make_cfg, overrides, message):
    with pytest.raises(ConfigError) as err:
        parse_gpt(make_cfg("mlp=moe", *overrides))
    assert message in str(err.value)


def test_a_hugging_face_checkpoint_is_refused_for_an_moe_model_naming_the_override():
    from gptlab.model.hf import check_compatible

    hf = {"model_type": "gpt2", "vocab_size": 61, "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32}
    hf |= {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
    with pytest.raises(ConfigError, match="mlp='moe' but the checkpoint has 'dense'"):
        check_compatible(tiny(activation="gelu_tanh"), hf)


def metrics_of(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(next(run_dir.glob("csv/**/metrics.csv")))))


def test_trains_through_the_run_path_logs_the_routing_apart_and_resumes_exactly(make_cfg, tmp_path, capsys):
    """`python train.py mlp=moe` in this process: the loss falls; train/loss and val/loss are the
    cross-entropy, the auxiliary losses and the experts' load logged apart; and a run stopped at step 4 and
    resumed to step 8 ends with the uninterrupted run's weights, bit for bit (a constant rate after warmup,
    so that the longer trainer.max_steps of the resumed command changes no step's rate)."""
    from gptlab.tasks.gpt import run

    args = [*TINY, "model.n_layer=2", "tokenizer=char", "mlp=moe", "mlp.experts=4", "optim.warmup_steps=2"]
    args += ["optim.min_lr_ratio=1.0", "trainer.val_check_interval=4", "trainer.log_every_n_steps=1"]
    args += [
        "logger=csv",
        "callbacks.sample_generation=null",
        "callbacks.last_checkpoint.every_n_train_steps=4",
    ]
    whole = tmp_path / "whole"
    run(make_cfg(*args, "trainer.max_steps=8", f"paths.output_dir={whole}"))
    rows = metrics_of(whole)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    balance = [float(r["train/moe_balance_loss"]) for r in rows if r.get("train/moe_balance_loss")]
    assert len(balance) == 8 and all(0.01 * 0.9 <= b <= 0.01 * 4 for b in balance), balance
    z = [float(r["train/moe_z_loss"]) for r in rows if r.get("train/moe_z_loss")]
    load = [float(r["train/moe_load_max"]) for r in rows if r.get("train/moe_load_max")]
    assert len(z) == 8 and all(v > 0 for v in z) and all(0.25 <= v <= 0.5 for v in load)
    counts = [r for r in rows if r.get("parameters/active")]
    assert float(counts[0]["parameters/active"]) < float(counts[0]["parameters/total"])
    from gptlab.runs.trained import load_run

    trained = load_run(whole)
    assert trained.model.config.mlp.name == "moe"

    stopped = tmp_path / "stopped"
    run(make_cfg(*args, "trainer.max_steps=4", f"paths.output_dir={stopped}"))
    capsys.readouterr()
    run(make_cfg(*args, "trainer.max_steps=8", f"paths.output_dir={stopped}", f"resume={stopped}"))
    assert "resumed at step 4, trained 4" in capsys.readouterr().out  # continued, not trained anew
    a = torch.load(last_checkpoint(whole), map_location="cpu", weights_only=True)["state_dict"]
    b = torch.load(last_checkpoint(stopped), map_location="cpu", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_global_balance_scope_in_one_process_is_the_default_and_counts_over_the_steps_micro_batches(tmp_path):
    """mlp.balance_scope=global in one process: with one micro-batch a step, the same step as the default
    scope, bit for bit; under gradient accumulation (2 micro-batches a step), the second micro-batch's
    load-balancing loss takes f_i over both micro-batches' assignments (the later ones are not run yet when
    the first's is taken), train/moe_balance_loss is the mean of the two, and train/moe_global_load_max the
    busiest expert's share of the whole step's assignments."""
    import lightning as L
    from moe_ranks import RankRecord
    from torch.utils.data import DataLoader, TensorDataset

    from gptlab.model.feedforward import balance_loss
    from gptlab.training.module import GPTLitModule

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 61, (2, 9), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)  # 8 tokens a micro-batch
    config = tiny({"experts": 16}, block_size=8, n_layer=1)

    def train(scope: str, accumulate: int = 1) -> tuple[dict, dict[str, float]]:
        torch.manual_seed(0)
        module = GPTLitModule(
            config.to_dict() | {"mlp": {"name": "moe", "experts": 16, "balance_scope": scope}}
        )
        record = RankRecord(str(tmp_path / f"{scope}-{accumulate}.pt"))
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=accumulate, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[record], default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(module, data)
        return record.record, {k: float(v) for k, v in trainer.logged_metrics.items()}

    default, global_scope = train("micro_batch")[0], train("global")[0]
    assert len(default["counts"]) == 1
    for name, value in default["final"].items():
        assert torch.equal(value, global_scope["final"][name]), name

    accumulated, logged = train("global", accumulate=2)
    first, second = accumulated["counts"]  # the step's two micro-batches
    assert torch.equal(accumulated["global_counts"][0], first + second)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(accumulated["initial"][name])
        routings = []
        for x, y in accumulated["batches"]:
            model(x, y)
            routings.append(model.transformer.h[0].mlp.routing)
    assert [torch.equal(r.counts, c) for r, c in zip(routings, (first, second))] == [True, True]
    so_far = [balance_loss(first, routings[0].probs), balance_loss(first + second, routings[1].probs)]
    assert logged["train/moe_balance_loss"] == pytest.approx(0.01 * float(sum(so_far)) / 2, rel=1e-5)
    # what the default scope would have logged: near a uniform router, a few parts in a thousand away
    each_own = 0.01 * float(routings[0].balance + routings[1].balance) / 2
    assert logged["train/moe_balance_loss"] != pytest.approx(each_own, rel=1e-3)
    assert logged["train/moe_global_load_max"] == pytest.approx(float((first + second).max()) / 32)


def compiled_against_eager_in_bf16(device: str, train_steps: int = 3) -> None:
    """A bf16-autocast training step of a tiny MoE model (a router far from uniform, the routing losses
    added), its blocks compiled as ``compile=true`` compiles them (gptlab.parallel.parallelize, with
    ``transforms.BLOCK_BACKEND``), against the same weights eager; then a few AdamW steps of the compiled
    model on one batch."""
    from gptlab.parallel import transforms

    config = tiny(
        {"experts": 4, "z_loss_coef": 0.01, "shared_experts": 1},
        vocab_size=97,
        block_size=64,
        n_layer=1,
        n_head=4,
        n_embd=64,
    )
    torch.manual_seed(0)
    eager = GPT(config).to(device)
    with torch.no_grad():
        for block in eager.transformer.h:
            block.mlp.router.weight.normal_(0.0, 0.5)
    compiled = GPT(config).to(device)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    transforms.parallelize(compiled, transforms.ParallelOptions(compile=True))
    idx = torch.randint(0, 97, (4, 64), device=device)

    def step(model: GPT) -> Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = model(idx, idx)
            total = loss + model.routing_losses().objective
        total.backward()
        return total.detach().float()

    want, got = step(eager), step(compiled)
    assert abs(float(got - want)) < 1e-2, (float(got), float(want))
    # A token whose second and third experts are within bf16's rounding of each other may go to another
    # expert in one of the two (their inputs are rounded differently): that moves one token's share of two
    # experts' gradients, so the routed experts of a layer are compared together, every other parameter alone.
    groups: dict[str, list[tuple[Tensor, Tensor]]] = {}
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            group = name.split(".experts.")[0] + ".experts" if ".experts." in name else name
            groups.setdefault(group, []).append((p.grad.float().flatten(), q.grad.float().flatten()))
    total_norm = float(torch.cat([a for pairs in groups.values() for a, _ in pairs]).norm())
    for group, pairs in groups.items():
        want_grad = torch.cat([a for a, _ in pairs])
        got_grad = torch.cat([b for _, b in pairs])
        difference = float((got_grad - want_grad).norm())
        scale = max(float(want_grad.norm()), 1e-4 * total_norm)  # near-0 gradients: against the whole
        assert difference < 5e-2 * scale, f"{group}: {difference:.2e} against {scale:.2e}"

    optimizer = torch.optim.AdamW(compiled.parameters(), lr=3e-3)
    losses = []
    for _ in range(train_steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(step(compiled)))
        optimizer.step()
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0] - 0.3, losses  # one batch learned: the loss falls


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_compiled_blocks_in_bf16_equal_eager_and_train(device, monkeypatch):
    """The routing's argsort, bincount and ``counts.tolist()`` split sizes under torch.compile (graph breaks,
    and new split sizes each step): on CUDA through inductor, compile=true's backend there; on the CPU through
    AOTAutograd's eager backend (the same graphs and breaks, forward and backward, without code generation's
    tens of seconds). The loss and gradients equal eager's within bf16's rounding, and training falls."""
    from gptlab.parallel import transforms

    monkeypatch.setattr(transforms, "BLOCK_BACKEND", "inductor" if device == "cuda" else "aot_eager")
    compiled_against_eager_in_bf16(device)


def test_a_compiled_block_is_not_recompiled_as_the_routing_changes():
    # The experts' split sizes are the routing's data: in the graph, each new split recompiled the block,
    # until torch's recompile limit left it uncompiled without a word. Outside it, the block compiles once.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=97,
        block_size=16,
        n_layer=1,
        n_head=2,
        n_embd=32,
        mlp={"name": "moe", "experts": 16, "top_k": 2},
    )
    model = GPT(config)
    model.transformer.h[0].compile(backend="aot_eager")
    graphs = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, config.vocab_size, (2, 16), generator=g)
        _, loss = model(x, torch.roll(x, -1, 1), head_loss=HeadLoss())
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == [graphs[0]] * 4, graphs  # every graph made at the first step, none since


# ---- two processes ---------------------------------------------------------------------------------------
def rank_records(out: Path, run: str) -> tuple[dict, dict]:
    """What each rank of one of tests/moe_ranks.py's runs saw (its RankRecord)."""
    first, second = (torch.load(out / f"{run}-rank{r}.pt", weights_only=False) for r in (0, 1))
    return first, second


def train_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["train/loss"]) for r in metrics_of(run_dir) if r.get("train/loss")}


@pytest.mark.slow
def test_two_processes_train_under_ddp_and_fsdp_and_global_balancing_is_the_whole_batchs(tmp_path):
    """tests/moe_ranks.py, one launch of two CPU processes: strategy=ddp with mlp.balance_scope=global,
    strategy=fsdp, and the FSDP run resumed from its step-3 checkpoint; 16 experts, 8 tokens a rank.

    An expert can take tokens on one rank and none on the other: DDP reduces its gradient all the same (the
    ranks' weights stay equal, bit for bit), FSDP reduces its shards; both train, and the resumed FSDP run ends
    with the uninterrupted run's losses and weights.

    Under the global scope, at the first step each rank's load-balancing loss took f_i from the two ranks'
    assignments together, those of one process routing the two ranks' batches as one; the logged balance loss
    is that process's, and the gradients DDP averaged are its gradients of the whole batch's objective. Per
    micro-batch (the default scope) the router's would differ by about a tenth."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(ROOT / "tests" / "moe_ranks.py"), str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for run in ("ddp", "fsdp"):
        first, second = rank_records(tmp_path, run)
        assert len(first["counts"]) == len(second["counts"]) == 6  # one router pass a step and rank
        one_sided = [
            int(((a == 0) & (b > 0)).sum() + ((b == 0) & (a > 0)).sum())
            for a, b in zip(first["counts"], second["counts"], strict=True)
        ]
        assert sum(one_sided) > 0, (run, one_sided)  # some step had an expert empty on one rank alone
        losses = train_losses(tmp_path / run)
        assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
        assert (losses[5] + losses[6]) / 2 < losses[1] - 0.5, (run, losses)
    first, second = rank_records(tmp_path, "ddp")
    for name, value in first["final"].items():
        assert torch.equal(value, second["final"][name]), name
    # FSDP: the sharded weights gathered whole, the resumed run against the uninterrupted one
    whole_run, resumed = rank_records(tmp_path, "fsdp")[0], rank_records(tmp_path, "resumed")[0]
    for name, value in whole_run["final"].items():
        assert torch.equal(value, resumed["final"][name]), name
    resumed_losses = train_losses(tmp_path / "resumed")
    assert resumed_losses == {s: v for s, v in train_losses(tmp_path / "fsdp").items() if s > 3}

    # the global scope against one process over the two ranks' batches together, at the first step
    hparams = torch.load(last_checkpoint(tmp_path / "ddp"), map_location="cpu", weights_only=False)
    model = GPT(GPTConfig.from_dict(dict(hparams["hyper_parameters"]["model"])))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(first["initial"][name])
    x, y = (torch.cat([a, b]) for a, b in zip(first["batches"][0], second["batches"][0], strict=True))

    def objective_gradients(x: Tensor, y: Tensor):
        model.zero_grad()
        _, loss = model(x, y)
        routing = model.routing_losses()
        (loss + routing.objective).backward()
        return routing, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, grads = objective_gradients(x, y)
    assert int(whole.counts.sum()) == 2 * 8 * 2  # two ranks' 8 tokens, top-2
    assert torch.equal(first["global_counts"], whole.counts)
    assert torch.equal(second["global_counts"], whole.counts)
    rows = metrics_of(tmp_path / "ddp")
    logged = next(float(r["train/moe_balance_loss"]) for r in rows if r.get("train/moe_balance_loss"))
    assert logged == pytest.approx(0.01 * float(whole.balance), rel=1e-6)
    assert first["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(first["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)

    router = "transformer.h.0.mlp.router.weight"
    halves = [objective_gradients(x[r : r + 1], y[r : r + 1])[1][router] for r in (0, 1)]
    per_micro_batch = (halves[0] + halves[1]) / 2
    assert float((per_micro_batch - grads[router]).norm()) > 0.02 * float(grads[router].norm())
