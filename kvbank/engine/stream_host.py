"""The streams' host: opens, feeds, forks and closes streams, and launches their questions.

What a stream is, and why it is one parked sequence, is told in engine/streams.py. The engine
steps the host: `after_step` evicts (and archives) a stream's frames once a step computed them
(engine/commit.py runs it), `progress` finishes the frame requests a step completed and launches
the questions that waited.

The host owns its streams and the frame requests still computing; the engine owns every other
request. A stream's questions are requests like any other once asked: they reach the engine's
table through `RequestHooks` (engine/stream_questions.py), which the host never holds.
"""

from __future__ import annotations

import time

import torch

from kvbank.cache.editor import KVEditor
from kvbank.cache.frames import FrameLog, frame_digest
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.offload import KVOffload
from kvbank.cache.policies import FrameWindow, KVPolicy, parse_policy
from kvbank.cache.prefix import root_hash
from kvbank.cache.recall import FrameArchive
from kvbank.cache.storage import KVStorage
from kvbank.engine.admission import Admission
from kvbank.engine.outputs import RequestMetrics, RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.engine.prompts import PromptType
from kvbank.engine.runner import ModelRunner
from kvbank.engine.scheduler import Scheduler
from kvbank.engine.sequence import Request, Sequence, SequenceStatus
from kvbank.engine.stream_questions import RequestHooks, StreamQuestions
from kvbank.engine.streams import FrameRequest, FrameType, PoolFull, Stream, stream_room

#: evicted frames a stream keeps recallable (their summaries take ~11 KiB of RAM each here)
RECALL_LIMIT = 1024


