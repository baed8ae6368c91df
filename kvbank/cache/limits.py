"""What long-context policies and the slot editor are checked against: the pool and the context."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """What a policy is checked against when a request is added."""

    block_size: int
    num_blocks: int
    max_model_len: int
    #: most tokens one step computes for a sequence (a prefill chunk)
    chunk_tokens: int
    #: the pool stores every layer dense in the model dtype
    dense_pool: bool
