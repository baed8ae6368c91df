"""The engine's running totals: tokens, prefix-cache queries and hits, finished requests, evictions."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbank.cache.policies import POLICIES
from kvbank.engine.sequence import Sequence


@dataclass
class EngineCounters:
    """Totals since the engine started; `as_dict` is what `LLMEngine.stats` reports of them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_requests: int = 0
    #: tokens each policy has evicted, by policy name
    evicted_tokens: dict[str, int] = field(default_factory=lambda: {n: 0 for n in POLICIES if n != "full"})

    def scheduled_first(self, seq: Sequence, prefix_caching: bool) -> None:
        """Count a request's prompt, and what the prefix cache gave it, at its first step."""
        self.prompt_tokens += seq.num_prompt_tokens
        if prefix_caching and not seq.no_prefix_cache:
            self.prefix_cache_queries += seq.num_prompt_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def as_dict(self) -> dict[str, float]:
        queries = self.prefix_cache_queries
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "finished_requests": self.finished_requests,
            "prefix_cache_hit_rate": self.prefix_cache_hits / queries if queries else 0.0,
            **{f"evicted_tokens_{name}": count for name, count in self.evicted_tokens.items()},
        }
