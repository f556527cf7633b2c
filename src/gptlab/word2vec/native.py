"""CBOW's step for the sigmoid objectives on a CPU as one C loop, compiled on first use with the machine's C
compiler and loaded through ctypes; where there is no compiler (or ``word2vec.native=false``) the numpy step
(:func:`gptlab.word2vec.fast.numpy_step`) runs instead.

Why: CBOW does little arithmetic per window (one mean of its context rows, one score per output row), and the
numpy step spends most of its time on what lies between its calls: a batch's rows gathered into temporaries,
products written out and read back to be scattered into the tables, a few dozen calls per batch. The C loop
reads and writes each table row in place, once per use. It is the same step: every score, step size, hidden
vector and gradient computed from the tables as they were before the batch (the autograd reference's one SGD
step on the batch's summed loss, as the test of :mod:`gptlab.word2vec.fast` checks for both), then the updates
added; only the order of float additions differs.

Under negative sampling every batch of a block (``Schedule.block_key``) has outputs of the same width, and the
block's steps go to C in one call (:func:`cbow_steps`): each step as :func:`cbow_step` takes it, bit for bit,
without the Python between steps (a batch cut out of the block, its outputs, the call's arguments): one
thread's training on the benchmark's corpus (``scripts/benchmark_word2vec.py``, 5,547 steps) took 1.23 CPU s
against 1.42 one step a call.
What remains is the loop itself, 550 to 590 ns a window there (window 5, 5 negatives, dim 100): flags that
change it (``-ffast-math``, 512-bit vectors, software prefetch of the next window's rows) measured no faster.

The library is built once per source, compiler and processor (it is compiled for this processor's instructions)
into ``$XDG_CACHE_HOME/gptlab`` (``~/.cache/gptlab``),
written beside its name and renamed (two processes building at once each write a whole file), and reused by
every later run: about half a second the first time.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from gptlab.word2vec.fast import StepBlock, Tables, WindowBatch

log = logging.getLogger("gptlab")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float dot(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < d; k++) s += a[k] * b[k];
    return s;
}

static void axpy(float *y, float a, const float *x, int64_t d) {
#pragma omp simd
    for (int64_t k = 0; k < d; k++) y[k] += a * x[k];
}

/* -log sigma(x), stably */
static double softplus_neg(double x) { return x > 0 ? log1p(exp(-x)) : -x + log1p(exp(x)); }

/* The factor each use of a row scales its step by, for a row the batch uses k times: min(1, 1 / (lr k W))
   (gptlab.word2vec.fast.row_scales; lr_w = lr W). */
static float use_scale(float lr_w, int32_t k) {
    float s = lr_w * (float)k;
    return s > 1.0f ? 1.0f / s : 1.0f;
}

/* Adds `add` to the count of each row the batch uses: uses_in over its present context slots, uses_out over
   its output slots in the mask. +1 counts a batch into zeroed arrays, -1 afterwards zeroes what it touched. */
static void count_uses(int32_t *uses_in, int32_t *uses_out, const int64_t *inputs, int64_t g_count,
                       int64_t c_slots, const int64_t *rows, const float *mask, int64_t m_cols, int32_t add) {
    for (int64_t j = 0; j < g_count * c_slots; j++)
        if (inputs[j] >= 0) uses_in[inputs[j]] += add;
    for (int64_t j = 0; j < g_count * m_cols; j++)
        if (mask[j] != 0.0f) uses_out[rows[j]] += add;
}

/* scratch floats of a step on G windows: each window's hidden vector, its gradient, and its output rows'
   step sizes */
static int64_t scratch_size(int64_t g_count, int64_t dim, int64_t m_cols) {
    return 2 * g_count * dim + g_count * m_cols;
}

/* One CBOW step on G windows: inputs (G, C) context rows of w_in, -1 for an empty slot; rows, labels, mask
   (G, M) the output rows of w_out each window is scored against. Everything is computed from the tables
   before the step, then added, each use of a row scaled by use_scale (workers: Hogwild workers stepping on
   the tables at once; uses_in, uses_out: zeroed counts, one per row of each table, left zeroed). Returns the
   summed loss when want_loss (else 0). */
static double cbow_step(float *w_in, float *w_out, int64_t dim, const int64_t *inputs, int64_t g_count,
                        int64_t c_slots, const int64_t *rows, const float *labels, const float *mask,
                        int64_t m_cols, float lr, int want_loss, float *hidden, float workers,
                        int32_t *uses_in, int32_t *uses_out) {
    double loss = 0.0;
    /* an output row's use is one pair, where skip-gram's carries its window's C context words: C times the
       uses before its bound (row_scales's pairs) */
    float lr_w = lr * workers, lr_w_out = lr_w / (float)c_slots;
    count_uses(uses_in, uses_out, inputs, g_count, c_slots, rows, mask, m_cols, 1);
    float *d_hidden = hidden + g_count * dim, *grad = d_hidden + g_count * dim;
    for (int64_t g = 0; g < g_count; g++) {
        float *h = hidden + g * dim, *dh = d_hidden + g * dim;
        memset(h, 0, sizeof(float) * dim);
        memset(dh, 0, sizeof(float) * dim);
        int64_t n = 0;
        for (int64_t c = 0; c < c_slots; c++) {
            int64_t i = inputs[g * c_slots + c];
            if (i >= 0) { axpy(h, 1.0f, w_in + i * dim, dim); n++; }
        }
        if (n > 1) {
            float inv = 1.0f / (float)n;
            for (int64_t k = 0; k < dim; k++) h[k] *= inv;
        }
        for (int64_t m = 0; m < m_cols; m++) {
            int64_t j = g * m_cols + m;
            const float *u = w_out + rows[j] * dim;
            float s = dot(u, h, dim);
            if (want_loss && mask[j] != 0.0f) loss += mask[j] * softplus_neg(s * (2.0f * labels[j] - 1.0f));
            float clipped = s > 30.0f ? 30.0f : (s < -30.0f ? -30.0f : s);
            float step = (labels[j] - 1.0f / (1.0f + expf(-clipped))) * mask[j] * lr;
            grad[j] = step;
            if (step != 0.0f) axpy(dh, step, u, dim);
        }
    }
    for (int64_t g = 0; g < g_count; g++) {
        for (int64_t m = 0; m < m_cols; m++) {
            int64_t j = g * m_cols + m;
            if (grad[j] != 0.0f)
                axpy(w_out + rows[j] * dim, grad[j] * use_scale(lr_w_out, uses_out[rows[j]]), hidden + g * dim, dim);
        }
        for (int64_t c = 0; c < c_slots; c++) {
            int64_t i = inputs[g * c_slots + c];
            if (i >= 0) axpy(w_in + i * dim, use_scale(lr_w, uses_in[i]), d_hidden + g * dim, dim);
        }
    }
    count_uses(uses_in, uses_out, inputs, g_count, c_slots, rows, mask, m_cols, -1);
    return loss;
}

/* Zeroed use counts for tables of n_in and n_out rows (calloc: untouched pages cost nothing); NULL when out
   of memory. */
static int32_t *use_counts(int64_t n_in, int64_t n_out) { return calloc(n_in + n_out, sizeof(int32_t)); }

/* One step (cbow_step's arguments; n_in, n_out: the tables' rows); NAN when out of memory. */
double w2v_cbow_step(float *w_in, float *w_out, int64_t dim, const int64_t *inputs, int64_t g_count,
                     int64_t c_slots, const int64_t *rows, const float *labels, const float *mask,
                     int64_t m_cols, float lr, int want_loss, float workers, int64_t n_in, int64_t n_out) {
    float *scratch = malloc(sizeof(float) * scratch_size(g_count, dim, m_cols));
    int32_t *uses = use_counts(n_in, n_out);
    double loss = NAN;
    if (scratch != NULL && uses != NULL)
        loss = cbow_step(w_in, w_out, dim, inputs, g_count, c_slots, rows, labels, mask, m_cols, lr, want_loss,
                         scratch, workers, uses, uses + n_in);
    free(scratch);
    free(uses);
    return loss;
}

/* n_batches steps one after the other, batch b being windows bounds[b] .. bounds[b + 1] - 1 of inputs, rows,
   labels and mask, at learning rate lrs[b]; its summed loss into losses[b] when want_loss[b] (else 0).
   Each step is w2v_cbow_step's: the same arithmetic in the same order. Returns -1 when out of memory. */
int w2v_cbow_steps(float *w_in, float *w_out, int64_t dim, const int64_t *inputs, int64_t c_slots,
                   const int64_t *rows, const float *labels, const float *mask, int64_t m_cols,
                   int64_t n_batches, const int64_t *bounds, const float *lrs, const int32_t *want_loss,
                   double *losses, float workers, int64_t n_in, int64_t n_out) {
    int64_t largest = 0;
    for (int64_t b = 0; b < n_batches; b++)
        if (bounds[b + 1] - bounds[b] > largest) largest = bounds[b + 1] - bounds[b];
    float *scratch = malloc(sizeof(float) * (scratch_size(largest, dim, m_cols) + 1));
    int32_t *uses = use_counts(n_in, n_out);
    if (scratch == NULL || uses == NULL) {
        free(scratch);
        free(uses);
        return -1;
    }
    for (int64_t b = 0; b < n_batches; b++) {
        int64_t g0 = bounds[b];
        losses[b] = cbow_step(w_in, w_out, dim, inputs + g0 * c_slots, bounds[b + 1] - g0, c_slots,
                              rows + g0 * m_cols, labels + g0 * m_cols, mask + g0 * m_cols, m_cols, lrs[b],
                              want_loss[b], scratch, workers, uses, uses + n_in);
    }
    free(scratch);
    free(uses);
    return 0;
}
"""

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared")
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptlab"


