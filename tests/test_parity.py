"""Numerical parity with Hugging Face reference models built from tiny random configs, through the same path
a user takes: a directory written by ``save_pretrained`` and ``model.init_from=<dir>``."""

import pytest
import torch
from conftest import TINY

import gptlab
from gptlab.errors import ConfigError
from gptlab.model import hf, positional
from gptlab.runs.layout import last_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 50257  # the gpt2 tokenizer's, so the saved model trains through the CLI as is


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory)
    return directory, model


GPT2_OVERRIDES = [
    "pos=learned",
    "activation=gelu_tanh",
    "norm=layernorm",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.block_size=64",
    f"model.vocab_size={VOCAB}",
]


def test_gpt2_weights_give_gpt2s_logits(make_cfg, gpt2_dir):
    directory, reference = gpt2_dir
    model = gptlab.build_model(make_cfg(*GPT2_OVERRIDES, f"model.init_from={directory}")).eval()
    idx = torch.randint(0, VOCAB, (2, 64))
    with torch.no_grad():
        expected = reference(idx).logits
        logits, _ = model(idx)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    # A shorter context keeps the first rows of the position table and the same logits on them.
    short = gptlab.build_model(
        make_cfg(*GPT2_OVERRIDES, "model.block_size=16", f"model.init_from={directory}")
    )
    with torch.no_grad():
        torch.testing.assert_close(short.eval()(idx[:, :16])[0], expected[:, :16], rtol=0, atol=1e-5)


def test_a_mismatched_model_is_refused_with_the_overrides_that_fix_it(make_cfg, gpt2_dir):
    directory, _ = gpt2_dir
    cfg = make_cfg(
        "model=tiny",
        "activation=relu",
        "attention=gated",
        f"model.vocab_size={VOCAB}",
        f"model.init_from={directory}",
    )
    with pytest.raises(ConfigError) as err:
        gptlab.build_model(cfg)
    message = str(err.value)
    assert "activation='relu' but the checkpoint has 'gelu_tanh'" in message
    # GPT-2 has no output gate: its weights would leave the gate untrained
    assert "attention.gate='elementwise' but the checkpoint has 'none'" in message
    assert "attention.gate=none" in message
    assert (
        "model.n_embd=32" in message
        and "activation=gelu_tanh" in message
        and "model.block_size=64" in message
    )
    with pytest.raises(ConfigError, match="no config.json"):
        gptlab.build_model(make_cfg(*GPT2_OVERRIDES, f"model.init_from={directory / 'missing'}"))


def test_a_training_run_starts_from_the_saved_gpt2_weights(make_cfg, tmp_path, gpt2_dir):
    """The training task with model.init_from: at a vanishing learning rate its last checkpoint still holds the
    saved weights."""
    from gptlab.tasks.gpt import run

    directory, reference = gpt2_dir
    run_dir = tmp_path / "run"
    args = [*TINY, *GPT2_OVERRIDES, "model.block_size=32", f"model.init_from={directory}"]
    args += ["trainer.max_steps=2", "optim.lr=1e-12", "optim.warmup_steps=0", "logger=csv"]
    run(make_cfg(*args, f"paths.output_dir={run_dir}"))
    state = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=False)["state_dict"]
    ref = reference.state_dict()
    # stored with 50,304 rows (model.vocab_multiple=64): GPT-2's 50,257, then zero rows that stay zero
    wte = state["model.transformer.wte.weight"]
    assert wte.shape == (50304, 32) and not wte[50257:].any()
    torch.testing.assert_close(wte[:50257], ref["transformer.wte.weight"])
    torch.testing.assert_close(state["model.transformer.pos.wpe.weight"], ref["transformer.wpe.weight"][:32])
    torch.testing.assert_close(
        state["model.transformer.h.1.mlp.c_fc.weight"], ref["transformer.h.1.mlp.c_fc.weight"].t()
    )


@pytest.mark.skipif("rope" not in positional.names(), reason="needs the rope positional scheme")
@pytest.mark.parametrize("tie,n_kv_head", [(False, 2), (True, 4)])
def test_llama_weights_give_llamas_logits(make_cfg, tmp_path, tie, n_kv_head):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_head,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
    )
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    overrides = [
        "pos=rope",
        "activation=swiglu",
        "norm=rmsnorm",
        "norm.eps=1e-5",
        "model.bias=false",
        f"model.tie_weights={str(tie).lower()}",
        "model.n_layer=2",
        "model.n_head=4",
        f"model.n_kv_head={n_kv_head}",
        "model.n_embd=64",
        "model.mlp_ratio=2.5",
        "model.block_size=64",
        "model.vocab_size=101",
        f"model.init_from={tmp_path}",
    ]
    model = gptlab.build_model(make_cfg(*overrides)).eval()
    idx = torch.randint(0, 101, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference(idx).logits, rtol=0, atol=1e-5)
    assert hf.config_from_pretrained(tmp_path).n_kv_head == n_kv_head


