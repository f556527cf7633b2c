"""The model card: parameter counts against built models, FLOPs against torch's FLOP counter, activation
memory against the tensors autograd really keeps, and the memory arithmetic of each strategy, read from the
same strategy choices that training builds."""

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import CONF, ROOT, load_script
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import gptlab
from gptlab import planning, torch_features
from gptlab.errors import ConfigError
from gptlab.model import counting, positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss, chunked_loss_terms, installed_kernel_modules
from gptlab.parallel import strategy_choice

GiB = 1024**3
PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
VARIANTS = [
    [],
    ["activation=swiglu"],
    ["norm=rmsnorm", "model.bias=false"],
    ["model.tie_weights=false", "pos=sinusoidal"],
    ["model.n_kv_head=1", "norm.placement=post", "activation=reglu", "model.mlp_ratio=3"],
    ["norm.placement=sandwich", "attention=gemma2", "attention.qk_norm=layernorm", "activation=geglu"],
]


#: scripts/fsdp_memory.py's arguments for a model whose root unit outweighs its blocks (docs/training-at-scale.md)
FSDP_ROOT_HEAVY = [
    "--vocab",
    "16384",
    "--width",
    "64",
    "--context",
    "32",
    "--batch",
    "2",
    "--chunk-rows",
    "32",
]


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=64), **kw})


@pytest.mark.parametrize("preset", PRESETS)
def test_analytic_counts_equal_a_meta_device_build(make_cfg, preset):
    for variant in VARIANTS if preset in ("tiny", "gpt2") else VARIANTS[:2]:
        config = gptlab.build_model_config(make_cfg(f"model={preset}", *variant, "model.vocab_size=50257"))
        with torch.device("meta"):
            built = GPT(config).parameter_counts()
        counted = counting.parameter_counts(config)
        assert {k: counted[k] for k in built} == built, (preset, variant)


@pytest.mark.parametrize("pos", positional.names())
def test_counts_cover_every_positional_scheme(pos):
    config = tiny(pos=pos, tie_weights=False)
    with torch.device("meta"):
        built = GPT(config).parameter_counts()
    counted = counting.parameter_counts(config)
    assert {k: counted[k] for k in built} == built


def test_gpt2_and_gpt3_presets_have_their_published_sizes(make_cfg):
    def total(preset: str) -> int:
        return counting.parameter_counts(gptlab.build_model_config(make_cfg(f"model={preset}")))["total"]

    # GPT-2's four checkpoints, exactly (the sizes of the released weights).
    assert total("gpt2") == 124_439_808
    assert total("gpt2-medium") == 354_823_168
    assert total("gpt2-large") == 774_030_080
    assert total("gpt2-xl") == 1_557_611_200
    # GPT-3, Brown et al. 2020, Table 2.1: 175B within 0.5%, the named sizes within 2%.
    assert abs(total("gpt3") / 175e9 - 1) < 0.005
    paper = {
        "gpt3-small": 125e6,
        "gpt3-medium": 350e6,
        "gpt3-large": 760e6,
        "gpt3-xl": 1.3e9,
        "gpt3-2.7b": 2.7e9,
        "gpt3-6.7b": 6.7e9,
        "gpt3-13b": 13e9,
    }
    for preset, size in paper.items():
        assert abs(total(preset) / size - 1) < 0.02, preset


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"activation": "swiglu"},
        {"n_kv_head": 2, "norm": "rmsnorm"},
        {"tie_weights": False},
        {"vocab_multiple": 1},
    ],
)
def test_flops_per_token_equal_torchs_flop_counter(kw):
    config = tiny(**kw)
    model = GPT(config)
    B, T = 2, 32
    idx = torch.randint(0, 97, (B, T))
    counter = FlopCounterMode(display=False)
    # The math backend spells attention out as matrix products, which the counter sees.
    with counter, sdpa_kernel(SDPBackend.MATH):
        _, loss = model(idx, idx)
        loss.backward()
    # The plain head multiplies by every stored row, the padding's too (97 -> 128, model.vocab_multiple=64);
    # the count is the model's, of its 97 rows (model/counting.py): the difference is the padding's products.
    padding = 6 * (config.padded_vocab_size - config.vocab_size) * config.n_embd
    assert counting.flops_per_token(config, T)["training"] + padding == counter.get_total_flops() / (B * T)


