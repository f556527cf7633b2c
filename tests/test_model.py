import pytest
import torch

from gptlab.errors import ConfigError
from gptlab.model import gpt, positional
from gptlab.model.attention import AttentionBias, DenseMask
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT, KVCache

SCHEMES = positional.names()  # every registered scheme


def tiny(**kw) -> GPTConfig:
    base = dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("pos", SCHEMES)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_causality_future_tokens_never_change_past_logits(pos, placement):
    torch.manual_seed(0)
    model = GPT(tiny(pos=pos, norm_placement=placement)).eval()
    idx = torch.randint(0, 97, (2, 24))
    logits, _ = model(idx)
    for t in (0, 7, 22):
        changed = idx.clone()
        changed[:, t + 1 :] = torch.randint(0, 97, changed[:, t + 1 :].shape)
        logits2, _ = model(changed)
        torch.testing.assert_close(logits2[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(logits2[:, t + 1 :], logits[:, t + 1 :])


def test_output_head_reuses_the_token_embedding():
    model = GPT(tiny())
    assert model.lm_head.weight is model.transformer.wte.weight
    untied = GPT(tiny(tie_weights=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.parameter_counts()["total"] == model.parameter_counts()["total"] + 97 * 32


def test_gpt2_preset_has_exactly_gpt2s_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))
    counts = model.parameter_counts()
    assert counts["total"] == 124_439_808
    assert counts["embedding"] == 50257 * 768 + 1024 * 768
    assert counts["non_embedding"] == 124_439_808 - counts["embedding"]


@pytest.mark.parametrize("pos", SCHEMES)
def test_kv_cache_gives_the_same_logits_as_recomputing(pos):
    torch.manual_seed(0)
    model = GPT(tiny(pos=pos)).eval()
    idx = torch.randint(0, 97, (2, 20))
    full, _ = model(idx)
    cache = KVCache.empty(model.config.n_layer)
    pieces = [model(idx[:, :12], cache=cache)[0]]  # a prompt, then a chunk, then one token at a time
    pieces.append(model(idx[:, 12:15], cache=cache)[0])
    for t in range(15, 20):
        pieces.append(model(idx[:, t : t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)


def test_greedy_generation_with_and_without_cache_agree():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = torch.randint(0, 97, (1, 5))
    a = model.generate(prompt, 40, use_cache=True)  # runs past block_size: the window slides
    b = model.generate(prompt, 40, use_cache=False)
    assert a.shape == (1, 45)
    assert torch.equal(a, b)


def test_sampling_respects_top_k():
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = torch.randint(0, 97, (4, 3))
    g = torch.Generator().manual_seed(0)
    out = model.generate(prompt, 1, temperature=1.0, top_k=1, generator=g)
    greedy = model.generate(prompt, 1)
    assert torch.equal(out, greedy)


def test_learned_positions_refuse_sequences_past_the_table():
    model = GPT(tiny(pos="learned"))
    with pytest.raises(ValueError, match="32 positions"):
        model(torch.zeros(1, 33, dtype=torch.long))
    # a fixed table extends past block_size
    GPT(tiny(pos="sinusoidal"))(torch.zeros(1, 40, dtype=torch.long))


def test_sinusoidal_table_equals_the_formula():
    import math

    model = GPT(tiny(pos="sinusoidal", n_embd=16, n_head=2))
    table = model.transformer.pos.table
    for pos in (0, 1, 5, 31):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_bad_model_configs_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"n_embd=100 is not divisible by model.n_head=3"):
        tiny(n_embd=100, n_head=3)
    with pytest.raises(ConfigError, match=r"Unknown positional encoding 'rotary'.*learned"):
        GPT(tiny(pos="rotary"))
    with pytest.raises(ConfigError, match=r"Unknown activation 'gleu'.*gelu.*Did you mean activation=gelu"):
        GPT(tiny(activation="gleu"))
    with pytest.raises(ConfigError, match="norm.placement"):
        tiny(norm_placement="middle")
    with pytest.raises(ConfigError, match=r"model.n_layers.*Did you mean model.n_layer\?"):
        GPTConfig.from_dict({"n_layers": 3})


def test_importing_the_model_pulls_in_no_training_framework():
    """`from gptlab.model import GPT` needs torch only: no Lightning, Hydra, OmegaConf or W&B; nor Dynamo (0.8 s
    of every process that reads a config), which a model imports only to compile or to keep experts eager."""
    import subprocess
    import sys

    code = (
        "import sys; from gptlab.model import GPT, GPTConfig; import gptlab.model.gpt; "
        "GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, pos='alibi')); "
        "loaded = [m for m in ('lightning', 'omegaconf', 'hydra', 'wandb', 'torch._dynamo') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def module_imports() -> dict[str, set[str]]:
    """gptlab module -> the gptlab modules it imports at module level (not inside functions, not under
    TYPE_CHECKING)."""
    import ast
    from pathlib import Path

    import gptlab

    root = Path(gptlab.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                edges |= subs or {node.module}
                if len(subs) < len(node.names):
                    edges.add(node.module)
    return graph


def test_no_import_circle_and_the_variants_know_only_their_own_options():
    """The model config chooses the variants; a variant family imports neither the model config nor the model
    (a variant is built from its own options and the dimensions it needs)."""
    import ast
    import importlib

    def gptlab_imports(module: str) -> set[str]:
        tree = ast.parse(open(importlib.import_module(module).__file__).read())
        anywhere = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}  # also in functions
        return {m for m in anywhere if m and m.startswith("gptlab")}

    assert gptlab_imports("gptlab.model.config") == {
        "gptlab.errors",
        "gptlab.model",  # the variant families' registries
        "gptlab.registry",
    }
    for family in ("activations", "norms", "positional.base", "positional.absolute", "positional.rotary"):
        assert gptlab_imports(f"gptlab.model.{family}") <= {
            "gptlab.errors",
            "gptlab.registry",
            "gptlab.model.positional.base",
        }, family
    # QK-norm is built from the norm family; otherwise the attention variants stand alone too.
    assert gptlab_imports("gptlab.model.attention_variants") <= {
        "gptlab.errors",
        "gptlab.registry",
        "gptlab.model",
    }
    graph = module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                circle = path[path.index(dep) :] + [dep] if dep in path else [module, dep]
                pytest.fail("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_a_checkpoints_model_config_from_before_typed_options_still_builds():
    """Checkpoints store GPTConfig.to_dict() in hyper_parameters["model"]; one written before activations
    had options (no activation_options key) builds the same model, its free-form pos_options typed."""
    old = {
        "vocab_size": 97,
        "block_size": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 32,
        "n_kv_head": None,
        "dropout": 0.0,
        "bias": True,
        "tie_weights": True,
        "mlp_ratio": None,
        "init_std": 0.02,
        "pos": "rope",
        "pos_options": {"base": 500, "rotary_fraction": 0.5, "scaling": "none", "scale_factor": 1.0},
        "activation": "swiglu",
        "norm": "rmsnorm",
        "norm_placement": "pre",
        "norm_eps": 1e-6,
        "norm_bias": None,
    }
    config = GPTConfig.from_dict(old)
    assert config.activation.name == "swiglu" and config.norm.options.eps == 1e-6
    model = GPT(config)
    scheme = model.transformer.pos
    assert scheme.options == positional.get("rope").Options(base=500.0, rotary_fraction=0.5)
    assert scheme.rotary_dim == 4
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    again = GPT(GPTConfig.from_dict(config.to_dict()))
    again.load_state_dict(state)
    model.load_state_dict(state)
    idx = torch.randint(0, 97, (1, 12))
    torch.testing.assert_close(again(idx)[0], model(idx)[0])
    # ...and the YAML node shape (name plus options) is accepted as well
    node = GPTConfig.from_dict({**old, "pos": {"name": "alibi"}, "pos_options": {}})
    assert node.pos.name == "alibi"


# ---- prefill in chunks ---------------------------------------------------------------------------

PREFILL_KINDS = [  # (pos, attention): no mask, a bias, a window (local and global layers), a cap
    ("rope", {}),
    ("learned", {}),
    ("alibi", {}),
    ("relative", {}),
    ("fire", {}),
    ("rope", {"window": 4, "window_pattern": "LG"}),
    ("alibi", {"window": 4, "window_pattern": "LG"}),
    ("relative", {"logit_softcap": 5.0}),
]


@pytest.mark.parametrize(("pos", "attention"), PREFILL_KINDS)
def test_prefill_in_chunks_gives_the_logits_and_cache_of_one_call(pos, attention):
    torch.manual_seed(0)
    model = GPT(tiny(pos=pos, attention=attention, init_std=0.3)).eval()
    # 45 = 6 x 7 + 3 tokens, past block_size (FIRE's normalisation past its threshold, ALiBi's extrapolation);
    # 29 = 4 x 7 + 1 within pos=learned's table
    length = 29 if pos == "learned" else 45
    idx = torch.randint(0, 97, (2, length))
    next_token = torch.randint(0, 97, (2, 1))
    with torch.no_grad():
        single, one_call = KVCache.empty(2), KVCache.empty(2)
        expected = model(idx, cache=one_call)[0][:, -1]
        chunked = KVCache.empty(2)
        last = model.prefill(idx, chunked, chunk=7)
        # fp32 rounding only: the sums run over different key blocks (observed <= 2e-6 on logits of ~5)
        torch.testing.assert_close(last, expected, rtol=1e-5, atol=1e-5)
        # one chunk is the one-call forward, but for the output layer's product over the last position alone
        # (last_only): the CPU's matrix kernels may round a 1-row product otherwise than a 45-row one (an AMD
        # EPYC's did, by up to 7e-7): fp32 rounding again, not bit for bit
        torch.testing.assert_close(model.prefill(idx, single, chunk=length), expected, rtol=1e-5, atol=1e-5)
        assert chunked.length == one_call.length == length
        for (k, v), (k1, v1) in zip(chunked.layers, one_call.layers):  # local layers keep their window
            assert k.shape == k1.shape and v.shape == v1.shape
        # the next step reads the chunked cache as it reads the one-call cache
        after_chunks = model(next_token, cache=chunked)[0]
        after_one = model(next_token, cache=one_call)[0]
        torch.testing.assert_close(after_chunks, after_one, rtol=1e-5, atol=1e-5)


def record_masks(monkeypatch) -> list[tuple[int, int]]:
    """(queries, bytes of the dense mask) of every AttentionBias.build from here on (0 bytes: none)."""
    built: list[tuple[int, int]] = []
    build = AttentionBias.build.__func__

    def recording(cls, pos, positions, *args, **kwargs):
        bias = build(cls, pos, positions, *args, **kwargs)
        mask = None if bias is None else bias.mask
        if isinstance(mask, DenseMask):
            mask = mask.whole()  # what one block of a chunk of at most QUERY_BLOCK queries builds
        built.append((len(positions), 0 if mask is None else mask.numel() * mask.element_size()))
        return bias

    monkeypatch.setattr(AttentionBias, "build", classmethod(recording))
    return built


@pytest.mark.parametrize(
    ("pos", "attention"), [("learned", {}), ("alibi", {"window": 4, "window_pattern": "LG"})]
)
def test_greedy_generation_is_the_same_with_a_chunked_prefill(pos, attention, monkeypatch):
    torch.manual_seed(0)
    model = GPT(tiny(pos=pos, attention=attention, init_std=0.3)).eval()
    prompt = torch.randint(0, 97, (2, 20))
    whole = model.generate(prompt, 40)  # prompts in one chunk; pos=learned's window slides past 32
    recompute = model.generate(prompt, 40, use_cache=False)
    built = record_masks(monkeypatch)
    monkeypatch.setattr(gpt, "PREFILL_MASK_BYTES", 4 * 4 * 64 * 3)  # 3 queries over 64 keys, 4 heads
    chunked = model.generate(prompt, 40)
    assert max(queries for queries, _ in built) < 20  # the prompt (and the slid window) went in chunks
    assert torch.equal(chunked, whole)
    assert torch.equal(chunked, recompute)


def test_prefill_bounds_the_attention_mask_it_builds(monkeypatch):
    assert gpt.prefill_chunk(12, 8192) == 682  # the default budget: 256 MiB over 8,192 keys with 12 heads
    assert 12 * 682 * 8192 * 4 <= gpt.PREFILL_MASK_BYTES < 12 * 683 * 8192 * 4
    torch.manual_seed(0)
    model = GPT(tiny(pos="alibi", attention={"window": 4, "window_pattern": "LG"})).eval()
    idx = torch.randint(0, 97, (1, 200))
    built = record_masks(monkeypatch)
    with torch.no_grad():
        model(idx, cache=KVCache.empty(2))
    one_call = max(size for _, size in built)
    assert one_call == 4 * 200 * 200 * 4  # (n_head, T, T) fp32
    built.clear()
    budget = 64 * 1024
    monkeypatch.setattr(gpt, "PREFILL_MASK_BYTES", budget)
    with torch.no_grad():
        model.prefill(idx, KVCache.empty(2))
    assert {queries for queries, _ in built} == {20}  # 64 KiB / (4 heads x 200 keys x 4 bytes)
    assert max(size for _, size in built) <= budget
    with pytest.raises(ValueError, match="chunk=0 must be a positive number"):
        model.prefill(idx, KVCache.empty(2), chunk=0)
    with pytest.raises(ValueError, match="at least one token"):
        model.prefill(idx[:, :0], KVCache.empty(2))
