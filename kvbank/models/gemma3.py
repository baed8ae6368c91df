"""Gemma 3 (text) over the paged KV cache: Llama's decoder with Gemma's departures.

- Norms scale by (1 + w), computed at load; a norm before and after attention and before and
  after the MLP; q and k are normed per head before rotation.
- Embeddings are multiplied by sqrt(hidden), rounded to the model dtype as transformers does.
- The MLP is GeGLU with tanh-approximated GELU; the LM head is the embedding table.
- Attention is scaled by query_pre_attn_scalar ** -0.5. Most layers attend to a sliding window
  of the latest positions (attention/window.py) and rotate with their own base; the others
  attend to everything with the global base (and the file's rope scaling).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from kvbank.attention import AttentionMetadata
from kvbank.attention.fast import DECODE_PARTITION, window_row_starts
from kvbank.attention.window import WindowRows, window_attention, window_rows
from kvbank.cache.layers.base import stack_step
from kvbank.models.config import ModelConfig
from kvbank.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, rope_inv_freq


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config)
        self.window = config.layer_window(layer)
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache,
        meta: AttentionMetadata,
        windows: dict[int, WindowRows],
    ) -> torch.Tensor:
        """`windows`: the step's windows by size, built on first use and shared by the layers."""
        qkv = self.rotated_qkv(x, cos, sin)
        if self.window is None:
            return self.o_proj(self.attend(qkv, kv_cache, meta))
        T = meta.slot_mapping.shape[0]
        q, k, v = (t.view(x.shape[0], -1, self.head_dim)[:T] for t in qkv.split(self.sizes, dim=-1))
        kv_cache.write(k, v, meta)
        # by rows through the native kernel (each row reads only its window), else gathered windows
        out = kv_cache.attend_window(q, meta, self.scale, self.window)
        if out is None:
            if self.window not in windows:
                windows[self.window] = window_rows(meta, self.window)
            out = window_attention(q, kv_cache.k, kv_cache.v, windows[self.window], self.scale)
        out = out.view(T, -1)
        return self.o_proj(out if x.shape[0] == T else F.pad(out, (0, 0, 0, x.shape[0] - T)))