def saved_activation_bytes(model: GPT, idx: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass, each storage once, weights excluded."""
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(storages.values())


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"activation": "swiglu"},
        {"n_kv_head": 1},
        {"norm": "rmsnorm"},
        {"attention": {"qk_norm": "rmsnorm"}, "n_kv_head": 2},
        {"norm_placement": "sandwich"},
        {"attention": {"gate": "elementwise"}},
        {"attention": {"value_residual": "learnable"}},
    ],
)
def test_activation_estimate_matches_what_autograd_keeps(kw):
    config = tiny(**kw)
    B, T = 4, 32
    measured = saved_activation_bytes(GPT(config), torch.randint(0, 97, (B, T)))
    estimate = planning.memory_per_device(
        config, planning.TrainingPlan("auto", 1, "32-true", micro_batch=B, context=T)
    ).activations
    # the plain head's part that autograd saves: cross-entropy's fp32 log-probabilities (the rest of its
    # peak is the gradients of the backward pass, test_head_estimate_matches_the_heads_peak)
    estimate += 4 * config.vocab_size * B * T
    assert abs(estimate / measured - 1) < 0.12, (estimate, measured)


def test_differential_attentions_activation_estimate_matches_what_autograd_keeps():
    # On a CPU its two attentions (queries narrower than the values) take SDPA's math kernel, which keeps each
    # head's T x T weights, uncounted as on the dense bias route (CUDA's fused kernels keep none): at T = 8
    # they are 4% of the rest, and what the estimate counts is compared.
    config = tiny(attention={"differential": True})
    B, T = 4, 8
    measured = saved_activation_bytes(GPT(config), torch.randint(0, 97, (B, T)))
    weights = 4 * B * config.n_layer * 2 * config.n_head * T * T
    estimate = planning.memory_per_device(
        config, planning.TrainingPlan("auto", 1, "32-true", micro_batch=B, context=T)
    ).activations
    estimate += 4 * config.vocab_size * B * T  # the plain head's log-probabilities
    assert abs(estimate / (measured - weights) - 1) < 0.12, (estimate, measured, weights)


def test_activations_of_gpt2_in_16_bits_are_korthikantis_34_sbh():
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.1)
    per_token = planning.activation_bytes_per_token(config, 2)
    outside = 2 * 2 * 768  # the embedding output and the final norm's input; the head is counted apart
    assert per_token - outside == 12 * 34 * 768


def test_strategies_shard_what_zero_says():
    config = tiny()
    counts = counting.parameter_counts(config)
    n = counts["total"] + counts["padding"]  # what is stored: the padding rows have gradients and moments too
    single = planning.memory_per_device(config, planning.TrainingPlan("auto", 1, "32-true"))
    assert (single.weights, single.gradients, single.optimizer) == (4 * n, 4 * n, 8 * n)
    ddp = planning.memory_per_device(config, planning.TrainingPlan("ddp", 8, "32-true"))
    assert ddp.total > single.total  # every replica whole, plus the gradient buckets
    z1 = planning.memory_per_device(config, planning.TrainingPlan("deepspeed_stage_1", 8, "bf16-mixed"))
    z2 = planning.memory_per_device(config, planning.TrainingPlan("deepspeed_stage_2", 8, "bf16-mixed"))
    z3 = planning.memory_per_device(config, planning.TrainingPlan("deepspeed_stage_3", 8, "bf16-mixed"))
    # ZeRO (Rajbhandari et al. 2020), mixed precision: 2 + 2 + 12 bytes per parameter, sharded stage by stage.
    assert (z1.weights, z1.gradients, z1.optimizer) == (2 * n, 2 * n, 12 * n / 8)
    assert (z2.weights, z2.gradients, z2.optimizer) == (2 * n, 2 * n / 8, 12 * n / 8)
    assert (z3.weights, z3.gradients, z3.optimizer) == (2 * n / 8, 2 * n / 8, 12 * n / 8)
    fsdp = planning.memory_per_device(config, planning.TrainingPlan("fsdp", 8, "bf16-mixed"))
    assert fsdp.weights == 4 * n / 8 and fsdp.optimizer == 8 * n / 8
    offload = planning.memory_per_device(
        config, planning.TrainingPlan("deepspeed_stage_3_offload", 8, "bf16-mixed")
    )
    assert offload.optimizer == 0 and offload.weights == 0 and offload.host == pytest.approx(14 * n / 8)
    # Activations grow with the micro-batch and are never sharded by data parallelism.
    assert (
        planning.memory_per_device(config, planning.TrainingPlan("fsdp", 8, micro_batch=4)).activations
        == 4 * single.activations
    )
    with pytest.raises(ConfigError, match="Unknown strategy 'zero4'"):
        planning.memory_per_device(config, planning.TrainingPlan("zero4"))


@pytest.mark.slow
def test_the_fsdp_estimate_counts_the_root_unit_two_processes_gather():
    """strategy=fsdp on two CPU processes (gloo), sharded as a run shards it: a model whose root unit (the
    tied 16,384 x 64 embedding and output layer) outweighs its blocks. The estimate bounds the peak the
    allocator recorded on each rank over a forward and backward pass, and is near it; without the root unit
    gathered whole (its weights and gradients), it fell below what any rank held."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fsdp_memory.py"), *FSDP_ROOT_HEAVY, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    measured, estimate = figures["measured_bytes"], figures["estimate_bytes"]
    assert figures["parts_bytes"]["gathered root"] > 0
    # ranks differ by a copy of the root unit, by when the collectives' buffers are freed (12.6 or 17.0 MiB)
    assert max(measured) <= 1.1 * estimate and estimate <= 1.6 * min(measured), (measured, estimate)
    assert figures["estimate_without_root_bytes"] < 0.85 * min(measured), figures


