"""kvbank's KV formats inside Hugging Face transformers: caches for `model.generate(past_key_values=...)`.

- `KVBankQuantizedCache(kv_dtype="int4")` keeps each layer's most recent tokens (at least
`residual_length`) in the model dtype and stores older ones in one of kvbank's codecs
(kvbank/cache/quant.py), a token (int8, fp8) or a block of 16 tokens (int4, int2) at a time: the
same bytes per token as the engine's pool. As transformers' own `QuantizedCache` does, every step
attends over the dequantized old tokens and the exact recent ones; with `residual_length=0` the
numbers are the engine's (prompts in 16-token chunks for int4/int2).
- `SinkWindowCache(sinks=4, window=1024, model=model)` is StreamingLLM: the first `sinks` tokens
  and the last `window`, so memory stays flat however long `generate` runs. Keys are stored
  rotated at their own positions; the sinks are handed to attention rotated forward (from their
  stored copy, so rounding never piles up) to sit just before the window, which gives every kept
  pair of tokens its distance within the cache, as kvbank's `sink_window` does.
  `get_seq_length()` counts every token seen (positions follow it) and the mask covers the kept.
- `SnapKVCache(budget=1024, window=64, kernel=5, model=model)`: at the end of the prompt, the
  last `window` prompt tokens' attention (average-pooled over `kernel` neighbours) chooses, per
  layer and KV head, the `budget - window` earlier tokens kept beside the window (kvbank's
  `snapkv`). A Cache never sees queries, so the cache hooks the model's attention modules to
  recompute the window's queries from their inputs, until every layer has compressed its prompt.

Written against transformers' layered caches (5.x): a `Cache` of per-layer objects, each a
`DynamicLayer` whose `update(key_states, value_states, *args, **kwargs)` takes and returns
[batch, kv_heads, tokens, head_dim]. Extra arguments (5.0's `cache_kwargs`) are accepted and unused.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvbank.attention.rope import apply_rope, rotation_tables
from kvbank.cache.policies import snapkv_keep
from kvbank.cache.quant import DEFAULT_GROUP_SIZE, KV_CACHE_DTYPES, Codec, FullPrecision, Stored, codecs_for
from kvbank.config import EngineConfig

#: the engine's block: int4/int2 keys share their ranges over its tokens, here as in the pool
BLOCK_SIZE = EngineConfig.block_size
#: the engine's KV codecs that store fewer bits than the model computes
QUANTIZED_DTYPES = tuple(
    name for name in KV_CACHE_DTYPES if not isinstance(codecs_for(name, torch.float32)[0], FullPrecision)
)


def _check(kv_dtype: str, residual_length: int, group_size: int) -> None:
    if kv_dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {', '.join(QUANTIZED_DTYPES)}")
    if not isinstance(residual_length, int) or residual_length < 0:
        raise ValueError(f"residual_length={residual_length!r} must be an integer >= 0")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")


class _Layer(DynamicLayer):
    """What kvbank's layers share across transformers 5.x: they cannot be cropped, `reset` empties them
    (up to 5.12 `DynamicLayer.reset` zeroes the tensors in place and keeps their length), and the
    maximum length answers to both names (`get_max_cache_shape` up to 5.12, `get_max_length` since)."""

    is_croppable = False  # read by 5.24+ (assisted decoding refuses the cache)

    def crop(self, length: int) -> None:
        # 5.24+: crop(-n) removes n tokens, crop(0) is a no-op; up to 5.12: crop(n >= 0) keeps n tokens.
        if length < 0 or 0 < length < self.get_seq_length():
            raise ValueError(f"{type(self).__name__} cannot be cropped: dropped or quantized tokens cannot be restored")

    def reset(self) -> None:
        super().reset()
        self.keys = self.values = None
        self.is_initialized = False

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()


class KVBankQuantizedLayer(_Layer):
    """One layer: `keys`/`values` hold the recent tokens exactly; older ones are stored through
    kvbank's codecs, as [batch, units, ...] tensors so that beams can be reordered.

    The unit is what the engine's pool stores at once. int8/fp8 scale each token: tokens beyond
    the residual are stored before attention reads them, so with `residual_length=0` every token,
    the new ones included, is attended in its stored form, as in the engine. int4/int2 scale keys
    per channel over a 16-token block: a block is stored once a step has completed it (beyond the
    residual), so a token attends to earlier blocks stored and to its own block exactly, as in the
    engine; a prompt given in one call attends to itself exactly (give it in 16-token chunks to
    score it as the engine does).
    """

    def __init__(
        self, kv_dtype: str = "int4", residual_length: int = 128, group_size: int = DEFAULT_GROUP_SIZE
    ) -> None:
        _check(kv_dtype, residual_length, group_size)
        super().__init__()
        self.kv_dtype, self.residual_length, self.group_size = kv_dtype, residual_length, group_size
        self.stored: tuple[Stored, Stored] | None = None
        self.num_stored = 0
        self._codecs: tuple[Codec, Codec] | None = None
        self.unit = BLOCK_SIZE if kv_dtype in ("int4", "int2") else 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; return every token's K and V (stored ones dequantized)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            dim = key_states.shape[-1]
            if self.unit > 1 and dim % self.group_size:
                raise ValueError(f"group_size={self.group_size} must divide the head dimension {dim}")
            self._codecs = codecs_for(self.kv_dtype, key_states.dtype, self.group_size)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        if self.unit == 1:
            self._store_overflow()
            return self._everything()
        keys, values = self._everything()
        self._store_overflow()
        return keys, values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.num_stored + self.keys.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: the stored codes and scales, and the exact recent tokens."""
        if not self.is_initialized:
            return 0
        stored = sum(t.nbytes for part in self.stored or () for t in part.values())
        return stored + self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        super().reset()
        self.stored, self.num_stored = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._select(lambda t: t[indices, ...])

    def _select(self, pick) -> None:
        if self.stored is not None:
            self.stored = tuple({k: pick(t) for k, t in part.items()} for part in self.stored)

    def _store_overflow(self) -> None:
        units = max(0, self.keys.shape[-2] - self.residual_length) // self.unit
        if not units:
            return
        count = units * self.unit
        pair = tuple(
            self._quantize(codec, states[..., :count, :], units)
            for codec, states in zip(self._codecs, (self.keys, self.values))
        )
        if self.stored is not None:
            pair = tuple({k: torch.cat([old[k], new[k]], dim=1) for k in new} for old, new in zip(self.stored, pair))
        self.stored = pair
        self.num_stored += count
        self.keys, self.values = self.keys[..., count:, :], self.values[..., count:, :]

    def _quantize(self, codec: Codec, states: torch.Tensor, units: int) -> Stored:
        # [batch, heads, tokens, dim] -> the codec's [n, unit, heads, dim], kept as [batch, units, ...]
        batch, heads, _, dim = states.shape
        x = states.transpose(1, 2).reshape(batch * units, self.unit, heads, dim).contiguous()
        return {k: t.view(batch, units, *t.shape[1:]) for k, t in codec.quantize(x).items()}

    def _everything(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stored is None:
            return self.keys, self.values
        out = []
        for codec, part, recent in zip(self._codecs, self.stored, (self.keys, self.values)):
            batch, units = next(iter(part.values())).shape[:2]
            x = codec.dequantize({k: t.flatten(0, 1) for k, t in part.items()}, recent.dtype)
            old = x.view(batch, units * self.unit, *x.shape[2:]).transpose(1, 2)
            out.append(torch.cat([old, recent], dim=-2))
        return out[0], out[1]


class KVBankQuantizedCache(Cache):
    """`past_key_values` for `generate`: kvbank's int8 / fp8 / int4 / int2 KV formats.

    The `residual_length` most recent tokens stay exact (int4/int2: up to a block more);
    `group_size` is the channels sharing a scale in int4/int2 values (it must divide the head
    dimension). `residual_length=0` attends exactly as the engine's quantized pool does.
    """

    def __init__(
        self, kv_dtype: str = "int4", residual_length: int = 128, group_size: int = DEFAULT_GROUP_SIZE
    ) -> None:
        _check(kv_dtype, residual_length, group_size)
        super().__init__(
            layer_class_to_replicate=functools.partial(KVBankQuantizedLayer, kv_dtype, residual_length, group_size)
        )

    @property
    def nbytes(self) -> int:
        """Bytes every layer holds (codes, scales, exact recent tokens)."""
        return sum(layer.nbytes for layer in self.layers)


class EvictingLayer(_Layer):
    """A layer that drops tokens: `seen` counts every token it was given (positions follow it),
    `keys`/`values` hold the kept ones, and the mask shows every kept token to every query."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        """(kept + new, seen - kept); `query_length` may be 5.0's cache_position tensor."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        kept = self.keys.shape[-2] if self.is_initialized else 0
        return kept + query_length, self.seen - kept

    def reset(self) -> None:
        super().reset()
        self.seen = 0


class SinkWindowLayer(EvictingLayer):
    """One layer of `SinkWindowCache`: `keys`/`values` hold the sinks then the window, keys rotated
    at the positions they were computed at."""

    def __init__(self, sinks: int, window: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.sinks, self.window, self.inv_freq = sinks, window, inv_freq.float().cpu()
        #: the position the first kept token after the sinks was computed at
        self.window_start = sinks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append; return the kept tokens and the new ones (the sinks rotated to sit before the
        window); then evict what falls out of the window."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += key_states.shape[-2]
        keys = self._sinks_moved(self.keys)
        values = self.values
        extra = self.keys.shape[-2] - self.sinks - self.window
        if extra > 0:
            keep = lambda t: torch.cat([t[..., : self.sinks, :], t[..., self.sinks + extra :, :]], dim=-2)
            self.keys, self.values = keep(self.keys), keep(self.values)
            self.window_start += extra
        return keys, values

    def get_max_length(self) -> int:
        return self.sinks + self.window

    def reset(self) -> None:
        super().reset()
        self.window_start = self.sinks

    def _sinks_moved(self, keys: torch.Tensor) -> torch.Tensor:
        delta = self.window_start - self.sinks
        count = min(self.sinks, keys.shape[-2])
        if delta == 0 or count == 0:
            return keys
        cos, sin = rotation_tables(torch.tensor([delta]), self.inv_freq)
        sinks = keys[..., :count, :]
        moved = apply_rope(sinks.float(), cos.to(keys.device), sin.to(keys.device)).to(keys.dtype)
        return torch.cat([moved, keys[..., count:, :]], dim=-2)


class SinkWindowCache(Cache):
    """StreamingLLM for `generate`: the first `sinks` tokens and the last `window`, in constant memory.

    `model` (a transformers model with rotary positions) gives the rotary frequencies the sinks are
    re-rotated with; `inv_freq` may be given instead.
    """

    def __init__(
        self,
        sinks: int = 4,
        window: int = 1024,
        model: torch.nn.Module | None = None,
        inv_freq: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks={sinks!r} must be an integer >= 0")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an integer >= 1")
        if inv_freq is None:
            if model is None:
                raise ValueError("SinkWindowCache needs the model (or its rotary inv_freq) to re-rotate the sinks")
            _refuse_sliding_window(model, "SinkWindowCache")
            inv_freq = _rotary_inv_freq(model)
        super().__init__(layer_class_to_replicate=functools.partial(SinkWindowLayer, sinks, window, inv_freq))

    @property
    def nbytes(self) -> int:
        """Bytes of the kept keys and values in every layer."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)


def _refuse_sliding_window(model: torch.nn.Module, cache: str) -> None:
    """Sliding-window layers mask by position, which an evicting cache no longer keeps contiguous."""
    config = getattr(model, "config", None)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in types if types is not None else window is not None
    if sliding:
        raise ValueError(
            f"{type(model).__name__} has attention layers with a sliding window of {window} tokens: "
            f"{cache} evicts by its own rule and cannot serve them (use KVBankQuantizedCache or DynamicCache)"
        )


def _rotary_inv_freq(model: torch.nn.Module) -> torch.Tensor:
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and "Rotary" in type(module).__name__:
            scaling = getattr(module, "attention_scaling", 1.0)
            if scaling != 1.0:
                raise ValueError(f"rotary attention_scaling={scaling} is not supported: sinks could not be re-rotated")
            return inv_freq
    raise ValueError(f"{type(model).__name__} has no rotary embedding module with inv_freq")


def bytes_per_token(config, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, float]:
    """KV bytes per token of a transformers model config, all layers, in its dtype (float32 when
    it names none) and in each kvbank format, scales and zero points included (as `kvbank plan`)."""
    heads = config.num_key_value_heads or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    sizes = {"auto": 2 * heads * dim * torch.empty(0, dtype=dtype).element_size()}
    for name in QUANTIZED_DTYPES:
        if name in ("int4", "int2") and dim % group_size:
            continue
        key, value = codecs_for(name, dtype, group_size)
        sizes[name] = (
            key.bytes_per_block(BLOCK_SIZE, heads, dim) + value.bytes_per_block(BLOCK_SIZE, heads, dim)
        ) / BLOCK_SIZE
    return {name: size * config.num_hidden_layers for name, size in sizes.items()}


class SnapKVLayer(EvictingLayer):
    """One layer of `SnapKVCache`: the compressed prompt (the same count per KV head), then every
    generated token."""

    def __init__(self, budget: int, window: int, kernel: int, queries) -> None:
        super().__init__()
        self.budget, self.window, self.kernel, self.queries = budget, window, kernel, queries
        self.compressed = False
        #: per batch row and KV head, the prompt positions kept (after compressing)
        self.kept: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The first call (the prompt) attends over everything, then keeps `budget` tokens per head."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += key_states.shape[-2]
        keys, values = self.keys, self.values
        if not self.compressed:
            self.compressed = True
            if self.keys.shape[-2] > self.budget:
                self._compress(self.queries())
        return keys, values

    def _compress(self, queries: torch.Tensor) -> None:
        # queries: [batch, heads, window, dim], rotated; the window's rows attend causally.
        batch, heads, window, dim = queries.shape
        kv_heads, length = self.keys.shape[1], self.keys.shape[-2]
        group = heads // kv_heads
        keys = self.keys.repeat_interleave(group, dim=1).float()
        logits = queries.float() @ keys.transpose(-1, -2) / dim**0.5
        future = torch.arange(length) > torch.arange(length - window, length).unsqueeze(1)
        weights = logits.masked_fill(future.to(logits.device), float("-inf")).softmax(dim=-1)
        votes = weights[..., : length - window].sum(dim=-2).view(batch, kv_heads, group, -1).sum(dim=2)
        self.kept = snapkv_keep(votes, self.kernel, self.budget - window, window).to(self.keys.device)
        index = self.kept.unsqueeze(-1).expand(-1, -1, -1, dim)
        self.keys, self.values = self.keys.gather(2, index), self.values.gather(2, index)


class SnapKVCache(Cache):
    """SnapKV for `generate`: the prompt compressed to `budget` tokens per layer and KV head.

    `model` is hooked (its attention modules' inputs, for the window's queries) until every layer
    has compressed its prompt; `close()` removes the hooks earlier. One cache serves one prompt.
    """

    def __init__(self, budget: int = 1024, window: int = 64, kernel: int = 5, model: torch.nn.Module | None = None):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an integer >= 1")
        if not isinstance(budget, int) or budget <= window:
            raise ValueError(f"budget={budget!r} must be an integer > window={window}")
        if not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel={kernel!r} must be a positive odd integer (pooling is centred)")
        if model is None:
            raise ValueError("SnapKVCache needs the model: the window's queries come from its attention modules")
        _refuse_sliding_window(model, "SnapKVCache")
        self.window = window
        self._inputs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")}
        if not self._modules:
            raise ValueError(f"{type(model).__name__} has no attention modules with q_proj and layer_idx")
        self._hooks = [m.register_forward_pre_hook(self._capture, with_kwargs=True) for m in self._modules.values()]
        self._layer_args = (budget, window, kernel)
        super().__init__(layer_class_to_replicate=self._new_layer)

    def _new_layer(self) -> SnapKVLayer:
        # Layers are made in order as update() first meets them: this one's index is the count so far.
        index = len(self.layers)
        return SnapKVLayer(*self._layer_args, lambda: self._queries(index))

    def _capture(self, module, args, kwargs) -> None:
        if not (
            self.layers and all(layer.compressed for layer in self.layers) and len(self.layers) == len(self._modules)
        ):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self._inputs[module.layer_idx] = (hidden[:, -self.window :], kwargs["position_embeddings"])
        else:
            self.close()

    def _queries(self, layer_idx: int) -> torch.Tensor:
        module = self._modules[layer_idx]
        hidden, (cos, sin) = self._inputs.pop(layer_idx)
        batch, window, _ = hidden.shape
        queries = module.q_proj(hidden).view(batch, window, -1, module.head_dim)
        norm = getattr(module, "q_norm", None)
        queries = (norm(queries) if norm is not None else queries).transpose(1, 2)
        cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
        half = queries.shape[-1] // 2
        turned = torch.cat((-queries[..., half:], queries[..., :half]), dim=-1)
        return queries * cos + turned * sin

    def reset(self) -> None:
        raise ValueError("a SnapKVCache serves one prompt (its hooks are gone once it compressed): make a new one")

    def close(self) -> None:
        """Remove the hooks from the model (done by itself once every layer has compressed)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
