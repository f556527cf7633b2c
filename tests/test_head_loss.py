"""The output layer and loss computed together: the same loss and gradients as the plain path, with any
chunk size, ignored targets, a bias, and through the whole model with a tied or untied head."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from gptlab import torch_features
from gptlab.errors import ConfigError
from gptlab.model import head_loss
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import (
    HeadLoss,
    chunked_linear_cross_entropy,
    chunked_loss_terms,
    default_chunk_rows,
    fused_by_default,
    plain_loss_terms,
    refusal,
    soft_cap,
    torch_linear_cross_entropy,
)
from gptlab.training.module import GPTLitModule

TOL = dict(rtol=1e-5, atol=1e-5)
# loss.impl=torch: F.linear_cross_entropy with its options, in torch >= 2.13 (an older torch refuses it at config
# time: tests/test_torch_range.py)
needs_torch_lce = pytest.mark.skipif(
    not torch_features.has("linear_cross_entropy"), reason="the installed torch has no F.linear_cross_entropy"
)
TORCH_IMPL = pytest.param("torch", marks=needs_torch_lce)


def problem(n=37, c=16, v=101, bias=False, ignore_every=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g, requires_grad=True)
    weight = torch.randn(v, c, generator=g).mul_(0.5).requires_grad_()
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -1
    return hidden, weight, b, targets


def reference(hidden, weight, bias, targets):
    """The plain path: the whole logits, then F.cross_entropy."""
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits, targets, ignore_index=-1)


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 37, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_the_plain_path(chunk_rows, bias):
    hidden, weight, b, targets = problem(bias=bias)
    inputs = [hidden, weight] + ([b] if bias else [])
    expected = reference(hidden, weight, b, targets)
    expected_grads = torch.autograd.grad(expected, inputs)
    loss = chunked_linear_cross_entropy(hidden, weight, targets, b, ignore_index=-1, chunk_rows=chunk_rows)
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, expected, **TOL)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL)


@needs_torch_lce
@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 37, 100, None])
@pytest.mark.parametrize("bias", [False, True])
def test_torchs_function_gives_the_loss_and_gradients_of_the_plain_path(chunk_rows, bias):
    # loss.impl=torch: F.linear_cross_entropy with the chunk set; every fifth target ignored
    hidden, weight, b, targets = problem(bias=bias)
    inputs = [hidden, weight] + ([b] if bias else [])
    expected = reference(hidden, weight, b, targets)
    expected_grads = torch.autograd.grad(expected, inputs)
    loss = HeadLoss("torch", chunk_rows=chunk_rows)(hidden, weight, targets, b)
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, expected, **TOL)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOL)
    assert torch.all(grads[0][targets == -1] == 0)  # an ignored row sends no gradient to its hidden state


@needs_torch_lce
def test_torchs_function_takes_leading_dimensions_and_an_upstream_gradient():
    hidden, weight, _, targets = problem(n=24)
    (reference(hidden, weight, None, targets) * 0.25).backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = torch_linear_cross_entropy(hidden.view(4, 6, -1), weight, targets.view(4, 6), chunk_rows=5)
    (loss * 0.25).backward()
    torch.testing.assert_close(hidden.grad, want[0], **TOL)
    torch.testing.assert_close(weight.grad, want[1], **TOL)
    with torch.no_grad():
        loss = torch_linear_cross_entropy(hidden, weight, targets, chunk_rows=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, None, targets).detach(), **TOL)


def test_the_mean_counts_only_targets_that_are_not_ignored():
    hidden, weight, _, targets = problem(ignore_every=2)
    keep = targets != -1
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_rows=4)
    per_row = F.cross_entropy(hidden[keep] @ weight.t(), targets[keep], reduction="none")
    torch.testing.assert_close(loss, per_row.mean(), **TOL)
    hidden.grad = None
    loss.backward()
    assert torch.all(hidden.grad[~keep] == 0)  # an ignored position sends no gradient to its hidden state


def test_an_upstream_gradient_scales_the_result():
    # Gradient accumulation divides the loss by the number of micro-batches before the backward.
    hidden, weight, _, targets = problem()
    (reference(hidden, weight, None, targets) * 0.25).backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (chunked_linear_cross_entropy(hidden, weight, targets, chunk_rows=8) * 0.25).backward()
    torch.testing.assert_close(hidden.grad, want[0], **TOL)
    torch.testing.assert_close(weight.grad, want[1], **TOL)


def test_without_grad_mode_only_the_loss_is_computed():
    hidden, weight, _, targets = problem()
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_rows=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, None, targets).detach(), **TOL)


@pytest.mark.parametrize("impl", ["chunked", TORCH_IMPL])
@pytest.mark.parametrize("tie_weights", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_the_whole_model_trains_the_same_with_the_chunked_head(tie_weights, bias, impl):
    config = GPTConfig(
        vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=tie_weights, bias=bias
    )
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 97, (3, 16))
    targets = torch.randint(0, 97, (3, 16))
    targets[0, :5] = -1  # e.g. padding
    _, expected = model(idx, targets)
    expected.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets, head_loss=HeadLoss(impl, chunk_rows=7))
    loss.backward()
    assert logits is None  # the logits are never made whole
    torch.testing.assert_close(loss, expected, **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    # generation still has logits: without targets the head runs as usual
    logits, loss = model(idx, head_loss=HeadLoss(impl))
    assert logits.shape == (3, 16, 97) and loss is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("z_loss", "softcap", "bias"), [(0.0, None, False), (1e-2, None, True), (0.0, 5.0, False)]
)
def test_the_chunked_products_in_half_precision_give_the_plain_heads_loss_and_gradients(
    dtype, z_loss, softcap, bias
):
    """On CUDA under bf16 / fp16 autocast the chunked head multiplies in that dtype (fp32 softmax, fp32
    accumulation): forced here on the CPU, its loss, z-loss and gradients equal the plain head's whose logits
    come from the same half-precision product, and stay within the half dtype's rounding of fp32's; ignored
    targets count for nothing."""
    hidden, weight, b, targets = problem(n=45, c=32, v=211, bias=bias, ignore_every=4)
    params = [hidden, weight] + ([b] if b is not None else [])
    # the reference: the product in the dtype, then the plain head's loss in fp32 (the bias added in fp32)
    rounded = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight)]
    logits = torch.mm(rounded[0], rounded[1].t()).float() + (b if b is not None else 0.0)
    logits = soft_cap(logits, softcap)
    want_ce = F.cross_entropy(logits, targets, ignore_index=-1)
    counted = targets != -1
    want_lse_square = (torch.logsumexp(logits, -1).square() * counted).sum() / counted.sum()
    want_loss = want_ce + z_loss * want_lse_square
    want_grads = [
        g.float() for g in torch.autograd.grad(want_loss, [*rounded, *([b] if b is not None else [])])
    ]
    exact = plain_loss_terms(hidden, weight, targets, b, -1, z_loss, softcap)
    exact_grads = torch.autograd.grad(exact.loss, params)
    got = chunked_loss_terms(hidden, weight, targets, b, -1, 16, z_loss, softcap, matmul_dtype=dtype)
    got_grads = torch.autograd.grad(got.loss, params)
    torch.testing.assert_close(got.loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cross_entropy, want_ce, rtol=1e-5, atol=1e-5)
    if z_loss:
        torch.testing.assert_close(got.lse_square, want_lse_square, rtol=1e-5, atol=1e-5)
    eps = torch.finfo(dtype).eps
    for name, g, w, e in zip(("hidden", "weight", "bias"), got_grads, want_grads, exact_grads):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        # the gradient products' operands are rounded too: within a few of the dtype's eps of the reference
        assert float((g - w).norm() / w.norm()) < 4 * eps, name
        assert float((g - e).norm() / e.norm()) < 8 * eps, name
    assert torch.all(got_grads[0][targets == -1] == 0)  # an ignored row's hidden state gets no gradient


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (each compile and each recompile)."""
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_fused_chunk_pass_gives_the_eager_passs_loss_and_gradients(dtype):
    """The fused elementwise pass (one compiled kernel per chunk: inductor's C++ here, Triton on CUDA), forced
    on the CPU, against the eager pass at the same product dtype and against the plain head, in one call that
    has it all: ignored targets, a last chunk shorter than the others (45 = 2 x 16 + 13), a bias, the z-loss
    and the softcap; then the same under no_grad (evaluation)."""
    z_loss, cap = 1e-2, 5.0
    hidden, weight, b, targets = problem(n=45, c=32, v=211, bias=True, ignore_every=4)
    params = [hidden, weight, b]

    def terms(fused: bool):
        return chunked_loss_terms(
            hidden, weight, targets, b, -1, 16, z_loss, cap, matmul_dtype=dtype, fused=fused
        )

    eager = terms(fused=False)
    eager_grads = torch.autograd.grad(eager.loss, params)
    fused = terms(fused=True)
    fused_grads = torch.autograd.grad(fused.loss, params)
    # The same logits (the same product) and fp32 reductions in another order: fp32's rounding apart.
    for name in ("loss", "cross_entropy", "lse_square"):
        torch.testing.assert_close(getattr(fused, name), getattr(eager, name), rtol=1e-5, atol=1e-6)
    for name, got, want in zip(("hidden", "weight", "bias"), fused_grads, eager_grads):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, name
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        else:
            # Both round the logits' gradient to bf16 before the products: an fp32 difference of one part in
            # 10^7 may flip a rounding, moving that entry by one bf16 step (2^-8 of it); a small fraction of
            # the norm. A wrong term (a missing z-loss factor or cap derivative) would be percents.
            assert float((got - want).norm() / want.norm()) < torch.finfo(dtype).eps / 8, name
    assert torch.all(fused_grads[0][targets == -1] == 0)  # an ignored row's hidden state gets no gradient
    # the plain head, whole logits in fp32: exact in fp32; with bf16 products, within their rounding
    exact = plain_loss_terms(hidden, weight, targets, b, -1, z_loss, cap)
    exact_grads = torch.autograd.grad(exact.loss, params)
    loose = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused.cross_entropy, exact.cross_entropy, **loose)
    torch.testing.assert_close(fused.lse_square, exact.lse_square, **loose)
    for name, got, want in zip(("hidden", "weight", "bias"), fused_grads, exact_grads):
        assert float((got - want).norm() / want.norm()) < 8 * torch.finfo(dtype).eps, name
    with torch.no_grad():
        evaluated = terms(fused=True)
    assert not evaluated.loss.requires_grad
    torch.testing.assert_close(evaluated.loss, eager.loss.detach(), rtol=1e-5, atol=1e-6)


