"""The engine loop: admit requests, run one scheduled step at a time, turn logits into outputs."""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from kvbank import kernels
from kvbank.cache.manager import KVCacheManager, blocks_for
from kvbank.cache.prefix import root_hash
from kvbank.cache.storage import KVStorage, PoolPlan, plan_pool
from kvbank.config import EngineConfig
from kvbank.engine.outputs import RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.engine.runner import ModelRunner, StepLogits
from kvbank.engine.sampler import Sampled, Sampler, token_logprobs
from kvbank.engine.scheduler import ScheduledSeq, Scheduler
from kvbank.engine.sequence import Request, Sequence
from kvbank.models.llama import LlamaForCausalLM
from kvbank.models.loader import load_model
from kvbank.models.packed import packed_matmul_available
from kvbank.tokenizer import IncrementalDetokenizer, Tokenizer

PromptType = str | list[int] | dict[str, Any]
DEFAULT_KV_CACHE_GB = 1.0
# Up to this many tokens in a step, 4-bit weights beat dense bfloat16 on a CPU (bench/throughput.py).
PACKED_MAX_ROWS = 8


def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse freed memory for allocations up to 32 MiB instead of returning it.

    Every layer of a step allocates and frees the same large temporaries (gathered and
    dequantized K/V). By default glibc maps each one afresh, and the kernel zeroes every page on
    first touch, which made int4 KV decoding over 2x slower. Returns whether the setting took.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 * 2**20)) and bool(libc.mallopt(m_trim_threshold, 2**30))
    except (OSError, AttributeError):
        return False


