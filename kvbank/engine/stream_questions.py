"""A stream's questions: requests answered from the stream's cached frames. A question forks the
stream's sequence (with `recall`, after the evicted frames most relevant to it are brought back
into its copy) once every frame sent before it is computed, and frees its own blocks when done.

The engine owns the requests in flight; a question reaches them through `RequestHooks`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbank.cache.editor import KVEditor
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.recall import splice_recalled
from kvbank.cache.storage import KVStorage
from kvbank.cache.tiers import tier_options
from kvbank.engine.admission import Admission
from kvbank.engine.params import SamplingParams
from kvbank.engine.prompts import PromptType
from kvbank.engine.runner import ModelRunner
from kvbank.engine.scheduler import Scheduler
from kvbank.engine.sequence import Request, Sequence, SequenceStatus
from kvbank.engine.streams import Stream, stream_room

#: a question that asks nothing in particular: what every question's queries share (cache/recall.py)
NEUTRAL_QUESTION = "What happened?"


@dataclass(frozen=True, slots=True)
class RequestHooks:
    """How a stream's questions reach the engine, which owns the requests in flight: `track` one
    once asked, `untrack` one that never launched (False where the engine dropped it already, as
    aborted), and ask whether one is still `tracked`."""

    track: Callable[[Request], None]
    untrack: Callable[[str], bool]
    tracked: Callable[[str], bool]


class StreamQuestions:
    """Asks, launches and drops the questions of one engine's streams."""

    def __init__(
        self,
        admission: Admission,
        scheduler: Scheduler,
        manager: KVCacheManager,
        storage: KVStorage,
        editor: KVEditor,
        runner: ModelRunner,
        hooks: RequestHooks,
    ) -> None:
        self.admission = admission
        self.scheduler = scheduler
        self.manager = manager
        self.storage = storage
        self.editor = editor
        self.runner = runner
        self.hooks = hooks
        self.max_model_len = admission.max_model_len
        self.block_size = admission.block_size

    def ask(
        self,
        stream: Stream,
        question: PromptType,
        params: SamplingParams | None,
        request_id: str | None,
        recall: int,
        promised: int,
    ) -> Request:
        """A request answering `question` from the stream's cached frames, once every frame sent
        before it is computed: it forks the stream's blocks and frees its own when done. `promised`:
        the blocks open streams reserved and do not hold yet, which the question may not take.

        `recall=k` first brings back the k evicted frames most relevant to the question (from the
        stream's tier; cache/recall.py) into the question's copy of the cache."""
        admit = self.admission
        if not isinstance(recall, int) or isinstance(recall, bool) or recall < 0:
            raise ValueError(f"recall={recall!r} must be an integer >= 0")
        if recall and stream.archive is None:
            raise ValueError(f"recall={recall} needs a KV tier for evicted frames (one of {tier_options()})")
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be given for a stream question: its frames are cached")
        if params.kv_policy is not None:
            raise ValueError("a stream question takes no kv_policy: it runs on the stream's cache")
        if isinstance(question, str):
            question = admit.continuation(question, question + stream.question_suffix)
        parsed = admit.parse(question, tenant=True)
        if parsed.salt is not None:
            raise ValueError("a question cannot carry a cache_salt: give it to open_stream")
        admit.check_sampling(params)
        kept = stream.seq.num_tokens
        room = self._room(stream.seq) - kept - len(parsed.token_ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(room, 1))
        if params.max_tokens > room:
            raise ValueError(
                f"the stream holds {kept} tokens and the question has {len(parsed.token_ids)}: "
                f"max_tokens={params.max_tokens} exceeds max_model_len={self.max_model_len}: {max(room, 0)} "
                "positions are left (a stream's positions keep growing past the frames it evicted)"
            )
        total = kept + len(parsed.token_ids) + params.max_tokens
        admit.ensure_room(
            blocks_for(stream.seq.lead + total, self.block_size) - len(stream.seq.block_table) + 1,
            "the question",
            promised,
        )
        request_id = admit.request_id(request_id)
        request = Request(
            request_id, parsed.text, parsed.token_ids, params, stream.seq.root_hash, time.time(), stream.policy
        )
        # the asker's tenant when it names one (a server's: the asker's API key), else the stream's
        request.tenant = parsed.tenant if parsed.tenant is not None else stream.seq.request.tenant
        request.stream_id = stream.stream_id
        request.no_prefix_cache = True  # the forked blocks are the stream's, rotated and compacted
        request.recall = recall
        self.hooks.track(request)
        stream.last_used = time.monotonic()
        if stream.seq.status is SequenceStatus.PARKED:
            self._launch(stream, request)
        else:
            stream.waiting_asks.append(request)
        return request

    def launch_waiting(self, stream: Stream) -> None:
        """Launch the questions that waited for the stream's frames (those not aborted meanwhile)."""
        waiting, stream.waiting_asks = stream.waiting_asks, []
        for request in waiting:
            if self.hooks.tracked(request.request_id):
                self._launch(stream, request)

    def drop_waiting(self, stream: Stream) -> list[Request]:
        """End the questions still waiting for `stream`, never launched (as aborted): returns them."""
        dropped = []
        for request in stream.waiting_asks:
            if self.hooks.untrack(request.request_id):  # never launched: no sequence yet
                request.forked = True
                request.metrics.finished_time = time.time()
                dropped.append(request)
        return dropped

    def _launch(self, stream: Stream, request: Request) -> None:
        if request.recall:
            if self._launch_recalling(stream, request):
                return
            stream.archive.stats.fallbacks += 1
        source, question, params = stream.seq, request.prompt_token_ids, request.params
        kept = source.num_computed_tokens
        if source.lead + kept + source.rope_offset + len(question) + params.max_tokens > self.editor.rope_len:
            self.editor.rebase_tokens(source, source.frames.keep_tokens)
        request.prompt_token_ids = source.token_ids + question
        request.embedded_spans = source.frames.embedded_spans()
        room = self._room(source) - len(request.prompt_token_ids)
        if params.max_tokens > room:  # frames longer than those the question was checked against
            request.params = dataclasses.replace(params, max_tokens=max(room, 1))
        seq = self.admission.sequence(request, 0, request.prompt_token_ids)
        seq.num_computed_tokens, seq.rope_offset = kept, source.rope_offset
        seq.lead = source.lead
        self.manager.fork(source, seq)
        request.seqs.append(seq)
        self.scheduler.add_running(seq)

    def _room(self, seq: Sequence) -> int:
        return stream_room(seq, self.max_model_len, self.editor.rope_len)

    def _mean_queries(self, token_ids: list[int]) -> torch.Tensor:
        device = self.storage.device
        return self.runner.model.mean_queries(torch.tensor(token_ids, device=device)).cpu()

    def _launch_recalling(self, stream: Stream, request: Request) -> bool:
        """Start the question on its own copy of the cache: sinks, the recalled frames, the kept
        frames (cache/recall.py); False if nothing came back or there is no room for it."""
        source, question, params, log = stream.seq, request.prompt_token_ids, request.params, stream.seq.frames
        started = time.perf_counter()
        queries = self._mean_queries(question)
        if stream.neutral_queries is None:
            text = NEUTRAL_QUESTION + stream.question_suffix
            neutral = self.admission.parse(self.admission.continuation(text, text)).token_ids
            stream.neutral_queries = self._mean_queries(neutral)
        room = self._room(source) - source.num_computed_tokens - len(question) - params.max_tokens
        chosen, total = [], 0
        for archived in reversed(stream.archive.choose(queries, stream.neutral_queries, request.recall, question)):
            if total + len(archived.token_ids) <= room:  # the newest fit first
                chosen.insert(0, archived)
                total += len(archived.token_ids)
        c = self.admission.model_config
        loaded = stream.archive.load(chosen, (c.num_layers, c.num_kv_heads, c.head_dim), self.storage.dtype)
        recalled = sum(len(a.token_ids) for a, _, _ in loaded)
        keep, kept = log.keep_tokens, source.num_computed_tokens
        needed = blocks_for(kept + recalled + len(question) + params.max_tokens, self.block_size)
        if not loaded or not source.pristine_blocks or needed > self.manager.num_free_blocks:
            return False
        table = splice_recalled(self.manager, self.storage, source, keep, loaded, self.editor.inv_freq)
        frames = [t for a, _, _ in loaded for t in a.token_ids]
        request.prompt_token_ids = source.token_ids[:keep] + frames + source.token_ids[keep:] + question
        held = log.embedded_spans()
        spans, position = [(a, b) for a, b in held if b <= keep], keep
        for archived, _, _ in loaded:
            if archived.embedded:
                spans.append((position, position + len(archived.token_ids)))
            position += len(archived.token_ids)
        request.embedded_spans = spans + [(a + recalled, b + recalled) for a, b in held if a >= keep]
        seq = self.admission.sequence(request, 0, request.prompt_token_ids)
        seq.num_computed_tokens, seq.block_table = kept + recalled, table
        request.recalled_frames = [a.index for a, _, _ in loaded]
        request.recall_seconds = time.perf_counter() - started
        request.seqs.append(seq)
        self.scheduler.add_running(seq)
        return True
