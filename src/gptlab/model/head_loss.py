"""The output layer and its cross-entropy in one step, without holding the (B*T, vocab) logits.

With the GPT-2 vocabulary the logits of a batch dwarf everything else the model holds: at B*T = 8,192 they
are 1.6 GB in fp32, and again for their gradient. Ways to the same loss (and, but for ``cce``, the same gradients):

- ``plain``: ``lm_head(x)`` then ``F.cross_entropy``, the whole logits in memory.
- ``chunked`` (any device, pure torch): :class:`ChunkedLinearCrossEntropy` takes ``chunk_rows`` rows of
  B*T at a time, computes their logits, log-sum-exp and loss, and, when a backward pass will follow, their
  softmax gradient at once, so that nothing of a chunk outlives it. This is the trick of Liger-Kernel's
  fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989) written in plain torch: computing the
  gradient in the forward pass saves the second (H @ W^T) product that a recompute in the backward would
  cost. The backward only scales the stored gradients by the incoming one. On CUDA with bf16 / fp16 products
  (where triton is installed: ``fused_by_default``) each chunk's elementwise work, after its product, is one
  kernel compiled by ``torch.compile`` (``chunk_loss_and_gradient``): the chunk's logits stay in the product
  dtype, the kernel takes each row's maximum and sum of exponentials in fp32, the row's loss terms, and writes
  the gradient (z-loss and softcap included) over the logits, instead of torch's eager operations over an fp32
  copy of the chunk (several passes over it). Elsewhere the eager pass: on a CPU, bound by arithmetic, the
  fused one was not faster and its compile costs seconds (docs/performance.md); ``fused=`` forces either.
- ``torch`` (any device): torch's own version of the same trick, ``F.linear_cross_entropy`` with
  ``nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_rows)`` (new in torch 2.13; see its docstring,
  ``help(torch.nn.functional.linear_cross_entropy)``). The chunk is always passed: torch's default options
  pick 2 rows per chunk at the default run's shape on CPU fp32, which took 80 s against 2 s at 160 rows
  (``--shapes default --torch-default``).
- On CUDA, the field's kernels: ``liger`` (Liger-Kernel's fused linear cross-entropy) and ``cce`` (Cut
  Cross-Entropy, Wijmans et al. 2024, arXiv:2411.09009), when installed (``pip install -e ".[gpu]"``), each
  asked for by name (``cce``'s gradients are less exact: below).

``auto`` takes the first of ``AUTO_ORDER[device type]`` that can run here: ``chunked`` on CUDA as on CPU.
``cce`` was faster on an H100 and an H200 (12.75 ms against 19.62 ms at B*T = 8,192, docs/performance.md) but
its gradients are not the others': its backward adds each tile's product into bf16 gradient buffers, one tile
at a time in whatever order the tiles finish (``cce_backward.py`` of cut-cross-entropy 25.1.1), about 393
bf16 roundings per hidden state at V = 50,257. Through a 2-layer model at initialisation its gradients were up
to 22-24% from fp32's (``ln_f.weight``; 5-7% at every bias) where ``plain`` and ``chunked`` under the same
autocast were within 0.75%, and they changed from run to run (an H200, and ``python
scripts/head_gradient_accuracy.py``, which reproduces the kernel's arithmetic on a CPU). ``liger`` and ``cce``
stay explicit choices (``cce`` refused under ``trainer.deterministic=true``: ``NONDETERMINISTIC``).
``torch`` needs
torch >= 2.13 (``gptlab.torch_features``): an older torch refuses ``loss.impl=torch`` at config time and ``auto`` never takes it. On CPU ``chunked`` is
kept ahead of ``torch`` because it was measurably faster with two threads and smaller at every chunk size
(``python scripts/benchmark_head_loss.py``, fp32, 2-core CPU, torch 2.13; medians of interleaved rounds):

- time, at the same chunk size, default run's shape (N = 8 x 128, D = 128, V = 50,257), the 2 threads
  training uses, 15 rounds: torch's took 1.152x (160 rows), 1.081x (512) and 1.055x (1024) the time of
  ``chunked`` (``--shapes default --repeats 15 --ours-chunks 512 1024 --torch-chunks 64 160 512 1024``).
  With one thread and this process's CPU time the work is the same: 0.994x, 1.022x, 1.011x (15 rounds,
  ``... --torch-chunks 160 512 1024 --no-memory --threads 1 --clock cpu``); at GPT-2 small's width (N =
  2,048, D = 768) 1.003x-1.014x for 160-2,048 rows (5 rounds, ``--shapes gpt2-small --gpt2-rows 2048``).
- memory, peak RSS above the inputs over two calls: default shape, 160 rows (the default), ``chunked`` 71
  MiB, torch's 165 MiB (plain 602 MiB); GPT-2 small (N = 8,192, D = 768), ``chunked`` 220 MiB, torch's 461
  MiB (plain 4,727 MiB).
- chunk size: with two threads both ran faster at 512 rows than at the default 160 (``chunked`` 0.80-0.86x,
  at 67 MiB more); with one thread, CPU time, 1.00x at the default shape and 0.95x at D = 768.

The loss node sets ``impl`` and ``chunk_rows``, and two terms that change what is trained, the z-loss and the
final-logit softcap (``HeadLoss``; ``plain`` and ``chunked`` only). ``ignore_index`` is -1, no label smoothing:
torch's function supports both the ignored targets and a (V,) bias; with label smoothing it would fall back
to the unchunked reference path. One difference: when every target of a call is ignored, the loss is nan on
every path, and torch's also makes the gradients nan where ``plain`` and ``chunked`` give zeros (gptlab's
loaders never ignore a target).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gptlab import torch_features
from gptlab.errors import ConfigError
from gptlab.registry import check_keys

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "chunked", "torch", "plain", "liger", "cce")

# Bytes of the one (rows, V) buffer a call uses: below glibc's largest dynamic mmap threshold (32 MiB), so that
# after the first step it comes from the heap and a step takes no page faults; large enough that the (V, C) weight
# gradient, accumulated once per chunk, is revisited only a few times (160 rows of fp32 logits at V = 50,257).
CHUNK_BYTES = 32 * 2**20


# On CUDA the chunk is larger: on an H100 (bf16 autocast, 8,192 x 768 x 50,257) 2,048 rows took 41.53 ms
# forward and backward against 60.04 ms at 160 (each chunk's kernels are small and many); about 2,000 rows of
# fp32 logits at the GPT-2 vocabulary, 0.39 GiB measured, still a tenth of the whole logits'. The fused pass
# keeps its logits in bf16 / fp16: the same bytes hold twice the rows (4,160 at that vocabulary).
CUDA_CHUNK_BYTES = 400 * 2**20


def default_chunk_rows(
    vocab_size: int, device_type: str = "cpu", logits_dtype: torch.dtype = torch.float32
) -> int:
    """Rows per chunk for a vocabulary: as many as fit ``CHUNK_BYTES`` of logits in ``logits_dtype``
    (``CUDA_CHUNK_BYTES`` on CUDA), a multiple of 8. The logits' dtype is the chunk buffer's:
    fp32 for the eager pass whatever the products' dtype, the products' (bf16 / fp16) for the fused pass
    (``chunk_logits_dtype``)."""
    budget = CUDA_CHUNK_BYTES if device_type == "cuda" else CHUNK_BYTES
    itemsize = torch.empty((), dtype=logits_dtype).element_size()
    return max(8, budget // (itemsize * vocab_size) // 8 * 8)


def chunk_logits_dtype(matmul_dtype: torch.dtype | None, fused: bool) -> torch.dtype:
    """The dtype of ``ChunkedLinearCrossEntropy``'s chunk of logits: the products' with the fused pass (fp32
    where they are fp32), fp32 with the eager one."""
    return (matmul_dtype or torch.float32) if fused else torch.float32


def chunk_loss_and_gradient(
    logits: Tensor,
    targets: Tensor,
    counted: Tensor,
    bias: Tensor | None,
    z_loss: float,
    softcap: float | None,
    with_grad: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk's elementwise work after its product, written to be one fused kernel under ``torch.compile``
    (``fused_chunk_loss_and_gradient``): from the (n, V) ``logits`` (in the product's dtype; ``bias`` (V,) fp32
    or None added, then capped to ``softcap * tanh(s / softcap)`` when ``softcap`` is set), in fp32, each row's
    log-partition log Z and, over the ``counted`` rows (the others contribute 0), the sum of the
    cross-entropies against ``targets`` (n,) and the sum of log^2 Z. With ``with_grad`` it writes the gradient
    of the summed objective with respect to the raw logits over ``logits``, in place and in its dtype:
    (softmax * (1 + 2 z_loss log Z) - onehot(target)) * (1 - tanh^2 with the softcap), 0 on ignored rows (the
    mean's 1 / count is left to the fp32 products that follow), and returns the fp32 sum of that gradient over
    the rows, the bias's share, when there is a bias. Returns (cross-entropy sum, log^2 Z sum, bias gradient or
    None).

    Written for inductor: the row maximum is taken over the raw logits (tanh is increasing, so capping it gives
    the capped row's maximum) and the exponentials are recomputed where the gradient needs them, so that no
    fp32 (n, V) intermediate is held: the kernel reads the chunk for the maximum, for the sum of exponentials
    and for the gradient, and writes it once. With a bias the gradient's column sum needs it whole, in fp32
    (gptlab's model has no bias on its output layer)."""
    raw = logits.float()
    if bias is not None:
        raw = raw + bias

    def cap(x: Tensor) -> Tensor:
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    top = cap(raw.amax(dim=1, keepdim=True))  # (n, 1)
    log_z = top + torch.log(torch.exp(cap(raw) - top).sum(dim=1, keepdim=True))  # (n, 1)
    target_logit = cap(raw.gather(1, targets[:, None]))  # (n, 1)
    # where(), not a product with the mask: a row that is ignored contributes 0 even if its logits are not finite
    cross_entropy = torch.where(counted, (log_z - target_logit).squeeze(1), 0.0).sum()
    log_z_square = torch.where(counted, log_z.squeeze(1).square(), 0.0).sum()
    if not with_grad:
        return cross_entropy, log_z_square, None
    if softcap is None:
        grad = torch.exp(raw - log_z)
    else:
        tanh = torch.tanh(raw / softcap)
        grad = torch.exp(tanh * softcap - log_z)
    if z_loss:
        grad = grad * (1.0 + 2.0 * z_loss * log_z)
    onehot = torch.arange(raw.size(1), device=raw.device)[None, :] == targets[:, None]
    grad = grad - onehot.to(grad.dtype)
    if softcap is not None:
        grad = grad * (1.0 - tanh * tanh)  # d(cap tanh(x / cap))/dx
    grad = torch.where(counted[:, None], grad, 0.0)
    grad_bias = grad.sum(dim=0) if bias is not None else None
    logits.copy_(grad.to(logits.dtype))
    return cross_entropy, log_z_square, grad_bias


