"""The paths that exist only on a CUDA GPU, each against the path it replaces: bf16 mixed precision against fp32,
``torch.compile`` against eager, the fused loss kernels under autocast against the plain head, DDP and FSDP over
NCCL resuming to the uninterrupted run's loss, an exact resume with deterministic algorithms, and KV-cache
decoding. Every test here is marked ``gpu`` and skipped without CUDA (conftest); ``scripts/gpu_check.py`` runs
them with its measurements. FlexAttention against SDPA is in test_attention.py, liger and cce against the plain
path in fp32 in test_head_loss.py, word2vec's CUDA step in test_word2vec.py; the Mixture of Experts compiled by
inductor in test_moe.py and multi-token prediction through each output kernel in test_mtp.py (parametrized over
conftest's ``CPU_AND_CUDA``: their CPU cases run here too)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from conftest import CONF, TINY, run_train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from gptlab.model.attention import KVCache
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import (
    HeadLoss,
    chunked_loss_terms,
    fused_by_default,
    plain_linear_cross_entropy,
    plain_loss_terms,
)
from gptlab.runs.layout import last_checkpoint
from gptlab.tasks.gpt import run

pytestmark = pytest.mark.gpu

# compile=false: compile=auto compiles every block on CUDA, a compile per process and per shape; these tests
# check other paths, and compile=true is checked against eager below (the gpu check's main_command section runs
# the default, compiled).
GPU = ["trainer.accelerator=gpu", "trainer.devices=1", "compile=false"]
QUIET = ["callbacks.sample_generation.max_new_tokens=0", "trainer.log_every_n_steps=1"]
# A character-level run that learns within a few dozen steps, so that a wrong path shows in the loss.
LEARNS = [
    *TINY,
    *QUIET,
    "tokenizer=char",
    "model.n_embd=64",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "trainer.max_steps=40",
    "trainer.val_check_interval=20",
    "trainer.limit_val_batches=4",
    "logger=csv",
]


def compose_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def train(tmp_path: Path, name: str, *overrides: str) -> dict[str, float]:
    out = tmp_path / name
    return run(
        compose_cfg(*LEARNS, *GPU, f"paths.root_dir={tmp_path}", f"paths.output_dir={out}", *overrides)
    )


def logged(run_dir: Path, key: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def train_losses(run_dir: Path) -> dict[int, float]:
    return logged(run_dir, "train/loss")


def val_losses(run_dir: Path) -> dict[int, float]:
    return logged(run_dir, "val/loss")


def test_bf16_mixed_training_reaches_a_finite_loss_close_to_fp32s(tmp_path):
    fp32 = train(tmp_path, "fp32", "trainer.precision=32-true")
    bf16 = train(tmp_path, "bf16", "trainer.precision=bf16-mixed")
    assert math.isfinite(bf16["val/loss"]) and math.isfinite(fp32["val/loss"])
    # bf16's rounding moves the trajectory, not where it goes: within 2% of fp32's loss after 40 steps
    assert abs(bf16["val/loss"] - fp32["val/loss"]) < 0.02 * fp32["val/loss"], (bf16, fp32)
    first = train_losses(tmp_path / "bf16")
    assert bf16["val/loss"] < first[1] - 0.5, "bf16 did not train"


def test_compiled_blocks_train_to_the_eager_loss(tmp_path):
    eager = train(tmp_path, "eager", "trainer.precision=32-true")
    compiled = train(tmp_path, "compiled", "trainer.precision=32-true", "compile=true")
    # The same arithmetic fused differently: equal to a few parts in a thousand after 40 steps
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], rel=5e-3, abs=5e-3)
    steps_eager, steps_compiled = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert steps_compiled[1] == pytest.approx(steps_eager[1], rel=1e-4)  # the first step, before drift


ATTENTION_PRESETS = sorted(p.stem for p in (CONF / "attention").glob("*.yaml"))


@pytest.mark.parametrize(
    ("preset", "pos"), [*((preset, "rope") for preset in ATTENTION_PRESETS), ("default", "alibi")]
)
def test_compiled_blocks_in_bf16_equal_eager_under_every_attention_preset(preset, pos):
    """compile=true on CUDA with each attention preset (sliding windows, the logit cap, QK-norm, the gate, the
    value residual, differential attention), and with a bias scheme whose FlexAttention call is compiled
    inside the block: a bf16 training step's loss and gradients equal eager's within bf16's rounding."""
    from omegaconf import OmegaConf

    from gptlab.parallel.transforms import ParallelOptions, parallelize

    attention = OmegaConf.to_container(compose_cfg(f"attention={preset}").attention, resolve=True)
    config = GPTConfig.from_dict(
        dict(vocab_size=97, block_size=128, n_layer=2, n_head=4, n_embd=128, pos=pos, attention=attention)
    )
    torch.manual_seed(0)
    eager = GPT(config).cuda()
    compiled = GPT(config).cuda()
    compiled.load_state_dict(eager.state_dict())
    parallelize(compiled, ParallelOptions(compile=True))
    idx = torch.randint(0, 97, (4, 128), device="cuda")

    def step(model: GPT) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        return loss.detach().float()

    want, got = step(eager), step(compiled)
    assert abs(float(got - want)) < 1e-2, (float(got), float(want))
    total = torch.cat([p.grad.float().flatten() for p in eager.parameters() if p.grad is not None]).norm()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, name
        difference = float((q.grad.float() - p.grad.float()).norm())
        # relative to the parameter's gradient, or to the whole gradient for one near 0
        scale = max(float(p.grad.float().norm()), 1e-4 * float(total))
        assert difference < 5e-2 * scale, f"{name}: {difference:.2e} against {scale:.2e}"


