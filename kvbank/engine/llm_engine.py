"""The engine loop: admit requests, run one scheduled step at a time, turn logits into outputs."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable

import torch

from kvbank import kernels, memory
from kvbank.cache.editor import KVEditor, ScoreState
from kvbank.cache.frames import FrameLog, frame_digest
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.offload import KVOffload
from kvbank.cache.policies import POLICIES, Full, KVPolicy, Limits, parse_policy
from kvbank.cache.prefix import root_hash
from kvbank.cache.recall import FrameArchive, rotate
from kvbank.cache.session import Session, install_session, pack_session, read_session, write_session
from kvbank.cache.storage import KVStorage, PoolPlan, plan_pool
from kvbank.cache.swap import Swapper
from kvbank.cache.tiers import build_offload, entry_format_for
from kvbank.cache.tiers.entry import dtype_name
from kvbank.config import EngineConfig
from kvbank.engine.outputs import RequestMetrics, RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.engine.prompts import ParsedPrompt, PromptType, parse_prompt
from kvbank.engine.runner import ModelRunner, StepLogits
from kvbank.engine.sampler import Sampled, Sampler, token_logprobs
from kvbank.engine.scheduler import ScheduledSeq, Scheduler
from kvbank.engine.sequence import Request, Sequence, SequenceStatus
from kvbank.engine.streams import FrameRequest, FrameType, PoolFull, Stream
from kvbank.kernels import isa
from kvbank.kernels.allocator import keep_freed_memory
from kvbank.models.build import build_model
from kvbank.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """One model, one KV pool, one scheduler; `step()` advances every running request by a step."""

    def __init__(self, config: EngineConfig, progress: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        if self.device.type == "cpu":
            keep_freed_memory()
        built = build_model(config, progress)
        self.model_config = built.config
        self.model_path = built.path
        self.tokenizer: Tokenizer | None = built.tokenizer
        self.packed_layers = built.packed_layers
        self.max_model_len = built.config.max_position_embeddings
        self.block_size = config.block_size
        self.kv_format = config.kv_format
        self.pool_plan = self._plan_pool()
        self.num_blocks = config.num_gpu_blocks or self.pool_plan.num_blocks
        storage = KVStorage(
            self.model_config,
            self.num_blocks,
            self.block_size,
            self.dtype,
            self.device,
            self.kv_format,
            config.max_num_seqs,
            config.batch_invariant,
        )
        self.manager = KVCacheManager(
            self.num_blocks, self.block_size, config.enable_prefix_caching, config.max_pinned_fraction
        )
        self.manager.pool.on_empty = storage.release
        # K/V written in another dtype or format are not interchangeable: keep their cache chains apart.
        self.cache_namespace = (
            self.model_config.fingerprint + f"|{dtype_name(self.dtype)}".encode() + self.kv_format.namespace
        )
        self.storage = storage
        self.entry_format = entry_format_for(storage, self.model_config.fingerprint, self.cache_namespace)
        self.offload: KVOffload | None = build_offload(
            config, self.manager, storage, self.model_config.fingerprint, self.cache_namespace
        )
        self.swapper = Swapper(storage, self.manager, config.preemption_mode, int(config.swap_space_gb * 2**30))
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens, self.swapper)
        self.runner = ModelRunner(built.model, storage, self.device)
        self.limits = Limits(
            self.block_size, self.num_blocks, self.max_model_len, config.max_num_batched_tokens, storage.all_dense
        )
        self.kv_policy = parse_policy(config.kv_policy)
        self.kv_policy.check(self.limits)
        self.editor = KVEditor(
            self.manager, storage, self.limits, built.model.rope_inv_freq, built.model.rope_cos.shape[0]
        )
        #: tokens each policy has evicted, by policy name
        self.evicted_tokens: dict[str, int] = {name: 0 for name in POLICIES if name != "full"}
        self.eos_token_ids = self.tokenizer.stop_token_ids if self.tokenizer else frozenset()
        token_text = self.tokenizer.token_text if self.tokenizer else str
        self.sampler = Sampler(self.eos_token_ids, token_text, torch.Generator(self.device).manual_seed(config.seed))
        self.requests: dict[str, Request] = {}
        #: streaming sessions by id, and their frames not computed yet by request id
        self.streams: dict[str, Stream] = {}
        self.frame_requests: dict[str, FrameRequest] = {}
        #: outputs settled between steps (a skipped repeat frame, a closed stream's frames), sent by the next step
        self._ready: list[RequestOutput] = []
        self._ids = itertools.count()
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "finished_requests": 0,
        }
        self.memory = memory.measure(self, built.load_peak)

    @property
    def kv_bytes_per_token(self) -> float:
        """Pool bytes per token across all layers, scales and zero points included."""
        return self.pool_plan.bytes_per_token

    def _plan_pool(self) -> PoolPlan:
        config = self.config
        gigabytes = config.kv_cache_memory_gb
        plan = plan_pool(
            self.model_config,
            self.dtype,
            int(gigabytes * 2**30),
            self.block_size,
            self.kv_format,
            reserved_seqs=config.max_num_seqs,
        )
        if plan.num_blocks < 1 and config.num_gpu_blocks is None:
            raise ValueError(
                f"kv_cache_memory_gb={gigabytes} holds less than one block of "
                f"{self.block_size} tokens ({plan.bytes_per_block} bytes per block, plus "
                f"{plan.residual_bytes_per_seq * plan.reserved_seqs} bytes of residual slots)"
            )
        return plan

    # --- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError for anything that could never run."""
        params = params or SamplingParams()
        request_id = self._new_request_id(request_id)
        parsed = self._parse(prompt, embeds=True)
        namespace = self.cache_namespace
        if parsed.embeds is not None:
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be given for prompt_embeds: the prompt has no token ids")
            # Placeholder ids say nothing of the rows: the chain starts from their content instead.
            namespace += b"|embeds|" + frame_digest([], parsed.embeds)
        root = root_hash(namespace, parsed.salt)
        policy = params.kv_policy or self.kv_policy
        if policy is not self.kv_policy:
            policy.check(self.limits)
        params = self._resolve_max_tokens(params, parsed.token_ids, root, policy)
        params.check_token_ids(self.model_config.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n={params.n} is more sequences than max_num_seqs={self.config.max_num_seqs} runs at once"
            )
        peak = policy.peak_slots(len(parsed.token_ids), params.max_tokens, self.limits)
        peak = None if isinstance(policy, Full) else peak
        request = Request(
            request_id, parsed.text, parsed.token_ids, params, root, arrival_time or time.time(), policy, peak
        )
        request.prefix_limit = policy.prefix_limit(len(parsed.token_ids), self.limits)
        if policy.scored:
            shape = (self.model_config.num_layers, self.model_config.num_kv_heads)
            capacity = len(parsed.token_ids) + params.max_tokens
            request.new_score_state = lambda: ScoreState.empty(*shape, capacity, self.device)
        request.prompt_embeds = parsed.embeds
        request.embedded_spans = [(0, len(parsed.token_ids))] if parsed.embeds is not None else []
        first = Sequence(request, 0, parsed.token_ids, self._generator(params, 0))
        first.kv_state = request.new_score_state()
        self._attach_detokenizer(first)
        request.seqs.append(first)
        self.requests[request_id] = request
        self.scheduler.add(first)
        if self.offload is not None:
            self.offload.request_load(first)
        return request

    def _new_request_id(self, request_id: str | None) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests or request_id in self.frame_requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its last state, or None if unknown.

        A frame sent to a stream is part of the stream once accepted: aborting its request only
        stops waiting for it.
        """
        if self.frame_requests.pop(request_id, None) is not None:
            return None
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                if self.offload is not None:
                    self.offload.forget(seq)
                self.scheduler.finish(seq)
        request.forked = True
        request.metrics.finished_time = time.time()
        return request.output()

    def pin_prefix(self, prompt: PromptType) -> int:
        """Keep a computed prompt prefix's full blocks cached until `unpin_prefix`; returns tokens pinned.

        Refused (ValueError) if what stays unpinned could no longer hold a request in flight.
        """
        token_ids, root = self._prefix_key(prompt)
        in_flight = (
            blocks_for(len(r.prompt_token_ids) + r.params.max_tokens, self.block_size) for r in self.requests.values()
        )
        return self.manager.pin(token_ids, root, keep_free=max(in_flight, default=0))

    def unpin_prefix(self, prompt: PromptType) -> int:
        """Release a pinned prefix to normal LRU eviction; returns tokens unpinned (0 if not pinned)."""
        token_ids, root = self._prefix_key(prompt)
        return self.manager.unpin(token_ids, root)

    def _prefix_key(self, prompt: PromptType) -> tuple[list[int], bytes]:
        if not self.config.enable_prefix_caching:
            raise ValueError("pinning needs enable_prefix_caching=True")
        parsed = self._parse(prompt)
        if len(parsed.token_ids) < self.block_size:
            raise ValueError(
                f"a prefix of {len(parsed.token_ids)} tokens fills no block of {self.block_size}; nothing to pin"
            )
        return parsed.token_ids, root_hash(self.cache_namespace, parsed.salt)

    # --- sessions -----------------------------------------------------------------------------

    def session_prompt(self, tokens_or_request: PromptType | RequestOutput, cache_salt: str | None = None) -> dict:
        """What a session covers, as a prompt dict of token ids and cache salt.

        `tokens_or_request` is a prompt as `add_request` takes it, or a RequestOutput (its prompt
        and its first completion's tokens). `cache_salt`, when given, must agree with the prompt's.
        """
        self._require_sessions()
        if isinstance(tokens_or_request, RequestOutput):
            output = tokens_or_request
            tokens_or_request = [*output.prompt_token_ids, *(output.outputs[0].token_ids if output.outputs else ())]
        parsed = self._parse(tokens_or_request)
        if None not in (cache_salt, parsed.salt) and cache_salt != parsed.salt:
            raise ValueError("cache_salt differs from the prompt's own cache_salt; give one of them")
        return {
            "prompt_token_ids": parsed.token_ids,
            "cache_salt": cache_salt if cache_salt is not None else parsed.salt,
        }

    def pack_session(
        self, tokens_or_request: PromptType | RequestOutput, cache_salt: str | None = None
    ) -> torch.Tensor:
        """The session file's bytes for what `session_prompt` makes of the arguments, read from the pool.

        Raises PrefixNotCached (a ValueError) unless every whole block of it is cached: run the
        prompt first (one token is enough) and pack again.
        """
        prompt = self.session_prompt(tokens_or_request, cache_salt)
        root = root_hash(self.cache_namespace, prompt["cache_salt"])
        return pack_session(self.entry_format, self.manager.pool, self.storage, prompt["prompt_token_ids"], root)

    def save_session(
        self, tokens_or_request: PromptType | RequestOutput, path: str | os.PathLike, cache_salt: str | None = None
    ) -> int:
        """Write the session's cached blocks (see `pack_session`) to one file at `path`, atomically;
        returns the bytes written."""
        return write_session(path, self.pack_session(tokens_or_request, cache_salt))

    def read_session(self, path: str | os.PathLike, cache_salt: str | None = None, name: str | None = None) -> Session:
        """Read and verify a session file (safe off the engine thread: it does not touch the pool).

        A missing file is FileNotFoundError; a corrupted, truncated, foreign or wrongly salted
        one a ValueError naming the file (as `name`, by default its path) and the reason.
        """
        self._require_sessions()
        return read_session(path, self.entry_format, root_hash(self.cache_namespace, cache_salt), name)

    def _require_sessions(self) -> None:
        if not self.config.enable_prefix_caching:
            raise ValueError(
                "sessions need enable_prefix_caching=True: a loaded session is found through the prefix cache"
            )

    def install_session(self, session: Session) -> list[int]:
        """Put a read session's blocks in the pool as cached prefix blocks; returns its token ids."""
        install_session(self.manager.pool, self.storage, session)
        return list(session.token_ids)

    def load_session(self, path: str | os.PathLike, cache_salt: str | None = None) -> list[int]:
        """`read_session` then `install_session`: a later prompt starting with the returned token
        ids finds all their whole blocks cached (until the pool evicts them)."""
        return self.install_session(self.read_session(path, cache_salt))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.frame_requests or self._ready)

    def _parse(self, prompt: PromptType, embeds: bool = False) -> ParsedPrompt:
        hidden = self.model_config.hidden_size if embeds else None
        return parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, hidden)

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """The model's own input embeddings of `token_ids` ([tokens, hidden], model dtype, CPU): what
        `prompt_embeds` or an embedding frame must look like."""
        ids = self._parse(list(token_ids)).token_ids
        with torch.inference_mode():
            return self.runner.model.embed_tokens(torch.tensor(ids, device=self.device)).cpu().clone()

    # --- streams ----------------------------------------------------------------------------------

    def open_stream(
        self,
        system: PromptType,
        policy: str | KVPolicy = "frame_window",
        separator: str = "\n",
        stream_id: str | None = None,
        request_id: str | None = None,
        chat: bool = True,
    ) -> FrameRequest:
        """Start a stream: queue its system prompt (text, ids, or a dict with "cache_salt"), which
        may come from the prefix cache. The returned request finishes once it is computed.

        With `chat` and a text system prompt, the model's chat template frames the stream: the
        system message, then a user turn that the frames fill; a text question closes that turn
        and opens the assistant's (only in the question's fork: the stream's turn stays open).
        """
        policy = parse_policy(policy, stream=True)
        policy.check(self.limits)
        stream_id = stream_id if stream_id is not None else f"stream-{next(self._ids)}"
        if not isinstance(stream_id, str) or not stream_id:
            raise ValueError(f"stream_id={stream_id!r} must be a non-empty string")
        if stream_id in self.streams:
            raise ValueError(f"stream_id {stream_id!r} is already in use")
        if not isinstance(separator, str):
            raise ValueError(f"separator={separator!r} must be a string")
        request_id = self._new_request_id(request_id)
        suffix = ""
        if chat and isinstance(system, str) and self.tokenizer is not None and self.tokenizer.chat_template:
            before, suffix = self._chat_frame(system)
            system = self._continuation(before, before)  # the template writes BOS where the model wants it
        parsed = self._parse(system)
        if len(parsed.token_ids) >= self.max_model_len:
            raise ValueError(
                f"the system prompt has {len(parsed.token_ids)} tokens; max_model_len={self.max_model_len} "
                "leaves no room for frames"
            )
        needed = blocks_for(len(parsed.token_ids), self.block_size) * 2
        if needed > self.num_blocks:
            raise ValueError(f"the system prompt needs {needed} KV blocks but the pool has only {self.num_blocks}")
        self._ensure_room(blocks_for(len(parsed.token_ids), self.block_size), "a stream's system prompt")
        root = root_hash(self.cache_namespace, parsed.salt)
        now = time.time()
        request = Request(stream_id, parsed.text, parsed.token_ids, SamplingParams(max_tokens=1), root, now, policy)
        request.stream_id = stream_id
        seq = Sequence(request, 0, parsed.token_ids, None)
        seq.frames = FrameLog(len(parsed.token_ids), policy.sinks)
        request.seqs.append(seq)
        stream = Stream(stream_id, seq, policy, separator, suffix)
        self._attach_archive(stream)
        self.streams[stream_id] = stream
        opened = FrameRequest(request_id, stream, None, parsed.text, parsed.token_ids, RequestMetrics(now))
        stream.pending.append(opened)
        self.frame_requests[request_id] = opened
        self.scheduler.add(seq)
        if self.offload is not None:
            self.offload.request_load(seq)
        return opened

    #: evicted frames a stream keeps recallable (their summaries take ~11 KiB of RAM each here)
    RECALL_LIMIT = 1024

    def _attach_archive(self, stream: Stream) -> None:
        """With a KV tier, evicted frames go to its first tier, recallable by relevance."""
        if self.offload is None or not self.offload.tiers:
            return
        namespace = self.cache_namespace + b"|stream|" + stream.stream_id.encode()
        archive = FrameArchive(self.offload.tiers[0], namespace, self.editor.inv_freq, self.RECALL_LIMIT)
        storage, bs = self.storage, self.block_size

        def store(seq: Sequence, frames) -> None:
            table = torch.tensor(seq.block_table, dtype=torch.long)
            for frame in frames:
                slots = torch.arange(frame.start, frame.end)
                keys, values = storage.gather_tokens(table[slots // bs] * bs + slots % bs)
                first = frame.start + seq.rope_offset
                archive.store(frame, seq.token_ids[frame.start : frame.end], keys, values, first)

        stream.archive = archive
        stream.seq.frames.archive = store

    def _chat_frame(self, system: str) -> tuple[str, str]:
        """(the text before a user message's content, the text after it up to the assistant's turn)."""
        mark = "\x00frames\x00"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": mark}]
        rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        before, found, after = rendered.partition(mark)
        if not found:
            raise ValueError("the model's chat template does not show a user message's content; pass chat=False")
        return before, after

    def _continuation(self, shown: str, text: str) -> PromptType:
        """`text` as a prompt tokenized without special tokens added (a stream's frames and questions
        continue it; a rendered template has its own BOS), shown as `shown`."""
        if self.tokenizer is None:
            return text  # refused by the parser with its usual message
        return {"prompt": shown, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def stream(self, stream_id: str) -> Stream:
        """The open stream `stream_id`; KeyError naming it otherwise."""
        stream = self.streams.get(stream_id)
        if stream is None:
            raise KeyError(f"no open stream {stream_id!r}")
        return stream

    def append_frame(
        self, stream_id: str, frame: FrameType, skip_repeat: bool = False, request_id: str | None = None
    ) -> FrameRequest:
        """Queue one frame after the stream's others: text (the stream's separator is added), token
        ids, embedding rows [tokens, hidden], or a prompt dict of one of them. The request finishes
        once the frame is computed; with `skip_repeat`, a frame identical to one the stream holds
        finishes at once, uncomputed."""
        stream = self.stream(stream_id)
        if isinstance(frame, str):
            frame = self._continuation(frame, frame + stream.separator)
        elif isinstance(frame, torch.Tensor):
            frame = {"prompt_embeds": frame}
        parsed = self._parse(frame, embeds=True)
        if parsed.salt is not None:
            raise ValueError("a frame cannot carry a cache_salt: give it to open_stream")
        request_id = self._new_request_id(request_id)
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
            self._ready.append(skipped.output())
            return skipped
        added = log.add(seq.num_tokens, len(parsed.token_ids), digest, parsed.embeds)
        seq.token_ids.extend(parsed.token_ids)
        request = FrameRequest(request_id, stream, added, parsed.text, parsed.token_ids, metrics, repeat)
        stream.pending.append(request)
        self.frame_requests[request_id] = request
        if seq.status is SequenceStatus.PARKED:
            self.scheduler.add_running(seq)
        return request

    def _check_frame(self, stream: Stream, num_tokens: int) -> None:
        # What the stream holds once this frame is in and the window has evicted: it must fit the
        # model's positions (with a question's first token) and the pool.
        log, window = stream.seq.frames, stream.policy.frames
        recent = [f.length for f in log.frames if not f.sink][-(window - 1) :] if window > 1 else []
        held = log.keep_tokens + sum(recent) + num_tokens
        limit = self.max_model_len - 1
        if held > limit:
            raise ValueError(
                f"a frame of {num_tokens} tokens would make the stream hold {held} tokens "
                f"({log.keep_tokens} kept for good, the last {len(recent)} frames and this one), "
                f"over max_model_len={self.max_model_len} less one for a question: send shorter frames "
                "or open the stream with fewer frames"
            )
        needed = 2 * blocks_for(held, self.block_size)
        if needed > self.num_blocks:
            raise ValueError(f"the stream would need {needed} KV blocks but the pool has only {self.num_blocks}")
        seq = stream.seq
        # Until the window evicts, the frame's blocks come on top of what the stream holds, plus a
        # scratch block and, at the first eviction, the unrotated copies of the kept leading blocks.
        growth = blocks_for(seq.num_tokens + num_tokens, self.block_size) - len(seq.block_table) + 1
        if not seq.pristine_blocks:
            growth += blocks_for(log.keep_tokens, self.block_size)
        self._ensure_room(growth, f"a frame of {num_tokens} tokens")

    def _ensure_room(self, blocks: int, what: str) -> None:
        """Refuse (PoolFull) work of streams, which is never preempted, that the pool could not hold
        even by preempting every other sequence: it would wait forever."""
        running = self.scheduler.running
        available = self.manager.num_free_blocks + sum(len(s.block_table) for s in running if s.preemptible)
        if blocks > available:
            raise PoolFull(
                f"{what} needs {blocks} more KV blocks, but only {available} of the pool's {self.num_blocks} "
                "can be freed for it (streams and their questions hold the rest and are never preempted): "
                "close a stream or retry once questions finish"
            )

    def ask_stream(
        self,
        stream_id: str,
        question: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        recall: int = 0,
    ) -> Request:
        """A request answering `question` from the stream's cached frames, once every frame sent
        before it is computed: it forks the stream's blocks and frees its own when done.

        `recall=k` first brings back the k evicted frames most relevant to the question (from the
        stream's tier; cache/recall.py) into the question's copy of the cache."""
        stream = self.stream(stream_id)
        if not isinstance(recall, int) or isinstance(recall, bool) or recall < 0:
            raise ValueError(f"recall={recall!r} must be an integer >= 0")
        if recall and stream.archive is None:
            raise ValueError(
                f"recall={recall} needs a KV tier for evicted frames (kv_host_gb, kv_disk_dir or kv_redis_url)"
            )
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be given for a stream question: its frames are cached")
        if params.kv_policy is not None:
            raise ValueError("a stream question takes no kv_policy: it runs on the stream's cache")
        if isinstance(question, str):
            question = self._continuation(question, question + stream.question_suffix)
        parsed = self._parse(question)
        if parsed.salt is not None:
            raise ValueError("a question cannot carry a cache_salt: give it to open_stream")
        params.check_token_ids(self.model_config.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} is more sequences than max_num_seqs={self.config.max_num_seqs}")
        kept = stream.seq.num_tokens
        room = self.max_model_len - kept - len(parsed.token_ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(room, 1))
        if params.max_tokens > room:
            raise ValueError(
                f"the stream holds {kept} tokens and the question has {len(parsed.token_ids)}: "
                f"max_tokens={params.max_tokens} exceeds max_model_len={self.max_model_len}"
            )
        total = kept + len(parsed.token_ids) + params.max_tokens
        self._ensure_room(blocks_for(total, self.block_size) - len(stream.seq.block_table) + 1, "the question")
        request_id = self._new_request_id(request_id)
        request = Request(
            request_id, parsed.text, parsed.token_ids, params, stream.seq.root_hash, time.time(), stream.policy
        )
        request.stream_id = stream_id
        request.no_prefix_cache = True  # the forked blocks are the stream's, rotated and compacted
        request.recall = recall
        self.requests[request_id] = request
        stream.last_used = time.monotonic()
        if stream.seq.status is SequenceStatus.PARKED:
            self._launch_ask(stream, request)
        else:
            stream.waiting_asks.append(request)
        return request

    def _launch_ask(self, stream: Stream, request: Request) -> None:
        if request.recall and self._launch_recalling(stream, request):
            return
        source, question, params = stream.seq, request.prompt_token_ids, request.params
        kept = source.num_computed_tokens
        if kept + source.rope_offset + len(question) + params.max_tokens > self.editor.rope_len:
            self.editor.rebase_tokens(source, source.frames.keep_tokens)
        request.prompt_token_ids = source.token_ids + question
        request.embedded_spans = source.frames.embedded_spans()
        room = self.max_model_len - len(request.prompt_token_ids)
        if params.max_tokens > room:  # frames longer than those the question was checked against
            request.params = dataclasses.replace(params, max_tokens=max(room, 1))
        seq = Sequence(request, 0, request.prompt_token_ids, self._generator(request.params, 0))
        seq.num_computed_tokens, seq.rope_offset = kept, source.rope_offset
        self.manager.fork(source, seq)
        self._attach_detokenizer(seq)
        request.seqs.append(seq)
        self.scheduler.add_running(seq)

    #: a question that asks nothing in particular: what every question's queries share (cache/recall.py)
    NEUTRAL_QUESTION = "What happened?"

    def _mean_queries(self, token_ids: list[int]) -> torch.Tensor:
        return self.runner.model.mean_queries(torch.tensor(token_ids, device=self.device)).cpu()

    def _launch_recalling(self, stream: Stream, request: Request) -> bool:
        """Start the question on its own copy of the cache: sinks, the recalled frames, the kept
        frames, at positions 0, 1, ... (every key re-rotated once); False if nothing came back."""
        source, question, params, log = stream.seq, request.prompt_token_ids, request.params, stream.seq.frames
        started = time.perf_counter()
        queries = self._mean_queries(question)
        if stream.neutral_queries is None:
            text = self.NEUTRAL_QUESTION + stream.question_suffix
            neutral = self._parse(self._continuation(text, text)).token_ids
            stream.neutral_queries = self._mean_queries(neutral)
        room = self.max_model_len - source.num_computed_tokens - len(question) - params.max_tokens
        chosen, total = [], 0
        for archived in reversed(
            stream.archive.choose(queries, stream.neutral_queries, request.recall)
        ):  # the newest fit first
            if total + len(archived.token_ids) <= room:
                chosen.insert(0, archived)
                total += len(archived.token_ids)
        c = self.model_config
        loaded = stream.archive.load(chosen, (c.num_layers, c.num_kv_heads, c.head_dim), self.dtype)
        recalled = sum(len(a.token_ids) for a, _, _ in loaded)
        keep, kept = log.keep_tokens, source.num_computed_tokens
        needed = blocks_for(kept + recalled + len(question) + params.max_tokens, self.block_size)
        if not loaded or not source.pristine_blocks or needed > self.manager.num_free_blocks:
            return False
        bs, pool, inv_freq = self.block_size, self.manager.pool, self.editor.inv_freq

        def slots(table: list[int], lo: int, hi: int) -> torch.Tensor:
            index = torch.arange(lo, hi)
            return torch.tensor(table, dtype=torch.long)[index // bs] * bs + index % bs

        sink_k, sink_v = self.storage.gather_tokens(slots(source.pristine_blocks, 0, keep))  # at positions 0..keep-1
        keys, values, position = [sink_k.float()], [sink_v], keep
        for _, k, v in loaded:
            keys.append(rotate(k, torch.arange(position, position + k.shape[1]), inv_freq))
            values.append(v)
            position += k.shape[1]
        recent_k, recent_v = self.storage.gather_tokens(slots(source.block_table, keep, kept))
        keys.append(rotate(recent_k, torch.full((kept - keep,), recalled - source.rope_offset), inv_freq))
        values.append(recent_v)
        table = [pool.take().block_id for _ in range(blocks_for(kept + recalled, bs))]
        self.storage.scatter_tokens(slots(table, 0, kept + recalled), torch.cat(keys, 1), torch.cat(values, 1))
        frames = [t for a, _, _ in loaded for t in a.token_ids]
        request.prompt_token_ids = source.token_ids[:keep] + frames + source.token_ids[keep:] + question
        held = source.frames.embedded_spans()
        spans, position = [(a, b) for a, b in held if b <= keep], keep
        for archived, _, _ in loaded:
            if archived.embedded:
                spans.append((position, position + len(archived.token_ids)))
            position += len(archived.token_ids)
        request.embedded_spans = spans + [(a + recalled, b + recalled) for a, b in held if a >= keep]
        seq = Sequence(request, 0, request.prompt_token_ids, self._generator(params, 0))
        seq.num_computed_tokens, seq.block_table = kept + recalled, table
        request.recalled_frames = [a.index for a, _, _ in loaded]
        request.recall_seconds = time.perf_counter() - started
        self._attach_detokenizer(seq)
        request.seqs.append(seq)
        self.scheduler.add_running(seq)
        return True

    def fork_stream(self, stream_id: str, new_id: str | None = None) -> Stream:
        """A new stream sharing every block of `stream_id` (copy-on-write) from here on."""
        source = self.stream(stream_id)
        if source.seq.status is not SequenceStatus.PARKED:
            raise ValueError(f"stream {stream_id!r} has frames still computing; fork it once they are in")
        new_id = new_id if new_id is not None else f"stream-{next(self._ids)}"
        if new_id in self.streams:
            raise ValueError(f"stream_id {new_id!r} is already in use")
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
        request.stream_id = new_id
        seq = Sequence(request, 0, old.token_ids, None)
        seq.num_computed_tokens, seq.rope_offset = old.num_computed_tokens, old.rope_offset
        seq.block_hashes, seq.chain_serials = list(old.block_hashes), list(old.chain_serials)
        seq.frames = old.frames.copy()
        seq.status = SequenceStatus.PARKED
        self.manager.fork(old, seq)
        request.seqs.append(seq)
        stream = Stream(new_id, seq, source.policy, source.separator, source.question_suffix)
        self._attach_archive(stream)  # its own: frames evicted before the fork stay the source's
        self.streams[new_id] = stream
        return stream

    def close_stream(self, stream_id: str) -> list[str]:
        """Free a stream's blocks. Frames and questions still waiting for it end (as aborted);
        returns their request ids. Questions already answering keep their own copies and finish."""
        stream = self.streams.pop(stream_id, None)
        if stream is None:
            raise KeyError(f"no open stream {stream_id!r}")
        ended = []
        for pending in stream.pending:
            if self.frame_requests.pop(pending.request_id, None) is not None:
                pending.finished = True
                self._ready.append(pending.output())
                ended.append(pending.request_id)
        for request in stream.waiting_asks:
            output = self.abort_request(request.request_id)
            if output is not None:
                self._ready.append(output)
                ended.append(request.request_id)
        self.scheduler.finish(stream.seq)
        if stream.archive is not None:
            stream.archive.close()
        return ended

    def _stream_progress(self, stream: Stream, now: float) -> list[RequestOutput]:
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
            if self.frame_requests.pop(first.request_id, None) is not None:
                outputs.append(first.output())
        if seq.num_pending == 0 and seq.status is SequenceStatus.RUNNING:
            self.scheduler.park(seq)
            waiting, stream.waiting_asks = stream.waiting_asks, []
            for request in waiting:
                if request.request_id in self.requests:
                    self._launch_ask(stream, request)
        return outputs

    def _resolve_max_tokens(
        self, params: SamplingParams, token_ids: list[int], root: bytes, policy: KVPolicy
    ) -> SamplingParams:
        prompt_len = len(token_ids)
        limit = self.max_model_len
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
        if needed > self.num_blocks:
            held = "" if isinstance(policy, Full) else f" (kv_policy={policy} holds up to {peak} tokens)"
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens={params.max_tokens} needs {needed} KV blocks{held} "
                f"but the pool has only {self.num_blocks}"
            )
        usable = self.manager.usable_blocks(token_ids, root)
        if needed > usable:
            pinned = len(self.manager.pinned_blocks)
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_tokens={params.max_tokens} needs {needed} KV blocks "
                f"but only {usable} of the pool's {self.num_blocks} can hold it: {pinned} are pinned "
                "(unpin a prefix or lower max_tokens)"
            )
        return params

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed((params.seed * 1_000_003 + index) % 2**64)

    def _attach_detokenizer(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.request.prompt_token_ids, skip_special_tokens=seq.params.skip_special_tokens
            )

    # --- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the (cumulative) outputs of requests that made progress."""
        if self.offload is not None:
            self.offload.poll(len(self.scheduler.running))
        ready, self._ready = self._ready, []
        batch = self.scheduler.schedule()
        if not batch:
            if ready:
                return ready
            if self.offload is not None and self.offload.loading:
                self.offload.wait(timeout=0.01)  # only loading sequences wait: nothing else to do
                return []
            if self.scheduler.waiting or self.scheduler.running:
                # Admission checks make this unreachable; failing beats a caller spinning on step().
                raise RuntimeError(
                    f"{len(self.scheduler.waiting)} sequences wait and {len(self.scheduler.running)} run "
                    "(streams and their questions are never preempted) but none can be scheduled "
                    f"({self.manager.num_free_blocks} of {self.num_blocks} blocks free, "
                    f"{len(self.manager.pinned_blocks)} pinned)"
                )
            return []
        copies, self.manager.pending_copies = self.manager.pending_copies, []
        started = time.perf_counter()
        try:
            result = self.runner.execute(batch, copies)
        except Exception:
            for item in batch:
                self.abort_request(item.seq.request.request_id)
            raise
        if self.offload is not None:
            prompt_tokens = sum(item.num_tokens for item in batch if item.num_tokens > 1)
            self.offload.observe_prefill(prompt_tokens, time.perf_counter() - started)
        now = time.time()
        touched: dict[str, Request] = {}
        streams: list[Stream] = []
        for i, item in enumerate(batch):
            self._record_progress(item, result, i, now)
            if item.seq.frames is not None:
                streams.append(self.streams[item.seq.request.stream_id])
            else:
                touched[item.seq.request.request_id] = item.seq.request
        self._sample(batch, result, now)
        outputs = ready
        for stream in streams:
            outputs.extend(self._stream_progress(stream, now))
        for request in touched.values():
            outputs.append(request.output())
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
                self.counters["finished_requests"] += 1
        return outputs

    def _record_progress(self, item: ScheduledSeq, result: StepLogits, i: int, now: float) -> None:
        seq, request = item.seq, item.seq.request
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
            request.num_cached_tokens = seq.num_computed_tokens
            self.counters["prompt_tokens"] += seq.num_prompt_tokens
            if not seq.no_prefix_cache and self.config.enable_prefix_caching:
                self.counters["prefix_cache_queries"] += seq.num_prompt_tokens
                self.counters["prefix_cache_hits"] += seq.num_computed_tokens
            if self.offload is not None:
                self.offload.on_admit(seq)
        if result.prompt_rows[i] is not None:
            first, last = result.prompt_rows[i]
            logprobs = result.logits[first:last].log_softmax(dim=-1)
            k = request.params.prompt_logprobs
            start = len(request.prompt_logprobs)
            for j in range(last - first):
                request.prompt_logprobs.append(
                    token_logprobs(logprobs[j], request.prompt_token_ids[start + j], k, self.sampler.token_text)
                )
        seq.num_computed_tokens += item.num_tokens
        self.manager.commit(seq)
        if self.offload is not None:
            self.offload.on_commit(seq)
        evicted = self.editor.after_step(seq.kv_policy, seq)
        if evicted:
            self.evicted_tokens[seq.kv_policy.name] += evicted

    def _sample(self, batch: list[ScheduledSeq], result: StepLogits, now: float) -> None:
        seqs: list[Sequence] = []
        rows: list[int] = []
        for i, item in enumerate(batch):
            row = result.sample_rows[i]
            if row < 0:
                continue
            family = [item.seq] if item.seq.request.forked else self._fork(item.seq)
            seqs.extend(family)
            rows.extend([row] * len(family))
        if not seqs:
            return
        # one row per sequence, in order (every batch without n > 1): no copy of the logits
        logits = result.logits if rows == list(range(result.logits.shape[0])) else result.logits[rows]
        samples = self.sampler(logits, seqs)
        for seq, sample in zip(seqs, samples):
            self._append_token(seq, sample, now)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        family = [parent]
        for index in range(1, request.params.n):
            child = parent.fork(index, self._generator(request.params, index))
            self._attach_detokenizer(child)
            self.manager.fork(parent, child)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            family.append(child)
        request.forked = True
        return family

    def _append_token(self, seq: Sequence, sample: Sampled, now: float) -> None:
        token = sample.token_id
        seq.token_ids.append(token)
        self.counters["generation_tokens"] += 1
        if seq.request.metrics.first_token_time is None:
            seq.request.metrics.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(sample.top_logprobs)
            seq.cumulative_logprob += sample.logprob
        new_text = seq.detokenizer.push([token]) if seq.detokenizer is not None else ""
        seq.text += new_text
        context = None if seq.kv_policy.unbounded else self.max_model_len
        reason = seq.check_stop(token, len(new_text), self.eos_token_ids, context)
        if reason is not None and not isinstance(reason[1], str) and seq.detokenizer is not None:
            # Bytes held back for an unfinished character end the text as U+FFFD (a whole decode's ending).
            seq.text += (tail := seq.detokenizer.flush())
            reason = seq.check_stop(token, len(tail), self.eos_token_ids, context)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            if self.offload is not None:
                self.offload.on_finish(seq)
            self.scheduler.finish(seq)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block not in use or pinned (tiers keep theirs); returns blocks dropped."""
        return self.manager.pool.evict_cached()

    def close(self) -> None:
        """Write what the tiers have queued and close them; the engine is unusable afterwards."""
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    # --- introspection ------------------------------------------------------------------------

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Each tier's bytes used and capacity (None where the store keeps its own), hits, misses,
        load/store bytes and seconds, errors, and the controller's counters under "offload"
        (empty without tiers)."""
        if self.offload is None:
            return {}
        stats = self.offload.stats()
        for tier in self.offload.tiers:
            stats[tier.name]["capacity_bytes"] = tier.capacity_bytes
        return stats

    def block_states(self) -> bytes:
        """One byte per KV block: 0 free (empty), 1 in use, 2 cached and evictable, 3 pinned."""
        return self.manager.block_states()

    def stats(self) -> dict[str, float | dict]:
        """Counters and gauges: prefix-cache hit rate, pool usage, queue depths, preemptions; and
        `kernel_isa`, the instruction-set level of the native kernels and each family's variant."""
        queries = self.counters["prefix_cache_queries"]
        return {
            **self.counters,
            "prefix_cache_hit_rate": self.counters["prefix_cache_hits"] / queries if queries else 0.0,
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.manager.num_free_blocks,
            "kv_cache_usage": self.manager.usage,
            "num_requests_running": len({s.request.request_id for s in self.scheduler.running}),
            "num_requests_waiting": len({s.request.request_id for s in self.scheduler.waiting}),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swaps_out": self.swapper.num_swaps_out,
            "num_swaps_in": self.swapper.num_swaps_in,
            "swap_bytes_used": self.swapper.bytes_used,
            "num_pinned_blocks": len(self.manager.pinned_blocks),
            **{f"evicted_tokens_{name}": count for name, count in self.evicted_tokens.items()},
            "kernel_isa": isa.report(kernels.native()),
        }
