"""From a model file to a model ready to run: load, cast, keep 4-bit weights packed, pick kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvbank import kernels
from kvbank.config import EngineConfig
from kvbank.models.archs import ARCHS
from kvbank.models.config import ModelConfig
from kvbank.models.llama import LlamaForCausalLM
from kvbank.models.loader import ProgressFn, load_model
from kvbank.models.packed import Int4Blocks, Int8Blocks, packed_matmul_available
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
    #: most resident memory loading added, in bytes (None where the OS does not say)
    load_peak: int | None


def build_model(config: EngineConfig, progress: ProgressFn | None = None) -> BuiltModel:
    """Load `config.model` (None: the bundled model) and make it ready to run."""
    device, dtype = torch.device(config.device), config.torch_dtype
    peak = PeakTracker()
    loaded = load_model(config.model, progress)
    model_config = loaded.config
    limit = config.max_model_len or model_config.max_position_embeddings
    if limit > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={limit} exceeds the model's context length {model_config.max_position_embeddings}"
        )
    model_config.max_position_embeddings = limit
    state_dict = {k: v.to(device) for k, v in loaded.state_dict.items()}
    model, packed = assemble(model_config, state_dict, loaded.int4, config, loaded.int8)
    built = BuiltModel(model.eval(), model_config, loaded.tokenizer, loaded.path, packed, None)
    del loaded
    built.load_peak = peak.stop()
    # CPU half-precision matmuls cache a kernel per row count (models/llama.padded_rows).
    model.pad_rows = device.type == "cpu" and dtype != torch.float32
    if device.type == "cpu" and dtype == torch.bfloat16:
        # Fused norms and rotary embedding: a bfloat16 decode step is mostly small ops on a CPU.
        model.use_native(kernels.native())
    return built


def integer_kernels(engine: EngineConfig):
    """kvbank's native module where the engine runs GGUF weights on its integer matmul kernels
    (a CPU with AVX2 or AVX-512 VNNI, bfloat16, KVBANK_NATIVE_KERNELS not 0), else None."""
    if torch.device(engine.device).type != "cpu" or engine.torch_dtype != torch.bfloat16:
        return None
    module = kernels.native()
    return module if module is not None and module.qmatmul_isa() != "scalar" else None


def assemble(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    int4: dict[str, Int4Blocks],
    engine: EngineConfig,
    int8: dict[str, Int8Blocks] | None = None,
) -> tuple[LlamaForCausalLM, int]:
    """The model as `engine` runs it: weights fused and cast, 4-bit ones packed where the engine
    keeps them packed. Returns the model and the number of packed projections.

    A batch-invariant engine runs every step on the 4-bit weights, so it keeps no dense copy of
    them; otherwise the dense copy serves steps of more than PACKED_MAX_ROWS tokens. With meta
    tensors in `state_dict` and `int4` this builds the same model without any data, which is how
    kvbank.memory.predict sizes it.
    """
    check_supported(config, engine)
    with torch.device("meta"):
        model = ARCHS[config.arch].model(config)
    model.load_weights(state_dict, engine.torch_dtype)
    projections = bool(int4) or any(name.endswith("proj.weight") for name in int8 or {})
    if not engine.packs_int4_weights(projections and packed_matmul_available(torch.device(engine.device))):
        return model, 0
    native = integer_kernels(engine)
    max_rows = None if engine.batch_invariant else PACKED_MAX_ROWS
    return model, model.pack_weights(int4, max_rows, int8, native)


def check_supported(config: ModelConfig, engine: EngineConfig) -> None:
    """Refuse an engine configuration a model with sliding-window layers cannot run correctly.

    Those layers read their window from dense K/V only (attention/window.py), and the
    long-context policies move tokens between slots, which a window over slots would not follow.
    """
    if not any(config.layer_windows):
        return
    if set(engine.kv_format.kinds(config.num_layers, engine.torch_dtype)) != {"dense"}:
        raise ValueError(
            f"kv_cache_dtype={engine.kv_cache_dtype!r} is not supported for {config.arch} (head_dim="
            f"{config.head_dim}, sliding-window layers): the quantized KV kernels take head_dim 64 or 128 and "
            "windows are read from dense K/V only; use kv_cache_dtype='auto'"
        )
    if engine.kv_policy != "full":
        raise ValueError(
            f"kv_policy={engine.kv_policy!r} is not supported for {config.arch}: its sliding-window layers "
            "need every token at its own slot; use kv_policy='full'"
        )


class PeakTracker:
    """The most resident memory the process gains from now until `stop()`, from Linux's VmHWM.

    Starting resets the process's high-water mark to its current size (/proc/self/clear_refs),
    so an earlier, larger peak does not hide this one. Elsewhere `stop()` returns None.
    """

    def __init__(self) -> None:
        self._start = _status_bytes("VmRSS") if _reset_high_water_mark() else None

    def stop(self) -> int | None:
        high = _status_bytes("VmHWM")
        return None if self._start is None or high is None else high - self._start


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