@pytest.mark.parametrize(
    ("impl", "package"), [("liger", "liger_kernel"), ("cce", "cut_cross_entropy"), ("chunked", None)]
)
def test_fused_loss_kernels_under_bf16_autocast_against_an_fp32_reference_through_the_model(impl, package):
    """Training runs the kernels under bf16 autocast (``_kernel_dtype``). Against the fp32 plain head (the
    reference), each kernel's loss is the plain head's under the same autocast, and ``chunked`` and ``liger``
    give every gradient within twice the plain head's own bf16 error (about 8e-3 at most on a CPU). Cut
    Cross-Entropy adds its gradient tiles in bf16 in the order they finish (head_loss's module docstring): its
    gradients are held to the size that arithmetic gives (``python scripts/head_gradient_accuracy.py``: up to
    2.5e-1, at ``ln_f.weight``, 5-6% at the biases; 2.23e-1 from the plain head on an H200), which is why
    ``auto`` does not take it."""
    if package is not None:
        pytest.importorskip(package)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, block_size=128, n_layer=2, n_head=4, n_embd=256)
    model = GPT(config).cuda()
    idx = torch.randint(0, 50257, (8, 128), device="cuda")
    targets = torch.randint(0, 50257, (8, 128), device="cuda")

    def loss_and_grads(head: HeadLoss, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(idx, targets, head_loss=head)
        loss.backward()
        return loss.detach().float(), {n: p.grad.double().clone() for n, p in model.named_parameters()}

    _, reference = loss_and_grads(HeadLoss("plain"), autocast=False)
    plain_loss, plain_grads = loss_and_grads(HeadLoss("plain"), autocast=True)
    loss, grads = loss_and_grads(HeadLoss(impl), autocast=True)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-3, atol=1e-3)

    def error(got: dict[str, torch.Tensor], name: str) -> float:
        want = reference[name]
        return float((got[name] - want).norm() / want.norm().clamp_min(1e-30))

    for name in reference:
        plain_error, kernel_error = error(plain_grads, name), error(grads, name)
        assert plain_error < 2e-2, f"plain under autocast, {name}: {plain_error:.2e} from fp32"
        bound = 0.4 if impl == "cce" else 2 * plain_error + 1e-3
        assert kernel_error < bound, f"{name}: {kernel_error:.2e} from fp32 (plain: {plain_error:.2e})"