@functools.cache
def fused_chunk_loss_and_gradient() -> Callable[..., tuple[Tensor, Tensor, Tensor | None]]:
    """``chunk_loss_and_gradient`` compiled, once per process: a Triton kernel on CUDA, C++ on a CPU. Each
    chunk's rows are marked dynamic at the call (``_fused_chunk``), so one compile serves every chunk and every
    batch size; a new compile comes only with a new dtype, grad mode (training or evaluation), z-loss weight,
    softcap, or with a bias."""
    return torch.compile(chunk_loss_and_gradient)


def _fused_chunk(
    logits: Tensor,
    targets: Tensor,
    counted: Tensor,
    bias: Tensor | None,
    z_loss: float,
    softcap: float | None,
    with_grad: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    for t in (logits, targets, counted):
        # the last chunk is shorter, and batches differ: the rows are a symbol of the compiled kernel, not a
        # constant (maybe_: a chunk of one row may still specialize, rather than raise)
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return fused_chunk_loss_and_gradient()(logits, targets, counted, bias, z_loss, softcap, with_grad)


@functools.cache
def _triton_available() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def fused_by_default(device_type: str, matmul_dtype: torch.dtype | None) -> bool:
    """Whether ``chunked`` takes the fused elementwise pass (``chunk_loss_and_gradient`` compiled) when not
    told: on CUDA, with bf16 / fp16 products (a bf16-mixed run's), where torch.compile can make its Triton
    kernel (triton importable). Elsewhere the eager pass: on a CPU the compile (tens of seconds) is not repaid
    in a short run, and fp32 products on CUDA are not the case it was written for."""
    return device_type == "cuda" and matmul_dtype in HALF_DTYPES and _triton_available()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over non-ignored rows of cross_entropy(s, targets) + z_loss * logsumexp(s)^2, chunk by chunk, where
    s = hidden @ weight^T + bias, capped to ``softcap * tanh(s / softcap)`` when ``softcap`` is set.

    hidden (N, C), weight (V, C), bias (V,) or None, targets (N,). Log-softmax and log-sum-exp are taken in
    fp32, and the gradients are accumulated in fp32, whatever the input dtype. The three matrix products per
    chunk (the logits, and the gradients of the hidden states and of the weight) run in ``matmul_dtype``: fp32
    (None), or bf16 / fp16 where training runs under that autocast on CUDA (``chunked_loss_terms``), as the
    plain head's products do there: an H100 multiplies bf16 about ten times faster than fp32, and the fp32
    products made this path the slowest on one (60 ms where Cut Cross-Entropy took 13). With ``fused`` each
    chunk's logits are kept in the product dtype and its elementwise work is one compiled kernel
    (``fused_chunk_loss_and_gradient``) that writes their gradient over them; without, torch's eager operations
    over an fp32 copy. Returns the objective (differentiable), and the mean cross-entropy and mean squared
    log-partition (for logging, not differentiable)."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        ignore_index: int,
        chunk_rows: int,
        with_grad: bool,
        z_loss: float = 0.0,
        softcap: float | None = None,
        matmul_dtype: torch.dtype | None = None,
        fused: bool = False,
        vocab_size: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        N = hidden.size(0)
        half = matmul_dtype is not None and matmul_dtype != torch.float32
        # The vocabulary: the first V rows of the weight (the rest, when it is padded to an aligned number of
        # rows, are zero and take part in no softmax; their gradient is 0).
        V = weight.size(0) if vocab_size is None else vocab_size
        valid = targets != ignore_index  # (N,)
        count = valid.sum()
        safe_targets = torch.where(valid, targets, 0)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse_square_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden, dtype=torch.float32) if with_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grad else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if with_grad and bias is not None else None
        # The products in bf16 / fp16 (a GPU's) take every stored row: a padded weight's row count is a multiple
        # of 64, the aligned kernels' case, and the padding's columns of the logits are cut before any
        # elementwise work. The fp32 products (a CPU's, where alignment changes nothing) take the first V rows
        # alone, exactly the unpadded layer's work.
        w = weight.to(matmul_dtype) if half else weight.float()[:V]
        b = bias.float()[:V] if bias is not None else None
        # the stored rows the products touch, and their share of the weight's gradient (the rest stays 0)
        w_rows = w.size(0)
        grad_w_rows = grad_weight[:w_rows] if grad_weight is not None else None
        # 1 / count: the mean's scale, folded into each chunk's gradient
        inv_count = 1.0 / count.clamp_min(1).float()
        # One (chunk_rows, V) buffer serves every chunk: logits, then log-probabilities, then the gradient,
        # each written over the last (no allocation per chunk). The softcap's gradient needs tanh(s / cap)
        # beside it: a second buffer, only then.
        rows_max = min(chunk_rows, N)
        # The fused pass keeps the logits in the product's dtype and writes their gradient over them; the
        # eager one works in fp32.
        buffer_dtype = chunk_logits_dtype(w.dtype, fused)
        # The fused pass writes the products into a buffer as wide as the stored rows and works on its first V
        # columns (a strided view its compiled kernel reads as such); the eager one keeps a contiguous (n, V)
        # buffer (torch's log_softmax over a strided view copies it).
        buffer_width = w_rows if fused else V
        buffer = torch.empty(rows_max, buffer_width, dtype=buffer_dtype, device=hidden.device)
        capped = torch.empty_like(buffer) if softcap is not None and with_grad and not fused else None
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            h = hidden[rows].to(w.dtype)  # (n, C)
            z = buffer[: h.size(0)]  # (n, V), or (n, w_rows) in the fused pass
            if fused:
                full = z
                torch.mm(h, w.t(), out=full)
                z = full[:, :V]
                ce_part, lse_part, bias_part = _fused_chunk(
                    z, safe_targets[rows], valid[rows], b, z_loss, softcap, with_grad
                )
                loss_sum += ce_part
                lse_square_sum += lse_part
                if with_grad:
                    assert grad_hidden is not None and grad_w_rows is not None
                    # z is now the gradient of the chunk's summed objective, ignored rows 0; the padding's
                    # columns get none. The mean's 1 / count is applied in fp32 to the products.
                    full[:, V:].zero_()
                    if half:
                        grad_hidden[rows] = torch.mm(full, w).float().mul_(inv_count)  # (n, C)
                        grad_w_rows.addcmul_(torch.mm(full.t(), h), inv_count)  # (rows, C), summed in fp32
                    else:
                        torch.mm(full, w, out=grad_hidden[rows]).mul_(inv_count)
                        grad_w_rows.addmm_(full.t(), h * inv_count)
                    if grad_bias is not None and bias_part is not None:
                        grad_bias[:V].add_(bias_part.mul_(inv_count))
                continue
            if half:
                # the product in bf16 / fp16 (accumulated in fp32) with every stored row, its first V columns
                # kept in fp32
                z.copy_(torch.mm(h, w.t())[:, :V])
                if b is not None:
                    z.add_(b)
            elif b is None:
                torch.mm(h, w.t(), out=z)
            else:
                torch.addmm(b, h, w.t(), out=z)
            if softcap is not None:
                if capped is None:
                    z.div_(softcap).tanh_().mul_(softcap)
                else:
                    tanh = capped[: h.size(0)]
                    torch.div(z, softcap, out=tanh).tanh_()
                    torch.mul(tanh, softcap, out=z)
            if z_loss:
                # log Z = s - log p at any entry: at the row's largest logit, where log p is nearest 0
                top, top_at = z.max(dim=1, keepdim=True)  # (n, 1)
            torch.log_softmax(z, dim=-1, out=z)  # each row is reduced before it is written: safe in place
            t = safe_targets[rows, None]  # (n, 1)
            counted = valid[rows]
            # per-row weight of the mean: 1 / count on counted rows, 0 on ignored ones
            scale = counted.float() * inv_count  # (n,)
            loss_sum -= (z.gather(1, t).squeeze(1) * counted).sum()
            if z_loss:
                lse = (top - z.gather(1, top_at)).squeeze(1)  # (n,)
                lse_square_sum += (lse.square() * counted).sum()
            if with_grad:
                assert grad_hidden is not None and grad_w_rows is not None
                # d(loss)/d(s) = (softmax * (1 + 2 z_loss log Z) - onehot(target)) * scale; the scale is
                # applied to the (n, C) factors rather than to the (n, V) gradient.
                z.exp_()
                if z_loss:
                    z.mul_((1.0 + 2.0 * z_loss * lse)[:, None])
                z.scatter_add_(1, t, torch.full_like(t, -1.0, dtype=z.dtype))
                if capped is not None:
                    # d(cap tanh(x / cap))/dx = 1 - tanh^2
                    z.mul_(capped[: h.size(0)].square_().neg_().add_(1.0))
                if half:
                    # The ignored rows zeroed (exact in any dtype), the mean's 1 / count applied in fp32; the
                    # padding's columns 0, so that the products take every stored row (aligned)
                    g = z.mul_(counted[:, None]).to(w.dtype)  # (n, V)
                    if w_rows > V:
                        g = F.pad(g, (0, w_rows - V))  # (n, w_rows)
                    grad_hidden[rows] = torch.mm(g, w).float().mul_(inv_count)  # (n, C)
                    grad_w_rows.add_(torch.mm(g.t(), h).float().mul_(inv_count))  # (w_rows, C)
                    del g
                else:
                    torch.mm(z, w, out=grad_hidden[rows]).mul_(scale[:, None])  # (n, C)
                    grad_w_rows.addmm_(z.t(), h * scale[:, None])  # (V, C)
                if grad_bias is not None:
                    grad_bias[:V].addmv_(z.t(), scale)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        # 0 / 0 = nan when every target is ignored, as F.cross_entropy gives
        cross_entropy = loss_sum / count.float()
        lse_square = lse_square_sum / count.float()
        objective = cross_entropy + z_loss * lse_square if z_loss else cross_entropy.clone()
        ctx.mark_non_differentiable(cross_entropy, lse_square)
        return objective, cross_entropy, lse_square

    @staticmethod
    def backward(ctx, grad_loss: Tensor, *unused: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        if grad_hidden is None:
            raise RuntimeError(
                "ChunkedLinearCrossEntropy was called without gradients (with_grad=False) and then "
                "differentiated: call linear_cross_entropy() with grad mode on."
            )
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        # Scaled in place: no second (V, C) buffer. A second backward through the same graph is refused by
        # autograd's version check on the saved tensors.
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = [
            grad_hidden.mul_(grad_loss).to(h_dtype) if need_h else None,
            grad_weight.mul_(grad_loss).to(w_dtype) if need_w else None,
            grad_bias.mul_(grad_loss).to(b_dtype) if grad_bias is not None and need_b else None,
        ]
        return (*grads, None, None, None, None, None, None, None, None, None)


@dataclass(frozen=True)
class LossTerms:
    """One call's loss: ``loss`` the objective that is differentiated (the cross-entropy, plus ``z_loss``
    times ``lse_square`` when the z-loss is on), ``cross_entropy`` the mean nats per scored token, and
    ``lse_square`` the mean of log^2 Z over the scored rows (None when the z-loss is off). The last two are
    detached: they are what is logged."""

    loss: Tensor
    cross_entropy: Tensor
    lse_square: Tensor | None = None


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """Final-logit softcapping (Gemma 2, Gemma Team 2024, arXiv:2408.00118): ``cap * tanh(logits / cap)``,
    every logit strictly inside (-cap, cap); ``cap`` None leaves the logits as they are."""
    if cap is None:
        return logits
    return cap * torch.tanh(logits / cap)


def chunked_loss_terms(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -1,
    chunk_rows: int | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    matmul_dtype: torch.dtype | None = None,
    fused: bool | None = None,
    vocab_size: int | None = None,
) -> LossTerms:
    """``ChunkedLinearCrossEntropy`` on ``hidden`` (..., C) and ``targets`` (...), leading dimensions
    flattened, ``chunk_rows`` rows at a time (default: ``default_chunk_rows`` for the device and the chunk's
    dtype, so twice the rows in the fused pass with bf16 / fp16 products). Its products run
    in ``matmul_dtype``; by default in the autocast dtype on CUDA, as every other product of a bf16-mixed run
    does there, and in fp32 elsewhere (on a CPU, fp32 products are the faster ones). ``fused``: each chunk's
    elementwise work as one compiled kernel (True) or as torch's eager operations (False); None takes
    ``fused_by_default``, the fused pass on CUDA with bf16 / fp16 products where triton is installed.
    ``vocab_size``: the vocabulary, the first rows of a ``weight`` padded with zero rows to an aligned count
    (``model.vocab_multiple``); None: every row is a token's."""
    hidden = hidden.reshape(-1, hidden.size(-1))
    targets = targets.reshape(-1)
    if matmul_dtype is None and hidden.device.type == "cuda":
        matmul_dtype = _kernel_dtype(hidden)
    chosen = fused is None
    if fused is None:
        fused = fused_by_default(hidden.device.type, matmul_dtype) and not _FUSED_COMPILE.failed
    with_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )

    def arguments(fused: bool) -> tuple[Any, ...]:
        # the default chunk holds the same bytes of logits in either pass: twice the rows in bf16 / fp16 (the
        # fused pass's buffer is as wide as the stored rows, the eager one's as the vocabulary)
        width = weight.size(0) if fused else (vocab_size or weight.size(0))
        rows = chunk_rows or default_chunk_rows(
            width, hidden.device.type, chunk_logits_dtype(matmul_dtype, fused)
        )
        return (hidden, weight, bias, targets, ignore_index, rows, with_grad, z_loss, softcap, matmul_dtype)

    if fused and chosen and not _FUSED_COMPILE.succeeded:
        # The first fused call compiles. Where that fails (a machine whose triton cannot build its launcher:
        # no C compiler, no CUDA headers), the eager pass computes the same numbers: take it, say so once.
        try:
            terms = ChunkedLinearCrossEntropy.apply(*arguments(True), True, vocab_size)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            _FUSED_COMPILE.failed = True
            log.warning(
                "loss.impl=chunked: the fused pass did not compile (%s: %s); the eager pass runs instead, "
                "with the same result and more memory traffic.",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            terms = ChunkedLinearCrossEntropy.apply(*arguments(False), False, vocab_size)
        else:
            _FUSED_COMPILE.succeeded = True
    else:
        terms = ChunkedLinearCrossEntropy.apply(*arguments(fused), fused, vocab_size)
    loss, cross_entropy, lse_square = terms
    return LossTerms(loss, cross_entropy, lse_square if z_loss else None)


@dataclass
class _FusedCompile:
    """Whether the fused pass has compiled in this process, or failed to (then ``chunked`` runs eager)."""

    succeeded: bool = False
    failed: bool = False


_FUSED_COMPILE = _FusedCompile()


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -1,
    chunk_rows: int | None = None,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> Tensor:
    """The mean cross-entropy of ``hidden @ weight^T (+ bias)`` (softcapped when ``softcap`` is set) against
    ``targets``, plus ``z_loss`` times the mean log^2 Z, ``chunk_rows`` rows at a time. hidden (..., C),
    targets (...): leading dimensions are flattened."""
    return chunked_loss_terms(hidden, weight, targets, bias, ignore_index, chunk_rows, z_loss, softcap).loss


def torch_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -1,
    chunk_rows: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """torch's own chunked output layer + cross-entropy (``F.linear_cross_entropy``, torch >= 2.13), with the
    chunk set explicitly (``chunk_rows``, default ``default_chunk_rows``): its default options pick a few rows
    per chunk on CPU fp32 and run many times slower. hidden (..., C), targets (...): leading dimensions are
    flattened. ``vocab_size``: the first rows of a padded ``weight`` (torch's function takes those alone)."""
    weight, bias = vocabulary_rows(weight, bias, vocab_size)
    rows = int(chunk_rows or default_chunk_rows(weight.size(0), hidden.device.type))
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows)
    return F.linear_cross_entropy(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        targets.reshape(-1),
        linear_bias=bias,
        ignore_index=ignore_index,
        options=options,
    )


