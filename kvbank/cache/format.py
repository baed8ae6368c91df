"""KVFormat: how the pool stores keys and values, as one frozen value.

A format names a codec (`dtype`, a key of kvbank.cache.quant.CODECS), the layers that stay in
the model dtype (`skip_layers`) and the int4/int2 group size. It yields every layer's codecs and
storage kind, and the prefix-cache namespace: K/V written in one format are never served to a
request that runs in another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbank.cache.quant import CODECS, DEFAULT_GROUP_SIZE, KV_CACHE_DTYPES, CodecPair, FullPrecision


@dataclass(frozen=True)
class KVFormat:
    """A KV storage format: codec name, layers kept in the model dtype, KIVI value group size."""

    dtype: str = "auto"
    skip_layers: tuple[int, ...] = ()
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.dtype not in CODECS:
            raise ValueError(f"kv_cache_dtype={self.dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.skip_layers):
            raise ValueError(f"kv_cache_dtype_skip_layers={self.skip_layers!r} must be layer indices")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"kv_quant_group_size={self.group_size!r} must be a positive integer")

    def codecs(self, num_layers: int, model_dtype: torch.dtype) -> list[CodecPair]:
        """(key, value) codecs of every layer; skipped layers stay in the model dtype."""
        skip = set()
        for index in self.skip_layers:
            if not -num_layers <= index < num_layers:
                raise ValueError(
                    f"kv_cache_dtype_skip_layers has layer {index}, but the model has "
                    f"{num_layers} layers (0..{num_layers - 1}, or negative from the end)"
                )
            skip.add(index % num_layers)
        quantized = CODECS[self.dtype](model_dtype, self.group_size)
        full = (FullPrecision(model_dtype), FullPrecision(model_dtype))
        return [full if i in skip else quantized for i in range(num_layers)]

    def kinds(self, num_layers: int, model_dtype: torch.dtype) -> list[str]:
        """The storage kind (kvbank.cache.layers.KINDS) of every layer."""
        return [layer_kind(pair, model_dtype) for pair in self.codecs(num_layers, model_dtype)]

    @property
    def namespace(self) -> bytes:
        """Appended to the model fingerprint to start every prefix-cache chain of this format."""
        if self.dtype == "auto":
            return b""
        # "r2": int4/int2 blocks with two-level key ranges and int8 value zero points
        revision = "/r2" if self.dtype in ("int4", "int2") else ""
        return f"|kv={self.dtype}/{','.join(map(str, self.skip_layers))}/{self.group_size}{revision}".encode()


def layer_kind(codecs: CodecPair, model_dtype: torch.dtype) -> str:
    """ "dense" for K/V kept as the model computes them, else the kind the codec asks for."""
    key = codecs[0]
    if isinstance(key, FullPrecision) and key.dtype == model_dtype:
        return "dense"
    return key.kind
