"""The decoder architectures kvbank runs, one registry entry each: the model class, what loading a GGUF
file or a Hugging Face folder of it does beyond Llama's reading, and the layer form of the native stack.

A new architecture is one entry in `ARCHS` (with its model class and loader hooks where Llama's do not fit).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvbank.models.gemma3 import Gemma3ForCausalLM
from kvbank.models.llama import LlamaForCausalLM

#: GGUF layer tensor names (after "blk.N.") -> Hugging Face ones (after "model.layers.N.")
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: Gemma 3 has a norm before and after attention and before and after the MLP; llama.cpp names
#: the one before the MLP as Llama's only post-attention norm.
GEMMA3_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

#: What the gemma3 architecture fixes where a file does not say otherwise, as llama.cpp's loader
#: (which wrote these files) and transformers' Gemma3TextConfig both define it: every sixth layer
#: attends to all positions, the others to `sliding_window`; windowed layers rotate with base 10,000.
GEMMA3_LAYER_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
#: The 27B scales attention by (hidden / heads) ** -0.5, every other size by head_dim ** -0.5.
GEMMA3_27B_LAYERS = 62


def gemma3_gguf_fields(meta: dict, names: set[str]) -> dict:
    """Gemma 3's departures from Llama, from the file's gemma3.* keys and the architecture's definition."""
    layers, window = int(meta["gemma3.block_count"]), meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise ValueError("GGUF gemma3 file has no gemma3.attention.sliding_window")
    if meta.get("gemma3.attn_logit_softcapping"):
        raise ValueError(
            f"gemma3.attn_logit_softcapping={meta['gemma3.attn_logit_softcapping']} is not supported (Gemma 3 has none)"
        )
    missing = [n for n in ("post_attention_norm", "post_ffw_norm", "ffn_norm") if f"blk.0.{n}.weight" not in names]
    if missing:
        raise ValueError(f"GGUF gemma3 file lacks the layer norms {', '.join(missing)}")
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_LAYER_PATTERN)
    if isinstance(pattern, list):  # one flag per layer: whether it is windowed
        windows = tuple(int(window) if flag else None for flag in pattern)
    else:
        windows = tuple(None if (i + 1) % int(pattern) == 0 else int(window) for i in range(layers))
    hidden, heads = int(meta["gemma3.embedding_length"]), int(meta["gemma3.attention.head_count"])
    head_dim = int(meta.get("gemma3.attention.key_length", hidden // heads))
    return {
        "layer_windows": windows,
        "rope_local_theta": float(meta.get("gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": float(hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim),
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping") or None,
    }


def gemma3_folder_fields(raw: dict, config_path: Path) -> dict:
    """Gemma 3's departures from Llama, from a Hugging Face `gemma3_text` config (transformers 4.x
    and 5.x spell the layer pattern and the local rotary base differently: both are read)."""
    refused = {
        "hidden_activation": (raw.get("hidden_activation") or raw.get("hidden_act"), "gelu_pytorch_tanh"),
        "attn_logit_softcapping": (raw.get("attn_logit_softcapping"), None),
        "use_bidirectional_attention": (bool(raw.get("use_bidirectional_attention")), False),
    }
    for key, (value, supported) in refused.items():
        if value != supported:
            raise ValueError(f"{key}={value!r} in {config_path} is not supported for gemma3_text (only {supported!r})")
    layers, window = int(raw["num_hidden_layers"]), raw.get("sliding_window")
    if not window:
        raise ValueError(f"{config_path} gives gemma3_text no sliding_window")
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or GEMMA3_LAYER_PATTERN)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types in {config_path} must name full_attention or sliding_attention per layer")
    local = (raw.get("rope_parameters") or {}).get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling of the sliding-window layers ({local}) in {config_path} is not supported")
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    return {
        "layer_windows": tuple(int(window) if t == "sliding_attention" else None for t in types),
        "rope_local_theta": float(local.get("rope_theta") or raw.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_BASE),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or head_dim),
        "final_logit_softcapping": raw.get("final_logit_softcapping") or None,
    }


@dataclass(frozen=True)
class Arch:
    """One decoder architecture, named as a GGUF file's `general.architecture` and `ModelConfig.arch` name it."""

    name: str
    model: type[LlamaForCausalLM]
    #: the `model_type` of its Hugging Face config.json
    model_type: str
    #: GGUF layer tensor names -> Hugging Face ones
    layer_names: Mapping[str, str] = field(default_factory=lambda: GGUF_LAYER_NAMES)
    #: llama.cpp stores the q/k rows interleaved for its rotary kernel (undone at load)
    interleaved_qk: bool = False
    #: llama.cpp stores norm weights as the factor (1 + w), Hugging Face as w
    norm_plus_one: bool = False
    #: the ModelConfig fields beyond Llama's, from a GGUF's metadata and tensor names
    gguf_fields: Callable[[dict, set[str]], dict] | None = None
    #: the same from a Hugging Face config.json (and its path, for errors)
    folder_fields: Callable[[dict, Path], dict] | None = None
    #: q/k norms and q/k/v biases that a Hugging Face config.json does not announce
    qk_norm: bool = False
    attention_bias: bool = False
    #: a Hugging Face config's sliding window (when used) caps the context
    window_caps_context: bool = False

    @property
    def stack_form(self) -> Literal["llama", "gemma"]:
        """The layer form of the native decoder stack, which the model class's layers fix."""
        return self.model.stack_form


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", LlamaForCausalLM, model_type="llama", interleaved_qk=True),
    "mistral": Arch(
        "mistral",
        LlamaForCausalLM,
        model_type="mistral",
        interleaved_qk=True,
        window_caps_context=True,
    ),
    "qwen2": Arch("qwen2", LlamaForCausalLM, model_type="qwen2", attention_bias=True),
    "qwen3": Arch("qwen3", LlamaForCausalLM, model_type="qwen3", qk_norm=True),
    "gemma3": Arch(
        "gemma3",
        Gemma3ForCausalLM,
        model_type="gemma3_text",
        layer_names=GEMMA3_LAYER_NAMES,
        norm_plus_one=True,
        gguf_fields=gemma3_gguf_fields,
        folder_fields=gemma3_folder_fields,
        qk_norm=True,
    ),
}
#: Hugging Face model types refused with a reason beyond "not supported"
REFUSED_MODEL_TYPES = {
    "gemma3": "Gemma 3's image-text model; only its text models (model_type 'gemma3_text', e.g. gemma-3-270m "
    "and gemma-3-1b) are supported",
}


def gguf_arch(name: object) -> Arch:
    """The architecture a GGUF file's `general.architecture` names; ValueError naming the supported ones."""
    if name not in ARCHS:
        raise ValueError(f"GGUF architecture {name!r} is not supported; supported: {', '.join(ARCHS)}")
    return ARCHS[name]


def folder_arch(model_type: object, config_path: Path) -> Arch:
    """The architecture a Hugging Face config.json's `model_type` names; ValueError naming the supported ones."""
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} in {config_path} is {REFUSED_MODEL_TYPES[model_type]}")
    for arch in ARCHS.values():
        if arch.model_type == model_type:
            return arch
    supported = ", ".join(arch.model_type for arch in ARCHS.values())
    raise ValueError(f"model_type {model_type!r} in {config_path} is not supported; supported: {supported}")
