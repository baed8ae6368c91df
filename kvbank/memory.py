"""Where an engine's memory goes, part by part: measured from a loaded engine's tensors, or
predicted from a model's metadata by building the same model on the meta device.

The parts are the ones that differ in kind: packed weights (GGUF blocks laid out for the integer
kernels; without batch invariance kept beside their dense copy, which serves large steps), the
dense weights, the embedding table and the LM head (one tensor when tied), the rotary tables, the
KV pool and the KIVI residual slots. Weight parts come from the same classification of the same
modules in both cases, so a prediction is exact as long as
the engine builds its model the way `predict` does (both call models.build.assemble).

The load peak is separate: loading dequantizes every GGUF tensor to float32 first, so for a
moment the process holds far more than the finished model.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvbank.cache.hybrid import kv_groups
from kvbank.cache.storage import KVStorage, plan_pool
from kvbank.config import EngineConfig
from kvbank.models.build import assemble
from kvbank.models.config import ModelConfig
from kvbank.models.llama import LlamaForCausalLM
from kvbank.models.loader import bundled_model_path, describe_model, gguf_tensor_plan
from kvbank.models.packed import GROUP_SIZE, Int4Blocks, Int8Blocks, PackedLinear
from kvbank.models.qweights import KIND_Q4, KIND_Q4F, KIND_Q5, KIND_Q5F, KIND_Q8, KIND_Q8H, QuantLinear, SplitLinear

#: memory parts in the order they are shown, with what each one is
PARTS = {
    "packed_weights": "projections packed for the integer kernels (4-, 5- and 8-bit GGUF blocks) with their scales",
    "dense_weights": "projections and norms in the model dtype",
    "embeddings": "the token embedding table",
    "lm_head": "the output projection (0 when tied to the embeddings)",
    "rope_tables": "rotary cos/sin tables for every position up to max_model_len",
    "kv_pool": "the KV block pool",
    "residual_slots": "full-precision slots of not-yet-full int4/int2 blocks",
}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per part (see PARTS); `load_peak` is how much more than before loading the process
    held at most while loading the weights (None where it cannot be known)."""

    packed_weights: int
    dense_weights: int
    embeddings: int
    lm_head: int
    rope_tables: int
    kv_pool: int
    residual_slots: int
    tied_embeddings: bool
    load_peak: int | None = None
    #: how many projections run on each kernel (see `projection_kernels`)
    projections: tuple[tuple[str, int], ...] = ()

    def parts(self) -> dict[str, int]:
        """Part name -> bytes, in the order of PARTS."""
        return {name: getattr(self, name) for name in PARTS}

    @property
    def total(self) -> int:
        return sum(self.parts().values())

    def lines(self) -> list[str]:
        """A compact human-readable block: weights on one line, KV on the next, then the totals."""
        tied = " (tied)" if self.tied_embeddings else ""
        peak = "unknown" if self.load_peak is None else _mib(self.load_peak)
        matmuls = ", ".join(f"{count} {kernel}" for kernel, count in self.projections) or "none"
        return [
            f"weights  packed {_mib(self.packed_weights)}, dense {_mib(self.dense_weights)}, "
            f"embeddings {_mib(self.embeddings)}, lm_head {_mib(self.lm_head)}{tied}, "
            f"rope tables {_mib(self.rope_tables)}",
            f"matmuls  {matmuls}",
            f"KV       pool {_mib(self.kv_pool)}, residual slots {_mib(self.residual_slots)}",
            f"total    {_mib(self.total)} held; loading peaks {peak} above the start",
        ]


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --- the model -----------------------------------------------------------------------------


def weight_parts(model: LlamaForCausalLM) -> dict[str, int]:
    """Bytes of the model's tensors by part (the weight parts of PARTS), each storage counted once."""
    parts = dict.fromkeys(("packed_weights", "dense_weights", "embeddings", "lm_head", "rope_tables"), 0)
    seen: set[int] = set()
    for part, tensor in _classified_tensors(model):
        # _cdata names the storage itself, also on the meta device (where data_ptr is 0).
        key = tensor.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            parts[part] += tensor.numel() * tensor.element_size()
    return parts


#: what each record kind of QuantLinear holds (kvbank/kernels/matmul.h)
_KERNELS = {
    KIND_Q4: "integer 4-bit (Q4_0/Q4_1)",
    KIND_Q4F: "integer 4-bit, float32 scales (Q4_K)",
    KIND_Q5F: "integer 5-bit, float32 scales (Q5_K/Q5_1)",
    KIND_Q5: "integer 5-bit (Q5_0/Q4_0)",
    KIND_Q8: "integer 8-bit (Q8_0, or Q5_0/Q4_0 fused with it)",
    KIND_Q8H: "integer 8-bit, scales per 16 (Q6_K)",
}


