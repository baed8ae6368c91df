"""Engine configuration, validated when it is built so mistakes surface before any model loads."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.cache.quant import DEFAULT_GROUP_SIZE, KV_CACHE_DTYPES

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

_WEIGHT_FORMATS = ("auto", "dense", "int4")


@dataclass
class EngineConfig:
    """Everything the engine needs to know before it loads a model.

    `model=None` means the bundled SmolLM2-135M-Instruct GGUF. Sizes of the KV pool come from
    `num_gpu_blocks` when given, else from `kv_cache_memory_gb`. `weight_format` "auto" keeps a
    GGUF's 4-bit weights 4-bit for small batches when running bfloat16 on a CPU ("int4" demands
    it, "dense" turns it off); float32 always runs dense, exactly like the reference.
    `kv_cache_dtype` is how the KV pool stores keys and values (see kvbank.cache.quant); the
    layers in `kv_cache_dtype_skip_layers` stay in the model dtype; `kv_quant_group_size` is the
    number of channels that share a scale in int4/int2 values. `batch_invariant` makes greedy
    output independent of what else is batched (every step size runs the 4-bit weight kernel, and
    every token attends through the native decode kernel: bfloat16 on a CPU, a Q4 GGUF, dense KV
    layers; dense weights or float32 are not invariant); False runs steps of more than 8 tokens on
    the dense weights and prefills through flash attention, which is faster for prefills.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_pinned_fraction: float = 0.5
    weight_format: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: tuple[int, ...] = ()
    kv_quant_group_size: int = DEFAULT_GROUP_SIZE
    seed: int = 0
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu', 'cuda' or 'auto'")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose from auto, {', '.join(_DTYPES)}")
        if self.dtype in ("float16", "fp16") and self.device == "cpu":
            raise ValueError("dtype=float16 is far too slow on CPU; use bfloat16 or float32")
        if self.weight_format not in _WEIGHT_FORMATS:
            raise ValueError(f"weight_format={self.weight_format!r} is not one of {', '.join(_WEIGHT_FORMATS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        self.kv_cache_dtype_skip_layers = tuple(self.kv_cache_dtype_skip_layers)
        if not all(isinstance(i, int) for i in self.kv_cache_dtype_skip_layers):
            raise ValueError(f"kv_cache_dtype_skip_layers={self.kv_cache_dtype_skip_layers!r} must be layer indices")
        _require_positive("kv_quant_group_size", self.kv_quant_group_size)
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction={self.max_pinned_fraction} must be in [0, 1]")
        _require_positive("block_size", self.block_size)
        _require_positive("max_num_seqs", self.max_num_seqs)
        _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_gpu_blocks is not None:
            _require_positive("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb} must be > 0")
        if self.max_model_len is not None:
            _require_positive("max_model_len", self.max_model_len)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype weights and activations run in: bfloat16 unless asked otherwise."""
        return torch.bfloat16 if self.dtype == "auto" else _DTYPES[self.dtype]


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
