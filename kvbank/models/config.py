"""The shape of a decoder (the Llama family, Gemma 3), as read from a GGUF file or a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The shape of a decoder. The fields after `rope_scaling` describe Gemma 3's departures from
    Llama; their defaults are Llama's."""

    #: the architecture, a key of kvbank.models.archs.ARCHS
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict | None = None
    #: per layer: the number of latest positions (itself included) a token attends to; None: all
    layer_windows: tuple[int | None, ...] = ()
    #: the rotary base of windowed layers (None: `rope_theta`); they take no rope scaling
    rope_local_theta: float | None = None
    #: attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim)
    query_pre_attn_scalar: float | None = None
    #: logits = cap * tanh(logits / cap) when set
    final_logit_softcapping: float | None = None
    name: str = ""
    fingerprint: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        """How many latest positions a token attends to in `layer` (itself included); None: all."""
        return self.layer_windows[layer] if self.layer_windows else None
