"""Wiring: from an engine config and a loaded model to the cache parts and services the engine drives."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbank.cache.editor import KVEditor
from kvbank.cache.events import build_events
from kvbank.cache.hybrid import KVGroups, kv_groups
from kvbank.cache.limits import Limits
from kvbank.cache.manager import KVCacheManager
from kvbank.cache.offload import KVOffload, chunk_blocks_for
from kvbank.cache.policies import KVPolicy, parse_policy
from kvbank.cache.storage import KVStorage, PoolPlan, plan_pool
from kvbank.cache.swap import Swapper
from kvbank.cache.tiers import build_tiers, entry_format_for, requested_tiers, tier_options
from kvbank.cache.tiers.entry import EntryFormat, dtype_name
from kvbank.config import EngineConfig
from kvbank.engine.admission import Admission
from kvbank.engine.blend import Blender
from kvbank.engine.decoding import Decoder
from kvbank.engine.params import SamplingParams
from kvbank.engine.runner import ModelRunner
from kvbank.engine.sampler import Sampler
from kvbank.engine.scheduler import ScheduledSeq, Scheduler
from kvbank.engine.sequence import Request, Sequence
from kvbank.engine.sessions import SessionFiles
from kvbank.engine.stream_host import StreamHost
from kvbank.engine.stream_questions import RequestHooks
from kvbank.models.build import BuiltModel


@dataclass(slots=True)
class CacheParts:
    """The KV cache as one engine sees it: pool storage and bookkeeping, tiers, swap, policy editor."""

    pool_plan: PoolPlan
    num_blocks: int
    storage: KVStorage
    manager: KVCacheManager
    #: K/V written in another dtype or format are not interchangeable: their cache chains stay apart
    namespace: bytes
    entry_format: EntryFormat
    offload: KVOffload | None
    swapper: Swapper
    limits: Limits
    kv_policy: KVPolicy
    editor: KVEditor


def build_cache(config: EngineConfig, built: BuiltModel, device: torch.device) -> CacheParts:
    """Size the pool, then build the storage, the manager, the tiers, swap and the policy editor."""
    model_config, dtype = built.config, config.torch_dtype
    groups = kv_groups(model_config.layer_windows, config.swa_full)
    if groups is not None:
        _check_hybrid(config, groups)
    plan = _plan_pool(config, built, groups)
    num_blocks = config.num_gpu_blocks or plan.num_blocks
    storage = KVStorage(
        model_config,
        num_blocks,
        config.block_size,
        dtype,
        device,
        config.kv_format,
        config.max_num_seqs,
        batch_invariant=config.batch_invariant,
        groups=groups,
    )
    # fmt: off
    events = build_events(
        config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic, config.block_size,
        device.type, config.kv_events_token_ids == "on",
    )
    manager = KVCacheManager(
        num_blocks, config.block_size, config.enable_prefix_caching, config.max_pinned_fraction, storage.release,
        events, groups,
    )
    # fmt: on
    try:  # a bound events socket must not outlive an engine that fails to start
        namespace = model_config.fingerprint + f"|{dtype_name(dtype)}".encode() + config.kv_format.namespace
        entry_format = entry_format_for(storage, model_config.fingerprint, namespace, config.kv_tier_key)
        max_model_len = model_config.max_position_embeddings
        kv_policy = parse_policy(config.kv_policy)
        chunk = config.prefill_chunk(max_model_len, kv_policy.chunk_room(config.block_size, max_model_len))
        limits = Limits(config.block_size, num_blocks, max_model_len, chunk, storage.edits, config.kv_cache_dtype)
        kv_policy.check(limits)
        model = built.model
        return CacheParts(
            plan,
            num_blocks,
            storage,
            manager,
            namespace,
            entry_format,
            _build_offload(config, manager, storage, entry_format, namespace),
            Swapper(storage, manager, config.preemption_mode, int(config.swap_space_gb * 2**30)),
            limits,
            kv_policy,
            KVEditor(manager, storage, limits, model.rope_inv_freq, model.rope_cos.shape[0]),
        )
    except BaseException:
        manager.close_events()
        raise


@dataclass(slots=True)
class Services:
    """What the engine drives besides the cache: scheduling, the model, admission, streams,
    session files and decoding."""

    scheduler: Scheduler
    runner: ModelRunner
    admission: Admission
    streams_host: StreamHost
    sessions: SessionFiles
    decoder: Decoder


def build_services(
    config: EngineConfig,
    built: BuiltModel,
    cache: CacheParts,
    device: torch.device,
    hooks: RequestHooks,
    in_use: Callable[[str], bool],
) -> Services:
    """The engine's services over `cache`; `hooks` hand a stream's questions to the engine's
    requests in flight and `in_use` says whether a request id is taken."""
    scheduler = Scheduler(cache.manager, config.max_num_seqs, cache.limits.chunk_tokens, cache.swapper)
    runner = ModelRunner(built.model, cache.storage, device)
    refusal = blend_refusal(built, cache.storage)
    if refusal is None:
        runner.blender = Blender(
            built.model,
            cache.storage,
            cache.manager,
            cache.offload,
            document_sequence,
            lambda seq, n: runner.prepare([ScheduledSeq(seq, n)]),
            cache.editor.rotation,
            cache.limits.chunk_tokens,
        )
    tokenizer, namespace = built.tokenizer, cache.namespace
    # fmt: off
    admission = Admission(
        config, built.config, tokenizer, cache.manager, scheduler, cache.limits, cache.kv_policy, namespace, device,
        in_use, refusal,
    )
    streams_host = StreamHost(
        admission, scheduler, cache.manager, cache.storage, cache.editor, cache.offload, runner, hooks, namespace
    )
    sessions = SessionFiles(
        admission, cache.manager, cache.storage, cache.entry_format, namespace, config.enable_prefix_caching
    )
    # fmt: on
    eos_token_ids = tokenizer.stop_token_ids if tokenizer else frozenset()
    generator = torch.Generator(device).manual_seed(config.seed)
    sampler = Sampler(eos_token_ids, tokenizer.token_text if tokenizer else str, generator)
    decoder = Decoder(sampler, admission, cache.manager, scheduler, eos_token_ids)
    return Services(scheduler, runner, admission, streams_host, sessions, decoder)


def document_sequence(tokens: list[int], root: bytes) -> Sequence:
    """A document's tokens as a prompt of its own under `root` (engine/blend.py computes it alone)."""
    request = Request("document", None, tokens, SamplingParams(max_tokens=1), root, time.time())
    return Sequence(request, 0, tokens, None)


