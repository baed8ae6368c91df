"""Requests and the sequences they run as (one per completion when n > 1)."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from kvbank.cache.policies import Full, KVPolicy
from kvbank.engine.outputs import CompletionOutput, Reports, RequestMetrics, RequestOutputKind, TokenLogprobs
from kvbank.engine.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvbank.cache.editor import ScoreState
    from kvbank.cache.frames import FrameLog
    from kvbank.engine.blend_plan import BlendPlan

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    #: a stream's sequence between frames: it holds its blocks but is not scheduled
    PARKED = "parked"
    FINISHED = "finished"


class Sequence:
    """One token stream with its block table; the unit the scheduler and cache manager see."""

    def __init__(self, request: Request, index: int, token_ids: list[int], generator: torch.Generator | None) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.chain_serials: list[int | None] = []
        self.held_blocks: list[int] = []
        # Window tables of a hybrid layout (kvbank/cache/hybrid.py), kept by the cache manager.
        self.window_tables: list[list[int]] = []
        self.window_first = 0
        self.window_committed = 0
        # Long-context policies (kvbank/cache/policies/): tokens gone from the cache, the RoPE
        # position of slot 0, unrotated copies of the kept leading blocks, and score buffers.
        self.num_evicted = 0
        self.rope_offset = 0
        self.pristine_blocks: list[int] = []
        self.kv_state: ScoreState | None = None
        #: slots before token 0 in the first block (a stream after evictions, cache/frames.py);
        #: attention starts each of the sequence's rows there
        self.lead = 0
        #: a streaming session's frames (engine/streams.py); its sequence never samples
        self.frames: FrameLog | None = None
        #: tokens up to which the next step may compute (None: all): a stream's frames that fit
        #: beside the ones it holds (StreamHost.fit)
        self.compute_limit: int | None = None
        #: a tier load is under way; the scheduler admits the sequence once it lands or times out
        self.loading = False
        #: documents of a blended prompt loaded from a tier, each holding its blocks until placed
        self.document_holds: list[Sequence] = []
        #: it waited for a running prefill to cache prompt blocks it shares (Scheduler)
        self.waited_for_prefix = False
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.logprobs: list[TokenLogprobs] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.text = ""
        self.detokenizer = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # What `delta_completion` has handed out: output tokens and characters of settled text.
        self.num_sent_tokens = 0
        self.num_sent_chars = 0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def root_hash(self) -> bytes:
        return self.request.root_hash

    @property
    def no_prefix_cache(self) -> bool:
        return self.request.no_prefix_cache

    @property
    def kv_policy(self) -> KVPolicy:
        return self.request.kv_policy

    @property
    def max_slots(self) -> int | None:
        """Most cache slots the sequence holds at once (None: one per token)."""
        return self.request.peak_slots

    @property
    def prefix_limit(self) -> int:
        """Leading tokens that may come from the prefix cache instead of being computed."""
        return self.request.prefix_limit

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seen_token_ids(self) -> list[int]:
        """Token ids a repetition penalty counts: all but the placeholders of embedding rows."""
        if not self.request.embedded_spans:
            return self.token_ids
        seen, start = [], 0
        for first, end in self.request.embedded_spans:
            seen += self.token_ids[start:first]
            start = end
        return seen + self.token_ids[start:]

    @property
    def num_cacheable_tokens(self) -> int:
        """Computed tokens the prefix index may list: a stream's system prompt, never its frames."""
        if self.frames is not None:
            return min(self.num_computed_tokens, self.frames.system_len)
        if self.request.blend is not None:  # blended blocks hold approximate K/V: only what precedes them
            return min(self.num_computed_tokens, self.request.blend.documents[0].start)
        return self.num_computed_tokens

    @property
    def preemptible(self) -> bool:
        """A stream's sequence and the questions forked from it cannot be recomputed from their tokens."""
        return self.request.stream_id is None

    def input_embeds(self, start: int, count: int) -> list[tuple[int, torch.Tensor]]:
        """(row offset, rows) of given embeddings among tokens [start, start + count)."""
        if self.frames is not None:
            return self.frames.input_embeds(start, count)
        embeds = self.request.prompt_embeds
        if embeds is None or start >= embeds.shape[0]:
            return []
        return [(0, embeds[start : min(start + count, embeds.shape[0])])]

    @property
    def num_slots(self) -> int:
        """Cache slots up to the end of this sequence's computed tokens (fewer than them after
        evictions of leading blocks; `lead` more after a stream's frames left)."""
        return self.num_computed_tokens - self.num_evicted + self.lead

    @property
    def num_pending(self) -> int:
        """Tokens not yet computed."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_schedulable(self) -> int:
        """Tokens the next step may compute: the pending ones, up to `compute_limit`."""
        end = len(self.token_ids) if self.compute_limit is None else min(len(self.token_ids), self.compute_limit)
        if self.blending:
            end = self._blend_end  # the blend, in one step; what follows the documents as usual
        return max(0, end - self.num_computed_tokens)

    @property
    def _blend_end(self) -> int:
        return min(self.request.blend.end, self.num_prompt_tokens - 1)

    @property
    def blend(self) -> BlendPlan | None:
        return self.request.blend

    @property
    def blending(self) -> bool:
        """Whether the next step blends the prompt's documents (engine/blend.py): the tokens up to the
        end of the last document (and never the prompt's last token, whose logits are sampled)."""
        return self.request.blend is not None and self.num_computed_tokens < self._blend_end

    def reset_cache(self) -> None:
        """Forget every computed token (after the blocks are freed): the sequence is recomputed."""
        self.num_computed_tokens = 0
        self.chain_serials = []
        self.num_evicted = 0
        self.rope_offset = 0
        if self.kv_state is not None:
            self.kv_state = self.kv_state.cleared()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        return self.request.params.priority, self.request.arrival_index, self.index

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        """A sibling at the same point; the caller shares the blocks through the cache manager."""
        child = Sequence(self.request, index, self.token_ids, generator)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.chain_serials = list(self.chain_serials)
        child.num_evicted, child.rope_offset = self.num_evicted, self.rope_offset
        child.lead = self.lead
        child.kv_state = self.kv_state.clone() if self.kv_state is not None else None
        child.status = self.status
        return child

    def check_stop(
        self, token: int, new_len: int, eos_token_ids: frozenset[int], max_model_len: int | None
    ) -> tuple[str, int | str | None] | None:
        """(finish reason, stop reason) once `token`, just appended with `new_len` new characters, ends
        the sequence; None while it goes on. A matched stop string is cut from the text here."""
        params = self.params
        if self.num_output_tokens > params.min_tokens:
            if token in params.stop_token_set:
                return "stop", token
            if not params.ignore_eos and token in eos_token_ids:
                return "stop", None
            for stop in params.stop_strings:
                index = self.text.find(stop, max(0, len(self.text) - new_len - len(stop) + 1))
                if index >= 0:
                    self.text = self.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                    return "stop", stop
        if self.num_output_tokens >= params.max_tokens:
            return "length", None
        if max_model_len is not None and self.num_tokens >= max_model_len:
            return "length", None
        return None

    def settled_text(self) -> str:
        """The text later steps can no longer change.

        A stop string is cut out only once it is complete, so while the sequence runs, the last
        characters (which could begin one) are held back; streams therefore never shrink.
        """
        stops = self.params.stop_strings
        if self.is_finished or not stops:
            return self.text
        return self.text[: max(0, len(self.text) - max(map(len, stops)) + 1)]

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.settled_text(),
            token_ids=self.output_token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta_completion(self) -> CompletionOutput:
        """What is new since the previous call: tokens, their logprobs and settled text."""
        text, start = self.settled_text(), self.num_sent_tokens
        delta = CompletionOutput(
            index=self.index,
            text=text[self.num_sent_chars :],
            token_ids=self.token_ids[self.num_prompt_tokens + start :],
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.num_sent_tokens, self.num_sent_chars = self.num_output_tokens, len(text)
        return delta


class Request(Reports):
    """A user's request: a prompt, sampling parameters and the sequences that serve it."""

    _arrivals = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        root_hash: bytes,
        arrival_time: float,
        kv_policy: KVPolicy | None = None,
        peak_slots: int | None = None,
    ) -> None:
        self.request_id = request_id
        #: the prompt as embedding rows [tokens, hidden] (its token ids are placeholders), if so given,
        #: and the [start, end) prompt ranges whose ids are placeholders
        self.prompt_embeds: torch.Tensor | None = None
        self.embedded_spans: list[tuple[int, int]] = []
        #: the streaming session the request computes frames of or asks a question of, the evicted
        #: frames a question asks to recall, those it got back and the seconds that took
        self.stream_id: str | None = None
        self.recall = 0
        self.recalled_frames: list[int] = []
        self.recall_seconds = 0.0
        #: what the request's sequences keep in the cache, and the most slots one holds at once
        self.kv_policy: KVPolicy = kv_policy or Full()
        self.peak_slots = peak_slots
        #: leading prompt tokens that may come from the prefix cache (the policy's limit)
        self.prefix_limit = len(prompt_token_ids)
        #: the documents the prompt reuses and how (engine/blend.py); None: a plain prefill
        self.blend: BlendPlan | None = None
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.root_hash = root_hash
        #: whose request it is (its cache_salt; None: the default tenant): the scheduler shares
        #: prefill among tenants
        self.tenant: str | None = None
        self.arrival_index = next(self._arrivals)
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # Cached blocks carry no logits, so a request that wants prompt logprobs computes them all.
        self.no_prefix_cache = params.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self.seqs: list[Sequence] = []
        self.num_cached_tokens = 0
        self.forked = params.n == 1
        self.output_kind = RequestOutputKind.CUMULATIVE
        self._num_sent_prompt_logprobs = 0

    @property
    def finished(self) -> bool:
        return self.forked and all(seq.is_finished for seq in self.seqs)

    @property
    def priority(self) -> int:
        return self.params.priority

    def progress(self) -> tuple[list[CompletionOutput], list[TokenLogprobs | None] | None]:
        """Every completion and prompt logprob so far, or what is new since the previous output (DELTA)."""
        if self.output_kind is RequestOutputKind.DELTA:
            return [seq.delta_completion() for seq in self.seqs], self._new_prompt_logprobs()
        return [seq.completion() for seq in self.seqs], self.prompt_logprobs

    def extra(self) -> dict:
        return {"recalled_frames": list(self.recalled_frames)} if self.recall else {}

    def _new_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        if self.prompt_logprobs is None:
            return None
        new = self.prompt_logprobs[self._num_sent_prompt_logprobs :]
        self._num_sent_prompt_logprobs = len(self.prompt_logprobs)
        return new