def test_half_to_interleaved_pairs_each_dimension_with_its_rotary_partner():
    head_dim, heads = 8, 2
    rows = torch.arange(heads * head_dim, dtype=torch.float32)[:, None]  # row i holds the value i
    out = hf.half_to_interleaved(rows, heads, head_dim).squeeze(1).tolist()
    # rotate-half pairs (i, i + 4) of each head become adjacent rows (2i, 2i + 1)
    assert out[:8] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert out[8:] == [8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.parametrize("sliding", [False, True])
def test_qwen3_weights_give_qwen3s_logits(make_cfg, tmp_path, sliding):
    """Qwen3 (QK-norm before RoPE; with use_sliding_window, windowed layers from max_window_layers on), tiny
    and random, with its norm gains moved off 1 so that a misplaced norm shows: logits within 1e-5 through
    ``model.init_from``."""
    if not hasattr(transformers, "Qwen3Config"):
        pytest.skip("this transformers has no Qwen3")
    torch.manual_seed(0)
    window = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1) if sliding else {}
    config = transformers.Qwen3Config(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        **window,
    )
    reference = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    reference.save_pretrained(tmp_path)
    overrides = [
        "pos=rope",
        "activation=swiglu",
        "norm=rmsnorm",
        "norm.eps=1e-6",
        "attention.qk_norm=rmsnorm",
        "model.bias=false",
        "model.tie_weights=false",
        "model.n_layer=3",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.n_embd=64",
        "model.mlp_ratio=2.5",
        "model.block_size=64",
        "model.vocab_size=101",
        f"model.init_from={tmp_path}",
    ]
    if sliding:
        overrides += ["attention.window=8", "attention.window_pattern=GLL"]
    model = gptlab.build_model(make_cfg(*overrides)).eval()
    idx = torch.randint(0, 101, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference(idx).logits, rtol=0, atol=1e-5)
    if not sliding:  # the same weights without QK-norm are refused with the override that fixes it
        plain = [o for o in overrides if not o.startswith("attention.")]
        with pytest.raises(ConfigError, match="attention.qk_norm='none' but the checkpoint has 'rmsnorm'"):
            gptlab.build_model(make_cfg(*plain))


def test_gemma2_weights_give_gemma2s_logits(make_cfg, tmp_path):
    """Gemma 2: sandwich norms with gains stored as w (applied as 1 + w), embeddings times sqrt(hidden), tanh
    GeGLU, local and global layers alternating (window 8, pattern LGL over 3 layers) and the attention-logit
    cap, tiny and random with the norm gains moved off their init: logits within 1e-5 through
    ``model.init_from``, whole and decoded over the bounded KV cache; then with its final-logit cap, which is ``loss.final_softcap``, and refused without
    it."""
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("this transformers has no Gemma 2")
    torch.manual_seed(0)
    shape = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=64,
        sliding_window=8,
        attn_logit_softcapping=5.0,  # low enough to bite on these scores
    )
    reference = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**shape, final_logit_softcapping=None)
    )
    reference.eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    reference.save_pretrained(tmp_path)
    overrides = [
        "pos=rope",
        "activation=geglu",
        "activation.approximate=tanh",
        "norm=rmsnorm",
        "norm.placement=sandwich",
        "norm.eps=1e-6",
        "attention.window=8",
        "attention.window_pattern=LGL",
        "attention.logit_softcap=5.0",
        "+model.embed_scale=8.0",
        "model.bias=false",
        "model.n_layer=3",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.n_embd=64",
        "model.mlp_ratio=2.5",
        "model.block_size=64",
        "model.vocab_size=101",
        f"model.init_from={tmp_path}",
    ]
    model = gptlab.build_model(make_cfg(*overrides)).eval()
    idx = torch.randint(0, 101, (2, 48))
    with torch.no_grad():
        expected = reference(idx).logits
        torch.testing.assert_close(model(idx)[0], expected, rtol=0, atol=1e-5)
        # Decoding over the KV cache, each local layer holding its last 8 positions only, 40 tokens past
        # the window: the same logits.
        cache = gptlab.model.KVCache.empty(3)
        steps = [model(idx[:, :8], cache=cache)[0]] + [
            model(idx[:, t : t + 1], cache=cache)[0] for t in range(8, 48)
        ]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=0, atol=1e-5)
        assert [k.size(2) for k, _ in cache.layers] == [8, 48, 8]
    capped = tmp_path / "capped"
    reference = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**shape, final_logit_softcapping=0.5)
    )
    reference.eval().save_pretrained(capped)
    cap_overrides = [*overrides[:-1], f"model.init_from={capped}"]
    model = gptlab.build_model(make_cfg(*cap_overrides, "loss.final_softcap=0.5")).eval()
    with torch.no_grad():
        logits = reference(idx).logits
        torch.testing.assert_close(model(idx)[0], logits, rtol=0, atol=1e-5)
    assert logits.abs().max() < 0.5 and logits.abs().max() > 0.25  # the cap bites
    with pytest.raises(
        ConfigError,
        match=r"the checkpoint caps its output logits at 0.5 \(final_logit_softcapping\) and the model not at "
        r"all: set loss.final_softcap=0.5",
    ):
        gptlab.build_model(make_cfg(*cap_overrides))