def test_the_fused_pass_compiles_once_for_every_batch_size():
    """The chunk's rows are dynamic in the compiled kernel: after the first call, other batch sizes (other
    last-chunk lengths, a batch smaller than one chunk) make no new graph."""
    hidden, weight, _, targets = problem(n=300, c=16, v=101)

    def call(n: int) -> None:
        loss = chunked_loss_terms(hidden[:n], weight, targets[:n], chunk_rows=64, fused=True).loss
        loss.backward()
        torch.testing.assert_close(loss, reference(hidden[:n], weight, None, targets[:n]), **TOL)

    before = compiled_graphs()
    call(300)  # chunks of 64, and 44: one graph (not one for 64 rows, then a dynamic one for 44)
    assert compiled_graphs() - before <= 1  # 0 where this process compiled this case before
    before = compiled_graphs()
    for n in (150, 37, 64):  # last chunks of 22 and 37 rows; one chunk of 64
        call(n)
    assert compiled_graphs() == before


def test_the_fused_pass_is_taken_on_cuda_with_half_products_where_triton_is(monkeypatch):
    monkeypatch.setattr(head_loss, "_triton_available", lambda: True)
    assert fused_by_default("cuda", torch.bfloat16) and fused_by_default("cuda", torch.float16)
    assert not fused_by_default("cuda", torch.float32)  # full precision: the eager pass
    assert not fused_by_default("cuda", None)
    assert not fused_by_default("cpu", torch.bfloat16)
    monkeypatch.setattr(head_loss, "_triton_available", lambda: False)
    assert not fused_by_default("cuda", torch.bfloat16)
    # on the CPU, loss.impl=chunked compiles nothing
    hidden, weight, _, targets = problem()
    before = compiled_graphs()
    HeadLoss("chunked", chunk_rows=8)(hidden, weight, targets).backward()
    assert compiled_graphs() == before


