"""Engine configuration, validated when it is built so mistakes surface before any model loads.

`EngineConfig` is the one place engine options and their defaults live: `LLM(model, **kw)`
builds it, and the `kvbank` command generates its flags from the fields and their metadata
(`help`, and optionally `choices`, `metavar`, `default_text` for a default that is not a value,
`env` for an environment variable that the command's flag defaults to, `plan=False` for options
that change none of the numbers `kvbank plan` prints, and `secret` for a value never shown: True
leaves it out of every output, "url" shows it with its credentials masked).

A secret on the command line is visible to every local user (`ps`, /proc/PID/cmdline), so each
one can also come from an environment variable (`env`) or from a file: a `NAME_file` field names
the file, which is read when the options are built (`load_secret_file`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbank.cache.events import check_endpoint
from kvbank.cache.format import KVFormat
from kvbank.cache.offload import WRITE_POLICIES, chunk_blocks_for
from kvbank.cache.policies import parse_policy
from kvbank.cache.quant import DEFAULT_GROUP_SIZE, KV_CACHE_DTYPES

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_WEIGHT_FORMATS = ("auto", "dense", "int4")
PREEMPTION_MODES = ("auto", "swap", "recompute")
#: most tokens one step computes unless `max_num_batched_tokens` says otherwise
DEFAULT_PREFILL_CHUNK = 2048
TIER_KEY_ENV = "KVBANK_TIER_KEY"
REDIS_URL_ENV = "KVBANK_REDIS_URL"
#: a shorter tier key could be guessed from one entry and its MAC
MIN_TIER_KEY_CHARS = 16
EVENTS_TOKEN_IDS = ("on", "off")
#: what --help says of every secret that a flag can carry
COMMAND_LINE_SECRET = "a value given on the command line is visible to other local users (ps)"

log = logging.getLogger("kvbank")


def check_ratio(ratio: Any, name: str = "blend_recompute_ratio") -> float:
    """`ratio` as a float in [0, 1]; ValueError naming it otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ValueError(f"{name}={ratio!r} must be a number between 0 and 1")
    return float(ratio)


def option(default: Any, help_text: str, **metadata: Any) -> Any:
    """A config field with its command-line help; see the module docstring for the metadata keys."""
    # a secret stays out of the dataclass repr, so that no log line or traceback shows it
    return field(default=default, repr=not metadata.get("secret"), metadata={"help": help_text, **metadata})


def load_secret_file(options: Any, name: str) -> None:
    """Set `options.<name>` to the content of the file `options.<name>_file` names (without the whitespace
    around it), then clear the `_file` field: the secret is read once. Refused (ValueError naming the
    option, never the content) when both are given or the file is unreadable or empty."""
    path = getattr(options, f"{name}_file")
    if path is None:
        return
    if getattr(options, name) is not None:
        raise ValueError(
            f"{name} and {name}_file are both given (the command line also takes {name} from the environment): give one"
        )
    try:
        with open(path, encoding="utf-8") as file:
            secret = file.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(f"{name}_file {str(path)!r} cannot be read: {why}") from None
    if not secret:
        raise ValueError(f"{name}_file {str(path)!r} is empty")
    setattr(options, name, secret)
    setattr(options, f"{name}_file", None)