def plain_loss_terms(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -1,
    z_loss: float = 0.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
) -> LossTerms:
    """The whole logits, softcapped when ``softcap`` is set, then ``F.cross_entropy`` and the z-loss. With
    ``vocab_size``, the product takes every row of a padded ``weight`` and its first ``vocab_size`` columns
    alone are the logits."""
    logits = F.linear(hidden, weight, bias)[..., :vocab_size]
    logits = soft_cap(logits.flatten(0, -2).float(), softcap)  # (N, V)
    targets = targets.reshape(-1)
    cross_entropy = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    if not z_loss:
        return LossTerms(cross_entropy, cross_entropy.detach())
    counted = targets != ignore_index
    lse_square = (torch.logsumexp(logits, dim=-1).square() * counted).sum() / counted.sum()
    return LossTerms(cross_entropy + z_loss * lse_square, cross_entropy.detach(), lse_square.detach())


def plain_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -1,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> Tensor:
    return plain_loss_terms(hidden, weight, targets, bias, ignore_index, z_loss, softcap).loss


def vocabulary_rows(
    weight: Tensor, bias: Tensor | None, vocab_size: int | None
) -> tuple[Tensor, Tensor | None]:
    """The first ``vocab_size`` rows of a padded output layer (contiguous views: no copy), for the kernels
    that take the weight whole (torch's, Liger-Kernel's, Cut Cross-Entropy's): they never see the padding."""
    if vocab_size is None or vocab_size == weight.size(0):
        return weight, bias
    return weight[:vocab_size], (bias[:vocab_size] if bias is not None else None)