def library() -> ctypes.CDLL | None:
    """The compiled step, built on first use (and cached on disk); None where it cannot be built."""
    compiler = os.environ.get("CC", "cc")
    if compiler in _loaded:
        return _loaded[compiler]
    lib = None
    path = shutil.which(compiler)
    if path is None:
        log.info("word2vec: no C compiler (%s) found; CBOW runs the numpy step", compiler)
    else:
        key = hashlib.sha256("\0".join([SOURCE, path, *FLAGS, _cpu()]).encode()).hexdigest()[:16]
        target = cache_dir() / f"word2vec-cbow-{key}.so"
        try:
            if not target.is_file():
                _build(path, target)
                log.info("word2vec: CBOW's C step built into %s (once per machine)", target)
            lib = _bind(ctypes.CDLL(str(target)))
        except (OSError, subprocess.SubprocessError) as e:  # a failed or timed-out build, an unloadable file
            detail = getattr(e, "stderr", None) or b""
            log.info(
                "word2vec: the C step could not be built (%s%s); CBOW runs the numpy step",
                e,
                f": {detail.decode(errors='replace').strip()[-500:]}" if detail else "",
            )
    _loaded[compiler] = lib
    return lib


def _cpu() -> str:
    """What ``-march=native`` compiles for: the processor's model and flags. A home directory shared by
    machines of different processors (a cluster's) then holds one library per kind, never one built for
    instructions this processor lacks."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(dict.fromkeys(info))  # the lines of one processor (each core repeats them)
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "word2vec_cbow.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(built), str(source), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # whole or not at all, also when another process builds it too


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    fn = lib.w2v_cbow_step
    fn.argtypes = [p, p, i64, p, i64, i64, p, p, p, i64, f32, ctypes.c_int, f32, i64, i64]
    fn.restype = ctypes.c_double
    steps = lib.w2v_cbow_steps
    steps.argtypes = [p, p, i64, p, i64, p, p, p, i64, i64, p, p, p, p, f32, i64, i64]
    steps.restype = ctypes.c_int
    return lib


def _pointer(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def cbow_step(
    lib: ctypes.CDLL,
    tables: Tables,
    batch: WindowBatch,
    lr: float,
    with_loss: bool = False,
    workers: int = 1,
) -> float | None:
    """:func:`gptlab.word2vec.fast.numpy_step` for CBOW (negative sampling or hierarchical softmax), in C,
    each row's step bounded as there (``workers``: :func:`gptlab.word2vec.fast.row_scales`). The tables must
    be contiguous float32 CPU tensors (as :class:`Tables` makes them)."""
    t = batch.outputs
    inputs = np.ascontiguousarray(batch.inputs, dtype=np.int64)
    rows = np.ascontiguousarray(t.rows, dtype=np.int64)
    labels = np.ascontiguousarray(t.labels, dtype=np.float32)
    mask = np.ascontiguousarray(t.mask, dtype=np.float32)
    g_count, c_slots = inputs.shape
    loss = lib.w2v_cbow_step(
        tables.input.data_ptr(),
        tables.output.data_ptr(),
        tables.input.shape[1],
        _pointer(inputs),
        g_count,
        c_slots,
        _pointer(rows),
        _pointer(labels),
        _pointer(mask),
        rows.shape[1],
        lr,
        int(with_loss),
        float(workers),
        tables.input.shape[0],
        tables.output.shape[0],
    )
    if math.isnan(loss):
        raise MemoryError("word2vec's C step could not allocate its scratch space")
    return loss if with_loss else None


def cbow_steps(
    lib: ctypes.CDLL,
    tables: Tables,
    steps: StepBlock,
    lrs: np.ndarray,
    want_loss: np.ndarray,
    workers: int = 1,
) -> np.ndarray:
    """Several consecutive steps in one call: each one :func:`cbow_step` on its batch at its learning rate
    ``lrs[i]`` (the same arithmetic, on the tables after the previous step), without a return to Python
    between them. Returns each step's summed loss (0 where ``want_loss`` did not ask for it)."""
    t = steps.outputs
    inputs = np.ascontiguousarray(steps.inputs, dtype=np.int64)
    rows = np.ascontiguousarray(t.rows, dtype=np.int64)
    labels = np.ascontiguousarray(t.labels, dtype=np.float32)
    mask = np.ascontiguousarray(t.mask, dtype=np.float32)
    bounds = np.ascontiguousarray(steps.bounds, dtype=np.int64)
    lrs = np.ascontiguousarray(lrs, dtype=np.float32)
    want_loss = np.ascontiguousarray(want_loss, dtype=np.int32)
    losses = np.zeros(len(lrs), dtype=np.float64)
    status = lib.w2v_cbow_steps(
        tables.input.data_ptr(),
        tables.output.data_ptr(),
        tables.input.shape[1],
        _pointer(inputs),
        inputs.shape[1],
        _pointer(rows),
        _pointer(labels),
        _pointer(mask),
        rows.shape[1],
        len(lrs),
        _pointer(bounds),
        _pointer(lrs),
        _pointer(want_loss),
        _pointer(losses),
        float(workers),
        tables.input.shape[0],
        tables.output.shape[0],
    )
    if status != 0:
        raise MemoryError("word2vec's C step could not allocate its scratch space")
    return losses