def test_a_fused_pass_that_cannot_compile_leaves_the_eager_pass_and_says_so(monkeypatch, tmp_path, caplog):
    """A real failed compile: the C++ compiler inductor calls does not exist (as triton's launcher build fails
    on a GPU machine without a C compiler). The fused pass is chosen as on CUDA; the first call falls back to
    the eager pass, with its numbers, and a warning; later calls take the eager pass at once."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(head_loss, "fused_by_default", lambda device_type, matmul_dtype: True)
    monkeypatch.setattr(head_loss, "_FUSED_COMPILE", head_loss._FusedCompile())
    no_compiler = inductor_config.patch(
        {"cpp.cxx": (None, str(tmp_path / "no-such-compiler")), "fx_graph_cache": False}
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no kernel built before
    head_loss.fused_chunk_loss_and_gradient.cache_clear()
    torch._dynamo.reset()
    hidden, weight, _, targets = problem(n=40, c=16, v=97)
    try:
        with no_compiler, caplog.at_level("WARNING", logger="gptlab.model.head_loss"):
            got = chunked_loss_terms(hidden, weight, targets, chunk_rows=16)
        (grad,) = torch.autograd.grad(got.loss, [hidden])
        want = chunked_loss_terms(hidden, weight, targets, chunk_rows=16, fused=False)
        (want_grad,) = torch.autograd.grad(want.loss, [hidden])
        assert torch.equal(got.loss, want.loss) and torch.equal(grad, want_grad)
        assert head_loss._FUSED_COMPILE.failed and not head_loss._FUSED_COMPILE.succeeded
        assert (
            "the fused pass did not compile" in caplog.text and "the eager pass runs instead" in caplog.text
        )
        caplog.clear()
        with caplog.at_level("WARNING", logger="gptlab.model.head_loss"):
            chunked_loss_terms(hidden, weight, targets, chunk_rows=16)
        assert caplog.text == ""  # said once
    finally:
        head_loss.fused_chunk_loss_and_gradient.cache_clear()
        torch._dynamo.reset()


def test_the_cuda_chunk_is_larger_and_the_cpu_chunk_unchanged():
    assert default_chunk_rows(50257) == 160
    assert default_chunk_rows(50257, "cuda") == 2080  # 2,048 rows measured faster than 160 on an H100


def test_a_half_precision_chunk_holds_twice_the_rows_in_the_same_bytes():
    """The fused pass keeps its chunk of logits in the products' bf16 / fp16: the chunk's budget (400 MiB on
    CUDA, 32 MiB on a CPU) holds twice the rows it holds in fp32; the eager pass's chunk is fp32 whatever the
    products' dtype."""
    for dtype in (torch.bfloat16, torch.float16):
        assert default_chunk_rows(50257, "cuda", dtype) == 4168
        assert default_chunk_rows(50257, "cpu", dtype) == 328
        assert head_loss.chunk_logits_dtype(dtype, fused=True) == dtype
        assert head_loss.chunk_logits_dtype(dtype, fused=False) == torch.float32
    rows = default_chunk_rows(50257, "cuda", torch.bfloat16)
    assert rows * 50257 * 2 <= head_loss.CUDA_CHUNK_BYTES < (rows + 8) * 50257 * 2
    assert head_loss.chunk_logits_dtype(None, fused=True) == torch.float32  # the fused pass forced in fp32