def _kernel_dtype(hidden: Tensor) -> torch.dtype:
    """The CUDA kernels run outside autocast: give them the autocast dtype (bf16/fp16) when it is on."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def _liger(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, ignore_index: int) -> Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    dtype = _kernel_dtype(hidden)
    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction="mean")
    hidden = hidden.reshape(-1, hidden.size(-1)).to(dtype)
    return loss_fn(weight.to(dtype), hidden, targets.reshape(-1), bias)


def _cce(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, ignore_index: int) -> Tensor:
    from cut_cross_entropy import linear_cross_entropy

    if bias is not None:  # gptlab's output layer has none (GPT.lm_head); cut-cross-entropy 25.1 takes none
        raise ValueError("loss.impl=cce computes an output layer without a bias; use loss.impl=chunked")
    dtype = _kernel_dtype(hidden)
    # filter_eps=None: every block of the gradient is computed. By default the kernel skips each block whose
    # softmax gradient is below bf16's eps / 32 (2.4e-4) everywhere; near initialisation, when the softmax
    # over 50,257 tokens is about 2e-5 at every entry, that drops the whole gradient but the targets' blocks
    # (the output layer's rows of every token that is no target in the batch get none). On an H100 the
    # filtered gradients of a 2-layer model's tied embedding differed from plain's by 3.5% (relative norm);
    # every loss.impl is to give the same gradients, so the exact kernel is used.
    return linear_cross_entropy(
        hidden.to(dtype),
        weight.to(dtype),
        targets,
        ignore_index=ignore_index,
        reduction="mean",
        filter_eps=None,
    )


# What ``auto`` takes, per device type: the first that can run here (``available``). ``chunked`` runs
# anywhere and closes each list. CPU: ``chunked`` was faster and smaller than ``torch`` (module docstring).
# CUDA: as scripts/gpu_check.py measured them on an H200 (torch 2.11, bf16, B*T = 8,192, D = 768, V = 50,257,
# forward and backward; docs/performance.md): cce 12.75 ms, chunked 19.62 ms (its fused pass, 4,168 rows),
# plain 21.74 ms with the whole logits (4.5 GiB), liger 26.49 ms. ``chunked`` is the fastest whose gradients
# are the plain head's (module docstring: cce's are not, by up to 24% through a model); liger is slower.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("chunked",),
    "cpu": ("chunked",),
}

# What an explicit choice is told once, when its config is read: how its numbers differ from the others'.
CAVEATS = {
    "cce": "loss.impl=cce: Cut Cross-Entropy adds its gradients in bf16, tile by tile in whatever order the "
    "tiles finish: through a 2-layer model at initialisation they were up to 24% from fp32's (plain and chunked: "
    "0.75%) and differ from run to run, so runs are not reproducible and compare only with other cce runs. "
    "loss.impl=auto (chunked) gives the plain head's gradients.",
}

# The CUDA kernels: (module to import, package to install).
KERNELS = {"liger": ("liger_kernel", "liger-kernel"), "cce": ("cut_cross_entropy", "cut-cross-entropy")}


def installed_kernel_modules() -> set[str]:
    """The CUDA kernels' modules that can be imported here."""
    import importlib.util

    return {module for module, _ in KERNELS.values() if importlib.util.find_spec(module) is not None}