def test_the_planner_reads_each_strategy_choice_that_training_builds():
    # Every conf/strategy choice, by its YAML name or as the config node training receives.
    for name in planning.strategy_choices():
        assert planning.memory_per_device(tiny(), planning.TrainingPlan(name, 4)).strategy == name
    node = {"name": "deepspeed", "stage": 3, "offload_optimizer": True, "offload_parameters": True}
    assert (
        planning.memory_per_device(tiny(), planning.TrainingPlan(node, 4)).strategy
        == "deepspeed_stage_3_offload"
    )
    # auto: the single device's placement on one device, DDP's on several.
    assert not strategy_choice("auto").placement(1).distributed
    assert strategy_choice("auto").placement(4) == strategy_choice("ddp").placement(4)
    # An option changes what each device holds: FSDP's cpu_offload moves the shards to the host.
    offloaded = planning.memory_per_device(
        tiny(), planning.TrainingPlan({"name": "fsdp", "cpu_offload": True}, 8)
    )
    assert offloaded.weights == offloaded.gradients == offloaded.optimizer == 0 and offloaded.host > 0
    # The table lists each distinct placement once, named as a user types it.
    names = [name for name, _ in planning.distinct_choices(8)]
    assert names[0] == "ddp" and "auto" not in names and "ddp_spawn" not in names
    assert {"fsdp", "deepspeed_stage_1", "deepspeed_stage_3_offload"} <= set(names)
    assert [name for name, _ in planning.distinct_choices(1)][0] == "auto"


def test_a_run_that_does_not_fit_names_the_strategy_that_would(make_cfg):
    gpt2_xl = gptlab.build_model_config(make_cfg("model=gpt2-xl"))
    # 1.56B parameters x 16 bytes of training state = 23 GiB: not on one 16 GiB device, nor replicated on 8.
    assert (
        planning.advise(gpt2_xl, 80 * GiB, planning.TrainingPlan("auto", 1, "bf16-mixed", micro_batch=1))
        is None
    )
    warning = planning.advise(gpt2_xl, 16 * GiB, planning.TrainingPlan("ddp", 8, "bf16-mixed", micro_batch=1))
    assert warning.startswith("WARNING") and "strategy=deepspeed_stage_1 would fit" in warning
    fit = planning.memory_per_device(
        gpt2_xl, planning.TrainingPlan("deepspeed_stage_1", 8, "bf16-mixed", micro_batch=1)
    )
    assert fit.fits(16 * GiB)
    # GPT-3 on one GPU: the warning says how many devices a sharded run needs.
    gpt3 = gptlab.build_model_config(make_cfg("model=gpt3"))
    warning = planning.advise(gpt3, 80 * GiB, planning.TrainingPlan("auto", 1, "bf16-mixed", micro_batch=1))
    assert "devices" in warning and "strategy=" in warning