def test_the_default_chunk_buffer_stays_below_glibcs_mmap_threshold():
    rows = default_chunk_rows(50257)
    assert rows % 8 == 0 and rows * 50257 * 4 <= 32 * 2**20 < (rows + 8) * 50257 * 4
    assert default_chunk_rows(10**9) == 8  # a huge vocabulary still takes a few rows at a time


def test_auto_takes_the_chunked_path_on_cpu_and_cuda_kernels_are_refused_there():
    assert HeadLoss("auto").resolve("cpu") == "chunked"
    assert HeadLoss("plain").resolve("cpu") == "plain"
    if torch_features.has("linear_cross_entropy"):
        assert HeadLoss("torch").resolve("cpu") == "torch"
    for impl in ("liger", "cce"):
        message = f"loss.impl={impl} cannot run on cpu: it is a CUDA kernel"
        with pytest.raises(RuntimeError, match=message):
            HeadLoss(impl).resolve("cpu")
        assert refusal(impl, "cpu").startswith(message)
        assert (
            "Use loss.impl=auto (here: chunked), which gives the plain head's loss and gradients"
            in refusal(impl, "cpu")
        )


@pytest.mark.parametrize(
    "installed,impl,verdict",
    [
        (
            set(),
            "liger",
            'loss.impl=liger needs the liger-kernel package, which is not installed. Install it with pip install -e ".[gpu]", or use loss.impl=auto (here: chunked)',
        ),
        (
            set(),
            "cce",
            'loss.impl=cce needs the cut-cross-entropy package, which is not installed. Install it with pip install -e ".[gpu]", or use loss.impl=auto (here: chunked)',
        ),
        (
            {"cut_cross_entropy"},
            "liger",
            'loss.impl=liger needs the liger-kernel package, which is not installed. Install it with pip install -e ".[gpu]", or use loss.impl=auto (here: chunked)',
        ),
        ({"liger_kernel"}, "liger", None),
        ({"cut_cross_entropy"}, "cce", None),
        (set(), "auto", None),
        (set(), "chunked", None),
        pytest.param(set(), "torch", None, marks=needs_torch_lce),
    ],
)
def test_on_a_cuda_machine_a_kernel_whose_package_is_missing_is_refused(installed, impl, verdict):
    message = refusal(impl, "cuda", installed)
    assert message == verdict if verdict is None else message.startswith(verdict), message
    if verdict is None:
        assert HeadLoss(impl).resolve("cuda", installed) in (impl, "chunked")
    else:
        with pytest.raises(RuntimeError, match="is not installed"):
            HeadLoss(impl).resolve("cuda", installed)


