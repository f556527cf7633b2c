"""With ``compile=true`` the evaluations outside the training step (the length and passkey studies after
training, sample generation, the downstream tasks) run the blocks' plain forward: their many shapes (other
lengths, a KV cache, one-token decoding steps) would each compile every block anew, up to torch's limit,
after which torch runs them uncompiled anyway. FlexAttention keeps its own compiled kernel there, and the
blocks are compiled again after. The blocks' compiles are counted by the backend torch.compile hands each
new graph (Dynamo's eager backend underneath: it compiles exactly when Inductor would, quickly)."""

from __future__ import annotations

import copy
import json
import logging
import string
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import TINY, load_script

from gptlab.data.tokenizers import CharTokenizer
from gptlab.evaluation import length, passkey
from gptlab.evaluation.options import LengthEvalOptions, PasskeyOptions
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.parallel import transforms
from gptlab.parallel.transforms import ParallelOptions, parallelize, uncompiled_blocks
from gptlab.training.callbacks import SampleGeneration

CONTEXT = 64


@pytest.fixture(scope="module")
def script():
    yield load_script("flex_recompiles")
    sys.modules.pop("flex_recompiles", None)


@pytest.fixture
def block_compiles(script, monkeypatch):
    """The backend `parallelize` compiles each block with, counting the graphs Dynamo hands it; torch's
    compile cache emptied before and after, so each test counts from a fresh process's state."""
    backend = script.CountingBackend("eager")
    monkeypatch.setattr(transforms, "BLOCK_BACKEND", backend)
    torch._dynamo.reset()
    yield backend
    torch._dynamo.reset()


def tiny_alibi(chars: CharTokenizer) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=chars.vocab_size, block_size=CONTEXT, n_layer=2, n_head=2, n_embd=32, pos="alibi"
    )
    return GPT(config)


def compiled_copy(model: GPT) -> GPT:
    """``model``'s weights in a second model, its blocks compiled as ``compile=true`` compiles them."""
    compiled = copy.deepcopy(model)
    parallelize(compiled, ParallelOptions(compile=True))
    return compiled


def training_step(model: GPT, batch_size: int = 2) -> None:
    """A forward and backward pass at the training length (the dense route: FlexAttention has no CPU
    backward)."""
    model.train()
    idx = torch.randint(
        0, model.config.vocab_size, (batch_size, CONTEXT), generator=torch.Generator().manual_seed(1)
    )
    _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad()
    model.eval()


def studies(model: GPT, chars: CharTokenizer, tokens: np.ndarray) -> tuple[dict, dict]:
    """The length study at 1x and 2x and the passkey study at 2x (a prompt needs more than 1x's 64
    tokens), as after training."""
    options = LengthEvalOptions(factors=[1, 2], batch_tokens=512)
    with torch.no_grad():
        lengths = length.evaluate_lengths(model, tokens, CONTEXT, options, chars)
        keys = passkey.evaluate_passkey(model, chars, CONTEXT, [2], PasskeyOptions(depths=2, trials=3))
    return lengths, keys


def figures(lengths: dict, keys: dict) -> tuple:
    """Every figure of both studies (the passkey cells' timings left out)."""
    entries = lengths["variants"]["alibi"]
    by_length = {f: (e["loss"], e["bpb"], e["loss_by_position"]) for f, e in entries.items()}
    cells = {
        factor: {depth: {k: v for k, v in cell.items() if k != "seconds"} for depth, cell in row.items()}
        for factor, row in keys["cells"].items()
    }
    return by_length, cells, keys["metrics"]


def test_the_studies_after_training_compile_no_block_keep_flex_attention_compiled_and_match(
    script, block_compiles
):
    """A compiled model trains a step (its blocks compile), then runs the length and passkey studies inside
    `uncompiled_blocks`: no block compiles, FlexAttention (forced, as on a GPU with a bias scheme) compiles
    its own kernels, and every figure is the plain model's. The next training step runs the compiled blocks
    again."""
    chars = CharTokenizer.from_texts([string.printable])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, chars.vocab_size - 1, 8 * CONTEXT + 1).astype(np.uint16)
    plain = tiny_alibi(chars)
    model = compiled_copy(plain)
    training_step(model)
    trained = block_compiles.compiles
    assert trained >= 1  # the counting backend sees the blocks (one graph can serve both)
    training_step(plain)
    flex = script.CountingBackend("eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile")
        with script.flex_forced(flex):  # from an empty compile cache: the blocks' entries gone too
            block_compiles.compiles = 0
            with uncompiled_blocks(model):
                got = figures(*studies(model, chars, tokens))
            assert block_compiles.compiles == 0
            assert flex.compiles > 0  # FlexAttention still compiled: the lengths' kernels
            expected = figures(*studies(plain, chars, tokens))  # the plain model, the same kernels
    assert got == expected
    training_step(model)  # the compile cache was emptied with FlexAttention's: the blocks compile anew
    assert block_compiles.compiles > 0