# The kernels whose gradients are not deterministic, which ``auto`` passes by and a run with
# ``trainer.deterministic=true`` refuses (``NONDETERMINISTIC_NOTES`` says why each; the others are):
# - ``cce``: Cut Cross-Entropy's backward (cut-cross-entropy 25.1.1, cce_backward.py) adds each block's share of
#   the embeddings' and the classifier's gradients into one bf16 buffer under a spin lock (tl_utils.py's
#   ``tl_lock_add``, an ``atomic_cas`` loop), in whatever order the blocks finish: the sums round differently
#   run to run. On an H200 its gradients through a 2-layer model differed from the plain head's by 5.69e-2 in one
#   run and 2.23e-1 in the next (docs/performance.md, "Measured on an H200").
# - ``liger`` (Liger-Kernel 0.8.5, ops/fused_linear_cross_entropy.py, read for this): its chunks are taken in a
#   Python loop, each chunk's gradients summed into the weight's by torch.mm / torch.addmm in chunk order, and
#   its Triton kernel (ops/cross_entropy.py) writes each row's own gradient; no atomics: deterministic wherever
#   torch's products are (Lightning's ``deterministic=true`` asks torch for that).
# - ``chunked``: torch operations in a fixed order; its fused pass is one compiled kernel that reduces within a
#   row and writes that row's gradient: deterministic as torch's operations are. ``plain`` and ``torch``: torch's.
NONDETERMINISTIC = frozenset({"cce"})
NONDETERMINISTIC_NOTES = {
    "cce": "adds its gradient's blocks into one bf16 buffer under locks, in whatever order the blocks finish, "
    "so its gradients differ from run to run",
}

