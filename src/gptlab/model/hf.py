"""Weights from Hugging Face ``transformers`` checkpoints: GPT-2, Llama, Qwen3 and Gemma 2, read from a local
directory.

A directory written by ``save_pretrained`` holds ``config.json`` and ``model.safetensors`` (or
``pytorch_model.bin``); nothing here needs ``transformers`` itself. ``load_pretrained(model, directory)``
checks that the directory's architecture is the model's (and names the overrides that make it so), maps
the tensor names and layouts, and loads every weight.

Mappings:

- GPT-2 (``GPT2LMHeadModel``): the same names as ours (``wte``, ``h.N.attn.c_attn``...), but GPT-2's
  ``Conv1D`` stores its matrices as (in, out): they are transposed into ``nn.Linear``'s (out, in). The
  position table ``wpe`` becomes ``transformer.pos.wpe``; a shorter ``model.block_size`` keeps its first rows.
- Llama (``LlamaForCausalLM``): ``q_proj``, ``k_proj``, ``v_proj`` are stacked into ``c_attn`` as [q | k | v];
  ``gate_proj`` and ``up_proj`` into ``c_fc`` as [gate | value], the order our gated activations split in;
  ``o_proj`` and ``down_proj`` are the ``c_proj`` matrices; ``input_layernorm``/``post_attention_layernorm``
  are ``ln_1``/``ln_2``. Rotary convention: Llama rotates the pairs (i, i + head_dim/2) of each head
  ("rotate_half"), and so does ``pos=rope`` here (``positional.rotate_half``), so the q/k rows are copied as
  they are. A rope that paired adjacent dimensions (2i, 2i+1) would need each head's rows permuted by
  ``half_to_interleaved``.
- Qwen3 (``Qwen3ForCausalLM``): Llama's layout plus QK-norm, an RMSNorm over each head's queries and keys
  before the rotation (``q_norm``/``k_norm`` -> ``attn.q_norm.norm``/``attn.k_norm.norm``, i.e.
  ``attention.qk_norm=rmsnorm``), and sliding-window layers where ``layer_types`` says
  ``sliding_attention`` (``attention.window`` with one pattern letter per layer, L where it slides).
- Gemma 2 (``Gemma2ForCausalLM``): Llama's layout with a sandwich of norms (``norm.placement=sandwich``:
  ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on the sublayers' outputs are ``ln_1_out``
  and ``ln_2_out``, ``pre_feedforward_layernorm`` is ``ln_2``), RMSNorm gains stored as w with the gain 1 + w
  (loaded as 1 + w), token embeddings times sqrt(hidden_size) (``embed_scale``), GeGLU with the tanh GELU,
  windowed layers (``layer_types``) and the attention-logit cap. Its final-logit cap
  (``final_logit_softcapping``) is ``loss.final_softcap``: a checkpoint that sets it is loaded only into a
  model capped at the same value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gptlab.errors import ConfigError
from gptlab.model import positional
from gptlab.model.attention_variants import AttentionOptions
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT, fit_vocab_rows, mlp_hidden_width

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
LLAMA_ACTIVATIONS = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"init_from={directory}: no config.json there. Point it at a directory written by a Hugging Face "
            "model's save_pretrained(...) (config.json plus model.safetensors or pytorch_model.bin)."
        )
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in FORMATS:
        raise ConfigError(
            f"init_from={directory} holds a {config.get('model_type')!r} model; supported: "
            f"{', '.join(FORMATS)}."
        )
    return config


def read_hf_state_dict(directory: str | Path) -> dict[str, Tensor]:
    path = Path(directory).expanduser()
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    sharded = sorted(path.glob("model-*-of-*.safetensors"))
    if sharded:
        from safetensors.torch import load_file

        state: dict[str, Tensor] = {}
        for shard in sharded:
            state.update(load_file(str(shard)))
        return state
    raise ConfigError(
        f"init_from={directory}: no model.safetensors or pytorch_model.bin there (save the model with "
        "save_pretrained)."
    )


def model_options_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The GPTConfig values (each variant as its config node) that reproduce a Hugging Face config."""
    return FORMATS[hf["model_type"]].options(hf)


