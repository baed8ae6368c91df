"""What long-context policies and the slot editor are checked against: the pool and the context."""

from __future__ import annotations

from dataclasses import dataclass

#: What a long-context policy or a stream may need done to a sequence's cache, and which KV
#: layouts can (`KVKind.edits` in cache/layers; a policy names its needs in `KVPolicy.needs`).
EDITS = {
    "rotate": "re-rotate the keys of whole blocks",
    "slots": "move single tokens of one layer and KV head",
    "tokens": "move tokens between blocks",
    "scores": "keep per-token attention scores",
    "gather": "read and write single tokens in the model dtype",
}
#: what per-token quantized layouts (int8, fp8) can do: every edit (gathered tokens are dequantized,
#: scattered ones quantized as a write would)
TOKEN_EDITS = frozenset(EDITS)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a policy is checked against when a request is added."""

    block_size: int
    num_blocks: int
    max_model_len: int
    #: most tokens one step computes for a sequence (a prefill chunk)
    chunk_tokens: int
    #: the edits of `EDITS` every layer of the pool can take
    kv_edits: frozenset[str]
    #: the pool's KV cache dtype, as configured (named in refusals)
    kv_cache_dtype: str = "auto"