# The kernels whose backward takes half-precision operands only: Cut Cross-Entropy's asserts "Backwards requires
# embeddings to be bf16 or fp16" (seen on an H100 in a trainer.precision=32-true run, at its first backward).
HALF_ONLY = frozenset({"cce"})
HALF_DTYPES = (torch.bfloat16, torch.float16)


def precision_dtype(precision: str | None) -> torch.dtype:
    """The dtype the output layer computes in under a Lightning ``precision`` (its full name): bf16 or fp16
    under the mixed and true half precisions, fp32 otherwise."""
    text = str(precision or "")
    if text.startswith("bf16"):
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    return torch.float32


def unavailable_reason(
    impl: str,
    device_type: str,
    installed: Collection[str] | None = None,
    dtype: torch.dtype | None = None,
    deterministic: bool = False,
) -> str | None:
    """Why ``impl`` cannot run on a ``device_type`` device ("cpu", "cuda", ...) with the ``installed``
    modules (default: those importable here) and the installed torch, with the head computed in ``dtype``
    (None: not asked), in a run that asks for ``deterministic`` algorithms, or None when it can."""
    if impl == "torch":
        feature = torch_features.FEATURES["linear_cross_entropy"]
        missing = feature.missing()
        if missing:
            return (
                f"needs {feature.what}, new in torch {feature.since}; the installed torch "
                f"{torch.__version__} lacks {', '.join(missing)}"
            )
        return None
    if impl not in KERNELS:
        return None  # chunked, plain and auto run anywhere
    module, package = KERNELS[impl]
    if device_type != "cuda":
        return f"cannot run on {device_type}: it is a CUDA kernel (it needs a CUDA GPU and its package)"
    if module not in (installed_kernel_modules() if installed is None else installed):
        return f"needs the {package} package, which is not installed"
    if impl in HALF_ONLY and dtype is not None and dtype not in HALF_DTYPES:
        return (
            f"takes bf16 or fp16 operands only (its backward kernel refuses {str(dtype).removeprefix('torch.')}), "
            "and this run computes the output layer in full precision"
        )
    if deterministic and impl in NONDETERMINISTIC:
        return f"{NONDETERMINISTIC_NOTES[impl]}, and this run asks for trainer.deterministic=true"
    return None