def gpt2_options(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ConfigError(f"GPT-2 activation_function={act!r} has no counterpart here.")
    return {
        "vocab_size": hf["vocab_size"],
        "block_size": hf["n_positions"],
        "n_layer": hf["n_layer"],
        "n_head": hf["n_head"],
        "n_embd": hf["n_embd"],
        "bias": True,
        "tie_weights": hf.get("tie_word_embeddings", True),
        "mlp_ratio": (hf["n_inner"] / hf["n_embd"]) if hf.get("n_inner") else None,
        "pos": {"name": "learned"},
        "activation": {"name": GPT2_ACTIVATIONS[act]},
        "norm": {"name": "layernorm", "eps": hf.get("layer_norm_epsilon", 1e-5)},
        "norm_placement": "pre",
    }


def llama_options(hf: dict[str, Any]) -> dict[str, Any]:
    act = hf.get("hidden_act", "silu")
    if act not in LLAMA_ACTIVATIONS:
        raise ConfigError(f"Llama hidden_act={act!r} has no gated counterpart here.")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError(
            "Llama checkpoints with attention_bias or mlp_bias are not supported: bias is all or none."
        )
    n_head = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // n_head):
        raise ConfigError(f"Llama head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads.")
    rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {
        "vocab_size": hf["vocab_size"],
        "block_size": hf.get("max_position_embeddings", 2048),
        "n_layer": hf["num_hidden_layers"],
        "n_head": n_head,
        "n_embd": hf["hidden_size"],
        "n_kv_head": hf.get("num_key_value_heads") or n_head,
        "bias": False,
        "tie_weights": hf.get("tie_word_embeddings", False),
        "mlp_ratio": hf["intermediate_size"] / hf["hidden_size"],
        "pos": {"name": "rope", "base": float(rope_theta)},
        "activation": {"name": LLAMA_ACTIVATIONS[act]},
        "norm": {"name": "rmsnorm", "eps": hf.get("rms_norm_eps", 1e-6)},
        "norm_placement": "pre",
    }


def window_options(hf: dict[str, Any]) -> dict[str, Any]:
    """The sliding-window layers of a Hugging Face config (``layer_types``, ``sliding_window``) as the
    attention node's ``window`` and ``window_pattern`` (L local, G global, one letter a layer); none without."""
    layer_types = hf.get("layer_types") or []
    if "sliding_attention" not in layer_types or not hf.get("sliding_window"):
        return {}
    pattern = "".join("L" if t == "sliding_attention" else "G" for t in layer_types)
    return {"window": hf["sliding_window"], "window_pattern": pattern}


def qwen3_options(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's values, with QK-norm (RMSNorm at the model's epsilon) and the sliding-window layers."""
    values = llama_options(hf)
    attention = {"qk_norm": "rmsnorm", "qk_norm_eps": hf.get("rms_norm_eps", 1e-6), **window_options(hf)}
    values["attention"] = attention
    return values


def gemma2_options(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's values with Gemma 2's block: sandwich norms, scaled embeddings, tanh GeGLU, windows, the cap."""
    n_head = hf["num_attention_heads"]
    head_dim = hf["hidden_size"] // n_head
    if hf.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise ConfigError(
            f"Gemma 2 query_pre_attn_scalar={hf['query_pre_attn_scalar']} scales the scores by other than "
            f"1/sqrt(head_dim) = 1/sqrt({head_dim}); only query_pre_attn_scalar = head_dim maps here."
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ConfigError(f"Gemma 2 hidden_activation={act!r} has no counterpart here.")
    values = llama_options({**hf, "hidden_act": "gelu"})
    values["tie_weights"] = hf.get("tie_word_embeddings", True)
    values["activation"] = {"name": "geglu", "approximate": "tanh" if act == "gelu_pytorch_tanh" else "none"}
    values["norm_placement"] = "sandwich"
    values["embed_scale"] = float(hf["hidden_size"] ** 0.5)
    attention = {"logit_softcap": hf.get("attn_logit_softcapping"), **window_options(hf)}
    values["attention"] = attention
    return values


def check_compatible(config: GPTConfig, hf: dict[str, Any], source: str = "the checkpoint") -> None:
    """Raise a ConfigError listing every architecture value of ``config`` that differs from the checkpoint's,
    with the overrides that fix them."""
    wanted = model_options_from_hf(hf)
    problems: list[tuple[str, Any, Any]] = []
    for key in ("vocab_size", "n_layer", "n_head", "n_embd", "bias", "tie_weights"):
        if getattr(config, key) != wanted[key]:
            problems.append((f"model.{key}", getattr(config, key), wanted[key]))
    if config.kv_heads != wanted.get("n_kv_head", config.n_head):
        problems.append(("model.n_kv_head", config.kv_heads, wanted["n_kv_head"]))
    want_width = round((wanted["mlp_ratio"] or 4) * wanted["n_embd"])
    if mlp_hidden_width(config) != want_width:
        problems.append(("model.mlp_ratio", config.mlp_ratio, wanted["mlp_ratio"]))
    if config.mlp.name != "dense":  # these formats' feed-forward layers are dense MLPs
        problems.append(("mlp", config.mlp.name, "dense"))
    for key in ("pos", "activation", "norm"):
        if getattr(config, key).name != wanted[key]["name"]:
            problems.append((key, getattr(config, key).name, wanted[key]["name"]))
    if config.norm_placement != wanted["norm_placement"]:
        problems.append(("norm.placement", config.norm_placement, wanted["norm_placement"]))
    if not math.isclose(config.embed_scale, wanted.get("embed_scale", 1.0)):
        problems.append(("+model.embed_scale", config.embed_scale, wanted["embed_scale"]))
    if config.activation.name == wanted["activation"]["name"]:
        for key, value in wanted["activation"].items():
            if key != "name" and getattr(config.activation.options, key) != value:
                problems.append((f"activation.{key}", getattr(config.activation.options, key), value))
    if not math.isclose(config.norm.options.eps, wanted["norm"]["eps"]):
        problems.append(("norm.eps", config.norm.options.eps, wanted["norm"]["eps"]))
    if config.pos.name == wanted["pos"]["name"]:
        for key, value in wanted["pos"].items():
            if key != "name" and getattr(config.pos.options, key) != value:
                problems.append((f"pos.{key}", getattr(config.pos.options, key), value))
    ours_attention = config.attention.node()
    theirs_attention = AttentionOptions.from_node(wanted.get("attention")).node()
    for key, value in theirs_attention.items():
        if key == "window_pattern" and theirs_attention["window"] is None:
            continue  # no window: the pattern places nothing
        same = ours_attention[key] == value
        if isinstance(value, float) and isinstance(ours_attention[key], float):
            same = math.isclose(ours_attention[key], value)
        if not same:
            problems.append((f"attention.{key}", ours_attention[key], value))
    if not positional.get(config.pos.name).extrapolates and config.block_size > wanted["block_size"]:
        problems.append(("model.block_size", config.block_size, wanted["block_size"]))
    if problems:
        found = "; ".join(f"{k}={ours!r} but the checkpoint has {theirs!r}" for k, ours, theirs in problems)
        fix = " ".join(f"{k}={_override_value(v)}" for k, _, v in problems)
        raise ConfigError(f"{source} does not match the model: {found}. Add the overrides: {fix}")


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def half_to_interleaved(weight: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Reorder each head's output rows from rotate-half pairs (i, i + d/2) to adjacent pairs (2i, 2i+1);
    weight: (n_heads * head_dim, in)."""
    w = weight.view(n_heads, 2, head_dim // 2, -1)  # (heads, half, d/2, in)
    return w.transpose(1, 2).reshape(n_heads * head_dim, -1)


def gpt2_to_gptlab(state: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Rename and transpose a GPT2LMHeadModel state dict into this project's GPT."""
    out: dict[str, Tensor] = {}
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    for key, value in state.items():
        name = key.removeprefix("transformer.") if key.startswith("transformer.") else key
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of older versions
            continue
        if name == "wpe.weight":
            out["transformer.pos.wpe.weight"] = value[: config.block_size]
        elif name.startswith(("wte.", "h.", "ln_f.")):
            out["transformer." + name] = value.t() if name.endswith(transposed) else value
        elif name == "lm_head.weight":
            out[name] = value
    if config.tie_weights:
        out.pop("lm_head.weight", None)
    return out


def llama_to_gptlab(state: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Rename and stack a LlamaForCausalLM state dict into this project's GPT (see the module doc for the
    rotary convention)."""
    out: dict[str, Tensor] = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
    }
    if not config.tie_weights:
        out["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        attn = [state[f"{src}self_attn.{p}_proj.weight"] for p in ("q", "k", "v")]
        out[dst + "attn.c_attn.weight"] = torch.cat(attn, dim=0)  # (n_head + 2 n_kv_head) * head_dim rows
        out[dst + "attn.c_proj.weight"] = state[f"{src}self_attn.o_proj.weight"]
        gate_value = [state[f"{src}mlp.gate_proj.weight"], state[f"{src}mlp.up_proj.weight"]]
        out[dst + "mlp.c_fc.weight"] = torch.cat(gate_value, dim=0)  # [gate | value]
        out[dst + "mlp.c_proj.weight"] = state[f"{src}mlp.down_proj.weight"]
        out[dst + "ln_1.weight"] = state[f"{src}input_layernorm.weight"]
        out[dst + "ln_2.weight"] = state[f"{src}post_attention_layernorm.weight"]
    return out


def qwen3_to_gptlab(state: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Llama's mapping plus each layer's query and key norms."""
    out = llama_to_gptlab(state, config)
    for i in range(config.n_layer):
        for name in ("q_norm", "k_norm"):
            out[f"transformer.h.{i}.attn.{name}.norm.weight"] = state[
                f"model.layers.{i}.self_attn.{name}.weight"
            ]
    return out


def gemma2_to_gptlab(state: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Llama's mapping with Gemma's four norms per layer, each gain stored as w and applied as 1 + w."""
    renamed = dict(state)
    for i in range(config.n_layer):
        src = f"model.layers.{i}."
        # Llama's post_attention_layernorm is the norm before the MLP: Gemma's pre_feedforward_layernorm.
        renamed[f"{src}post_attention_layernorm.weight"] = state[f"{src}pre_feedforward_layernorm.weight"]
    out = llama_to_gptlab(renamed, config)
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        out[dst + "ln_1_out.weight"] = state[f"{src}post_attention_layernorm.weight"]
        out[dst + "ln_2_out.weight"] = state[f"{src}post_feedforward_layernorm.weight"]
    return {
        k: v + 1.0 if k.endswith(("ln_1.weight", "ln_2.weight", "_out.weight", "ln_f.weight")) else v
        for k, v in out.items()
    }


@dataclass(frozen=True)
class HFFormat:
    """How one Hugging Face ``model_type`` maps onto this project's GPT."""

    options: Callable[[dict[str, Any]], dict[str, Any]]  # its config.json -> GPTConfig values
    to_gptlab: Callable[[dict[str, Tensor], GPTConfig], dict[str, Tensor]]  # its state dict -> ours


FORMATS: dict[str, HFFormat] = {
    "gpt2": HFFormat(gpt2_options, gpt2_to_gptlab),
    "llama": HFFormat(llama_options, llama_to_gptlab),
    "qwen3": HFFormat(qwen3_options, qwen3_to_gptlab),
    "gemma2": HFFormat(gemma2_options, gemma2_to_gptlab),
}
SUPPORTED = tuple(FORMATS)


def config_from_pretrained(directory: str | Path, **overrides: Any) -> GPTConfig:
    """The GPTConfig of a saved Hugging Face GPT-2, Llama, Qwen3 or Gemma 2, with optional overrides (e.g. block_size)."""
    values = model_options_from_hf(read_hf_config(directory))
    values.update(overrides)
    return GPTConfig.from_dict(values)


def load_pretrained(model: GPT, directory: str | Path) -> GPT:
    """Load a Hugging Face GPT-2, Llama, Qwen3 or Gemma 2 saved in ``directory`` into ``model`` (in place); every weight of
    the model must be covered. Returns the model."""
    hf = read_hf_config(directory)
    check_compatible(model.config, hf, f"init_from={directory}")
    cap = hf.get("final_logit_softcapping")
    if cap is not None and model.final_softcap != cap:
        capped = f"at {model.final_softcap}" if model.final_softcap is not None else "not at all"
        raise ConfigError(
            f"init_from={directory}: the checkpoint caps its output logits at {cap} (final_logit_softcapping) "
            f"and the model {capped}: set loss.final_softcap={cap}."
        )
    state = read_hf_state_dict(directory)
    mapped = FORMATS[hf["model_type"]].to_gptlab(state, model.config)
    # The checkpoint's vocab_size rows, given the zero rows the model stores beyond them (model.vocab_multiple)
    for key in model.vocab_rows:
        if key in mapped:
            mapped[key] = fit_vocab_rows(mapped[key], model.config, f"init_from={directory}: {key}")
    ours = model.state_dict()
    for key, value in mapped.items():
        if key in ours and ours[key].shape != value.shape:
            raise ConfigError(
                f"init_from={directory}: {key} has shape {tuple(value.shape)} there and {tuple(ours[key].shape)} "
                "in the model."
            )
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    # A tied head shares the embedding's tensor, so it is never missing in substance.
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_weights)]
    if missing or unexpected:
        raise ConfigError(
            f"init_from={directory}: the checkpoint does not cover the model. Missing: {missing[:8]}; "
            f"unexpected: {unexpected[:8]}."
        )
    return model
