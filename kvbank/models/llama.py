"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameters keep Hugging Face's names except that q/k/v and gate/up are fused into one matmul
each. The model sees a flat batch of new tokens; the KV cache and the attention metadata say
where each token's past lives.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvbank import kernels
from kvbank.attention import AttentionMetadata
from kvbank.attention.fast import DECODE_PARTITION
from kvbank.attention.rope import apply_rope
from kvbank.cache.layers.base import stack_step
from kvbank.models.config import ModelConfig
from kvbank.models.packed import Int4Blocks, Int8Blocks, PackedLinear
from kvbank.models.qweights import (
    KIND_Q8,
    QuantEmbedding,
    QuantHead,
    QuantLinear,
    SplitLinear,
    pack,
    pack_q8,
    packable,
)


class RMSNorm(nn.Module):
    #: kvbank's native module (kvbank/kernels) when the model runs its fused CPU ops, else None
    native = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == self.weight.dtype:
            # the native op: one pass per row (q/k norms run per head: rows of head_dim)
            rows = x.reshape(-1, x.shape[-1])
            return self.native.add_rms_norm(rows, None, self.weight, self.eps).view(x.shape)
        # One fused op; it accumulates in float32 for bfloat16 inputs.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm of x + residual, and that sum (the new residual); the first layer passes no residual.

        The native op adds into `residual` in place and norms in the same pass over the rows.
        """
        if self.native is not None:
            return self.native.add_rms_norm(x, residual, self.weight, self.eps), x if residual is None else residual
        if residual is not None:
            x = x + residual
        return self.forward(x), x


def padded_rows(n: int) -> int:
    """`n` rounded up to one of eight sizes per power of two (at most 12.5% more), n > 8 only.

    On CPU, bfloat16 matmuls go through oneDNN, which builds and caches (~0.5 MB) a kernel for
    every new row count it sees; a server sees every count up to its token budget. Padded, the
    counts up to 2,048 come from 47 sizes.
    """
    if n <= 8:
        return n
    step = max(8, 1 << ((n - 1).bit_length() - 4))
    return -(-n // step) * step


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary inverse frequencies, with linear or Llama-3 scaling when the model asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_freqs is not None:
        return inv_freq / rope_freqs.float()
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    native = None  # see RMSNorm.native

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """cos, sin: [rows, head_dim] rotary tables at the tokens' positions."""
        return self.o_proj(self.attend(self.rotated_qkv(x, cos, sin), kv_cache, meta))

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q, k and v rows [rows, q_size + 2 * kv_size] of `x`, q and k normed (if the model does) and rotated."""
        rows = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = (self.num_heads, self.num_kv_heads)
        if self.native is not None and self.q_norm is None:
            # Rotate q and k where the projection left them: no copies, one op.
            self.native.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads)
        elif self.native is not None:
            q, k, v = qkv.split(self.sizes, dim=-1)
            q = self.q_norm(q.view(rows, self.num_heads, self.head_dim)).view(rows, -1)
            k = self.k_norm(k.view(rows, self.num_kv_heads, self.head_dim)).view(rows, -1)
            qkv = torch.cat((q, k, v), dim=-1)
            self.native.rope_(qkv, cos, sin, self.num_heads + self.num_kv_heads)
        else:
            qk, v = qkv.split((self.sizes[0] + self.sizes[1], self.sizes[2]), dim=-1)
            qk = qk.view(rows, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = qk.split(heads, dim=1)
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
            qkv = torch.cat((apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1)).flatten(1), v), dim=-1)
        return qkv

    def attend(self, qkv: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output [rows, q_size] from rotated q/k/v rows: the new keys and values are
        written to the cache, the first T rows attend, rows past T (matmul padding) are zeros."""
        rows, T = qkv.shape[0], meta.slot_mapping.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)
        q, k = q.view(rows, self.num_heads, self.head_dim), k.view(rows, self.num_kv_heads, self.head_dim)
        q, k, v = q[:T], k[:T], v[:T].view(T, self.num_kv_heads, self.head_dim)
        written = kv_cache.write(k, v, meta)
        out = kv_cache.attend(q, written, meta, self.scale).view(T, -1)
        return out if rows == T else F.pad(out, (0, 0, 0, rows - T))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    native = None  # the native module when the whole layer runs on integer kernels

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (None in the first layer).

        Returns this layer's output and the residual stream it was added to; the norms do the adds.
        """
        qkv, residual = self.attn_in(x, residual, cos, sin)
        return self.attn_out(self.self_attn.attend(qkv, kv_cache, meta), residual)

    def _integer(self, rows: int) -> bool:
        return self.native is not None and self.self_attn.qkv_proj.integer_path(rows)

    def attn_in(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to attention: the residual add and norm, q/k/v projected and rotated (on
        integer kernels: one native call). Returns the q/k/v rows and the residual stream."""
        attn = self.self_attn
        if self._integer(x.shape[0]):
            qkv = self.native.qlayer_attn_in(
                x,
                residual,
                self.input_layernorm.weight,
                self.input_layernorm.eps,
                *attn.qkv_proj.segments(),
                cos,
                sin,
                attn.num_heads + attn.num_kv_heads,
            )
            return qkv, (x if residual is None else residual)
        h, residual = self.input_layernorm.add_forward(x, residual)
        return attn.rotated_qkv(h, cos, sin), residual

    def attn_out(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention: the output projection, the residual add and norm, the MLP (on
        integer kernels: one native call). Returns the layer's output and the residual stream."""
        attn, mlp = self.self_attn, self.mlp
        if self._integer(attended.shape[0]):
            out = self.native.qlayer_mlp(
                attended,
                residual,
                *attn.o_proj.segments(),
                self.post_attention_layernorm.weight,
                self.post_attention_layernorm.eps,
                *mlp.gate_up_proj.segments(),
                *mlp.down_proj.segments(),
            )
            return out, residual
        h, residual = self.post_attention_layernorm.add_forward(attn.o_proj(attended), residual)
        return mlp(h), residual

    def use_integer_kernels(self, native) -> bool:
        """Run the whole layer on native integer kernels when all its projections are packed
        records without biases (and no q/k norms); returns whether it does."""
        attn = self.self_attn
        linears = (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        fusable = (
            all(isinstance(m, (QuantLinear, SplitLinear)) and m.bias is None for m in linears)
            and attn.q_norm is None
            and len({m.max_rows for m in linears}) == 1
        )
        self.native = native if fusable else None
        return fusable


def group_blocks(
    int4: list[Int4Blocks | None], int8: list[Int8Blocks | None], native
) -> Int4Blocks | Int8Blocks | None:
    """One block form for the tensors fused into one projection (q/k/v, gate/up), or None when they
    have none in common (they then run split, see split_linear, or dense).

    Tensors with minimums (Int4Blocks) stay so; with the native kernels, a group whose tensors all
    fit 8 bits (Q8_0, Q5_0, Q6_K, and symmetric Q4_0) becomes 8-bit. Without them only Q4_0 / Q4_1
    run packed (torch's int4 matmul holds scales in the model dtype; K-quants need float32).
    """
    if all(part is not None for part in int4):
        blocks = Int4Blocks.cat(int4)
        return blocks if native is not None or not blocks.wide else None
    if native is None:
        return None
    parts = [eight if eight is not None else four and four.as_int8() for four, eight in zip(int4, int8)]
    return Int8Blocks.cat(parts) if all(part is not None for part in parts) else None


def split_linear(
    dense: nn.Linear, int4: list[Int4Blocks | None], int8: list[Int8Blocks | None], native, max_rows: int | None
) -> SplitLinear | None:
    """The fused projection `dense` as one integer-kernel linear per tensor, when every tensor has
    blocks and records of its own but they share no form (see group_blocks); else None (dense)."""
    parts = [four if four is not None else eight for four, eight in zip(int4, int8)]
    if native is None or dense.bias is not None or any(p is None for p in parts):
        return None
    if not all(packable(*p.q.shape) for p in parts):
        return None
    linears, row = [], 0
    for part in parts:
        rows = part.q.shape[0]
        linear = QuantLinear(dense.weight[row : row + rows], None, *pack(part), max_rows)
        linear.native = native
        linears.append(linear)
        row += rows
    return SplitLinear(linears)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer: embed, N layers of attention + gated MLP, final norm, LM head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # An explicit weight skips the random init: under the meta device that init goes through
        # torch._refs, whose first use imports torch._dynamo (seconds at every start).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        #: pad matmul rows to a few sizes (see padded_rows); set where the matmul library needs it
        self.pad_rows = False
        #: the native decoder stack (built on first use) when every layer runs on integer kernels
        self._native_stack = None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's input rows (padded to a matmul size) and their positions; `embeds` = (rows,
        values) replaces those rows' token embeddings."""
        T = input_ids.shape[0]
        rows = self._rows(T)
        if rows > T:
            input_ids, positions = F.pad(input_ids, (0, rows - T)), F.pad(positions, (0, rows - T))
        x = self._token_rows(input_ids)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        return x, positions

    def _token_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input rows of token ids (a model that scales its embeddings overrides this)."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens (before the final norm); `embeds` = (rows,
        values) replaces those rows' token embeddings (a prompt or frame given as embeddings)."""
        T = input_ids.shape[0]
        x, positions = self.embed(input_ids, positions, embeds)
        rows = x.shape[0]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        step = self._stack_attention(rows, kv_caches, meta)
        if step is not None:
            return self._stack().forward(x=x, cos=cos, sin=sin, step=step)[:T]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return (x + residual)[:T]

    @torch.inference_mode()
    def mean_queries(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The mean query of `input_ids` computed alone (causal, no cache), per layer and KV head
        (the mean over the heads that share it), before rotation: [layers, kv_heads, head_dim]."""
        n = input_ids.shape[0]
        positions = torch.arange(n, device=input_ids.device)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        x, means = self.embed_tokens(input_ids), []
        for layer in self.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.qkv_proj(h).split(attn.sizes, dim=-1)
            q, k = q.view(n, attn.num_heads, attn.head_dim), k.view(n, attn.num_kv_heads, attn.head_dim)
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            group = attn.num_heads // attn.num_kv_heads
            means.append(q.float().mean(dim=0).view(attn.num_kv_heads, group, attn.head_dim).mean(dim=1))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.view(n, attn.num_kv_heads, attn.head_dim)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=attn.scale
            )
            x = x + attn.o_proj(out.transpose(0, 1).reshape(n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return torch.stack(means)

    def _stack_attention(self, rows: int, kv_caches: list, meta: AttentionMetadata):
        """The step as the native stack takes it (a StackStep: the layers' caches and the rows'
        attention) when this step can run as one native call over every layer: all layers on integer
        kernels for this many rows, caches attended by rows (bfloat16, or int8/fp8/int4/int2 read in
        place), one format for every layer, no scores; else None."""
        first = self.layers[0]
        if first.native is None or not first.self_attn.qkv_proj.integer_path(rows):
            return None
        if not all(layer.native is not None for layer in self.layers):
            return None
        if len({c.kind for c in kv_caches}) != 1:
            return None
        rows_attention = kv_caches[0].row_attention(meta)
        step = stack_step(kv_caches)
        if rows_attention is None or step is None:
            return None  # one cache format, and one the stack takes, for every layer
        for field, value in rows_attention.items():
            setattr(step, field, value)
        step.slot_mapping = meta.slot_mapping
        step.scale = first.self_attn.scale
        step.partition = DECODE_PARTITION
        return step

    #: the native stack's layer form: Llama's, or Gemma's (six norms, GeGLU)
    stack_form: Literal["llama", "gemma"] = "llama"

    def _stack_norms(self, layer) -> list[torch.Tensor]:
        """A layer's norm weights in the order the native stack takes them."""
        return [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]

    def _stack(self):
        if self._native_stack is None:
            weights, kinds, norms = [], [], []
            for layer in self.layers:
                for linear in (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                ):
                    records, kind = linear.segments()
                    weights.append(records)
                    kinds.append(kind)
                norms += self._stack_norms(layer)
            c = self.config
            self._native_stack = kernels.native().QuantStack(
                weights,
                kinds,
                norms,
                c.rms_norm_eps,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                gemma=self.stack_form == "gemma",
            )
        return self._native_stack

    def varies_with_batch(self) -> str | None:
        """Why a row's logits may depend on the other rows of its step, or None when they cannot:
        every projection and the LM head run on the integer kernels for steps of any size, each row's
        arithmetic its own (qweights.py)."""
        if not isinstance(self.lm_head, QuantHead):
            return "the LM head is a dense matmul"
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not isinstance(linear, (QuantLinear, SplitLinear)) or linear.max_rows is not None:
                    return f"layer {i}'s projections are not all on the integer kernels for every step"
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of hidden states."""
        if isinstance(self.lm_head, QuantHead):
            return self.lm_head.logits(hidden, self.norm.weight, self.norm.eps)
        hidden = self.norm(hidden)
        if hidden.shape[0] == 1 and hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu":
            # For one row, the matrix-vector kernel reads the bfloat16 head twice as fast as linear.
            return torch.mv(self.lm_head.weight, hidden[0]).float().unsqueeze(0)
        n = hidden.shape[0]
        rows = self._rows(n)
        if rows > n:
            hidden = F.pad(hidden, (0, 0, 0, rows - n))
        return self.lm_head(hidden)[:n].float()

    def _rows(self, n: int) -> int:
        return padded_rows(n) if self.pad_rows else n

    def use_native(self, module) -> None:
        """Run the norms and rotary embedding through kvbank's fused CPU ops (None: PyTorch's)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention)):
                m.native = module

    def load_weights(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Take Hugging Face-named float32 weights, fuse them, and cast to `dtype`."""
        c = self.config
        params = {
            "embed_tokens.weight": state_dict["model.embed_tokens.weight"],
            "norm.weight": state_dict["model.norm.weight"],
            "lm_head.weight": state_dict["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"],
        }
        for i in range(c.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            params[dst + "self_attn.qkv_proj.weight"] = torch.cat([state_dict[f"{attn}{p}_proj.weight"] for p in "qkv"])
            if c.attention_bias:
                params[dst + "self_attn.qkv_proj.bias"] = torch.cat([state_dict[f"{attn}{p}_proj.bias"] for p in "qkv"])
            params[dst + "self_attn.o_proj.weight"] = state_dict[attn + "o_proj.weight"]
            if c.qk_norm:
                params[dst + "self_attn.q_norm.weight"] = state_dict[attn + "q_norm.weight"]
                params[dst + "self_attn.k_norm.weight"] = state_dict[attn + "k_norm.weight"]
            params[dst + "mlp.gate_up_proj.weight"] = torch.cat(
                [state_dict[src + "mlp.gate_proj.weight"], state_dict[src + "mlp.up_proj.weight"]]
            )
            params[dst + "mlp.down_proj.weight"] = state_dict[src + "mlp.down_proj.weight"]
            params[dst + "input_layernorm.weight"] = state_dict[src + "input_layernorm.weight"]
            params[dst + "post_attention_layernorm.weight"] = state_dict[src + "post_attention_layernorm.weight"]
        missing = set(self.state_dict()) - set(params)
        assert not missing, f"weights not provided: {sorted(missing)[:5]}"
        cast: dict[int, torch.Tensor] = {}  # tied weights stay one tensor
        self.load_state_dict({k: cast.setdefault(id(v), v.to(dtype)) for k, v in params.items()}, assign=True)
        self._build_rope(state_dict.get("rope_freqs"), dtype)

    def pack_weights(
        self,
        int4: dict[str, Int4Blocks],
        max_rows: int | None,
        int8: dict[str, Int8Blocks] | None = None,
        native=None,
    ) -> int:
        """Give every projection whose GGUF weights are all 4-bit a packed path; returns how many.

        With `native` (kvbank's native module, whose integer kernels this CPU runs) projections get
        integer kernels on GGUF records, whole layers run in native calls, and a Q8_0 embedding
        table becomes the embedding and the LM head; without it, projections get torch's int4
        matmul. The packed path serves steps of at most `max_rows` tokens, or every step for None:
        a row's result then never depends on how many rows share its step.
        """
        packed = 0
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            groups = {
                (layer.self_attn, "qkv_proj"): ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                (layer.self_attn, "o_proj"): ["self_attn.o_proj"],
                (layer.mlp, "gate_up_proj"): ["mlp.gate_proj", "mlp.up_proj"],
                (layer.mlp, "down_proj"): ["mlp.down_proj"],
            }
            for (module, attr), names in groups.items():
                keys = [f"{prefix}{name}.weight" for name in names]
                parts4, parts8 = [int4.get(k) for k in keys], [(int8 or {}).get(k) for k in keys]
                blocks = group_blocks(parts4, parts8, native)
                dense = getattr(module, attr)
                if blocks is None:
                    linear = split_linear(dense, parts4, parts8, native, max_rows)
                    if linear is None:
                        continue
                elif native is not None and packable(*dense.weight.shape):
                    linear = QuantLinear(dense.weight, dense.bias, *pack(blocks), max_rows)
                    linear.native = native
                else:
                    linear = PackedLinear(dense.weight, dense.bias, blocks, max_rows)
                setattr(module, attr, linear)
                packed += 1
            if native is not None:
                layer.use_integer_kernels(native)
        if native is not None:
            self._pack_embeddings(int8 or {}, native, int4)
        return packed

    def _pack_embeddings(self, int8: dict[str, Int8Blocks], native, int4: dict[str, Int4Blocks]) -> None:
        """A Q8_0 embedding table read as it is stored, by the lookup and, when tied, the LM head; an
        untied head of any type with a kernel, in its own records."""
        c = self.config
        dtype = self.embed_tokens.weight.dtype
        table = int8.get("model.embed_tokens.weight")
        if table is not None and packable(*table.q.shape):
            records = pack_q8(table)
            self.embed_tokens = QuantEmbedding(records, c.vocab_size, dtype)
            self.embed_tokens.native = native
            if c.tie_word_embeddings:
                self.lm_head = QuantHead(records, KIND_Q8, c.vocab_size)
                self.lm_head.native = native
        head = int8.get("lm_head.weight") or int4.get("lm_head.weight")
        if not c.tie_word_embeddings and head is not None and packable(*head.q.shape):
            self.lm_head = QuantHead(*pack(head), c.vocab_size)
            self.lm_head.native = native

    def _build_rope(self, rope_freqs: torch.Tensor | None, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.config, rope_freqs)
        #: what re-rotating cached keys by a position delta needs (cache/editor.py)
        self.rope_inv_freq = inv_freq
        self.rope_cos, self.rope_sin = self._rotary_tables(inv_freq, dtype)

    def _rotary_tables(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        device = self.embed_tokens.weight.device
        sin = emb.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        return emb.cos().to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)