@pytest.mark.parametrize(("z_loss", "softcap"), [(0.0, None), (1e-4, 30.0)], ids=["ce", "zloss-softcap"])
def test_the_chunked_heads_fused_pass_in_bf16_matches_the_plain_head_and_the_eager_pass(z_loss, softcap):
    """On CUDA under bf16 autocast ``chunked`` takes the fused pass (its elementwise work one Triton kernel
    per chunk, made by torch.compile): at GPT-2's vocabulary, two chunks of its CUDA default (4,168 rows of bf16
    logits, and a shorter one), ignored targets, its loss and gradients equal the plain head's under the same
    autocast within bf16's rounding, and the eager pass's (three chunks of 2,080 fp32 rows) within a rounding
    flip of the bf16 gradient."""
    assert fused_by_default("cuda", torch.bfloat16), "triton is not importable: the fused pass is not taken"
    g = torch.Generator(device="cuda").manual_seed(0)
    n, c, v = 6000, 256, 50257
    hidden = torch.randn(n, c, device="cuda", generator=g).requires_grad_()
    weight = (torch.randn(v, c, device="cuda", generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    targets[::7] = -1

    def run(fused: bool | str | None):  # "plain": the plain head
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused == "plain":
                terms = plain_loss_terms(hidden, weight, targets, None, -1, z_loss, softcap)
            else:
                terms = chunked_loss_terms(
                    hidden, weight, targets, z_loss=z_loss, softcap=softcap, fused=fused
                )
        grads = torch.autograd.grad(terms.loss, [hidden, weight])
        return terms, [gr.float() for gr in grads]

    fused, fused_grads = run(None)  # the rule: fused here
    eager, eager_grads = run(False)
    plain, plain_grads = run("plain")
    torch.testing.assert_close(fused.loss, eager.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.loss.float(), plain.loss.float(), rtol=1e-3, atol=1e-3)
    for got, eager_want, plain_want in zip(fused_grads, eager_grads, plain_grads):
        # both write the gradient in bf16, each rounding within 2**-9 of it: 2.37e-3 apart on an H200 at
        # ca8c4ce (against fp32 the fused pass is the closer: 4.6e-3 against the eager pass's 5.7e-3)
        assert float((got - eager_want).norm() / eager_want.norm()) < 2**-8
        assert float((got - plain_want).norm() / plain_want.norm()) < 2e-2  # bf16 operands: about 1e-2
    assert torch.all(fused_grads[0][targets == -1] == 0)


def test_the_plain_head_in_fp32_is_the_reference_on_cuda():
    # The reference the kernels are held to: F.cross_entropy over the whole logits, in fp32 on the GPU equal to
    # a float64 computation.
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(512, 64, device="cuda", generator=g)
    weight = torch.randn(5003, 64, device="cuda", generator=g) * 0.1
    targets = torch.randint(0, 5003, (512,), device="cuda", generator=g)
    loss = plain_linear_cross_entropy(hidden, weight, targets)
    want = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().T, targets)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_device_over_nccl_trains_checkpoints_and_resumes_to_the_uninterrupted_loss(tmp_path, strategy):
    """strategy=ddp and strategy=fsdp on one GPU (a process group of one over NCCL): a run resumed from its
    step-20 checkpoint (for fsdp a sharded directory) ends with the uninterrupted run's losses."""
    common = [
        *LEARNS,
        *GPU,
        f"strategy={strategy}",
        "trainer.deterministic=true",
        "loss.impl=plain",
        "callbacks.model_checkpoint.save_top_k=-1",
        f"paths.root_dir={tmp_path}",
    ]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    full = tmp_path / "full"
    run_train([*common, f"hydra.run.dir={full}"], cwd=tmp_path, env=env)
    middle = next((full / "checkpoints").glob("best-step000020-*.ckpt"))
    if strategy == "fsdp":
        assert middle.is_dir() and list(middle.glob("*.distcp"))  # a distributed checkpoint
    resumed = tmp_path / "resumed"
    proc = run_train([*common, f"resume={middle}", f"hydra.run.dir={resumed}"], cwd=tmp_path, env=env)
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    want, got = train_losses(full), train_losses(resumed)
    # rows are numbered by optimizer steps done: the resumed run logs steps 21 to 40
    assert min(got) == 21 and max(got) == max(want) == 40
    for step in range(21, 41):
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-4), step
    assert val_losses(resumed)[40] == pytest.approx(val_losses(full)[40], rel=1e-4, abs=1e-4)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_a_resume_on_the_gpu_with_deterministic_algorithms_is_bit_identical(tmp_path):
    """bf16 mixed precision, deterministic algorithms: the run resumed from its step-20 checkpoint ends with the
    uninterrupted run's weights, bit for bit (the loss is the plain head: the fused kernels' atomics are not
    deterministic)."""
    common = [
        *LEARNS,
        *GPU,
        "trainer.precision=bf16-mixed",
        "trainer.deterministic=true",
        "loss.impl=plain",
        "callbacks.model_checkpoint.save_top_k=-1",
        f"paths.root_dir={tmp_path}",
    ]
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    full = tmp_path / "full"
    run_train([*common, f"hydra.run.dir={full}"], cwd=tmp_path, env=env)
    middle = next((full / "checkpoints").glob("best-step000020-*.ckpt"))
    resumed = tmp_path / "resumed"
    run_train([*common, f"resume={middle}", f"hydra.run.dir={resumed}"], cwd=tmp_path, env=env)
    a, b = weights(last_checkpoint(full)), weights(last_checkpoint(resumed))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("pos", ["learned", "rope", "alibi", "relative"])