@dataclass
class EngineConfig:
    """Everything the engine needs to know before it loads a model.

    `model=None` means the bundled SmolLM2-135M-Instruct GGUF. The KV pool holds `num_gpu_blocks`
    blocks when given, else as many as fit in `kv_cache_memory_gb`. `weight_format` "auto" keeps
    a GGUF's 4-bit weights 4-bit for small batches when running bfloat16 on a CPU ("int4" demands
    it, "dense" turns it off); float32 always runs dense, exactly like the reference.
    `kv_cache_dtype` is how the KV pool stores keys and values (see kvbank.cache.quant); the
    layers in `kv_cache_dtype_skip_layers` stay in the model dtype; `kv_quant_group_size` is the
    number of channels that share a scale in int4/int2 values. `batch_invariant` makes greedy
    output independent of what else is batched (every step size runs the 4-bit weight kernel, and
    every token attends through the native decode kernel: bfloat16 on a CPU, a Q4 GGUF, dense KV
    layers; dense weights or float32 are not invariant); False runs steps of more than 8 tokens on
    the dense weights and prefills through flash attention, which is faster for prefills.
    """

    model: str | None = option(
        None, "a .gguf file or a Hugging Face model folder", default_text="the bundled SmolLM2-135M-Instruct"
    )
    dtype: str = option(
        "auto", "weights and activations; auto is bfloat16 (float16 is refused on CPU)", choices=("auto", *_DTYPES)
    )
    device: str = option("auto", "cpu, cuda, cuda:N or auto (cuda when available)")
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory_gb: float = option(1.0, "memory for the KV pool in GiB")
    num_gpu_blocks: int | None = option(
        None, "size the KV pool in blocks instead of memory", default_text="from --kv-cache-memory-gb"
    )
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens", default_text="the model's context length"
    )
    max_num_seqs: int = option(64, "most sequences running at once (int4/int2 reserve a residual slot for each)")
    max_num_batched_tokens: int | None = option(
        None,
        "most tokens in one step; longer prompts prefill in chunks",
        default_text=f"{DEFAULT_PREFILL_CHUNK}, or less to fit max_model_len and kv_policy",
        plan=False,
    )
    max_step_ms: float | None = option(
        200.0,
        "step-time target in milliseconds: while sequences decode, a step prefills only the prompt tokens that "
        "fit beside them in this time (learned from the steps it runs), so a long prompt never stalls their "
        "streams for seconds; with nothing decoding, prompts get the whole token budget (0: no target). "
        "200 keeps every stream above 5 tokens/s at no cost in throughput on 2 cores; 25 bounds gaps near a "
        "decode step's time but slows prefill where many prompts arrive at once",
        plan=False,
    )
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks of shared prefixes", plan=False)
    blend_separator: str | None = option(
        None,
        "text that marks documents in a text prompt (after the chat template): the pieces between two "
        "separators are documents, computed once and reused at any position (CacheBlend); off by default",
        plan=False,
        metavar="TEXT",
    )
    blend_recompute_ratio: float = option(
        0.15,
        "share of each reused document's tokens recomputed in the prompt it is placed in, those whose KV "
        "deviates most at the check layer (0: pure reuse, 1: the full prefill); a prompt may give its own",
        plan=False,
    )
    swa_full: bool = option(
        False,
        "keep every token in sliding-window layers too (as llama.cpp's --swa-full); by default a model "
        "with such layers (Gemma 3) keeps only their windows, which KV tiers, session files and streams "
        "do not support",
    )
    max_pinned_fraction: float = option(0.5, "most of the KV pool that pinned prefixes may hold", plan=False)
    max_stream_pool_fraction: float = option(
        0.5,
        "most of the KV pool that streaming sessions may hold or reserve in all (they are never preempted, so "
        "the rest stays for requests); a stream, frame or fork beyond it is refused",
        plan=False,
    )
    weight_format: str = option(
        "auto",
        "auto runs a GGUF's quantized weights (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K) on the integer kernels "
        "in bfloat16 on CPU; dense dequantizes everything; int4 requires the packed path",
        choices=_WEIGHT_FORMATS,
    )
    chat_template: str | None = option(
        None,
        "a Jinja chat template, or a file holding one, for a model whose file has none (or to replace it)",
        default_text="the model file's",
        plan=False,
    )
    kv_cache_dtype: str = option(
        "auto", "how the KV pool stores keys and values; auto is the model dtype", choices=KV_CACHE_DTYPES
    )
    kv_cache_dtype_skip_layers: tuple[int, ...] = option(
        (), "layers kept in the model dtype, e.g. 0,-1", metavar="I,J,...", default_text="none"
    )
    kv_quant_group_size: int = option(DEFAULT_GROUP_SIZE, "channels sharing one scale in int4/int2 values")
    seed: int = option(0, "seed of the sampler (a request's own seed overrides it)", plan=False)
    batch_invariant: bool = option(
        True,
        "greedy output independent of what else runs: every step uses the 4-bit "
        "weights and every token attends through the decode kernel (bfloat16 on an "
        "x86 CPU with AVX2 or above, with a Q4 GGUF); --no-batch-invariant prefills faster",
    )

    # The tiers' options: each tier (kvbank.cache.tiers.TIERS) declares those it is built from, with the
    # same names, types and defaults as here.
    kv_host_gb: float = option(
        0.0, "host RAM for KV blocks offloaded from the pool, in GiB (0: no host tier)", plan=False
    )
    kv_disk_dir: str | None = option(
        None, "directory that keeps offloaded KV blocks across restarts", default_text="no disk tier", plan=False
    )
    kv_disk_gb: float = option(16.0, "most disk space the disk tier may use, in GiB", plan=False)
    kv_redis_url: str | None = option(
        None,
        "Redis (or Valkey) shared by many servers: redis://, rediss://, unix:// or a cluster node; without "
        "--kv-tier-key whoever can write it can change what is served (warned at start); its password is "
        f"masked in every output, but {COMMAND_LINE_SECRET}: prefer ${REDIS_URL_ENV} or --kv-redis-url-file",
        env=REDIS_URL_ENV,
        metavar="URL",
        default_text=f"${REDIS_URL_ENV}, else no Redis tier",
        secret="url",
        plan=False,
    )
    kv_redis_url_file: str | None = option(
        None, "a file holding --kv-redis-url", metavar="PATH", default_text="none", plan=False
    )
    kv_redis_ttl: float | None = option(
        None, "seconds a Redis entry lives after it is written", default_text="no expiry", plan=False
    )
    kv_redis_timeout: float = option(1.0, "socket timeout of Redis calls in seconds", plan=False)
    kv_tier_write_policy: str = option(
        "write_through",
        "write_through offloads a chunk when it is computed; write_back when the pool evicts it",
        choices=WRITE_POLICIES,
        plan=False,
    )
    kv_offload_min_hits: int = option(
        0, "prefix-cache hits a chunk needs before it is offloaded (0: every chunk)", plan=False
    )
    kv_tier_chunk_tokens: int = option(256, "tokens per tier entry (a multiple of --block-size)", plan=False)
    kv_tier_load_timeout: float | None = option(
        None,
        "seconds a prompt waits for its blocks from the tiers before it is computed instead",
        default_text="as long as computing it would take, at least 0.1",
        plan=False,
    )
    kv_tier_key: str | None = option(
        None,
        "secret that signs every tier entry, stream frame and session file (keyed BLAKE2b): "
        "entries without its MAC are refused; without a key, whoever can write the store can change "
        f"what is served (at least {MIN_TIER_KEY_CHARS} characters, e.g. `openssl rand -hex 32`); "
        f"{COMMAND_LINE_SECRET}: prefer ${TIER_KEY_ENV} or --kv-tier-key-file",
        env=TIER_KEY_ENV,
        metavar="KEY",
        default_text=f"${TIER_KEY_ENV}, else no key",
        secret=True,
        plan=False,
    )
    kv_tier_key_file: str | None = option(
        None, "a file holding --kv-tier-key", metavar="PATH", default_text="none", plan=False
    )
    preemption_mode: str = option(
        "auto",
        "what happens to a sequence the pool cannot hold: swap its blocks to host RAM, "
        "recompute them later, or auto (swap when that is faster)",
        choices=PREEMPTION_MODES,
        plan=False,
    )
    swap_space_gb: float = option(4.0, "host RAM for swapped-out sequences, in GiB", plan=False)
    kv_policy: str = option(
        "full",
        "what a sequence's KV cache keeps on a long context (a request may choose its own): full, "
        "sink_window(sinks=4,window=1024), h2o(heavy=256,recent=256), snapkv(budget=1024,window=64,kernel=5) "
        "or context_shift(keep=256)",
        metavar="POLICY",
        plan=False,
    )
    kv_events_endpoint: str | None = option(
        None,
        "ZMQ endpoint to bind a PUB socket on that publishes KV cache events in vLLM's format "
        "(BlockStored, BlockRemoved, AllBlocksCleared; msgpack), e.g. tcp://127.0.0.1:5557, "
        "for routers that score replicas by their cache (needs pyzmq and msgpack); the events carry every "
        "tenant's token ids to whoever connects, so an address other than loopback needs --kv-events-public "
        "(and --kv-events-token-ids off sends hashes only)",
        metavar="ENDPOINT",
        default_text="no events",
        plan=False,
    )
    kv_events_public: bool = option(
        False,
        "let --kv-events-endpoint and --kv-events-replay-endpoint bind an address other than loopback, "
        "where anyone who reaches it reads the events",
        plan=False,
    )
    kv_events_token_ids: str = option(
        "on",
        "whether a BlockStored event lists its blocks' token ids (vLLM's format); off sends an empty list: "
        "the block hashes, all a router matching kvbank's events needs, without the prompts' tokens",
        choices=EVENTS_TOKEN_IDS,
        plan=False,
    )
    kv_events_replay_endpoint: str | None = option(
        None,
        "ZMQ endpoint to bind a ROUTER socket on that resends recent event batches from a sequence number",
        metavar="ENDPOINT",
        default_text="no replay",
        plan=False,
    )
    kv_events_topic: str = option(
        "", "topic (first frame) of every KV event message", metavar="TOPIC", default_text="empty", plan=False
    )

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu', 'cuda' or 'auto'")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose from auto, {', '.join(_DTYPES)}")
        if self.dtype in ("float16", "fp16") and self.device == "cpu":
            raise ValueError("dtype=float16 is far too slow on CPU; use bfloat16 or float32")
        if self.weight_format not in _WEIGHT_FORMATS:
            raise ValueError(f"weight_format={self.weight_format!r} is not one of {', '.join(_WEIGHT_FORMATS)}")
        self.kv_cache_dtype_skip_layers = tuple(self.kv_cache_dtype_skip_layers)
        KVFormat(self.kv_cache_dtype, self.kv_cache_dtype_skip_layers, self.kv_quant_group_size)  # raises if bad
        if self.blend_separator is not None and not (isinstance(self.blend_separator, str) and self.blend_separator):
            raise ValueError(f"blend_separator={self.blend_separator!r} must be a non-empty string")
        check_ratio(self.blend_recompute_ratio)
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction={self.max_pinned_fraction} must be in [0, 1]")
        if not 0.0 < self.max_stream_pool_fraction <= 1.0:
            raise ValueError(f"max_stream_pool_fraction={self.max_stream_pool_fraction} must be in (0, 1]")
        _require_positive("block_size", self.block_size)
        _require_positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _require_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_step_ms is not None and self.max_step_ms < 0:
            raise ValueError(f"max_step_ms={self.max_step_ms} must be >= 0 (0: no step-time target)")
        if self.num_gpu_blocks is not None:
            _require_positive("num_gpu_blocks", self.num_gpu_blocks)
        if not (isinstance(self.kv_cache_memory_gb, (int, float)) and self.kv_cache_memory_gb > 0):
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb!r} must be > 0")
        if self.max_model_len is not None:
            _require_positive("max_model_len", self.max_model_len)
        for name in ("kv_host_gb", "kv_disk_gb", "swap_space_gb", "kv_redis_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a number >= 0")
        for name in ("kv_redis_ttl", "kv_tier_load_timeout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        if self.kv_tier_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"kv_tier_write_policy={self.kv_tier_write_policy!r} is not one of {', '.join(WRITE_POLICIES)}"
            )
        if not isinstance(self.kv_offload_min_hits, int) or self.kv_offload_min_hits < 0:
            raise ValueError(f"kv_offload_min_hits={self.kv_offload_min_hits!r} must be an integer >= 0")
        chunk_blocks_for(self.kv_tier_chunk_tokens, self.block_size)  # raises if bad
        load_secret_file(self, "kv_tier_key")
        load_secret_file(self, "kv_redis_url")
        _check_tier_key(self.kv_tier_key)
        if self.kv_redis_url and self.kv_tier_key is None:
            log.warning(
                "the Redis tier has no tier key: whoever can write that Redis can change the K/V this engine "
                "serves; set kv_tier_key (--kv-tier-key-file or $%s) on every server that shares it",
                TIER_KEY_ENV,
            )
        parse_policy(self.kv_policy)  # raises if bad
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is not one of {', '.join(PREEMPTION_MODES)}")
        check_endpoint("kv_events_endpoint", self.kv_events_endpoint, self.kv_events_public)
        check_endpoint("kv_events_replay_endpoint", self.kv_events_replay_endpoint, self.kv_events_public)
        if self.kv_events_token_ids not in EVENTS_TOKEN_IDS:
            raise ValueError(f"kv_events_token_ids={self.kv_events_token_ids!r} is not one of on, off")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the PUB socket it replays)")
        if self.kv_events_replay_endpoint is not None and self.kv_events_replay_endpoint == self.kv_events_endpoint:
            raise ValueError(f"kv_events_replay_endpoint={self.kv_events_replay_endpoint!r} is kv_events_endpoint too")

    def prefill_chunk(self, max_model_len: int, policy_room: int | None = None) -> int:
        """Most tokens one step computes: `max_num_batched_tokens` if set, otherwise the default
        lowered to the context and to what the long-context policy leaves room for (`policy_room`)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        chunk = min(DEFAULT_PREFILL_CHUNK, max_model_len)
        if policy_room is not None and policy_room >= self.block_size:
            chunk = min(chunk, policy_room)
        return chunk

    @property
    def kv_format(self) -> KVFormat:
        """How the KV pool stores keys and values."""
        return KVFormat(self.kv_cache_dtype, self.kv_cache_dtype_skip_layers, self.kv_quant_group_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype weights and activations run in: bfloat16 unless asked otherwise."""
        return torch.bfloat16 if self.dtype == "auto" else _DTYPES[self.dtype]

    def packs_int4_weights(self, packable: bool) -> bool:
        """Whether the engine keeps a model's 4-bit GGUF weights 4-bit (see `weight_format`);
        `packable`: the model has 4-bit weights and this torch multiplies them on the device.

        Raises ValueError when `weight_format="int4"` asks for what this model or device cannot do.
        """
        usable = packable and self.torch_dtype == torch.bfloat16
        if self.weight_format == "int4" and not usable:
            raise ValueError("weight_format='int4' needs a GGUF with Q4_0/Q4_1 weights, dtype=bfloat16 and a CPU")
        return usable and self.weight_format != "dense"


def _check_tier_key(key: object) -> None:
    if key is not None and not (isinstance(key, str) and len(key) >= MIN_TIER_KEY_CHARS):
        got = f"{len(key)} characters" if isinstance(key, str) else f"a {type(key).__name__}"  # never the key
        raise ValueError(f"kv_tier_key must be a string of at least {MIN_TIER_KEY_CHARS} characters, got {got}")


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
