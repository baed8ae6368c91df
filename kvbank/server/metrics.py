"""Prometheus metrics for `kvbank serve`, in the text exposition format, with vLLM-style names.

Counters and gauges come from the engine's own counters (`AsyncEngine.stats()`); latency
histograms are fed by `RequestTimer.observe`, which the engine thread calls with every step's
outputs, and carry the request's `priority` as a label (the first 16 distinct priorities, 0 among
them; later ones fold into `priority="other"`), so summing over that label gives every request's
totals. Names use the `kvbank:` prefix where vLLM uses `vllm:`, so dashboards port over.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence

from kvbank.engine.outputs import RequestOutput
from kvbank.memory import PARTS, MemoryReport

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


#: distinct request priorities that get series of their own in the latency histograms; the ones seen
#: after them share `priority="other"`, so clients cannot grow /metrics without bound (a priority is
#: any integer in (-2^31, 2^31))
MAX_PRIORITY_LABELS = 16
OTHER_PRIORITY = "other"
_BY_PRIORITY = (
    f" By request priority; once {MAX_PRIORITY_LABELS} priorities have series, further ones share"
    f' priority="{OTHER_PRIORITY}".'
)


class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms keep them (one series)."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, labels: str) -> list[str]:
        """The bucket, sum and count lines of `name`, each with `labels` (`key="value"` pairs) first."""
        lines = []
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines += [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {self.count}"]
        return lines


class PriorityHistogram:
    """One histogram metric with a series per `priority` label value: summed over the label, the
    series give the totals of every request."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help_text, self.buckets = name, help_text, tuple(buckets)
        # The default priority's series exist from the start, so a fresh server already lists the metric.
        self.series: dict[str, Histogram] = {"0": Histogram(self.buckets)}

    def observe(self, priority: str, value: float) -> None:
        """Count `value` under the label value `priority` (a `PriorityLabels` label)."""
        if priority not in self.series:
            self.series[priority] = Histogram(self.buckets)
        self.series[priority].observe(value)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        for priority in sorted(self.series, key=_label_order):
            lines += self.series[priority].render(self.name, f'priority="{priority}"')
        return lines


def _label_order(priority: str) -> tuple[bool, int]:
    return (priority == OTHER_PRIORITY, 0 if priority == OTHER_PRIORITY else int(priority))


class PriorityLabels:
    """The `priority` label value of each request priority: the priority itself for the first
    MAX_PRIORITY_LABELS distinct ones seen (0 among them from the start), OTHER_PRIORITY for the rest."""

    def __init__(self) -> None:
        self._labelled: set[int] = {0}

    def __call__(self, priority: int) -> str:
        if priority not in self._labelled and len(self._labelled) < MAX_PRIORITY_LABELS:
            self._labelled.add(priority)
        return str(priority) if priority in self._labelled else OTHER_PRIORITY


class RequestTimer:
    """Time to first token, inter-token latency and end-to-end latency of every request, by priority
    (the `priority` label, bounded by `PriorityLabels`)."""

    def __init__(self) -> None:
        self.ttft = PriorityHistogram(
            "kvbank:time_to_first_token_seconds", "Time from arrival to the first output token." + _BY_PRIORITY
        )
        self.itl = PriorityHistogram(
            "kvbank:inter_token_latency_seconds", "Time between two output tokens of a sequence." + _BY_PRIORITY
        )
        self.e2e = PriorityHistogram(
            "kvbank:e2e_request_latency_seconds", "Time from arrival to the last output token." + _BY_PRIORITY
        )
        self._label = PriorityLabels()
        self._lock = threading.Lock()
        # (request id, completion index) -> (tokens seen, time of the latest one)
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}

    def observe(self, outputs: list[RequestOutput], now: float | None = None) -> None:
        """Record one engine step's outputs, deltas as AsyncEngine sets them (called on the engine thread)."""
        now = time.time() if now is None else now
        with self._lock:
            for output in outputs:
                priority = self._label(output.priority)
                for completion in output.outputs:
                    key = (output.request_id, completion.index)
                    seen, last = self._seen.get(key, (0, 0.0))
                    tokens = seen + len(completion.token_ids)  # outputs are deltas
                    if tokens > seen:
                        if seen == 0:
                            if completion.index == 0 and output.metrics.time_to_first_token is not None:
                                self.ttft.observe(priority, output.metrics.time_to_first_token)
                        else:
                            gap = (now - last) / (tokens - seen)
                            for _ in range(tokens - seen):
                                self.itl.observe(priority, gap)
                        self._seen[key] = (tokens, now)
                if output.finished:
                    finished = output.metrics.finished_time or now
                    self.e2e.observe(priority, finished - output.metrics.arrival_time)
                    for completion in output.outputs:
                        self._seen.pop((output.request_id, completion.index), None)

    def render(self) -> list[str]:
        with self._lock:
            return [*self.ttft.render(), *self.itl.render(), *self.e2e.render()]


