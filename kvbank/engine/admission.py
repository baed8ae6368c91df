"""Admission: every check a request, a stream's frame or a stream's question passes before it is
queued, in one place, and the records (requests, sequences) it becomes.

A check here raises ValueError naming the value and the limit for anything that could never run,
and `PoolFull` for a stream's work the pool cannot hold now (streams are never preempted).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable

import torch

from kvbank.cache.editor import ScoreState
from kvbank.cache.frames import frame_digest
from kvbank.cache.limits import Limits
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.policies import Full, KVPolicy
from kvbank.cache.prefix import root_hash
from kvbank.config import EngineConfig
from kvbank.engine.blend_plan import BlendPlan, document_lead, document_root, separator_segments
from kvbank.engine.params import SamplingParams
from kvbank.engine.prompts import ParsedPrompt, PromptType, parse_prompt
from kvbank.engine.scheduler import Scheduler
from kvbank.engine.sequence import Request, Sequence
from kvbank.engine.streams import PoolFull
from kvbank.models.config import ModelConfig
from kvbank.tokenizer import IncrementalDetokenizer, Tokenizer


class Admission:
    """Parses prompts, checks requests against the model, the pool and the context, and builds
    the sequences that run them."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        manager: KVCacheManager,
        scheduler: Scheduler,
        limits: Limits,
        kv_policy: KVPolicy,
        namespace: bytes,
        device: torch.device,
        in_use: Callable[[str], bool],
        blend_refusal: str | None = None,
    ) -> None:
        self.config = config
        self.limits = limits
        #: the engine's policy, for requests that name none
        self.kv_policy = kv_policy
        self.namespace = namespace
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.manager = manager
        self.scheduler = scheduler
        self.device = device
        self.max_model_len = model_config.max_position_embeddings
        self.block_size = config.block_size
        self._in_use = in_use
        #: why this engine cannot blend documents (None: it can)
        self.blend_refusal = blend_refusal
        self._ids = itertools.count()

    # --- ids and prompts ----------------------------------------------------------------------

    def request_id(self, request_id: str | None) -> str:
        """`request_id`, or a fresh one; ValueError if a request or frame in flight has it."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self._in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def stream_id(self, stream_id: str | None, open_streams: dict) -> str:
        """`stream_id`, or a fresh one; ValueError if it is empty or an open stream has it."""
        stream_id = stream_id if stream_id is not None else f"stream-{next(self._ids)}"
        if not isinstance(stream_id, str) or not stream_id:
            raise ValueError(f"stream_id={stream_id!r} must be a non-empty string")
        if stream_id in open_streams:
            raise ValueError(f"stream_id {stream_id!r} is already in use")
        return stream_id

    def parse(self, prompt: PromptType, embeds: bool = False, tenant: bool = False) -> ParsedPrompt:
        """A prompt as token ids (and embedding rows where `embeds` allows them, a "tenant" where
        `tenant` does), checked against the model."""
        hidden = self.model_config.hidden_size if embeds else None
        return parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, hidden, tenant)

    def continuation(self, shown: str, text: str) -> PromptType:
        """`text` as a prompt tokenized without special tokens added (a stream's frames and questions
        continue it; a rendered template has its own BOS), shown as `shown`."""
        if self.tokenizer is None:
            return text  # refused by the parser with its usual message
        return {"prompt": shown, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def prefix_key(self, prompt: PromptType) -> tuple[list[int], bytes]:
        """(token ids, chain root) of a prefix to pin or unpin."""
        if not self.config.enable_prefix_caching:
            raise ValueError("pinning needs enable_prefix_caching=True")
        parsed = self.parse(prompt)
        return parsed.token_ids, root_hash(self.namespace, parsed.salt)

    # --- requests -----------------------------------------------------------------------------

    def check_policy(self, policy: KVPolicy) -> None:
        """Refuse a long-context policy this pool or this model cannot run (ValueError naming it)."""
        if not isinstance(policy, Full) and any(self.model_config.layer_windows):
            raise ValueError(
                f"kv_policy={policy} is not supported for {self.model_config.arch}: its sliding-window layers "
                "need every token at its own slot"
            )
        policy.check(self.limits)

    def request(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None, arrival_time: float | None
    ) -> Request:
        """A checked request with its first sequence (`seqs[0]`), ready to queue."""
        request_id = self.request_id(request_id)
        parsed = self.parse(prompt, embeds=True, tenant=True)
        segments = self._separated(prompt, parsed)
        if segments is not None:
            parsed = self.parse({**_salt_and_tenant(prompt), "segments": segments}, tenant=True)
        namespace = self.namespace
        if parsed.embeds is not None:
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be given for prompt_embeds: the prompt has no token ids")
            # Placeholder ids say nothing of the rows: the chain starts from their content instead.
            namespace += b"|embeds|" + frame_digest([], parsed.embeds)
        root, policy, prompt_len = (
            root_hash(namespace, parsed.salt),
            params.kv_policy or self.kv_policy,
            len(parsed.token_ids),
        )
        if policy is not self.kv_policy:
            self.check_policy(policy)
        params = self.resolve_max_tokens(params, parsed.token_ids, root, policy)
        self.check_sampling(params)
        peak = None if isinstance(policy, Full) else policy.peak_slots(prompt_len, params.max_tokens, self.limits)
        arrival = arrival_time or time.time()
        request = Request(request_id, parsed.text, parsed.token_ids, params, root, arrival, policy, peak)
        request.prefix_limit = policy.prefix_limit(prompt_len, self.limits)
        request.blend = self.blend_plan(parsed, params, policy)
        request.tenant = parsed.tenant
        request.prompt_embeds = parsed.embeds
        request.embedded_spans = [(0, prompt_len)] if parsed.embeds is not None else []
        first = self.sequence(request, 0, parsed.token_ids)
        first.kv_state = self.score_state(policy, prompt_len + params.max_tokens)
        request.seqs.append(first)
        return request

    # --- blending (engine/blend.py) -------------------------------------------------------------

    def _separated(self, prompt: PromptType, parsed: ParsedPrompt) -> list | None:
        """A text prompt cut into segments at the engine's `blend_separator`, if it holds it."""
        separator = self.config.blend_separator
        given_as_text = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
        if separator is None or parsed.text is None or not given_as_text:
            return None
        return separator_segments(parsed.text, separator)

    def blend_plan(self, parsed: ParsedPrompt, params: SamplingParams, policy: KVPolicy) -> BlendPlan | None:
        """How the request blends its documents; None when it marks none or recomputes every token.
        ValueError for what blending cannot run with."""
        if not parsed.documents:
            return None
        ratio = self.config.blend_recompute_ratio if parsed.blend_ratio is None else parsed.blend_ratio
        if ratio >= 1.0:
            return None  # the full prefill, exactly
        if self.blend_refusal is not None:
            raise ValueError(f"documents cannot be blended here: {self.blend_refusal}")
        if not isinstance(policy, Full):
            raise ValueError(f"kv_policy={policy} cannot run with documents: blending needs every token at its slot")
        root = document_root(self.namespace, parsed.salt)
        return BlendPlan(parsed.documents, ratio, root, self.model_config.num_layers, document_lead(self.tokenizer))

    # --- checks -------------------------------------------------------------------------------

    def check_sampling(self, params: SamplingParams) -> None:
        """What every request's sampling parameters must satisfy in this engine."""
        params.check_token_ids(self.model_config.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} is more sequences than max_num_seqs={self.config.max_num_seqs} runs at once"
            )

    def resolve_max_tokens(
        self, params: SamplingParams, token_ids: list[int], root: bytes, policy: KVPolicy
    ) -> SamplingParams:
        """`params` with max_tokens set (the context's room when unset); ValueError if the prompt and
        its output could never fit the context or the pool."""
        prompt_len, limit = len(token_ids), self.max_model_len
        if policy.unbounded:
            # Positions are assigned in the cache, so neither the prompt nor the output is capped by
            # the context; an unset max_tokens means one context's worth of output.
            if params.max_tokens is None:
                params = dataclasses.replace(params, max_tokens=limit)
        else:
            hint = "; a kv_policy such as sink_window runs past it" if isinstance(policy, Full) else ""
            if prompt_len >= limit:
                raise ValueError(
                    f"prompt has {prompt_len} tokens; max_model_len={limit} leaves no room to generate{hint}"
                )
            if params.max_tokens is None:
                params = dataclasses.replace(params, max_tokens=limit - prompt_len)
            if prompt_len + params.max_tokens > limit:
                raise ValueError(
                    f"prompt has {prompt_len} tokens and max_tokens={params.max_tokens}: "
                    f"{prompt_len + params.max_tokens} exceeds max_model_len={limit}{hint}"
                )
        peak = policy.peak_slots(prompt_len, params.max_tokens, self.limits)
        needed = blocks_for(peak, self.block_size) + policy.pristine_blocks(self.block_size)
        groups = self.manager.groups
        if groups is not None:  # and its window tables at their fullest: a prefill chunk and its window
            widest = groups.chunk_blocks(self.limits.chunk_tokens, self.block_size)
            needed += groups.num_window_tables * min(blocks_for(peak, self.block_size), widest)
        num_blocks = self.limits.num_blocks
        if needed > num_blocks:
            held = "" if isinstance(policy, Full) else f" (kv_policy={policy} holds up to {peak} tokens)"
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens={params.max_tokens} needs {needed} KV blocks{held} "
                f"but the pool has only {num_blocks}"
            )
        usable = self.manager.usable_blocks(token_ids, root)
        if needed > usable:
            pinned = len(self.manager.pinned_blocks)
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens={params.max_tokens} needs {needed} KV blocks "
                f"but only {usable} of the pool's {num_blocks} can hold it: {pinned} are pinned "
                "(unpin a prefix or lower max_tokens)"
            )
        return params

    def ensure_room(self, blocks: int, what: str, held_back: int = 0) -> None:
        """Refuse (PoolFull) work of streams, which is never preempted, that the pool could not hold
        even by preempting every other sequence: it would wait forever. `held_back` blocks are
        promised to other streams (their reservations) and count as taken."""
        running = self.scheduler.running
        available = self.manager.num_free_blocks + sum(len(s.block_table) for s in running if s.preemptible)
        available -= held_back
        if blocks > available:
            promised = f", {held_back} are reserved by other streams" if held_back else ""
            raise PoolFull(
                f"{what} needs {blocks} more KV blocks, but only {max(available, 0)} of the pool's "
                f"{self.limits.num_blocks} can be freed for it (streams and their questions hold the "
                f"rest and are never preempted{promised}): close a stream or retry once questions finish"
            )

    def in_flight_blocks(self, requests) -> int:
        """The most blocks one of `requests` may still need: what pinning must leave unpinned."""
        return max(
            (blocks_for(len(r.prompt_token_ids) + r.params.max_tokens, self.block_size) for r in requests), default=0
        )

    # --- records ------------------------------------------------------------------------------

    def sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        """A sequence of `request` with its own seeded generator and detokenizer."""
        seq = Sequence(request, index, token_ids, self.generator(request.params, index))
        self.attach_detokenizer(seq)
        return seq

    def generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """The generator of completion `index` of a seeded request (None: the engine's own)."""
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed((params.seed * 1_000_003 + index) % 2**64)

    def attach_detokenizer(self, seq: Sequence) -> None:
        """Give `seq` an incremental detokenizer over its prompt (none without a tokenizer)."""
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.request.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
            )

    def score_state(self, policy: KVPolicy, capacity: int) -> ScoreState | None:
        """Empty score buffers for a policy that ranks tokens, for up to `capacity` tokens."""
        if not policy.scored:
            return None
        c = self.model_config
        return ScoreState.empty(c.num_layers, c.num_kv_heads, capacity, self.device)


def _salt_and_tenant(prompt: PromptType) -> dict:
    """What a prompt dict says besides its tokens (cache_salt, tenant)."""
    return {k: v for k, v in prompt.items() if k in ("cache_salt", "tenant")} if isinstance(prompt, dict) else {}
