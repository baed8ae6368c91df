"""The engine loop: admit requests, run one scheduled step at a time, turn logits into outputs.

`LLMEngine` orchestrates: the builder wires the cache (engine/builder.py), admission checks and
builds requests (engine/admission.py), the stream host runs streams (engine/stream_host.py),
session files go through engine/sessions.py, the decoder turns logits into tokens
(engine/decoding.py), and the step's commit settles the sequences a step ran (engine/commit.py).
The engine owns the step: schedule, run the model, settle, report.

One thread uses an engine. Another thread (a server's) reads only what `info()` says, which never
changes, or asks the engine's thread for snapshots (`stats`, `waiting_prompt_tokens`, `memory_now`);
the few methods safe from any thread say so.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbank import kernels, memory
from kvbank.cache.manager import blocks_for
from kvbank.cache.policies import DEFAULT_STREAM_POLICY, KVPolicy
from kvbank.cache.tiers.entry import dtype_name
from kvbank.config import EngineConfig
from kvbank.engine.blend_plan import BlendPlan, document_lead, document_root
from kvbank.engine.builder import batch_variance, build_cache, build_services, document_sequence
from kvbank.engine.commit import StepCommit
from kvbank.engine.counters import EngineCounters
from kvbank.engine.outputs import RequestFailed, RequestOutput
from kvbank.engine.pacing import StepPacer
from kvbank.engine.params import SamplingParams
from kvbank.engine.prompts import PromptType, parse_prompt
from kvbank.engine.runner import StepLogits
from kvbank.engine.scheduler import ScheduledSeq
from kvbank.engine.sequence import Request, Sequence
from kvbank.engine.stream_questions import RequestHooks
from kvbank.engine.streams import FrameRequest, FrameType, PoolFull, Stream
from kvbank.kernels import isa
from kvbank.kernels.allocator import keep_freed_memory
from kvbank.memory import MemoryReport
from kvbank.models.build import build_model
from kvbank.models.config import ModelConfig
from kvbank.tokenizer import Tokenizer, load_chat_template

__all__ = ["EngineInfo", "LLMEngine", "PromptType"]

log = logging.getLogger("kvbank")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine is, fixed once it is built: safe to read from any thread."""

    config: EngineConfig
    model_config: ModelConfig
    model_path: str
    tokenizer: Tokenizer | None
    max_model_len: int
    block_size: int
    num_blocks: int
    #: most tokens one step computes
    max_num_batched_tokens: int
    #: whether KV tiers keep the pool's prefixes (kv_host_gb, kv_disk_dir, kv_redis_url)
    has_tiers: bool