def test_cut_cross_entropy_is_refused_in_full_precision_and_auto_never_takes_a_cuda_kernel():
    """Cut Cross-Entropy's backward takes bf16 or fp16 only: a trainer.precision=32-true run on a GPU is refused
    loss.impl=cce when its config is read, with the fix. auto takes chunked on CUDA whatever is installed and
    in whatever precision: cce's gradients are not the plain head's (head_loss's module docstring), and liger
    measured slower than chunked."""
    both = {"cut_cross_entropy", "liger_kernel"}
    message = refusal("cce", "cuda", both, torch.float32)
    assert message is not None and message.startswith(
        "loss.impl=cce takes bf16 or fp16 operands only (its backward kernel refuses float32), and this run "
        "computes the output layer in full precision. Train with trainer.precision=bf16-mixed"
    )
    assert message.endswith(
        "or use loss.impl=auto (here: chunked), which gives the plain head's loss and gradients without "
        "holding the logits."
    )
    assert refusal("cce", "cuda", both, torch.bfloat16) is None
    assert refusal("cce", "cuda", both, torch.float16) is None
    assert refusal("liger", "cuda", both, torch.float32) is None
    for dtype in (torch.bfloat16, torch.float16, torch.float32, None):
        assert HeadLoss("auto").resolve("cuda", both, dtype) == "chunked"
    assert HeadLoss("cce").resolve("cuda", both, torch.bfloat16) == "cce"  # asked for by name: taken
    with pytest.raises(RuntimeError, match="loss.impl=cce takes bf16 or fp16 operands only"):
        HeadLoss("cce").resolve("cuda", both, torch.float32)