def blend_refusal(built: BuiltModel, storage: KVStorage) -> str | None:
    """Why this engine cannot blend documents (engine/blend.py), or None when it can."""
    config = built.config
    if any(config.layer_windows) or storage.groups is not None:
        return f"{config.arch} has sliding-window layers, which the blend does not place documents in yet"
    if not hasattr(built.model.layers[0], "attn_in"):
        return f"the {config.arch} layers have no split at attention"
    if storage.kind("kivi") is not None:
        return (
            f"the {storage.kind('kivi').name} KV layout (kv_cache_dtype int4/int2) quantizes each block's keys "
            "as it fills, and the blend writes a prompt's tokens out of order; use auto, bfloat16, int8 or fp8"
        )
    missing = {"tokens", "rotate", "gather"} - storage.edits
    if missing:
        return f"the KV layout ({', '.join(k.name for k in storage.kinds)}) cannot move and rotate single tokens"
    return None


def batch_variance(model, storage: KVStorage) -> str | None:
    """Why greedy output may depend on what else runs in this engine, or None when every row's
    arithmetic is its own: the model's projections and head (models/llama.py) and every KV kind's
    attention by rows."""
    reason = model.varies_with_batch()
    if reason is None:
        batched = [kind.name for kind in storage.kinds if not kind.attend_rows]
        if batched:
            reason = f"the {', '.join(batched)} KV cache attends batched, not by rows"
    return reason


def _check_hybrid(config: EngineConfig, groups: KVGroups) -> None:
    """Refuse what the hybrid layout cannot do yet, naming the way out."""
    if requested_tiers(config):
        raise ValueError(
            f"KV tiers ({tier_options()}) are not supported with the hybrid sliding-window "
            f"KV cache ({groups.window}-token windows): a tier entry holds a prefix's full-attention blocks, not "
            "its windows; use swa_full=True (--swa-full) to keep every token in every layer"
        )


def _plan_pool(config: EngineConfig, built: BuiltModel, groups: KVGroups | None = None) -> PoolPlan:
    gigabytes = config.kv_cache_memory_gb
    plan = plan_pool(
        built.config,
        config.torch_dtype,
        int(gigabytes * 2**30),
        config.block_size,
        config.kv_format,
        reserved_seqs=config.max_num_seqs,
        groups=groups,
    )
    if plan.num_blocks < 1 and config.num_gpu_blocks is None:
        raise ValueError(
            f"kv_cache_memory_gb={gigabytes} holds less than one block of "
            f"{config.block_size} tokens ({plan.bytes_per_block} bytes per block, plus "
            f"{plan.residual_bytes_per_seq * plan.reserved_seqs} bytes of residual slots)"
        )
    return plan


def _build_offload(
    config: EngineConfig, manager: KVCacheManager, storage: KVStorage, entry_format: EntryFormat, namespace: bytes
) -> KVOffload | None:
    """The controller that keeps the pool's prefixes in the configured tiers (None without tiers)."""
    tiers = build_tiers(config, namespace)
    if not tiers:
        return None
    if not config.enable_prefix_caching:
        raise ValueError(f"KV tiers ({tier_options()}) need enable_prefix_caching=True")
    return KVOffload(
        tiers,
        manager,
        storage,
        entry_format,
        chunk_blocks_for(config.kv_tier_chunk_tokens, config.block_size),
        config.kv_tier_write_policy,
        config.kv_offload_min_hits,
        load_timeout=config.kv_tier_load_timeout,
    )