def refusal(
    impl: str,
    device_type: str,
    installed: Collection[str] | None = None,
    dtype: torch.dtype | None = None,
    deterministic: bool = False,
) -> str | None:
    """The message that refuses ``impl`` on ``device_type`` with the head in ``dtype`` in a run that asks
    for ``deterministic`` algorithms (see ``unavailable_reason``), with the fix; None when it can run."""
    reason = unavailable_reason(impl, device_type, installed, dtype, deterministic)
    if reason is None:
        return None
    fallback = HeadLoss("auto").resolve(device_type, installed, dtype, deterministic)
    if impl == "torch":
        fix = f"Install torch>={torch_features.FEATURES['linear_cross_entropy'].since}, or use"
    elif unavailable_reason(impl, device_type, installed, dtype) is None:  # determinism alone
        fix = "Train with trainer.deterministic=false, or use"
    elif unavailable_reason(impl, device_type, installed) is None:  # the dtype alone
        fix = "Train with trainer.precision=bf16-mixed (gptlab's choice on GPUs with bf16: null), or use"
    elif device_type == "cuda":
        fix = 'Install it with pip install -e ".[gpu]", or use'
    else:
        fix = "Use"
    return (
        f"loss.impl={impl} {reason}. {fix} loss.impl=auto (here: {fallback}), which gives the plain head's "
        "loss and gradients without holding the logits."
    )