@pytest.mark.parametrize(
    "precision,refused",
    [("32-true", True), ("64-true", True), ("bf16-mixed", False), ("16-mixed", False), ("bf16-true", False)],
)
def test_a_gpu_runs_precision_decides_whether_cut_cross_entropy_is_refused_at_config_time(
    precision, refused, monkeypatch
):
    from gptlab.config import parse_loss
    from gptlab.model import head_loss

    monkeypatch.setattr(head_loss, "installed_kernel_modules", lambda: {"cut_cross_entropy"})
    trainer = {"accelerator": "gpu", "precision": precision}
    if refused:
        with pytest.raises(ConfigError, match="loss.impl=cce takes bf16 or fp16 operands only"):
            parse_loss({"impl": "cce"}, trainer)
    else:
        assert parse_loss({"impl": "cce"}, trainer).impl == "cce"
    assert parse_loss({"impl": "auto"}, trainer).impl == "auto"


def test_under_deterministic_algorithms_cut_cross_entropy_asked_for_is_refused():
    """Cut Cross-Entropy adds its gradient's blocks under locks in whatever order they finish: with
    deterministic algorithms asked for, loss.impl=cce is refused with both settings named and the fix; auto,
    which never takes it, is unchanged."""
    both = {"cut_cross_entropy", "liger_kernel"}
    bf16 = torch.bfloat16
    for deterministic in (False, True):
        assert HeadLoss("auto").resolve("cuda", both, bf16, deterministic=deterministic) == "chunked"
    message = refusal("cce", "cuda", both, bf16, deterministic=True)
    assert message == (
        "loss.impl=cce adds its gradient's blocks into one bf16 buffer under locks, in whatever order the blocks "
        "finish, so its gradients differ from run to run, and this run asks for trainer.deterministic=true. "
        "Train with trainer.deterministic=false, or use loss.impl=auto (here: chunked), which gives the plain "
        "head's loss and gradients without holding the logits."
    )
    assert refusal("liger", "cuda", both, bf16, deterministic=True) is None
    assert refusal("chunked", "cuda", both, bf16, deterministic=True) is None
    with pytest.raises(RuntimeError, match="trainer.deterministic=true"):
        HeadLoss("cce").resolve("cuda", both, bf16, deterministic=True)


def test_auto_reads_whether_torch_has_deterministic_algorithms_on():
    """A run's loss resolves at each call with torch's flag, which Lightning's trainer.deterministic sets:
    an explicit loss.impl=cce is refused under it, and runs under the warn-only mode."""
    both = {"cut_cross_entropy", "liger_kernel"}
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch.use_deterministic_algorithms(True)
        assert HeadLoss("auto").resolve("cuda", both, torch.bfloat16) == "chunked"
        with pytest.raises(RuntimeError, match="trainer.deterministic=true"):
            HeadLoss("cce").resolve("cuda", both, torch.bfloat16)
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert HeadLoss("cce").resolve("cuda", both, torch.bfloat16) == "cce"
        torch.use_deterministic_algorithms(False)
        assert HeadLoss("cce").resolve("cuda", both, torch.bfloat16) == "cce"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize(
    "deterministic,refused", [(True, True), ("warn", False), (False, False), (None, False)]
)
def test_a_gpu_run_with_deterministic_algorithms_is_refused_cut_cross_entropy_at_config_time(
    deterministic, refused, monkeypatch, caplog
):
    from gptlab.config import parse_loss
    from gptlab.model import head_loss
    from gptlab.planning import HeadPlan

    monkeypatch.setattr(head_loss, "installed_kernel_modules", lambda: {"cut_cross_entropy", "liger_kernel"})
    trainer = {"accelerator": "gpu", "precision": "bf16-mixed", "deterministic": deterministic}
    if refused:
        with pytest.raises(
            ConfigError, match=r"trainer.deterministic=true\. Train with trainer.deterministic=false, or use"
        ):
            parse_loss({"impl": "cce"}, trainer)
    else:
        with caplog.at_level("WARNING", logger="gptlab"):
            assert parse_loss({"impl": "cce"}, trainer).impl == "cce"
        warned = [r.getMessage() for r in caplog.records if "trainer.deterministic=warn" in r.getMessage()]
        assert len(warned) == (deterministic == "warn"), warned
    # the memory plan counts the head the run takes
    plan = HeadPlan.of(HeadLoss("auto"), "cuda", "bf16-mixed", deterministic=bool(deterministic))
    assert plan.impl == "chunked"