def test_model_card_script_reports_gpt3(capsys):
    script = load_script("model_card")
    del sys.modules["model_card"]
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    args = ["model=gpt3", "activation=gelu_tanh", "--devices", "1024", "--device-memory", "80"]
    assert script.main([*args, "--precision", "bf16-mixed", "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "Parameters: total 174,604,259,328 (174.60B)" in out
    assert "Training FLOPs per token at context 2048" in out
    assert "deepspeed_stage_3 " in out and "fsdp " in out and "activation checkpointing" in out
    assert "strategy=fsdp with activation checkpointing would fit" in out
    GlobalHydra.instance().clear()
    assert script.main(["model=tiny", "model.n_head=3"]) == 2
    assert "not divisible by model.n_head=3" in capsys.readouterr().err


def head_peak_bytes(loss: HeadLoss, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> int:
    """The most bytes the CPU allocator held at once, above what existed before, over one forward and backward
    pass of ``loss`` (the profiler's record of every allocation and free, in order)."""
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    return planning.cpu_peak_bytes(lambda: loss(hidden, weight, targets).backward())


needs_torch_lce = pytest.mark.skipif(
    not torch_features.has("linear_cross_entropy"), reason="the installed torch has no F.linear_cross_entropy"
)


@pytest.mark.parametrize(
    ("loss", "C"),
    [
        (HeadLoss("plain"), 32),
        (HeadLoss("plain", z_loss=1e-4, final_softcap=30.0), 32),
        (HeadLoss("chunked"), 32),
        (HeadLoss("chunked", chunk_rows=96, final_softcap=30.0), 32),
        # torch's holds the most during its chunks at this width, and at the end of its backward (two copies
        # of each gradient) at the wider one
        pytest.param(HeadLoss("torch", chunk_rows=96), 32, marks=needs_torch_lce),
        pytest.param(HeadLoss("torch", chunk_rows=128), 256, marks=needs_torch_lce),
    ],
    ids=["plain", "plain-zloss-softcap", "chunked", "chunked-96-softcap", "torch-96", "torch-128-wide"],
)
def test_head_estimate_matches_the_heads_peak(loss, C):
    """What the card counts for the output layer and loss against what the allocator really held: the whole
    logits and their gradients for plain, one chunk and the accumulated gradients for chunked and torch's."""
    N, V = 1024, 4096
    config = tiny(vocab_size=V, n_embd=C)
    head = planning.HeadPlan.of(loss, "cpu", "32-true")
    assert head.impl == ("chunked" if loss.impl == "auto" else loss.impl)
    hidden, weight = torch.randn(N, C), torch.randn(V, C) * 0.1
    measured = head_peak_bytes(loss, hidden, weight, torch.randint(0, V, (N,)))
    estimate = head.bytes(config, N)
    assert abs(estimate / measured - 1) < 0.1, (estimate, measured)


def test_the_fused_chunked_heads_estimate_matches_its_peak():
    """The chunked head's fused pass, counted as on CUDA in bf16 (a bf16 chunk that its gradient overwrites,
    no fp32 one) against the allocator's record of the same pass forced on the CPU with bf16 products (a
    compile of its kernel, some seconds)."""
    N, C, V, rows = 1024, 256, 4096, 128
    config = tiny(vocab_size=V, n_embd=C)
    fused = planning.HeadPlan("chunked", rows, "cuda", half_products=True, fused=True)
    eager = replace(fused, fused=False)

    def loss(hidden, weight, targets):
        return chunked_loss_terms(
            hidden, weight, targets, chunk_rows=rows, matmul_dtype=torch.bfloat16, fused=True
        ).loss

    hidden, weight, targets = torch.randn(N, C), torch.randn(V, C) * 0.1, torch.randint(0, V, (N,))
    head_peak_bytes(loss, hidden, weight, targets)  # compiled before the measure
    measured = head_peak_bytes(loss, hidden, weight, targets)
    assert abs(fused.bytes(config, N) / measured - 1) < 0.1, (fused.bytes(config, N), measured)
    # the fp32 chunk is gone: 4 bytes a logit of the chunk fewer than the eager pass
    assert eager.bytes(config, N) - fused.bytes(config, N) == rows * V * 4
    assert "fused" in fused.describe(config) and "fused" not in eager.describe(config)


def test_the_fused_heads_default_chunk_holds_twice_the_rows_in_the_same_bytes():
    """Without ``chunk_rows`` the fused pass's chunk, in the products' bf16, takes twice the rows of the eager
    pass's fp32 one (here the CPU's 32 MiB budget: 4,096 rows against 2,048 at V = 4,096), and what the card
    counts for it is what the allocator held (the pass forced on the CPU with bf16 products; the vocabulary of
    the test above, whose compiled kernel serves here)."""
    N, C, V = 8192, 8, 4096
    config = tiny(vocab_size=V, n_embd=C)
    fused = planning.HeadPlan("chunked", None, "cpu", half_products=True, fused=True)
    eager = replace(fused, fused=False)
    assert (fused.rows(config), eager.rows(config)) == (4096, 2048)
    assert "4,096 rows per chunk, fused" in fused.describe(config)

    def loss(hidden, weight, targets):
        return chunked_loss_terms(hidden, weight, targets, matmul_dtype=torch.bfloat16, fused=True).loss

    hidden, weight, targets = torch.randn(N, C), torch.randn(V, C) * 0.1, torch.randint(0, V, (N,))
    head_peak_bytes(loss, hidden, weight, targets)  # compiled before the measure
    measured = head_peak_bytes(loss, hidden, weight, targets)
    assert abs(fused.bytes(config, N) / measured - 1) < 0.1, (fused.bytes(config, N), measured)


def test_the_card_counts_the_head_the_run_takes(make_cfg):
    """GPT-2 small at 32 x 1024 in bf16: the chunked head holds a third of a GiB where the plain one holds
    the whole logits and their gradients (18 GiB), and the card says which it counted."""
    config = gptlab.build_model_config(make_cfg("model=gpt2", "model.vocab_size=50257"))
    plan = planning.TrainingPlan("auto", 1, "bf16-mixed", micro_batch=32, context=1024)

    def card(loss: HeadLoss, device_type: str) -> tuple[str, planning.MemoryEstimate]:
        planned = replace(plan, head=planning.HeadPlan.of(loss, device_type, "bf16-mixed"))
        return planning.model_card(config, planned, short=True), planning.memory_per_device(config, planned)

    text, chunked = card(HeadLoss(), "cpu")  # loss.impl=auto: the card says what it took
    assert "output layer and loss 0.27 GiB (loss.impl=auto: chunked, 160 rows per chunk)" in text
    assert "(loss.impl=chunked, 160 rows per chunk)" in card(HeadLoss("chunked"), "cpu")[0]
    text, plain = card(HeadLoss("plain"), "cpu")
    assert "output layer and loss 18.40 GiB (loss.impl=plain, the whole logits)" in text
    assert plain.total - chunked.total > 18 * GiB
    # on CUDA, the kernels keep no logits: their fixed allowance; chunked's chunk is larger there
    _, cce = (
        card(HeadLoss("cce"), "cuda") if "cut_cross_entropy" in installed_kernel_modules() else (None, None)
    )
    if cce is not None:
        assert cce.head == planning.KERNEL_HEAD_BYTES
    text, cuda_chunked = card(HeadLoss("chunked"), "cuda")
    # 400 MiB of logits: fp32 ones in the eager pass; bf16 ones, twice the rows, in the fused pass (with triton)
    fused = planning.HeadPlan.of(HeadLoss("chunked"), "cuda", "bf16-mixed").fused
    assert f"{4168 if fused else 2080:,} rows per chunk" in text and cuda_chunked.head < 1.5 * GiB


def test_the_cards_first_line_counts_one_layer_and_one_head_in_the_singular(make_cfg):
    from gptlab.planning import model_card

    one = model_card(gptlab.build_model_config(make_cfg("model.n_layer=1", "model.n_head=1"))).splitlines()[0]
    assert one.startswith("Model: 1 layer x 1 head x 128 wide, "), one
    two = model_card(gptlab.build_model_config(make_cfg())).splitlines()[0]
    assert two.startswith("Model: 2 layers x 4 heads x 128 wide, "), two


def test_the_cards_memory_figures_keep_two_significant_digits(make_cfg):
    """A term under 0.1 GiB is given in MiB (debug=fast's AdamW state: 12.4 MiB, which "0.01 GiB" rounded by
    a fifth); the larger ones in GiB."""
    _gib = planning._gib
    assert _gib(12.4 * 2**20) == "12.4 MiB" and _gib(0.3 * 2**20) == "0.3 MiB"
    assert _gib(0.17 * 2**30) == "0.17 GiB" and _gib(3758.4 * 2**30, 1) == "3,758.4 GiB"
    assert _gib(0.5 * 2**30, 1) == "512 MiB"
    card = planning.model_card(gptlab.build_model_config(make_cfg("debug=fast")), short=True)
    memory = next(line for line in card.splitlines() if line.startswith("Memory per device"))
    assert re.search(r" = weights \d+\.\d MiB \+ gradients \d+\.\d MiB \+ AdamW \d\d\.\d MiB ", memory), (
        memory
    )


def test_counts_read_with_a_suffix_up_to_yotta_and_in_powers_of_ten_beyond():
    from gptlab.model.counting import human

    # GPT-3's training, 3.14e23 FLOPs, read as 314.00Z (it printed as 314000.00E)
    assert [human(n) for n in (999, 1234, 124.4e6, 3.14e23, 9.9e26, 2e28)] == [
        "999",
        "1.23k",
        "124.40M",
        "314.00Z",
        "990.00Y",
        "2.00e+28",
    ]