def projection_kernels(model: LlamaForCausalLM) -> tuple[tuple[str, int], ...]:
    """(kernel, how many of the model's projections run on it), most used first: the integer
    kernels by record kind, PyTorch's int4 matmul, or dense (the GGUF type has no kernel here)."""
    counts: dict[str, int] = {}
    for layer in model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if isinstance(module, QuantLinear):
                kernel = _KERNELS[module.kind]
            elif isinstance(module, SplitLinear):
                kernel = "split: " + " + ".join(_KERNELS[part.kind].removeprefix("integer ") for part in module.parts)
            else:
                kernel = "torch int4" if isinstance(module, PackedLinear) else "dense"
            counts[kernel] = counts.get(kernel, 0) + 1
    return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _classified_tensors(model: LlamaForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    # The first part to name a storage gets it: the specific parts come first, then every
    # tensor of the model, so whatever is left (projections, norms, biases) counts as dense.
    yield "embeddings", model.embed_tokens.weight
    yield "lm_head", model.lm_head.weight
    for name in ("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"):  # local: Gemma's windowed layers
        if hasattr(model, name):
            yield "rope_tables", getattr(model, name)
    for module in model.modules():
        if isinstance(module, PackedLinear):
            yield "packed_weights", module.packed
            yield "packed_weights", module.scales_zeros
        if isinstance(module, QuantLinear):
            yield "packed_weights", module.records
    for _, tensor in _named_tensors(model):
        yield "dense_weights", tensor


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def tied(model: LlamaForCausalLM) -> bool:
    """Whether the LM head is the embedding table itself."""
    return model.lm_head.weight.untyped_storage()._cdata == model.embed_tokens.weight.untyped_storage()._cdata


def kv_bytes(storage: KVStorage) -> tuple[int, int]:
    """(KV pool, residual slots) bytes of a KVStorage: the pool, and what its kinds hold beside it."""
    return storage.nbytes, storage.extra_nbytes


# --- a loaded engine -------------------------------------------------------------------------


def measure(model: LlamaForCausalLM, storage: KVStorage, load_peak: int | None = None) -> MemoryReport:
    """Bytes of a loaded engine's actual tensors (its model and its KV storage), part by part."""
    kv_pool, residual = kv_bytes(storage)
    return MemoryReport(
        **weight_parts(model),
        kv_pool=kv_pool,
        residual_slots=residual,
        tied_embeddings=tied(model),
        load_peak=load_peak,
        projections=projection_kernels(model),
    )


def current(report: MemoryReport, storage: KVStorage) -> MemoryReport:
    """`report` with the KV parts of `storage` measured now (residual slots grow with open blocks)."""
    kv_pool, residual = kv_bytes(storage)
    return dataclasses.replace(report, kv_pool=kv_pool, residual_slots=residual)


# --- a prediction from metadata ----------------------------------------------------------------


def predict(config: EngineConfig) -> MemoryReport:
    """What `LLMEngine(config)` will hold, from the model's metadata alone (no weights read)."""
    path = bundled_model_path() if config.model is None else os.path.expanduser(str(config.model))
    info = describe_model(path)
    model_config = dataclasses.replace(info.config)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's context length {model_config.max_position_embeddings}"
        )
    model_config.max_position_embeddings = max_model_len
    shapes, int4_names, int8_names = _tensor_shapes(path)
    state_dict = {name: _meta(shape) for name, shape in shapes.items()}
    if "rope_freqs" in state_dict:  # read by value to build the rotary tables; tiny
        state_dict["rope_freqs"] = torch.ones(shapes["rope_freqs"])
    int4 = {name: Int4Blocks.meta(shapes[name], kind) for name, kind in int4_names.items()}
    int8 = {name: Int8Blocks.meta(shapes[name], kind) for name, kind in int8_names.items()}
    model, _ = assemble(model_config, state_dict, int4, config, int8)
    kv_pool, residual = _predict_kv(model_config, config)
    weights = weight_parts(model)
    return MemoryReport(
        **weights,
        kv_pool=kv_pool,
        residual_slots=residual,
        tied_embeddings=tied(model),
        load_peak=_predict_load_peak(shapes, int4_names, int8_names, weights, info.file_bytes),
        projections=projection_kernels(model),
    )


def _tensor_shapes(path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, str]]:
    """Hugging Face name -> shape of every tensor the loader keeps, and the names it also keeps 4-bit
    and 8-bit (-> GGUF type)."""
    if path.endswith(".gguf"):
        return gguf_tensor_plan(path)
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})  # noqa: SIM118 -- not a dict
    return shapes, {}, {}


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _predict_kv(model_config: ModelConfig, config: EngineConfig) -> tuple[int, int]:
    plan = plan_pool(
        model_config,
        config.torch_dtype,
        int(config.kv_cache_memory_gb * 2**30),
        config.block_size,
        config.kv_format,
        reserved_seqs=config.max_num_seqs,
        groups=kv_groups(model_config.layer_windows, config.swa_full),
    )
    num_blocks = config.num_gpu_blocks or plan.num_blocks
    residual_slots = max(config.max_num_seqs, 1) if plan.residual_bytes_per_seq else 0
    return num_blocks * plan.bytes_per_block, residual_slots * plan.residual_bytes_per_seq


def _predict_load_peak(
    shapes: dict[str, tuple[int, ...]],
    int4_names: dict[str, str],
    int8_names: dict[str, str],
    weights: dict[str, int],
    file_bytes: int,
) -> int:
    # What the loader holds at once: the file it reads, every tensor dequantized to float32, the
    # unpacked 4-bit blocks (a byte per weight and two float32 per group), the 8-bit blocks (a
    # byte per weight and a float32 per group), the float32 fused
    # q/k/v and gate/up matrices, and the finished model.
    numel = {name: _numel(shape) for name, shape in shapes.items()}
    float32 = 4 * sum(numel.values())
    blocks = sum(numel[name] + 8 * numel[name] // GROUP_SIZE for name in int4_names)
    blocks += sum(numel[name] + 4 * numel[name] // GROUP_SIZE for name in int8_names)
    fused = 4 * sum(n for name, n in numel.items() if _fused(name))
    return file_bytes + float32 + blocks + fused + sum(weights.values())


def _fused(name: str) -> bool:
    return name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