class LLMEngine:
    """One model, one KV pool, one scheduler; `step()` advances every running request by a step."""

    def __init__(self, config: EngineConfig, progress: Callable[[int, int], None] | None = None) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        if config.device == "cpu":
            keep_freed_memory()
        loaded = load_model(config.model, progress)
        self.model_config = mc = loaded.config
        self.model_path = loaded.path
        self.tokenizer: Tokenizer | None = loaded.tokenizer
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        mc.max_position_embeddings = self.max_model_len
        with torch.device("meta"):
            model = LlamaForCausalLM(mc)
        model.load_weights({k: v.to(self.device) for k, v in loaded.state_dict.items()}, self.dtype)
        self.packed_layers = self._pack_weights(model, loaded)
        # CPU half-precision matmuls cache a kernel per row count (models/llama.padded_rows).
        model.pad_rows = self.device.type == "cpu" and self.dtype != torch.float32
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            # Fused norms and rotary embedding: a bfloat16 decode step is mostly small ops on a CPU.
            model.use_native(kernels.native())
        del loaded
        self.block_size = config.block_size
        self.pool_plan = self._plan_pool()
        self.num_blocks = config.num_gpu_blocks or self.pool_plan.num_blocks
        storage = KVStorage(mc, self.num_blocks, self.block_size, self.dtype, self.device, config.kv_cache_dtype,
                            config.kv_cache_dtype_skip_layers, config.kv_quant_group_size, config.max_num_seqs)
        self.manager = KVCacheManager(self.num_blocks, self.block_size, config.enable_prefix_caching,
                                      config.max_pinned_fraction)
        self.manager.pool.on_empty = storage.release
        # K/V written in another format are not interchangeable: keep their cache chains apart.
        skip = ",".join(map(str, config.kv_cache_dtype_skip_layers))
        self.cache_namespace = mc.fingerprint + (
            f"|kv={config.kv_cache_dtype}/{skip}/{config.kv_quant_group_size}".encode()
            if config.kv_cache_dtype != "auto" else b"")
        self.scheduler = Scheduler(self.manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model.eval(), storage, self.device, config.batch_invariant)
        self.eos_token_ids = self.tokenizer.stop_token_ids if self.tokenizer else frozenset()
        token_text = self.tokenizer.token_text if self.tokenizer else str
        self.sampler = Sampler(self.eos_token_ids, token_text, torch.Generator(self.device).manual_seed(config.seed))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_cache_queries": 0,
                         "prefix_cache_hits": 0, "finished_requests": 0}

    def _pack_weights(self, model: LlamaForCausalLM, loaded) -> int:
        wanted = self.config.weight_format
        usable = bool(loaded.int4) and packed_matmul_available(self.device) and self.dtype == torch.bfloat16
        if wanted == "int4" and not usable:
            raise ValueError("weight_format='int4' needs a GGUF with Q4_0/Q4_1 weights, dtype=bfloat16 and a CPU")
        if wanted == "dense" or not usable:
            return 0
        return model.pack_weights(loaded.int4, None if self.config.batch_invariant else PACKED_MAX_ROWS)

    @property
    def kv_bytes_per_token(self) -> float:
        """Pool bytes per token across all layers, scales and zero points included."""
        return self.pool_plan.bytes_per_token

    def _plan_pool(self) -> PoolPlan:
        config = self.config
        gigabytes = config.kv_cache_memory_gb or DEFAULT_KV_CACHE_GB
        plan = plan_pool(self.model_config, self.dtype, int(gigabytes * 2**30), self.block_size,
                         config.kv_cache_dtype, config.kv_cache_dtype_skip_layers, config.kv_quant_group_size,
                         reserved_seqs=config.max_num_seqs)
        if plan.num_blocks < 1 and config.num_gpu_blocks is None:
            raise ValueError(f"kv_cache_memory_gb={gigabytes} holds less than one block of "
                             f"{self.block_size} tokens ({plan.bytes_per_block} bytes per block, plus "
                             f"{plan.residual_bytes_per_seq * plan.reserved_seqs} bytes of residual slots)")
        return plan

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue a request; raises ValueError for anything that could never run."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids, salt = self._parse_prompt(prompt)
        params = self._resolve_max_tokens(params, len(token_ids))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        namespace = self.cache_namespace
        request = Request(request_id, text, token_ids, params, root_hash(namespace, salt), arrival_time or time.time())
        first = Sequence(request, 0, token_ids, self._generator(params, 0))
        self._attach_detokenizer(first)
        request.seqs.append(first)
        self.requests[request_id] = request
        self.scheduler.add(first)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its last state, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        request.forked = True
        request.metrics.finished_time = time.time()
        return request.output()

    def pin_prefix(self, prompt: PromptType) -> int:
        """Keep a computed prompt prefix's full blocks cached until `unpin_prefix`; returns tokens pinned."""
        token_ids, root = self._prefix_key(prompt)
        return self.manager.pin(token_ids, root)

    def unpin_prefix(self, prompt: PromptType) -> int:
        """Release a pinned prefix to normal LRU eviction; returns tokens unpinned (0 if not pinned)."""
        token_ids, root = self._prefix_key(prompt)
        return self.manager.unpin(token_ids, root)

    def _prefix_key(self, prompt: PromptType) -> tuple[list[int], bytes]:
        if not self.config.enable_prefix_caching:
            raise ValueError("pinning needs enable_prefix_caching=True")
        _, token_ids, salt = self._parse_prompt(prompt)
        if len(token_ids) < self.block_size:
            raise ValueError(f"a prefix of {len(token_ids)} tokens fills no block of {self.block_size}; nothing to pin")
        return token_ids, root_hash(self.cache_namespace, salt)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _parse_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}")
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt={salt!r} must be a string")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        return text, token_ids, salt

    def _resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(f"prompt has {prompt_len} tokens; max_model_len={limit} leaves no room to generate")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=limit - prompt_len)
        if prompt_len + params.max_tokens > limit:
            raise ValueError(f"prompt has {prompt_len} tokens and max_tokens={params.max_tokens}: "
                             f"{prompt_len + params.max_tokens} exceeds max_model_len={limit}")
        needed = blocks_for(prompt_len + params.max_tokens, self.block_size)
        if needed > self.num_blocks:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens={params.max_tokens} needs {needed} KV blocks "
                             f"but the pool has only {self.num_blocks}")
        return params

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed(params.seed * 1_000_003 + index)

    def _attach_detokenizer(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids,
                                                     skip_special_tokens=seq.params.skip_special_tokens)

    # --- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the (cumulative) outputs of requests that made progress."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        copies, self.manager.pending_copies = self.manager.pending_copies, []
        try:
            result = self.runner.execute(batch, copies)
        except Exception:
            for item in batch:
                self.abort_request(item.seq.request.request_id)
            raise
        now = time.time()
        touched: dict[str, Request] = {}
        for i, item in enumerate(batch):
            self._record_progress(item, result, i, now)
            touched[item.seq.request.request_id] = item.seq.request
        self._sample(batch, result, now)
        outputs = []
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
        if result.prompt_rows[i] is not None:
            first, last = result.prompt_rows[i]
            logprobs = result.logits[first:last].log_softmax(dim=-1)
            k = request.params.prompt_logprobs
            start = len(request.prompt_logprobs)
            for j in range(last - first):
                request.prompt_logprobs.append(token_logprobs(logprobs[j], request.prompt_token_ids[start + j], k,
                                                              self.sampler.token_text))
        seq.num_computed_tokens += item.num_tokens
        self.manager.commit(seq)

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
        samples = self.sampler(result.logits[rows], seqs)
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
        reason = self._stop_reason(seq, token, len(new_text))
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            self.scheduler.finish(seq)

    def _stop_reason(self, seq: Sequence, token: int, new_len: int) -> tuple[str, int | str | None] | None:
        params = seq.params
        if seq.num_output_tokens > params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            for stop in params.stop_strings:
                index = seq.text.find(stop, max(0, len(seq.text) - new_len - len(stop) + 1))
                if index >= 0:
                    seq.text = seq.text[:index + (len(stop) if params.include_stop_str_in_output else 0)]
                    return "stop", stop
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    # --- introspection ------------------------------------------------------------------------

    def block_states(self) -> bytes:
        """One byte per KV block: 0 free (empty), 1 in use, 2 cached and evictable, 3 pinned."""
        states = bytearray(self.num_blocks)
        pool = self.manager.pool
        for block_id in pool.cached:
            states[block_id] = 2
        for block in pool.blocks:
            if block.ref_count:
                states[block.block_id] = 1
        for block_id in self.manager.pinned_blocks:
            states[block_id] = 3
        return bytes(states)

    def stats(self) -> dict[str, float]:
        """Counters and gauges: prefix-cache hit rate, pool usage, queue depths, preemptions."""
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
            "num_pinned_blocks": len(self.manager.pinned_blocks),
        }