@pytest.mark.parametrize(
    "loss,expected",
    [
        (
            {"impl": "fused"},
            r"loss.impl='fused' is not one of \['auto', 'chunked', 'torch', 'plain', 'liger', 'cce'\]",
        ),
        ({"chunk_rows": 0}, "loss.chunk_rows=0 must be a positive integer"),
        (
            {"chunk": 64},
            r"loss does not take option\(s\) loss.chunk. Its options: loss.impl, loss.chunk_rows, loss.z_loss, "
            "loss.final_softcap",
        ),
    ],
)
def test_bad_loss_options_are_refused_with_the_fix(loss, expected):
    with pytest.raises(ConfigError, match=expected):
        HeadLoss.from_node(loss)


def test_the_lightning_module_uses_the_configured_head():
    config = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    chunked = GPTLitModule(model=config, loss={"impl": "chunked", "chunk_rows": 3})
    plain = GPTLitModule(model=config, loss={"impl": "plain"})
    plain.load_state_dict(chunked.state_dict())
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    a = chunked.model(x, y, head_loss=chunked.head_loss)
    b = plain.model(x, y, head_loss=plain.head_loss)
    assert chunked.head_loss.resolve("cpu") == "chunked" and plain.head_loss.resolve("cpu") == "plain"
    torch.testing.assert_close(a[1], b[1], **TOL)
    assert GPTLitModule(model=config).head_loss == HeadLoss("auto")  # checkpoints from before the option


# ---- CUDA kernels: run where a GPU and the optional packages are installed --------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl,package", [("liger", "liger_kernel"), ("cce", "cut_cross_entropy")])
def test_cuda_kernels_equal_the_plain_path(impl, package):
    """Each kernel against the fp32 reference: Liger-Kernel's in fp32; Cut Cross-Entropy's, which takes bf16
    or fp16 only, under bf16 autocast (as a bf16-mixed run calls it), within bf16's rounding, its gradient
    exact (not filtered)."""
    pytest.importorskip(package)
    hidden, weight, _, targets = problem(n=512, c=64, v=5003)
    hidden, weight, targets = (t.detach().cuda() for t in (hidden, weight, targets))
    hidden.requires_grad_()
    weight.requires_grad_()
    expected = reference(hidden, weight, None, targets)
    want = torch.autograd.grad(expected, [hidden, weight])
    half = impl == "cce"
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
        loss = HeadLoss(impl)(hidden, weight, targets)
    got = torch.autograd.grad(loss, [hidden, weight])
    if not half:  # the kernel accumulates in fp32 but may use TF32 products on the way
        torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
        return
    assert abs(float(loss) - float(expected)) < 2e-2
    for g, w in zip(got, want):
        assert float((g.float() - w).norm() / w.norm()) < 2e-2  # bf16 operands: about 1e-2 relative
    with pytest.raises(RuntimeError, match="loss.impl=cce takes bf16 or fp16 operands only"):
        HeadLoss(impl)(hidden, weight, targets)  # outside autocast: fp32, refused with the fix


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["chunked", TORCH_IMPL])
def test_chunked_path_runs_on_cuda(impl):
    hidden, weight, _, targets = problem(n=300, c=32, v=1001)
    hidden, weight, targets = (
        t.detach().cuda().requires_grad_(t.is_floating_point()) for t in (hidden, weight, targets)
    )
    expected = reference(hidden, weight, None, targets)
    loss = HeadLoss(impl, chunk_rows=64)(hidden, weight, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