def test_without_it_decoding_compiles_the_blocks_at_every_step(block_compiles):
    """What `uncompiled_blocks` spares: greedy decoding through the compiled blocks compiles them again and
    again (a KV cache, then one-token steps with a growing cache)."""
    chars = CharTokenizer.from_texts([string.printable])
    model = compiled_copy(tiny_alibi(chars)).eval()
    prompt = torch.tensor([chars.encode("The")])
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        model.generate(prompt, 6)
    assert block_compiles.compiles >= 3
    torch._dynamo.reset()  # as in a fresh process: nothing cached
    block_compiles.compiles = 0
    with torch.no_grad(), uncompiled_blocks(model):
        model.generate(prompt, 6)
    assert block_compiles.compiles == 0


def test_the_compiled_blocks_come_back_when_the_evaluation_raises(block_compiles):
    chars = CharTokenizer.from_texts([string.printable])
    model = compiled_copy(tiny_alibi(chars))
    compiled = [block._compiled_call_impl for block in model.transformer.h]
    assert all(call is not None for call in compiled)
    with pytest.raises(RuntimeError, match="evaluation failed"), uncompiled_blocks(model):
        assert all(block._compiled_call_impl is None for block in model.transformer.h)
        training_step(model)
        raise RuntimeError("evaluation failed")
    assert block_compiles.compiles == 0
    assert [block._compiled_call_impl for block in model.transformer.h] == compiled
    training_step(model)
    assert block_compiles.compiles >= 1


def test_sample_generation_runs_the_plain_blocks(block_compiles):
    """The callback's continuations of a compiled model: no block compiles, the plain model's text, and the
    blocks compiled again after."""
    chars = CharTokenizer.from_texts([string.printable])
    plain = tiny_alibi(chars).eval()
    model = compiled_copy(plain)
    callback = SampleGeneration(prompt="The", max_new_tokens=8, temperature=1.0, top_k=5)

    def module(gpt: GPT) -> torch.nn.Module:
        holder = torch.nn.Module()
        holder.model, holder.tokenizer, holder.device = gpt, chars, torch.device("cpu")
        return holder

    with torch.no_grad():
        expected = callback.continuations(module(plain))
        got = callback.continuations(module(model))
    assert got == expected and expected is not None and len(expected) == 2
    assert block_compiles.compiles == 0
    assert all(block._compiled_call_impl is not None for block in model.transformer.h)


def test_downstream_evaluation_runs_the_plain_blocks(make_cfg, block_compiles):
    """The harness's requests (lengths of their own) on a compiled model: no block compiles and the plain
    model's metrics."""
    pytest.importorskip("lm_eval")
    from gptlab.api import build_model, build_tokenizer
    from gptlab.evaluation.downstream import DownstreamEvalOptions
    from gptlab.training.downstream_eval import DownstreamEvaluation

    cfg = make_cfg(*TINY, "tokenizer=char")
    tokenizer = build_tokenizer(cfg)
    plain = build_model(cfg, tokenizer)
    model = compiled_copy(plain)
    callback = DownstreamEvaluation(DownstreamEvalOptions(tasks=["gptlab_python_mc"], limit=2), 32)
    results = []
    for gpt in (plain, model):
        holder = torch.nn.Module()
        holder.model, holder.tokenizer, holder.device = gpt, tokenizer, torch.device("cpu")
        results.append(callback.evaluate(holder))
    assert results[1] == results[0] and set(results[0]) == {
        "eval/gptlab_python_mc/acc",
        "eval/gptlab_python_mc/acc_norm",
    }
    assert block_compiles.compiles == 0


def test_a_compiled_run_compiles_no_block_in_its_studies_after_training(
    make_cfg, block_compiles, monkeypatch, caplog, tmp_path
):
    """``python train.py compile=true eval_length.enabled=true`` (in-process): the length and passkey studies
    after training compile no block, write their figures, and leave no recompile line of torch's."""
    from gptlab.tasks.gpt import run

    during: list[int] = []
    real = length.after_training

    def counted(*args, **kwargs):
        before = block_compiles.compiles
        try:
            return real(*args, **kwargs)
        finally:
            during.append(block_compiles.compiles - before)

    monkeypatch.setattr(length, "after_training", counted)
    cfg = make_cfg(
        *TINY,
        "tokenizer=char",
        "pos=alibi",
        f"paths.output_dir={tmp_path / 'run'}",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "compile=true",
        "eval_length.enabled=true",
        "eval_length.factors=[1,2]",
        "eval_length.max_tokens=513",
        "eval_length.passkey.depths=2",
        "eval_length.passkey.trials=2",
        "callbacks.sample_generation.max_new_tokens=4",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.WARNING):
            metrics = run(cfg)
    finally:
        torch.set_num_threads(threads)
    assert block_compiles.compiles >= 1  # training compiled the blocks
    assert during == [0]
    result = json.loads((tmp_path / "run" / "eval_length" / "length.json").read_text())
    assert set(result["variants"]["alibi"]) == {"1", "2"}
    assert metrics["length/loss@2x"] == result["variants"]["alibi"]["2"]["loss"]
    assert (tmp_path / "run" / "eval_length" / "passkey.json").exists()
    assert not [r for r in caplog.records if "recompile" in r.getMessage().lower()]