class StreamHost:
    """Every open stream of one engine, their frames still computing and their waiting questions."""

    def __init__(
        self,
        admission: Admission,
        scheduler: Scheduler,
        manager: KVCacheManager,
        storage: KVStorage,
        editor: KVEditor,
        offload: KVOffload | None,
        runner: ModelRunner,
        hooks: RequestHooks,
        namespace: bytes,
    ) -> None:
        self.admission = admission
        self.scheduler = scheduler
        self.manager = manager
        self.storage = storage
        self.editor = editor
        self.offload = offload
        self.runner = runner
        #: a stream's questions (engine/stream_questions.py)
        self.questions = StreamQuestions(admission, scheduler, manager, storage, editor, runner, hooks)
        self.namespace = namespace
        self.max_model_len = admission.max_model_len
        self.block_size = admission.block_size
        self.streams: dict[str, Stream] = {}
        #: frames (and system prompts) not computed yet, by request id
        self._frame_requests: dict[str, FrameRequest] = {}
        #: how many streams' archives hold each archived frame's tier entry (a fork shares its
        #: source's): an entry is deleted when the last of them lets it go
        self.archive_holders: dict[bytes, int] = {}

    def get(self, stream_id: str) -> Stream:
        """The open stream `stream_id`; KeyError naming it otherwise."""
        stream = self.streams.get(stream_id)
        if stream is None:
            raise KeyError(f"no open stream {stream_id!r}")
        return stream

    def is_open(self, stream_id: str) -> bool:
        """Whether `stream_id` names an open stream."""
        return stream_id in self.streams

    def has_frame_request(self, request_id: str) -> bool:
        """Whether `request_id` is a frame (or a system prompt) still computing."""
        return request_id in self._frame_requests

    def frames_pending(self) -> bool:
        """Whether any frame (or system prompt) is still computing."""
        return bool(self._frame_requests)

    def drop_frame_request(self, request_id: str) -> bool:
        """Stop waiting for a frame request (the frame stays part of its stream); False if unknown."""
        return self._frame_requests.pop(request_id, None) is not None

    # --- opening, forking, closing --------------------------------------------------------------

    def open(
        self,
        system: PromptType,
        policy: str | KVPolicy,
        separator: str,
        stream_id: str | None,
        request_id: str | None,
        chat: bool,
        reserve_tokens: int | None = None,
    ) -> FrameRequest:
        """Start a stream: queue its system prompt (text, ids, or a dict with "cache_salt"), which
        may come from the prefix cache. The returned request finishes once it is computed.

        With `reserve_tokens`, the stream may hold at most that many tokens at once (system prompt,
        kept leading frames, window and the frame being computed), and the KV blocks for that are
        promised to it now: other streams and questions cannot take them, so its frames are never
        refused for room, and a stream the pool cannot promise that to is refused here (PoolFull).

        With `chat` and a text system prompt, the model's chat template frames the stream: the
        system message, then a user turn that the frames fill; a text question closes that turn
        and opens the assistant's (only in the question's fork: the stream's turn stays open).
        """
        if self.manager.groups is not None:
            raise ValueError(
                "streams are not supported with the hybrid sliding-window KV cache (frames are evicted and "
                "recalled in every layer alike); load the model with swa_full=True (--swa-full)"
            )
        admit = self.admission
        policy = parse_policy(policy, stream=True)
        admit.check_policy(policy)
        stream_id = admit.stream_id(stream_id, self.streams)
        if not isinstance(separator, str):
            raise ValueError(f"separator={separator!r} must be a string")
        request_id = admit.request_id(request_id)
        suffix = ""
        tokenizer = admit.tokenizer
        text = system.get("prompt") if isinstance(system, dict) and "prompt_token_ids" not in system else system
        if chat and isinstance(text, str) and tokenizer is not None and tokenizer.chat_template:
            before, suffix = self._chat_frame(text)
            framed = admit.continuation(before, before)  # the template writes BOS where the model wants it
            # a dict keeps its other keys (its cache_salt) around the framed prompt
            system = framed if isinstance(system, str) else {**system, **framed}
        parsed = admit.parse(system, tenant=True)
        system_len = len(parsed.token_ids)
        if system_len >= self.max_model_len:
            raise ValueError(
                f"the system prompt has {system_len} tokens; max_model_len={self.max_model_len} "
                "leaves no room for frames"
            )
        needed = blocks_for(system_len, self.block_size) * 2
        if needed > admit.limits.num_blocks:
            raise ValueError(
                f"the system prompt needs {needed} KV blocks but the pool has only {admit.limits.num_blocks}"
            )
        reserved = self._reservation(reserve_tokens, system_len, policy)
        what = f"a stream reserving {reserve_tokens} tokens" if reserved else "a stream's system prompt"
        needed = reserved or blocks_for(system_len, self.block_size)
        admit.ensure_room(needed, what, self.promised())
        self._check_share(needed, what)
        root = root_hash(self.namespace, parsed.salt)
        now = time.time()
        request = Request(stream_id, parsed.text, parsed.token_ids, SamplingParams(max_tokens=1), root, now, policy)
        request.stream_id, request.tenant = stream_id, parsed.tenant
        seq = Sequence(request, 0, parsed.token_ids, None)
        seq.frames = FrameLog(system_len, policy.sinks)
        request.seqs.append(seq)
        stream = Stream(stream_id, seq, policy, separator, suffix, archive=self._archive_for(stream_id))
        stream.reserve_tokens, stream.reserved_blocks = reserve_tokens, reserved
        self.streams[stream_id] = stream
        opened = FrameRequest(request_id, stream, None, parsed.text, parsed.token_ids, RequestMetrics(now))
        stream.pending.append(opened)
        self._frame_requests[request_id] = opened
        self.scheduler.add(seq)
        if self.offload is not None:
            self.offload.request_load(seq)
        return opened

    def _reservation(self, reserve_tokens: int | None, system_len: int, policy: FrameWindow) -> int:
        """KV blocks a stream holding at most `reserve_tokens` tokens can need at once: those
        tokens' blocks (and one more: they start up to a block in once frames left) and the
        unrotated copies of its kept leading tokens (the
        system prompt and up to `sinks` tokens of leading frames). 0 without a reservation."""
        if reserve_tokens is None:
            return 0
        if not isinstance(reserve_tokens, int) or isinstance(reserve_tokens, bool) or reserve_tokens <= system_len:
            raise ValueError(
                f"reserve_tokens={reserve_tokens!r} must be an integer above the system prompt's {system_len} tokens"
            )
        if reserve_tokens > self.max_model_len:
            raise ValueError(f"reserve_tokens={reserve_tokens} exceeds max_model_len={self.max_model_len}")
        bs = self.block_size
        # tokens start up to a block into their first block once frames left (Sequence.lead): one more
        blocks = blocks_for(reserve_tokens, bs) + 1 + blocks_for(min(system_len + policy.sinks, reserve_tokens), bs)
        if blocks > self.admission.limits.num_blocks:
            raise ValueError(
                f"reserve_tokens={reserve_tokens} needs {blocks} KV blocks but the pool has only "
                f"{self.admission.limits.num_blocks}"
            )
        return blocks

    def held_blocks(self) -> int:
        """Blocks the open streams hold (those forks share counted once)."""
        return len({b for s in self.streams.values() for b in s.seq.block_table + s.seq.pristine_blocks})

    def _check_share(self, blocks: int, what: str, besides: Stream | None = None) -> None:
        """Refuse (PoolFull) stream work that would take the streams past their share of the pool
        (max_stream_pool_fraction): streams are never preempted and may stay open for long, so
        without a share a few of them could leave no room for requests."""
        fraction, pool = self.admission.config.max_stream_pool_fraction, self.admission.limits.num_blocks
        share = int(fraction * pool)
        taken = self.held_blocks() + self.promised(besides)
        if taken + blocks > share:
            raise PoolFull(
                f"{what} needs {blocks} more KV blocks, but streams hold or reserve {taken} of the {share} "
                f"blocks they may (max_stream_pool_fraction={fraction:g} of {pool}): close a stream, or send "
                "shorter frames"
            )

    def promised(self, besides: Stream | None = None) -> int:
        """Blocks reserved by open streams (but `besides`) that they do not hold yet."""
        return sum(self._outstanding(s) for s in self.streams.values() if s is not besides)

    def _outstanding(self, stream: Stream) -> int:
        """Blocks promised to `stream` that it does not hold yet. A fork holds, for this, only the
        blocks no one else holds: those it shares with its source are counted by the source until
        one of them writes (and copies) or lets go."""
        if not stream.forked:
            return stream.outstanding_blocks
        blocks = self.manager.pool.blocks
        own = sum(blocks[b].ref_count == 1 for b in stream.seq.block_table + stream.seq.pristine_blocks)
        return max(0, stream.reserved_blocks - own)

    def fork(self, stream_id: str, new_id: str | None) -> Stream:
        """A new stream sharing every block of `stream_id` (copy-on-write) from here on. A source
        that reserved its window passes the reservation on: the fork is promised as many blocks of
        its own (PoolFull when the pool cannot promise them), since it copies what it shares as it
        diverges."""
        source = self.get(stream_id)
        if source.seq.status is not SequenceStatus.PARKED:
            raise ValueError(f"stream {stream_id!r} has frames still computing; fork it once they are in")
        new_id = self.admission.stream_id(new_id, self.streams)
        if source.reserve_tokens is not None:
            what = f"a fork of stream {stream_id!r} reserving {source.reserve_tokens} tokens"
            self.admission.ensure_room(source.reserved_blocks, what, self.promised())
            self._check_share(source.reserved_blocks, what)
        old = source.seq
        request = Request(
            new_id,
            old.request.prompt,
            old.request.prompt_token_ids,
            old.params,
            old.root_hash,
            time.time(),
            old.kv_policy,
        )
        request.stream_id, request.tenant = new_id, old.request.tenant
        seq = Sequence(request, 0, old.token_ids, None)
        seq.num_computed_tokens, seq.rope_offset = old.num_computed_tokens, old.rope_offset
        seq.block_hashes, seq.chain_serials = list(old.block_hashes), list(old.chain_serials)
        seq.frames = old.frames.copy()
        seq.lead = old.lead
        seq.status = SequenceStatus.PARKED
        self.manager.fork(old, seq)
        request.seqs.append(seq)
        # Its own archive, holding the frames the source evicted before the fork as well (shared
        # entries: each stays in the tier while either stream holds it).
        archive = self._archive_for(new_id)
        if archive is not None and source.archive is not None:
            archive.inherit(source.archive)
        stream = Stream(new_id, seq, source.policy, source.separator, source.question_suffix, archive=archive)
        stream.reserve_tokens, stream.reserved_blocks = source.reserve_tokens, source.reserved_blocks
        stream.forked = True
        self.streams[new_id] = stream
        return stream

    def close(self, stream_id: str) -> tuple[list[str], list[RequestOutput]]:
        """Free a stream's blocks. Frames and questions still waiting for it end (as aborted): returns
        their request ids and final outputs. Questions already answering keep their own copies and finish."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            raise KeyError(f"no open stream {stream_id!r}")
        ended, outputs = [], []
        for pending in stream.pending:
            if self.drop_frame_request(pending.request_id):
                pending.finished = True
                outputs.append(pending.output())
                ended.append(pending.request_id)
        for request in self.questions.drop_waiting(stream):
            outputs.append(request.output())
            ended.append(request.request_id)
        self.scheduler.finish(stream.seq)
        if stream.archive is not None:
            stream.archive.close()
        return ended, outputs

    def _archive_for(self, stream_id: str) -> FrameArchive | None:
        """With a KV tier, evicted frames go to its first tier, recallable by relevance."""
        if self.offload is None or not self.offload.tiers:
            return None
        namespace = self.namespace + b"|stream|" + stream_id.encode()
        return FrameArchive(
            self.offload, namespace, self.editor.inv_freq, RECALL_LIMIT, self.storage.codecs, self.archive_holders
        )

    def _chat_frame(self, system: str) -> tuple[str, str]:
        """(the text before a user message's content, the text after it up to the assistant's turn)."""
        mark = "\x00frames\x00"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": mark}]
        rendered = self.admission.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        before, found, after = rendered.partition(mark)
        if not found:
            raise ValueError("the model's chat template does not show a user message's content; pass chat=False")
        return before, after

    # --- frames ---------------------------------------------------------------------------------

    def append(
        self, stream_id: str, frame: FrameType, skip_repeat: bool, request_id: str | None
    ) -> tuple[FrameRequest, RequestOutput | None, int]:
        """Queue one frame after the stream's others: text (the stream's separator is added), token
        ids, embedding rows [tokens, hidden], or a prompt dict of one of them. The request finishes
        once the frame is computed; with `skip_repeat`, a frame identical to one the stream holds
        finishes at once, uncomputed (its final output is returned beside it). Also returns the
        tokens evicted to make room for the frame (`fit`)."""
        stream, admit = self.get(stream_id), self.admission
        if isinstance(frame, str):
            frame = admit.continuation(frame, frame + stream.separator)
        elif isinstance(frame, torch.Tensor):
            frame = {"prompt_embeds": frame}
        parsed = admit.parse(frame, embeds=True)
        if parsed.salt is not None:
            raise ValueError("a frame cannot carry a cache_salt: give it to open_stream")
        request_id = admit.request_id(request_id)
        seq, log = stream.seq, stream.seq.frames
        self._check_frame(stream, len(parsed.token_ids))
        digest = frame_digest(parsed.token_ids, parsed.embeds)
        repeat = log.repeat_of(digest)
        metrics = RequestMetrics(time.time())
        stream.last_used = time.monotonic()
        if skip_repeat and repeat is not None:
            held = next(f for f in log.frames if f.index == repeat)
            skipped = FrameRequest(request_id, stream, held, parsed.text, parsed.token_ids, metrics, repeat, True)
            skipped.finished, metrics.finished_time = True, metrics.arrival_time
            return skipped, skipped.output(), 0
        added = log.add(seq.num_tokens, len(parsed.token_ids), digest, parsed.embeds)
        seq.token_ids.extend(parsed.token_ids)
        request = FrameRequest(request_id, stream, added, parsed.text, parsed.token_ids, metrics, repeat)
        stream.pending.append(request)
        self._frame_requests[request_id] = request
        evicted = self.fit(stream)
        if seq.status is SequenceStatus.PARKED:
            self.scheduler.add_running(seq)
        return request, None, evicted

    def _check_frame(self, stream: Stream, num_tokens: int) -> None:
        # What the stream holds once this frame is in and the window has evicted: it must fit the
        # model's positions (with a question's first token) and the pool.
        # A block less than the context: the cache may start up to a block into its first block
        # (Sequence.lead), and positions count those slots.
        log, window = stream.seq.frames, stream.policy.frames
        recent = [f.length for f in log.frames if not f.sink][-(window - 1) :] if window > 1 else []
        held = log.keep_tokens + sum(recent) + num_tokens
        room = min(self.max_model_len, self.editor.rope_len) - self.block_size
        if held > room:
            raise ValueError(
                f"a frame of {num_tokens} tokens would make the stream hold {held} tokens "
                f"({log.keep_tokens} kept for good, the last {len(recent)} frames and this one), "
                f"over max_model_len={self.max_model_len} less a block ({self.block_size}): send shorter "
                "frames or open the stream with fewer frames"
            )
        seq = stream.seq
        if stream.reserve_tokens is not None:
            # The stream's own promise: what it holds until the window evicts stays within it.
            holding = seq.num_tokens + num_tokens
            if holding > stream.reserve_tokens:
                raise ValueError(
                    f"a frame of {num_tokens} tokens would make the stream hold {holding} tokens before its "
                    f"window evicts, over its reserve_tokens={stream.reserve_tokens}: send shorter frames "
                    "or open the stream with a larger reservation or fewer frames"
                )
            return  # its blocks were promised when it opened
        needed, num_blocks = 2 * blocks_for(held, self.block_size), self.admission.limits.num_blocks
        if needed > num_blocks:
            raise ValueError(f"the stream would need {needed} KV blocks but the pool has only {num_blocks}")
        # Until the window evicts, the frame's blocks come on top of what the stream holds (less what
        # `fit` lets go first when it could not hold them all), plus a spare block and, at the first
        # eviction, the unrotated copies of the kept leading blocks.
        peak = min(seq.num_tokens + num_tokens, max(self._room(seq), log.keep_tokens + num_tokens))
        growth = blocks_for(seq.lead + peak, self.block_size) - len(seq.block_table) + 1
        if not seq.pristine_blocks:
            growth += blocks_for(log.keep_tokens, self.block_size)
        self.admission.ensure_room(growth, f"a frame of {num_tokens} tokens", self.promised(stream))
        self._check_share(growth, f"a frame of {num_tokens} tokens", stream)

    # --- questions ------------------------------------------------------------------------------

    def ask(
        self, stream_id: str, question: PromptType, params: SamplingParams | None, request_id: str | None, recall: int
    ) -> Request:
        """A request answering `question` from the stream's cached frames (StreamQuestions.ask)."""
        return self.questions.ask(self.get(stream_id), question, params, request_id, recall, self.promised())

    # --- stepping -------------------------------------------------------------------------------

    def after_step(self, seq: Sequence) -> int:
        """Evict the frames the stream's window lets go, archiving them first, and fit what it
        computes next (`fit`); returns tokens evicted."""
        stream = self.streams[seq.request.stream_id]
        return self._evict(stream, stream.policy.victims(seq)) + self.fit(stream)

    def _evict(self, stream: Stream, victims: list) -> int:
        if victims and stream.archive is not None:
            stream.archive.archive(self.storage, stream.seq, victims)
        return stream.policy.evict(stream.seq, self.editor, victims)

    def fit(self, stream: Stream) -> int:
        """Bound what the stream computes next by what it can hold: its frames are computed while
        the window's older frames are still in the cache, so when the next frame would not fit
        beside them (in max_model_len or in the rotary tables' positions) the oldest leave first,
        as they would once it is in; positions restart at the first slot when they would run past
        the tables; and the sequence's `compute_limit` stops the scheduler at the last pending
        frame that fits, so the frame after it is fitted again once that one is in. Returns tokens
        evicted."""
        seq, log = stream.seq, stream.seq.frames
        evicted = 0
        ends = log.pending_ends(seq.num_computed_tokens)
        while ends and not self._holds(seq, ends[0]):
            oldest = log.evictable(seq.num_computed_tokens, 0)[:1]
            if not oldest:
                break  # the frame is too long to ever fit (refused at append); attention refuses it
            evicted += self._evict(stream, oldest)
            ends = log.pending_ends(seq.num_computed_tokens)
        if not ends:
            seq.compute_limit = None
            return evicted
        rope_len = self.editor.rope_len
        if seq.lead + seq.rope_offset + ends[0] > rope_len:
            self.editor.rebase_tokens(seq, log.keep_tokens)
        fitting = [e for e in ends if self._holds(seq, e) and seq.lead + seq.rope_offset + e <= rope_len]
        seq.compute_limit = fitting[-1] if fitting else ends[0]
        return evicted

    def _holds(self, seq: Sequence, end: int) -> bool:
        """Whether the stream can hold its first `end` tokens at once."""
        return end <= self._room(seq)

    def _room(self, seq: Sequence) -> int:
        return stream_room(seq, self.max_model_len, self.editor.rope_len)

    def progress(self, stream: Stream, now: float) -> list[RequestOutput]:
        """Finish the frame requests a step completed; park the stream once it has no frame left to compute."""
        seq, outputs = stream.seq, []
        seq.frames.computed(seq.num_computed_tokens)
        while stream.pending:
            first = stream.pending[0]
            done = first.frame.done if first.frame is not None else seq.num_computed_tokens >= seq.frames.system_len
            if not done:
                break
            stream.pending.popleft()
            if first.frame is None:
                first.num_cached_tokens = seq.request.num_cached_tokens
            first.finished, first.metrics.finished_time = True, now
            if self.drop_frame_request(first.request_id):
                outputs.append(first.output())
        if seq.num_pending == 0 and seq.status is SequenceStatus.RUNNING:
            self.scheduler.park(seq)
            self.questions.launch_waiting(stream)
        return outputs