def test_kv_cache_decoding_equals_recomputing_on_cuda(pos):
    torch.manual_seed(0)
    model = (
        GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=64, pos=pos)).cuda().eval()
    )
    idx = torch.randint(0, 97, (2, 20), device="cuda")
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache.empty(model.config.n_layer)
        pieces = [model(idx[:, :12], cache=cache)[0]]
        for t in range(12, 20):
            pieces.append(model(idx[:, t : t + 1], cache=cache)[0])
    # the whole sequence takes FlexAttention for alibi and relative, the cached steps the dense route
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)
    if pos in ("alibi", "relative"):
        return  # without a cache each new length would compile FlexAttention anew: greedy decoding below
    prompt = idx[:1, :5]
    a = model.generate(prompt, 40, use_cache=True)  # past block_size: the window slides
    b = model.generate(prompt, 40, use_cache=False)
    assert a.shape == (1, 45) and torch.equal(a, b)


@pytest.mark.parametrize(
    "attention",
    [{"differential": True}, {"gate": "elementwise", "value_residual": "learnable"}],
    ids=["differential", "gate+value_residual"],
)
def test_attention_variants_on_cuda_equal_the_cpu_and_train_in_bf16(attention):
    """Differential attention's queries are half as wide as its values: which fused SDPA kernel CUDA takes for
    that (the flash kernel wants equal widths) is the GPU's to show. Each variant's loss and gradients on CUDA
    in fp32 equal the CPU's, and a bf16-autocast step gives a finite loss near fp32's."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, block_size=64, n_layer=3, n_head=4, n_embd=128, attention=attention)
    cpu_model = GPT(config)
    cuda_model = GPT(config).cuda()
    cuda_model.load_state_dict(cpu_model.state_dict())
    idx = torch.randint(0, 97, (4, 64))

    def loss_and_grads(model: GPT, device: str, bf16: bool = False):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(idx.to(device), idx.to(device))
        loss.backward()
        return loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}

    cpu_loss, cpu_grads = loss_and_grads(cpu_model, "cpu")
    cuda_loss, cuda_grads = loss_and_grads(cuda_model, "cuda")
    torch.testing.assert_close(cuda_loss, cpu_loss, rtol=1e-4, atol=1e-4)
    for name, want in cpu_grads.items():
        error = (cuda_grads[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert error < 1e-3, f"{name}: relative gradient error {error:.2e}"
    bf16_loss, _ = loss_and_grads(cuda_model, "cuda", bf16=True)
    assert math.isfinite(float(bf16_loss)) and abs(float(bf16_loss) - float(cpu_loss)) < 0.05


def test_a_background_checkpoint_save_copies_cuda_tensors_at_their_step(tmp_path):
    """The background writer's host copy of CUDA tensors (a tied pair among them): the file holds the values
    at the save, not those the next steps write, with the tie kept."""
    from gptlab.parallel.checkpoint_io import AtomicCheckpointIO

    embedding = torch.randn(1000, 64, device="cuda")
    at_save = embedding.cpu()
    writer = AtomicCheckpointIO()
    with writer.in_background():
        writer.save_checkpoint(
            {"state_dict": {"wte": embedding, "lm_head": embedding}, "global_step": 1}, tmp_path / "last.ckpt"
        )
    embedding.mul_(2.0)  # the next step, on the GPU, while the thread writes
    writer.teardown()
    saved = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert torch.equal(saved["wte"], at_save)
    assert saved["wte"].untyped_storage().data_ptr() == saved["lm_head"].untyped_storage().data_ptr()


def test_the_host_copy_of_cuda_tensors_is_pinned_equal_and_keeps_the_tie():
    """The background writer's host copy of CUDA tensors goes to pinned buffers (queued without waiting, then
    waited for once): the same bytes as a pageable copy, the tied pair still one storage, an optimizer state's
    step count on the CPU copied too, and the next save reuses the pinned buffers."""
    from gptlab.parallel.checkpoint_io import HostSnapshot

    embedding = torch.randn(5000, 256, device="cuda")
    state = {
        "state_dict": {"wte": embedding, "lm_head": embedding, "ln": torch.ones(256, device="cuda")},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(5000, 256, device="cuda")}}}],
        "step": torch.tensor(3.0),
    }
    pinned, pageable = HostSnapshot(), HostSnapshot(pin=False)
    at_save = embedding.cpu()
    copy = pinned.take(state)
    embedding.mul_(2.0)  # the next step, queued on the GPU after the copy
    cuda_bytes = 2 * 5000 * 256 * 4 + 256 * 4  # the tied pair's one storage, exp_avg, ln; not the CPU step
    assert pinned.pinned_bytes() == cuda_bytes and copy["state_dict"]["wte"].is_pinned()
    assert not copy["step"].is_pinned()
    assert torch.equal(copy["state_dict"]["wte"], at_save)
    assert copy["state_dict"]["wte"].untyped_storage().data_ptr() == (
        copy["state_dict"]["lm_head"].untyped_storage().data_ptr()
    )
    plain = pageable.take(state)
    assert pageable.pinned_bytes() == 0
    for got, want in (
        (
            copy["optimizer_states"][0]["state"][0]["exp_avg"],
            plain["optimizer_states"][0]["state"][0]["exp_avg"],
        ),
        (copy["state_dict"]["ln"], plain["state_dict"]["ln"]),
        (copy["step"], plain["step"]),
    ):
        assert got.device.type == "cpu" and torch.equal(got, want)
    buffers = {id(b) for b in pinned._buffers.values()}
    again = pinned.take(state)
    assert {id(b) for b in pinned._buffers.values()} == buffers  # nothing pinned anew per save
    assert torch.equal(again["state_dict"]["wte"], embedding.cpu())
