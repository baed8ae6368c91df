"""Sampling parameters, shaped like vLLM's so code written for one runs on the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbank.cache.policies import KVPolicy, parse_policy
from kvbank.defaults import SAMPLING_MAX_TOKENS

_GREEDY_EPS = 1e-5
# What torch.Generator.manual_seed takes: any signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: bounds on what a request may ask the engine to check per token: stop ids and strings are
#: tested after every token, logit biases applied to every step's logits
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    `temperature=0` is greedy. `top_k` of 0 or -1 disables top-k. `logprobs=k` returns the top-k
    log-probabilities of every generated token (plus the chosen one); `prompt_logprobs=k` does the
    same for every prompt token after the first. `logit_bias` maps token ids to a bias in
    [-100, 100] added to their logits before any other rule (as OpenAI's field does).
    `kv_policy` is what the request's KV cache keeps on a long context (kvbank.cache.policies: a
    spelling such as "sink_window(sinks=4,window=1024)" or a policy object; None: the engine's).
    `priority` orders the scheduler's queue as vLLM's field does: a lower value is admitted first,
    and when the pool is full the sequence preempted is the newest of the highest value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = SAMPLING_MAX_TOKENS
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    kv_policy: str | KVPolicy | None = None
    priority: int = 0
    stop_strings: list[str] = field(init=False, repr=False)
    #: `stop_token_ids` as a set, for the per-token check
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_set = frozenset(t for t in self.stop_token_ids if isinstance(t, int))
        if self.top_k == -1:
            self.top_k = 0
        if self.kv_policy is not None:
            self.kv_policy = parse_policy(self.kv_policy)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        bounded = _is_int(self.priority) and abs(self.priority) < 2**31
        _check(bounded, "priority", self.priority, "must be an integer in (-2^31, 2^31)")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "must be -1, 0 (off) or a positive integer",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "must be a positive integer or None",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must be <= max_tokens={self.max_tokens}",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            self.logprobs,
            "must be an integer in [0, 20]",
        )
        _check(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            self.prompt_logprobs,
            "must be an integer in [0, 20]",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX),
            "seed",
            self.seed,
            f"must be an integer in [{SEED_MIN}, {SEED_MAX}]",
        )
        _limit("stop", self.stop_strings, MAX_STOP_STRINGS, "strings")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", self.stop, "must be non-empty strings")
        longest = max(self.stop_strings, key=len, default="")
        _check(
            len(longest) <= MAX_STOP_STRING_CHARS,
            "stop",
            f"{longest[:32]}... ({len(longest)} characters)",
            f"is longer than {MAX_STOP_STRING_CHARS} characters",
        )
        _limit("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, "ids")
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must be non-negative integers",
        )
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        _check(
            self.logit_bias is None or isinstance(self.logit_bias, dict),
            "logit_bias",
            self.logit_bias,
            "must be a dict from token id to bias",
        )
        _limit("logit_bias", self.logit_bias or {}, MAX_LOGIT_BIAS, "entries")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(_is_int(token_id) and token_id >= 0, "logit_bias token id", token_id, "must be an integer >= 0")
            _check(
                _is_number(bias) and -100.0 <= bias <= 100.0,
                f"logit_bias[{token_id}]",
                bias,
                "must be a number in [-100, 100]",
            )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if a token id these parameters name is not in a vocabulary of `vocab_size`."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias token id", self.logit_bias or {})):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, bad[0] if bad else None, f"is out of range [0, {vocab_size})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _limit(name: str, items, limit: int, unit: str) -> None:
    if len(items) > limit:
        raise ValueError(f"{name} has {len(items)} {unit}; at most {limit} are allowed")


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} {rule}")