class LLMEngine:
    """One model, one KV pool, one scheduler; `step()` advances every running request by a step."""

    def __init__(self, config: EngineConfig, progress: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        self.device, self.dtype = torch.device(config.device), config.torch_dtype
        if self.device.type == "cpu":
            keep_freed_memory()
        template = None if config.chat_template is None else load_chat_template(config.chat_template)
        built = build_model(config, progress)
        self.model_config, self.model_path, self.tokenizer = built.config, built.path, built.tokenizer
        if template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = template
        self.packed_layers = built.packed_layers
        self.max_model_len = built.config.max_position_embeddings
        self.block_size, self.kv_format = config.block_size, config.kv_format
        cache = build_cache(config, built, self.device)
        self.pool_plan, self.num_blocks = cache.pool_plan, cache.num_blocks
        self.storage, self.manager = cache.storage, cache.manager
        self.offload, self.swapper = cache.offload, cache.swapper
        self.cache_namespace, self.entry_format = cache.namespace, cache.entry_format
        self.limits, self.kv_policy, self.editor = cache.limits, cache.kv_policy, cache.editor
        self.requests: dict[str, Request] = {}
        hooks = RequestHooks(self._track, self._untrack, self._tracked)
        parts = build_services(config, built, cache, self.device, hooks, self._in_use)
        self.scheduler, self.runner, self.admission = parts.scheduler, parts.runner, parts.admission
        #: streams (open, append, ask, fork, close), and session files (prompt, pack, save, read, install)
        self.streams_host, self.sessions, self.decoder = parts.streams_host, parts.sessions, parts.decoder
        self.eos_token_ids = self.decoder.eos_token_ids
        #: sizes each step's prefill beside its decodes to the step-time target (None: no target)
        self.pacer = None
        if config.max_step_ms:
            budget = self.scheduler.max_num_batched_tokens
            self.pacer = StepPacer(config.max_step_ms / 1000, budget, min(config.block_size, budget))
        #: outputs settled between steps (a skipped repeat frame, a closed stream's frames), sent by the next step
        self._ready: list[RequestOutput] = []
        self.counters = EngineCounters()
        # fmt: off
        self.commit = StepCommit(
            self.manager, self.offload, self.editor, self.scheduler, self.streams_host, self.decoder, self.counters,
            config.enable_prefix_caching, self._fail,
        )
        # fmt: on
        self.memory = memory.measure(built.model, self.storage, built.load_peak)
        #: whether greedy output is independent of the batch (config.batch_invariant, where kept)
        self.batch_invariant = False
        if config.batch_invariant:
            reason = batch_variance(built.model, self.storage)
            self.batch_invariant = reason is None
            if reason is not None:
                log.warning(
                    "batch_invariant is not kept here: %s (%s, %s, native kernels at %s); greedy output may "
                    "depend on what else runs. It holds for bfloat16 on a CPU at avx2 or above with 4- or "
                    "8-bit GGUF weights.",
                    reason,
                    dtype_name(self.dtype),
                    self.device.type,
                    isa.report(kernels.native())["active"] or "none",
                )

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.requests or self.streams_host.has_frame_request(request_id)

    def _track(self, request: Request) -> None:
        self.requests[request.request_id] = request

    def _untrack(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def _tracked(self, request_id: str) -> bool:
        return request_id in self.requests

    @property
    def kv_bytes_per_token(self) -> float:
        """Pool bytes per token across all layers, scales and zero points included (a hybrid
        cache: its full-attention layers; the windowed layers hold a bounded number of blocks)."""
        return self.pool_plan.bytes_per_token

    @property
    def streams(self) -> dict[str, Stream]:
        """Open streams by id."""
        return self.streams_host.streams

    # --- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError for anything that could never run."""
        request = self.admission.request(prompt, params or SamplingParams(), request_id, arrival_time)
        if self.streams:
            # Refused now (PoolFull) rather than left waiting when streams, which are never
            # preempted, hold so much of the pool that even its prompt could not be computed.
            ids = request.prompt_token_ids
            needed = blocks_for(len(ids) + 1, self.block_size) - self.manager.held_prefix_blocks(ids, request.root_hash)
            what = f"a prompt of {len(ids)} tokens"
            self.admission.ensure_room(needed, what, self.streams_host.promised())
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])
        if self.offload is not None:
            self.offload.request_load(request.seqs[0])
            if request.blend is not None:
                self._load_documents(request.seqs[0])
        return request

    def precompute_documents(self, documents: list, cache_salt: str | None = None) -> dict[str, int]:
        """Compute and cache `documents` (texts or token id lists) as a blended prompt's first use
        would, so that later prompts reuse them (engine/blend.py); each runs as a prompt of its own,
        now, on this thread. Returns counts: documents, computed, cached (the pool held them),
        tokens stored (each document's whole blocks; a shorter one stores none)."""
        blender = self.runner.blender
        if blender is None:
            raise ValueError(f"documents cannot be blended here: {self.admission.blend_refusal}")
        if not isinstance(documents, list) or not documents:
            raise ValueError("documents must be a non-empty list of texts or token id lists")
        prompt: dict = {"segments": [{"document": d} for d in documents]}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        root = document_root(self.cache_namespace, parsed.salt)
        plan = BlendPlan(parsed.documents, 0.0, root, self.model_config.num_layers, document_lead(self.tokenizer))
        counts = {"documents": len(documents), "computed": 0, "cached": 0, "tokens": 0}
        for doc in parsed.documents:
            tokens = plan.stored_tokens(doc, parsed.token_ids, self.block_size)
            if len(tokens) > len(plan.lead):
                computed = blender.precompute(tokens, root)
                counts["computed" if computed else "cached"] += 1
                counts["tokens"] += len(tokens) - len(plan.lead)
        return counts

    def _load_documents(self, seq: Sequence) -> None:
        """Ask the tiers for the blocks of `seq`'s documents the pool lacks (engine/blend.py): they
        are held for it until its blend places them, and it waits until they land or time out."""
        plan, seen = seq.blend, set()
        for doc in plan.documents:
            tokens = tuple(plan.stored_tokens(doc, seq.token_ids, self.block_size))
            if len(tokens) <= len(plan.lead) or tokens in seen:
                continue
            seen.add(tokens)
            held = document_sequence(list(tokens), plan.root)
            if self.offload.request_load(held, waiter=seq):  # False where the pool holds it all
                seq.document_holds.append(held)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its last state, or None if unknown.

        A frame sent to a stream is part of the stream once accepted: aborting its request only
        stops waiting for it.
        """
        if self.streams_host.drop_frame_request(request_id):
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

        Only whole blocks are cached: a prefix shorter than one block pins nothing (0, with a
        warning; its requests still run). Refused (ValueError) if what stays unpinned could no
        longer hold a request in flight.
        """
        token_ids, root = self.admission.prefix_key(prompt)
        return self.manager.pin(token_ids, root, keep_free=self.admission.in_flight_blocks(self.requests.values()))

    def unpin_prefix(self, prompt: PromptType) -> int:
        """Release a pinned prefix to normal LRU eviction; returns tokens unpinned (0 if not pinned)."""
        return self.manager.unpin(*self.admission.prefix_key(prompt))

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """The model's own input embeddings of `token_ids` ([tokens, hidden], model dtype, CPU): what
        `prompt_embeds` or an embedding frame must look like."""
        ids = self.admission.parse(list(token_ids)).token_ids
        with torch.inference_mode():
            return self.runner.model.embed_tokens(torch.tensor(ids, device=self.device)).cpu().clone()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.streams_host.frames_pending() or self._ready)

    # --- streams (engine/stream_host.py: what each does and refuses) ------------------------------

    def open_stream(
        self,
        system: PromptType,
        policy: str | KVPolicy = DEFAULT_STREAM_POLICY,
        separator: str = "\n",
        stream_id: str | None = None,
        request_id: str | None = None,
        chat: bool = True,
        reserve_tokens: int | None = None,
    ) -> FrameRequest:
        """Start a stream: queue its system prompt; the returned request finishes once it is computed.
        `reserve_tokens`: see StreamHost.open."""
        return self.streams_host.open(system, policy, separator, stream_id, request_id, chat, reserve_tokens)

    def stream(self, stream_id: str) -> Stream:
        """The open stream `stream_id`; KeyError naming it otherwise."""
        return self.streams_host.get(stream_id)

    def append_frame(
        self, stream_id: str, frame: FrameType, skip_repeat: bool = False, request_id: str | None = None
    ) -> FrameRequest:
        """Queue one frame after the stream's others; the request finishes once it is computed (or skipped)."""
        request, output, evicted = self.streams_host.append(stream_id, frame, skip_repeat, request_id)
        if output is not None:
            self._ready.append(output)
        if evicted:
            self.counters.evicted_tokens[request.stream.policy.name] += evicted
        return request

    def ask_stream(
        self,
        stream_id: str,
        question: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        recall: int = 0,
    ) -> Request:
        """A request answering `question` from the stream's cached frames (and `recall` evicted ones)."""
        return self.streams_host.ask(stream_id, question, params, request_id, recall)

    def fork_stream(self, stream_id: str, new_id: str | None = None) -> Stream:
        """A new stream sharing every block of `stream_id` (copy-on-write) from here on."""
        return self.streams_host.fork(stream_id, new_id)

    def close_stream(self, stream_id: str) -> list[str]:
        """Free a stream's blocks; what still waited for it ends (as aborted). Returns their request ids."""
        ended, outputs = self.streams_host.close(stream_id)
        self._ready.extend(outputs)
        return ended

    # --- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the (cumulative) outputs of requests that made progress."""
        try:
            return self._step()
        finally:
            self.manager.end_step()  # the step's cache events (and those since the last step) as one batch

    def _step(self) -> list[RequestOutput]:
        if self.offload is not None:
            self.offload.poll(len(self.scheduler.running))
        ready, self._ready = self._ready, []
        started = time.perf_counter()
        if self.pacer is not None:
            decoding = sum(1 for s in self.scheduler.running if s.num_schedulable == 1)
            self.scheduler.prefill_budget = self.pacer.prefill_budget(decoding)
        batch = self.scheduler.schedule()
        if not batch:
            if ready:
                return ready
            if self.offload is not None and self.offload.loading:
                self.offload.wait(timeout=0.01)  # only loading sequences wait: nothing else to do
                return []
            self._unstall()
            return self._take_ready()
        batch, result = self._execute(batch)
        if result is None:
            return ready + self._take_ready()
        prompt_tokens = sum(item.num_tokens for item in batch if item.num_tokens > 1)
        if self.offload is not None:
            self.offload.observe_prefill(prompt_tokens, time.perf_counter() - started)
        now = time.time()
        settled = self.commit(batch, result, now)
        streams = [self.streams_host.get(seq.request.stream_id) for seq in settled if seq.frames is not None]
        touched = {seq.request.request_id: seq.request for seq in settled if seq.frames is None}
        if self.pacer is not None:
            rows = sum(1 for item in batch if item.num_tokens == 1)
            self.pacer.observe(prompt_tokens, rows, time.perf_counter() - started)
        outputs = ready
        for stream in streams:
            outputs.extend(self.streams_host.progress(stream, now))
        outputs.extend(self._take_ready())
        for request in touched.values():
            outputs.append(request.output())
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
                self.counters.finished_requests += 1
        return outputs

    def _execute(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], StepLogits | None]:
        """Run the step for every scheduled sequence that can run: one whose metadata would reach
        outside the tables or the pool fails alone beforehand (`ModelRunner.check`), and if the
        model still raises, each sequence runs alone to find the ones it raises for, those fail,
        and the others run together again, so a failure caused by one sequence costs the others
        nothing but time. Returns the sequences that ran and their logits (None: none ran).

        A rerun writes the same K/V to the same slots. Only the attention-score sums of the scored
        policies (h2o, snapkv, ...) also count the failed attempt's rows."""
        runnable = []
        for item in batch:
            try:
                self.runner.check(item)
                runnable.append(item)
            except Exception as error:
                self._fail(item.seq, error)
        if not runnable:
            return [], None
        try:
            return runnable, self.runner.execute(runnable)
        except Exception as error:
            if len(runnable) == 1:
                self._fail(runnable[0].seq, error)
                return [], None
        survivors = []
        for item in runnable:
            try:
                self.runner.execute([item])
                survivors.append(item)
            except Exception as error:
                self._fail(item.seq, error)
        if not survivors:
            return [], None
        return survivors, self.runner.execute(survivors)

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End what `seq` belongs to because of `error`: a request fails whole, a stream closes with
        its waiting frames and questions, and everything else goes on. Their callers get an output
        whose `error` is a PoolFull (the pool has no room for it: said as it is) or a RequestFailed
        (the engine's own fault) quoting an incident id the log holds the details under."""
        if not isinstance(error, PoolFull):
            incident = uuid.uuid4().hex[:16]
            log.error("request %s failed (incident %s)", seq.request.request_id, incident, exc_info=error)
            error = RequestFailed(f"internal error while running this request (incident {incident})")
        stream_id = seq.request.stream_id if seq.frames is not None else None
        if stream_id is not None and self.streams_host.is_open(stream_id):
            outputs = self.streams_host.close(stream_id)[1]
        else:
            request = self.requests.get(seq.request.request_id)
            if request is None:
                self.scheduler.finish(seq)
                return
            outputs = [self.abort_request(request.request_id)]
        for output in outputs:
            output.error = error
            for completion in output.outputs:
                completion.finish_reason = "error"
        self._ready.extend(outputs)

    def _unstall(self) -> None:
        """Nothing could be scheduled although sequences wait or run: then only what is never
        preempted (streams, their questions, pins) holds blocks, and it leaves no room. Rather than
        wait for a stream to close, the first waiting sequence (else the newest running one) is
        refused for room (PoolFull), and the next step tries the rest."""
        scheduler = self.scheduler
        stuck = next((s for s in scheduler.waiting if not s.loading), None)
        if stuck is None and scheduler.running:
            stuck = scheduler.running[-1]
        if stuck is None:
            return
        held = self.streams_host.held_blocks()
        self._fail(
            stuck,
            PoolFull(
                f"the KV pool has no room for this request now: {self.manager.num_free_blocks} of its "
                f"{self.num_blocks} blocks are free, streams hold {held} and {len(self.manager.pinned_blocks)} "
                "are pinned (neither is ever preempted); retry later, or close a stream"
            ),
        )

    def _take_ready(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        return ready

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block not in use or pinned (tiers keep theirs); returns blocks dropped."""
        return self.manager.evict_cached()

    def close(self) -> None:
        """Write what the tiers have queued and close them; the engine is unusable afterwards."""
        self.manager.close_events()
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    # --- introspection ------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        """What this engine is (model, limits, pool size), fixed once it is built."""
        return EngineInfo(
            self.config,
            self.model_config,
            self.model_path,
            self.tokenizer,
            self.max_model_len,
            self.block_size,
            self.num_blocks,
            self.scheduler.max_num_batched_tokens,
            self.offload is not None,
        )

    def waiting_prompt_tokens(self) -> int:
        """Tokens of the sequences waiting to be scheduled (preempted ones with what they generated)."""
        return sum(len(seq.token_ids) for seq in self.scheduler.waiting)

    def memory_now(self) -> MemoryReport:
        """The memory report (`memory`) with the KV parts measured now: residual slots grow with open blocks."""
        return memory.current(self.memory, self.storage)

    def spill_to_tiers(self, limit: int, tried: set[int]) -> int:
        """Write-back: queue up to `limit` pool chunks that never reached the tiers (KVOffload.spill);
        returns how many were queued, or -1 when none is left to try (or there are no tiers)."""
        return self.offload.spill(limit, tried) if self.offload is not None else -1

    def flush_tiers(self, timeout: float) -> bool:
        """Wait until the tiers' writer has stored everything queued; False if `timeout` passed first.
        Safe from any thread (the writer's queue has its own lock), and meant for one: it blocks."""
        offload = self.offload
        return offload.flush(timeout) if offload is not None else True

    def refresh_tier_stats(self) -> None:
        """Refresh the tier gauges that cost a round trip (Redis memory and key count). Safe from any
        thread, and meant for one: it blocks on the round trip."""
        offload = self.offload
        for tier in offload.tiers if offload is not None else []:
            refresh = getattr(tier, "refresh_stats", None)
            if refresh is not None:
                refresh()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Each tier's bytes used and capacity (None where the store keeps its own), hits, misses,
        load/store bytes and seconds, errors, and the controller's counters under "offload"
        (empty without tiers)."""
        return self.offload.stats() if self.offload is not None else {}

    def block_states(self) -> bytes:
        """One byte per KV block: 0 free (empty), 1 in use, 2 cached and evictable, 3 pinned."""
        return self.manager.block_states()

    def _blend_stats(self) -> dict[str, float]:
        """Documents blended into prompts (engine/blend.py): reused from the cache or computed alone,
        their tokens placed, tokens recomputed, and the seconds the blends took."""
        blender = self.runner.blender
        totals = (
            blender.totals
            if blender is not None
            else dict.fromkeys(("documents_reused", "documents_computed", "tokens_reused", "tokens_recomputed"), 0)
        )
        return {
            **{f"blend_{key}": value for key, value in totals.items()},
            "blend_seconds": blender.seconds if blender is not None else 0.0,
        }

    def stats(self) -> dict[str, float | dict]:
        """Counters and gauges: prefix-cache hit rate, pool usage, queue depths, preemptions; and
        `kernel_isa`, the instruction-set level of the native kernels and each family's variant."""
        return {
            **self.counters.as_dict(),
            **self.manager.gauges(),
            **self.scheduler.gauges(),
            **self.swapper.gauges(),
            **self._blend_stats(),
            "num_paced_steps": self.pacer.num_paced_steps if self.pacer is not None else 0,
            "num_steps_over_target": self.pacer.num_steps_over_target if self.pacer is not None else 0,
            "kernel_isa": isa.report(kernels.native()),
            "batch_invariant": self.batch_invariant,
        }
