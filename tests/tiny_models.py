"""Small model configurations for the tests, in one place; each constructor takes keyword overrides,
so a test states only what it changes.

kvbank's own `ModelConfig` (for storage, planning and runner tests that never load weights):

- `smollm2_135m()`: the shape of the bundled SmolLM2-135M, for sizes that must match the real model;
- `tiny_config()`: four small layers, for fast unit tests of the KV pool.

transformers configurations (for random checkpoints built with `from_config`; transformers is
imported only when one is asked for, so the modules that need none do not need it installed):

- `tiny_hf_config(config_cls)` / `tiny_llama_config()`: a tiny decoder of any Llama-family class;
- `smollm2_135m_hf()`: the bundled model's shape as a `transformers.LlamaConfig`.
"""

from __future__ import annotations

from kvbank.models.config import ModelConfig

# --- kvbank ModelConfig -------------------------------------------------------------------------------

# SmolLM2-135M, as kvbank reads the bundled GGUF: 30 layers of 9 query heads over 3 KV heads of 64 dims,
# a hidden size of 576 and a 49,152-token vocabulary whose embedding table is tied to the LM head.
_SMOLLM2_135M = dict(
    arch="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)

# Four layers of 4 query heads over 2 KV heads of 64 dims (64 so that every KV format's group size
# divides it), and everything a KV pool does not read as small as it goes.
_TINY = dict(
    arch="llama",
    vocab_size=10,
    intermediate_size=8,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def smollm2_135m(**overrides) -> ModelConfig:
    """kvbank's `ModelConfig` of the bundled SmolLM2-135M (30 layers, 9 heads over 3 KV heads of 64 dims)."""
    return ModelConfig(**{**_SMOLLM2_135M, **overrides})


def tiny_config(**overrides) -> ModelConfig:
    """A tiny kvbank `ModelConfig`: 4 layers of 4 heads over 2 KV heads of 64 dims, vocabulary 10.

    The hidden size is `num_heads * head_dim` unless given, so overriding either keeps it consistent."""
    config = {**_TINY, **overrides}
    config.setdefault("hidden_size", config["num_heads"] * config["head_dim"])
    return ModelConfig(**config)


# --- transformers configurations ----------------------------------------------------------------------

#: The tiny transformers decoder: a 256-token vocabulary, 2 layers of 4 query heads over 2 KV heads of 16 dims.
TINY_VOCAB, TINY_LAYERS, TINY_HEADS, TINY_KV_HEADS, TINY_HEAD_DIM = 256, 2, 4, 2, 16

_TINY_HF = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=TINY_HEADS * TINY_HEAD_DIM,
    intermediate_size=128,
    num_hidden_layers=TINY_LAYERS,
    num_attention_heads=TINY_HEADS,
    num_key_value_heads=TINY_KV_HEADS,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_hf_config(config_cls, **overrides):
    """A tiny `config_cls` (transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config...):
    `TINY_LAYERS` layers of `TINY_HEADS` heads over `TINY_KV_HEADS` KV heads of `TINY_HEAD_DIM` dims,
    an intermediate size of 128, `TINY_VOCAB` tokens, 512 positions, untied embeddings."""
    return config_cls(**{**_TINY_HF, **overrides})


def tiny_llama_config(**overrides):
    """`tiny_hf_config` of a `transformers.LlamaConfig`."""
    import transformers

    return tiny_hf_config(transformers.LlamaConfig, **overrides)


def smollm2_135m_hf(**overrides):
    """The bundled SmolLM2-135M's shape (`smollm2_135m`) as a `transformers.LlamaConfig`."""
    import transformers

    shape = smollm2_135m()
    return transformers.LlamaConfig(
        **{
            "vocab_size": shape.vocab_size,
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "rms_norm_eps": shape.rms_norm_eps,
            "rope_theta": shape.rope_theta,
            "max_position_embeddings": shape.max_position_embeddings,
            "tie_word_embeddings": shape.tie_word_embeddings,
            **overrides,
        }
    )
