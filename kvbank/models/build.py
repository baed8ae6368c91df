"""From a model file to a model ready to run: load, cast, keep 4-bit weights packed, pick kernels."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank import kernels
from kvbank.models.config import ModelConfig
from kvbank.models.llama import LlamaForCausalLM
from kvbank.models.loader import LoadedModel, ProgressFn, load_model
from kvbank.models.packed import packed_matmul_available
from kvbank.tokenizer import Tokenizer

#: Up to this many tokens in a step, 4-bit weights beat dense bfloat16 on a CPU (bench/throughput.py).
PACKED_MAX_ROWS = 8


@dataclass
class BuiltModel:
    """A model in its run dtype on its device, with what came with it."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: str
    #: projections that run on packed 4-bit weights for small steps
    packed_layers: int


def build_model(path: str | None, device: torch.device, dtype: torch.dtype, weight_format: str = "auto",
                max_model_len: int | None = None, progress: ProgressFn | None = None) -> BuiltModel:
    """Load `path` (None: the bundled model) and make it ready to run; `max_model_len` caps its context."""
    loaded = load_model(path, progress)
    config = loaded.config
    limit = max_model_len or config.max_position_embeddings
    if limit > config.max_position_embeddings:
        raise ValueError(f"max_model_len={limit} exceeds the model's context length {config.max_position_embeddings}")
    config.max_position_embeddings = limit
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_weights({k: v.to(device) for k, v in loaded.state_dict.items()}, dtype)
    packed = _pack_weights(model, loaded, device, dtype, weight_format)
    # CPU half-precision matmuls cache a kernel per row count (models/llama.padded_rows).
    model.pad_rows = device.type == "cpu" and dtype != torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16:
        # Fused norms and rotary embedding: a bfloat16 decode step is mostly small ops on a CPU.
        model.use_native(kernels.native())
    return BuiltModel(model.eval(), config, loaded.tokenizer, loaded.path, packed)


def _pack_weights(model: LlamaForCausalLM, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                  wanted: str) -> int:
    usable = bool(loaded.int4) and packed_matmul_available(device) and dtype == torch.bfloat16
    if wanted == "int4" and not usable:
        raise ValueError("weight_format='int4' needs a GGUF with Q4_0/Q4_1 weights, dtype=bfloat16 and a CPU")
    if wanted == "dense" or not usable:
        return 0
    return model.pack_weights(loaded.int4, PACKED_MAX_ROWS)