class GeGLU(MLP):
    native = None  # kvbank's native module: gelu(gate) * up in one bfloat16 pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native is not None and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
            return self.down_proj(self.native.geglu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    native = None  # never the fused layer calls: Gemma's extra norms are not in them

    def use_integer_kernels(self, native) -> bool:
        """The layer's projections run on the integer kernels one by one, never fused with its norms."""
        return False

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Gemma3Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.mlp = GeGLU(config)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache,
        meta: AttentionMetadata,
        windows: dict[int, WindowRows],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: the layer's output, and the residual stream it is added to next."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta, windows))
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder; weights come Hugging Face-named, norms as w (not 1 + w)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.rope_scaling and config.rope_scaling.get("rope_type") != "linear":
            raise ValueError(f"gemma3 rope scaling {config.rope_scaling.get('rope_type')!r} is not supported: linear")
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_layers))
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)
        self.register_buffer("rope_local_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_local_sin", torch.empty(0), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward."""
        T = input_ids.shape[0]
        x, positions = self.embed(input_ids, positions, embeds)
        full = self.rope_cos[positions], self.rope_sin[positions]
        local = self.rope_local_cos[positions], self.rope_local_sin[positions]
        step = self._gemma_stack_step(x, kv_caches, meta)
        if step is not None:
            step.cos_local, step.sin_local = local
            return self._stack().forward(x=x, cos=full[0], sin=full[1], step=step)[:T]
        windows: dict[int, dict[int, WindowRows]] = {}
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            window = layer.self_attn.window  # dense storage only: check_supported refuses the rest at build
            cos, sin = full if window is None else local
            # a hybrid cache gives each layer its own tables; windows are shared by layers of one table
            layer_meta = meta if meta.layer_metas is None else meta.layer_metas[i]
            shared = windows.setdefault(id(layer_meta), {})
            x, residual = layer(x, residual, cos, sin, kv_cache, layer_meta, shared)
        return (x + residual)[:T]

    def _gemma_stack_step(self, x: torch.Tensor, kv_caches: list, meta: AttentionMetadata):
        """The step as the native stack takes it (a StackStep, but for the local rotary tables) when it
        can run as one native call over every layer: bfloat16 rows, every projection on the integer
        kernels, bfloat16 caches attended by rows; else None. Layers that attend through one table (the
        hybrid cache's full table or a window's) and the same window share a group: its slots, block
        tables, context lengths and starts (trailing by the window)."""
        rows = x.shape[0]
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or self.layers[0].mlp.native is None:
            return None
        for layer in self.layers:
            projections = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            if not all(hasattr(p, "segments") and p.integer_path(rows) for p in projections):
                return None
        step = stack_step(kv_caches)
        if step is None or step.format != 0:
            return None
        groups: dict[tuple, int] = {}
        layer_groups: list[int] = []
        slots, tables, lens, starts = [], [], [], []
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            layer_meta = meta if meta.layer_metas is None else meta.layer_metas[i]
            window = layer.self_attn.window
            key = (id(layer_meta), cache.kind, window)
            if key not in groups:
                rows_attention = cache.row_attention(layer_meta)
                if rows_attention is None:
                    return None
                first = rows_attention["starts"]
                if window is not None:
                    first = window_row_starts(rows_attention["context_lens"], first, window)
                elif first is None and groups:
                    first = torch.zeros_like(rows_attention["context_lens"])
                groups[key] = len(slots)
                slots.append(layer_meta.slot_mapping)
                tables.append(rows_attention["block_tables"])
                lens.append(rows_attention["context_lens"])
                starts.append(first)
            layer_groups.append(groups[key])
        step.slot_mapping, step.block_tables, step.context_lens, step.starts = slots[0], tables[0], lens[0], starts[0]
        step.layer_groups = layer_groups
        step.group_slots, step.group_tables = slots[1:], tables[1:]
        step.group_lens, step.group_starts = lens[1:], starts[1:]
        step.local_layers = [int(layer.self_attn.window is not None) for layer in self.layers]
        step.scale = self.layers[0].self_attn.scale
        step.partition = DECODE_PARTITION
        return step

    stack_form = "gemma"

    def _stack_norms(self, layer) -> list[torch.Tensor]:
        """Before and after attention, before and after the MLP, then q's and k's per head."""
        return [
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            layer.pre_feedforward_layernorm.weight,
            layer.post_feedforward_layernorm.weight,
            layer.self_attn.q_norm.weight,
            layer.self_attn.k_norm.weight,
        ]

    def use_native(self, module) -> None:
        """As LlamaForCausalLM's, and GeGLU's activation too."""
        super().use_native(module)
        for m in self.modules():
            if isinstance(m, GeGLU):
                m.native = module

    def _token_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, soft-capped where the model says so."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def mean_queries(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Not available: recall's query summary follows Llama's layer."""
        raise ValueError("recall (mean_queries) is not supported for gemma3 models")

    def load_weights(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Take Hugging Face-named float32 weights, fuse them, add 1 to the norms, cast to `dtype`."""
        c = self.config
        if c.attention_bias:
            raise ValueError("gemma3 with attention biases is not supported")
        norm = lambda name: 1 + state_dict[name]  # float32, as transformers computes the factor
        embed = state_dict["model.embed_tokens.weight"]
        params = {
            "embed_tokens.weight": embed,
            "norm.weight": norm("model.norm.weight"),
            "lm_head.weight": embed if c.tie_word_embeddings else state_dict["lm_head.weight"],
        }
        for i in range(c.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            params[dst + "self_attn.qkv_proj.weight"] = torch.cat([state_dict[f"{attn}{p}_proj.weight"] for p in "qkv"])
            params[dst + "self_attn.o_proj.weight"] = state_dict[attn + "o_proj.weight"]
            params[dst + "self_attn.q_norm.weight"] = norm(attn + "q_norm.weight")
            params[dst + "self_attn.k_norm.weight"] = norm(attn + "k_norm.weight")
            params[dst + "mlp.gate_up_proj.weight"] = torch.cat(
                [state_dict[src + "mlp.gate_proj.weight"], state_dict[src + "mlp.up_proj.weight"]]
            )
            params[dst + "mlp.down_proj.weight"] = state_dict[src + "mlp.down_proj.weight"]
            for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
                params[f"{dst}{name}_layernorm.weight"] = norm(f"{src}{name}_layernorm.weight")
        missing = set(self.state_dict()) - set(params)
        assert not missing, f"weights not provided: {sorted(missing)[:5]}"
        cast: dict[int, torch.Tensor] = {}  # tied weights stay one tensor
        self.load_state_dict({k: cast.setdefault(id(v), v.to(dtype)) for k, v in params.items()}, assign=True)
        self.embed_scale = torch.tensor(c.hidden_size**0.5).to(dtype=dtype, device=self.embed_tokens.weight.device)
        self._build_rope(state_dict.get("rope_freqs"), dtype)

    def _build_rope(self, rope_freqs: torch.Tensor | None, dtype: torch.dtype) -> None:
        super()._build_rope(rope_freqs, dtype)
        c = self.config
        local = dataclasses.replace(c, rope_theta=c.rope_local_theta or c.rope_theta, rope_scaling=None)
        self.rope_local_cos, self.rope_local_sin = self._rotary_tables(rope_inv_freq(local), dtype)