_COUNTERS = (
    ("prefix_cache_queries", "kvbank:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "kvbank:prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "kvbank:num_preemptions_total", "Sequences preempted (swapped out or to be recomputed)."),
    (
        "num_prefix_waits",
        "kvbank:num_prefix_waits_total",
        "Requests that waited for a running prefill to cache the prompt blocks they share.",
    ),
    ("num_swaps_out", "kvbank:num_swaps_out_total", "Preempted sequences whose KV blocks went to host RAM."),
    ("num_swaps_in", "kvbank:num_swaps_in_total", "Swapped sequences whose KV blocks came back into the pool."),
    (
        "num_paced_steps",
        "kvbank:num_paced_steps_total",
        "Engine steps that carried decodes (paced to --max-step-ms).",
    ),
    (
        "num_steps_over_target",
        "kvbank:num_steps_over_target_total",
        "Engine steps carrying decodes that took longer than --max-step-ms.",
    ),
    (
        "blend_documents_reused",
        "kvbank:blend_documents_reused_total",
        "Documents placed in a prompt from the cache (computed by an earlier prompt).",
    ),
    ("blend_documents_computed", "kvbank:blend_documents_computed_total", "Documents computed alone and cached."),
    ("blend_tokens_reused", "kvbank:blend_tokens_reused_total", "Document tokens whose KV was placed, not computed."),
    (
        "blend_tokens_recomputed",
        "kvbank:blend_tokens_recomputed_total",
        "Tokens of blended prompts computed past the check layer (selected document tokens and the rest).",
    ),
    ("blend_seconds", "kvbank:blend_seconds_total", "Seconds spent blending documents into prompts."),
    ("prompt_tokens", "kvbank:prompt_tokens_total", "Prompt tokens admitted."),
    ("generation_tokens", "kvbank:generation_tokens_total", "Tokens generated."),
    ("finished_requests", "kvbank:request_success_total", "Requests finished (any reason but abort)."),
)
_GAUGES = (
    (
        "kv_cache_usage",
        "kvbank:kv_cache_usage_perc",
        "Fraction of KV blocks in use or pinned (0-1); cached blocks are evictable and count as available.",
    ),
    ("num_requests_running", "kvbank:num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "kvbank:num_requests_waiting", "Requests waiting to be scheduled."),
    ("num_blocks", "kvbank:num_blocks", "KV blocks in the pool."),
    (
        "num_free_blocks",
        "kvbank:num_free_blocks",
        "KV blocks free, i.e. empty (free + cached + used + pinned = num_blocks).",
    ),
    (
        "num_cached_blocks",
        "kvbank:num_cached_blocks",
        "KV blocks holding a cached prefix no sequence uses; evicted least recently used first when blocks run out.",
    ),
    ("num_used_blocks", "kvbank:num_used_blocks", "KV blocks held by live sequences and streams, pinned ones aside."),
    ("num_pinned_blocks", "kvbank:num_pinned_blocks", "KV blocks held by pinned prefixes."),
    ("swap_bytes_used", "kvbank:swap_bytes_used", "Host RAM held by swapped-out sequences, in bytes."),
    ("prefix_cache_hit_rate", "kvbank:prefix_cache_hit_rate", "Prefix-cache hits / queries since start."),
    ("batch_invariant", "kvbank:batch_invariant", "1 where greedy output cannot depend on what else runs, else 0."),
)


#: (TierStats field, metric, type, help) of every tier's series, labelled with `tier`
_TIER_SERIES = (
    ("bytes_used", "kvbank:kv_tier_bytes_used", "gauge", "Bytes of KV entries the tier holds."),
    ("capacity_bytes", "kvbank:kv_tier_capacity_bytes", "gauge", "The tier's byte budget (absent for Redis)."),
    ("entries", "kvbank:kv_tier_entries", "gauge", "KV entries the tier holds."),
    ("hits", "kvbank:kv_tier_hits_total", "counter", "Entries asked of the tier that it had."),
    ("misses", "kvbank:kv_tier_misses_total", "counter", "Entries asked of the tier that it lacked."),
    ("load_bytes", "kvbank:kv_tier_load_bytes_total", "counter", "Bytes read from the tier."),
    ("load_seconds", "kvbank:kv_tier_load_seconds_total", "counter", "Seconds spent reading from the tier."),
    ("store_bytes", "kvbank:kv_tier_store_bytes_total", "counter", "Bytes written to the tier."),
    ("store_seconds", "kvbank:kv_tier_store_seconds_total", "counter", "Seconds spent writing to the tier."),
    ("stores_dropped", "kvbank:kv_tier_stores_dropped_total", "counter", "Entries the tier did not store."),
    ("errors", "kvbank:kv_tier_errors_total", "counter", "Failed tier operations (outages, I/O errors)."),
    ("corrupt", "kvbank:kv_tier_corrupt_entries_total", "counter", "Entries refused as corrupt and deleted."),
)
#: (offload counter, metric, help): what moving KV between the pool and the tiers did
_OFFLOAD_COUNTERS = (
    ("loads", "kvbank:kv_offload_loads_total", "Prompt prefixes loaded from the tiers into the pool."),
    ("load_tokens", "kvbank:kv_offload_load_tokens_total", "Prompt tokens loaded from the tiers instead of computed."),
    ("load_timeouts", "kvbank:kv_offload_load_timeouts_total", "Loads abandoned as slower than recomputing."),
    ("stores", "kvbank:kv_offload_stores_total", "Entries sent to the tiers."),
    ("store_queue_full", "kvbank:kv_offload_store_queue_full_total", "Entries dropped: the writer was behind."),
    ("bad_entries", "kvbank:kv_offload_bad_entries_total", "Entries that failed verification on load."),
)


def render_metrics(
    stats: dict[str, float],
    timer: RequestTimer,
    extra_gauges: dict[str, float] | None = None,
    memory: MemoryReport | None = None,
    tiers: dict[str, dict[str, float]] | None = None,
) -> str:
    """The whole /metrics page; `memory` adds the engine's memory by part (kvbank.memory), `tiers`
    the KV tiers' series (`LLMEngine.tier_stats()`)."""
    lines: list[str] = []
    for key, name, help_text in _COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {stats.get(key, 0)}"]
    for key, name, help_text in _GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {_number(stats.get(key, 0))}"]
    for name, value in (extra_gauges or {}).items():
        lines += [f"# TYPE {name} gauge", f"{name} {value}"]
    lines += render_evictions(stats)
    lines += render_isa(stats.get("kernel_isa"))
    lines += timer.render()
    if memory is not None:
        lines += render_memory(memory)
    if tiers:
        lines += render_tiers(tiers)
    rss = resident_memory_bytes()
    if rss is not None:
        lines += [
            "# HELP process_resident_memory_bytes Resident memory size in bytes.",
            "# TYPE process_resident_memory_bytes gauge",
            f"process_resident_memory_bytes {rss}",
        ]
    return "\n".join(lines) + "\n"


def _number(value: float | bool) -> float | int:
    """A gauge's value as Prometheus writes it: a flag as 1 or 0."""
    return int(value) if isinstance(value, bool) else value


#: the engine's per-policy eviction counters are its stats keys with this prefix
EVICTED_PREFIX = "evicted_tokens_"


def render_evictions(stats: dict[str, float]) -> list[str]:
    """Tokens each long-context policy has evicted, one series per policy."""
    name = "kvbank:kv_policy_evicted_tokens_total"
    lines = [f"# HELP {name} Tokens long-context KV policies dropped from the cache.", f"# TYPE {name} counter"]
    for key, value in stats.items():
        if key.startswith(EVICTED_PREFIX):
            lines.append(f'{name}{{policy="{key[len(EVICTED_PREFIX) :]}"}} {value}')
    return lines


def render_isa(report: dict | None) -> list[str]:
    """`kvbank:cpu_isa_info{family=...,isa=...,cpu=...} 1`: the variant each native kernel family runs
    (isa="pytorch" where the native kernels are unavailable or a family has no variant there)."""
    if not report:
        return []
    name = "kvbank:cpu_isa_info"
    lines = [f"# HELP {name} The instruction-set variant each native kernel family runs.", f"# TYPE {name} gauge"]
    cpu = report.get("cpu") or "none"
    for family, variant in report.get("families", {}).items():
        lines.append(f'{name}{{family="{family}",isa="{variant or "pytorch"}",cpu="{cpu}"}} 1')
    return lines


def render_memory(report: MemoryReport) -> list[str]:
    """`kvbank:memory_bytes{part=...}` for every part, and `kvbank:load_peak_bytes` when known."""
    name = "kvbank:memory_bytes"
    parts = "; ".join(f"{part}: {what}" for part, what in PARTS.items())
    lines = [f"# HELP {name} Bytes the engine holds, by part ({parts}).", f"# TYPE {name} gauge"]
    lines += [f'{name}{{part="{part}"}} {value}' for part, value in report.parts().items()]
    if report.load_peak is not None:
        lines += [
            "# HELP kvbank:load_peak_bytes Most resident memory loading the weights added above the start.",
            "# TYPE kvbank:load_peak_bytes gauge",
            f"kvbank:load_peak_bytes {report.load_peak}",
        ]
    return lines


def render_tiers(tiers: dict[str, dict[str, float]]) -> list[str]:
    """Each tier's series with a `tier` label, and the offload controller's counters."""
    named = {name: values for name, values in tiers.items() if name != "offload"}
    lines: list[str] = []
    for key, name, kind, help_text in _TIER_SERIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [
            f'{name}{{tier="{tier}"}} {values[key]}' for tier, values in named.items() if values.get(key) is not None
        ]
    offload = tiers.get("offload", {})
    for key, name, help_text in _OFFLOAD_COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {offload.get(key, 0)}"]
    return lines


def resident_memory_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