def available(
    impl: str,
    device: torch.device | str,
    installed: Collection[str] | None = None,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether ``impl`` can run on ``device`` here with the head in ``dtype`` (the CUDA kernels need CUDA and
    their package; ``cce`` needs bf16 or fp16)."""
    return unavailable_reason(impl, torch.device(device).type, installed, dtype) is None


# What each implementation can add to the cross-entropy. The z-loss needs each row's log-partition log Z, the
# softcap the logits before the softmax: ``plain`` and ``chunked`` compute both. torch's F.linear_cross_entropy
# exposes neither. Liger-Kernel's fused linear cross-entropy has ``lse_square_scale`` (the z-loss) and
# ``softcap`` arguments, and Cut Cross-Entropy a ``softcap`` one, but gptlab does not pass them: they run on
# CUDA only and are not checked against ``plain`` here, so those combinations are refused rather than trusted.
EXTRAS: dict[str, frozenset[str]] = {
    "plain": frozenset({"z_loss", "final_softcap"}),
    "chunked": frozenset({"z_loss", "final_softcap"}),
}
EXTRA_NOTES = {
    "torch": "torch's F.linear_cross_entropy returns only the mean loss: no log Z, no hook on the logits",
    "liger": "Liger-Kernel's fused kernel has lse_square_scale and softcap arguments, but gptlab does not pass "
    "them (not checked against plain yet)",
    "cce": "Cut Cross-Entropy returns no log Z and gptlab does not pass its softcap argument (not checked "
    "against plain yet)",
}

# The keys of the ``loss`` config node.
LOSS_KEYS = ("impl", "chunk_rows", "z_loss", "final_softcap")


@dataclass(frozen=True)
class HeadLoss:
    """How the model computes its output layer and loss in training and validation. ``impl``: one of
    ``IMPLEMENTATIONS`` (not an architecture choice: every one gives the same loss, and all but ``cce`` the
    same gradients); ``chunk_rows``: rows of B*T per chunk for ``chunked`` and ``torch`` (null: ``default_chunk_rows``).

    Two terms that do change the model, on ``plain`` and ``chunked`` (``auto`` takes ``chunked``):

    - ``z_loss``: the z-loss of PaLM (Chowdhery et al. 2022, arXiv:2204.02311), ``z_loss * log^2 Z`` added to
      each token's loss, Z the softmax's partition function; it keeps log Z near 0 (PaLM: 1e-4). 0 is off.
    - ``final_softcap``: final-logit softcapping of Gemma 2 (Gemma Team 2024, arXiv:2408.00118), the logits
      replaced by ``cap * tanh(logits / cap)`` before the softmax (Gemma 2: 30). None is off. The model
      applies the same cap wherever it produces logits (``GPT.final_softcap``): generation and evaluation see
      the logits training saw."""

    impl: str = "auto"
    chunk_rows: int | None = None
    ignore_index: int = -1
    z_loss: float = 0.0
    final_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"loss.impl={self.impl!r} is not one of {list(IMPLEMENTATIONS)}; e.g. loss.impl=chunked."
            )
        if self.chunk_rows is not None and (isinstance(self.chunk_rows, bool) or int(self.chunk_rows) < 1):
            raise ValueError(f"loss.chunk_rows={self.chunk_rows!r} must be a positive integer or null.")
        z = self.z_loss
        if isinstance(z, bool) or not isinstance(z, int | float) or not math.isfinite(z) or z < 0:
            raise ValueError(
                f"loss.z_loss={z!r} must be a number >= 0: the weight of log^2 Z in the loss (PaLM used 1e-4; "
                "0 turns the z-loss off)."
            )
        cap = self.final_softcap
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap) or cap <= 0
        ):
            raise ValueError(
                f"loss.final_softcap={cap!r} must be a positive number (Gemma 2 used 30) or null for no cap."
            )
        message = self.extras_refusal(self.impl)
        if message is not None:
            raise ValueError(message)

    @classmethod
    def from_node(cls, node: Mapping[str, Any] | None) -> HeadLoss:
        """The ``loss`` config node (``LOSS_KEYS``; absent: the defaults), its unknown keys and bad values
        refused with the fix. Where its kernel can run is the run's question (:func:`gptlab.config.parse_loss`):
        a checkpoint's node is read on any device."""
        values = dict(node or {})
        check_keys(values, LOSS_KEYS, "loss", "loss")
        try:
            return cls(**values)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def extras(self) -> frozenset[str]:
        """The terms beyond the cross-entropy this loss uses: ``z_loss``, ``final_softcap``."""
        used = {"z_loss"} if self.z_loss else set()
        return frozenset(used | ({"final_softcap"} if self.final_softcap is not None else set()))

    def extras_refusal(self, impl: str) -> str | None:
        """Why ``impl`` cannot compute this loss's extra terms, with the fix; None when it can (``auto``
        takes an implementation that can)."""
        supported = EXTRAS.get(impl, frozenset())
        missing = [m for m in ("z_loss", "final_softcap") if m in self.extras and m not in supported]
        if impl == "auto":
            return None
        if not missing:
            return None
        settings = " and ".join(
            f"loss.z_loss={self.z_loss}" if m == "z_loss" else f"loss.final_softcap={self.final_softcap}"
            for m in missing
        )
        offs = " or ".join("loss.z_loss=0" if m == "z_loss" else "loss.final_softcap=null" for m in missing)
        return (
            f"{settings} cannot be computed by loss.impl={impl}: {EXTRA_NOTES.get(impl, 'not supported')}. "
            f"Use loss.impl=chunked, plain or auto (which takes chunked), or {offs}."
        )

    def describe(self) -> str | None:
        """The model card's line for the terms this loss adds to the cross-entropy; None when it adds none."""
        parts = []
        if self.z_loss:
            parts.append(f"z-loss {self.z_loss:g} x log^2 Z (PaLM; loss.z_loss, logged as train/z_loss)")
        if self.final_softcap is not None:
            parts.append(
                f"final logits softcapped to {self.final_softcap:g} x tanh(logits / {self.final_softcap:g}) "
                "(Gemma 2; loss.final_softcap, in training, evaluation and generation)"
            )
        return "Loss: cross-entropy + " + "; ".join(parts) if parts else None

    def options(self) -> dict[str, Any]:
        """The config node's values (saved with checkpoints)."""
        return {
            "impl": self.impl,
            "chunk_rows": self.chunk_rows,
            "z_loss": self.z_loss,
            "final_softcap": self.final_softcap,
        }

    def resolve(
        self,
        device: torch.device | str,
        installed: Collection[str] | None = None,
        dtype: torch.dtype | None = None,
        deterministic: bool | None = None,
    ) -> str:
        """The implementation used on ``device`` (with the ``installed`` kernel modules, default: those
        importable here) with the head computed in ``dtype`` (None: any), in a run that asks for
        ``deterministic`` algorithms (None: whether torch has them on now, as Lightning's
        ``trainer.deterministic`` turns them on): ``auto`` made concrete, passing by the kernels whose
        gradients are not deterministic (``NONDETERMINISTIC``) when they are asked for; a CUDA kernel asked
        for where it cannot run raises an error that says what to install or choose instead (a run refuses it
        at config time: ``refusal``). Under torch's warn-only determinism (``trainer.deterministic=warn``)
        ``loss.impl=cce`` runs, as torch's own nondeterministic operations then do, with a warning at config
        time (:func:`gptlab.config.parse_loss`)."""
        strict = deterministic
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
            strict = deterministic and not torch.is_deterministic_algorithms_warn_only_enabled()
        if self.impl == "auto":
            order = AUTO_ORDER.get(torch.device(device).type, AUTO_ORDER["cpu"])
            return next(
                impl
                for impl in order
                if available(impl, device, installed, dtype)
                and not (deterministic and impl in NONDETERMINISTIC)
                and self.extras_refusal(impl) is None
            )
        message = refusal(self.impl, torch.device(device).type, installed, dtype, bool(strict))
        if message is not None:
            raise RuntimeError(message)
        return self.impl

    def terms(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None = None,
        vocab_size: int | None = None,
    ) -> LossTerms:
        """The objective, cross-entropy and z-loss of ``hidden @ weight^T (+ bias)`` against ``targets``.
        ``vocab_size``: the vocabulary, the first rows of a ``weight`` padded to an aligned number of rows
        (``model.vocab_multiple``; the rest are never part of a softmax); None: all of its rows."""
        impl = self.resolve(hidden.device, dtype=_kernel_dtype(hidden))
        if impl == "plain":
            return plain_loss_terms(
                hidden, weight, targets, bias, self.ignore_index, self.z_loss, self.final_softcap, vocab_size
            )
        if impl == "chunked":
            return chunked_loss_terms(
                hidden,
                weight,
                targets,
                bias,
                self.ignore_index,
                self.chunk_rows,
                self.z_loss,
                self.final_softcap,
                vocab_size=vocab_size,
            )
        weight, bias = vocabulary_rows(weight, bias, vocab_size)
        if impl == "torch":
            loss = torch_linear_cross_entropy(
                hidden, weight, targets, bias, self.ignore_index, self.chunk_rows
            )
        else:
            loss = (_liger if impl == "liger" else _cce)(hidden, weight, targets, bias, self.ignore_index)
        return LossTerms(loss, loss.detach())

    def __call__(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None = None,
        vocab_size: int | None = None,
    ) -> Tensor:
        """The objective (what is differentiated): the mean cross-entropy, plus the z-loss when it is on."""
        return self.terms(hidden, weight, targets, bias, vocab_size).loss


class CallLog:
    """The terms of each call of a RecordingHeadLoss, in order. Not a list: a wrapper that rebuilds the
    containers in a forward pass's arguments copies lists and dataclasses (FSDP's cast of the root module's
    inputs under mixed precision, ``torch.distributed.utils._apply_to_tensors``, makes a new
    RecordingHeadLoss with a new list), while an object it does not know is passed on as itself: the copy
    records into the log the training step reads."""

    def __init__(self) -> None:
        self._terms: list[LossTerms] = []

    def append(self, terms: LossTerms) -> None:
        self._terms.append(terms)

    def __iter__(self) -> Any:
        return iter(self._terms)

    def __len__(self) -> int:
        return len(self._terms)

    def __getitem__(self, index: int) -> LossTerms:
        return self._terms[index]


@dataclass(frozen=True)
class RecordingHeadLoss(HeadLoss):
    """A HeadLoss that keeps each call's terms in ``calls``: the training step passes it to the model to log
    the cross-entropy and the z-loss apart from the objective it differentiates."""

    calls: CallLog = field(default_factory=CallLog, compare=False, repr=False)

    @classmethod
    def of(cls, head_loss: HeadLoss) -> RecordingHeadLoss:
        return cls(**head_loss.options(), ignore_index=head_loss.ignore_index)

    def __call__(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None = None,
        vocab_size: int | None = None,
    ) -> Tensor:
        terms = self.terms(hidden, weight, targets, bias, vocab_size)
        self.calls.append(terms)
        return terms.loss
