"""The latency histograms of /metrics, fed with hand-built engine outputs: one set of series per
request priority, a bounded number of them, in the text exposition format."""

import re

from kvbank.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvbank.engine.params import SamplingParams
from kvbank.engine.sequence import Request
from kvbank.server.metrics import LATENCY_BUCKETS, MAX_PRIORITY_LABELS, OTHER_PRIORITY, RequestTimer

ARRIVAL = 1000.0
METRICS = (
    "kvbank:time_to_first_token_seconds",
    "kvbank:inter_token_latency_seconds",
    "kvbank:e2e_request_latency_seconds",
)
SAMPLE = re.compile(
    r"^(?P<name>[a-z0-9_:]+)_(?P<kind>bucket|sum|count)"
    r'\{priority="(?P<priority>-?\d+|other)"(?:,le="(?P<le>[^"]+)")?\} (?P<value>\S+)$'
)


def _step(request_id: str, priority: int, new_tokens: int, finished: bool = False) -> RequestOutput:
    """A delta output of a request whose first token came 0.25 s after it arrived, and that finished 1 s after."""
    metrics = RequestMetrics(
        ARRIVAL, first_token_time=ARRIVAL + 0.25, finished_time=ARRIVAL + 1.0 if finished else None
    )
    completion = CompletionOutput(0, "x" * new_tokens, list(range(new_tokens)), None, None)
    return RequestOutput(request_id, None, [1], None, [completion], finished, metrics, priority=priority)


def _parse(page: list[str]) -> dict[str, dict[str, dict]]:
    """metric -> priority -> {"buckets": [(le, cumulative)], "sum": s, "count": n}, checking every line's form
    and that HELP and TYPE come once per metric."""
    series: dict[str, dict[str, dict]] = {}
    for line in page:
        if line.startswith("# "):
            continue
        sample = SAMPLE.match(line)
        assert sample, line
        one = series.setdefault(sample["name"], {}).setdefault(sample["priority"], {"buckets": []})
        if sample["kind"] == "bucket":
            one["buckets"].append((sample["le"], int(sample["value"])))
        else:
            one[sample["kind"]] = float(sample["value"])
    for name in METRICS:
        assert page.count(f"# TYPE {name} histogram") == 1
        assert sum(line.startswith(f"# HELP {name} ") for line in page) == 1
        for one in series[name].values():
            bounds = [le for le, _ in one["buckets"]]
            assert bounds == [repr(b) for b in LATENCY_BUCKETS] + ["+Inf"]
            cumulative = [count for _, count in one["buckets"]]
            assert cumulative == sorted(cumulative) and cumulative[-1] == one["count"]
    return series


def _counts(series: dict[str, dict[str, dict]], name: str) -> dict[str, int]:
    return {priority: int(one["count"]) for priority, one in series[name].items()}


def test_a_fresh_timer_lists_each_histogram_with_the_default_priority_only():
    series = _parse(RequestTimer().render())
    assert set(series) == set(METRICS)
    for name in METRICS:
        assert _counts(series, name) == {"0": 0}


def test_each_priority_gets_its_own_series_that_sum_to_the_totals():
    timer = RequestTimer()
    timer.observe([_step("a", 0, 1), _step("b", 3, 1)], now=ARRIVAL + 0.25)
    timer.observe([_step("a", 0, 2), _step("b", 3, 1, finished=True)], now=ARRIVAL + 0.75)
    timer.observe([_step("a", 0, 1, finished=True)], now=ARRIVAL + 1.0)
    series = _parse(timer.render())
    assert _counts(series, "kvbank:time_to_first_token_seconds") == {"0": 1, "3": 1}
    assert _counts(series, "kvbank:inter_token_latency_seconds") == {"0": 3, "3": 1}
    assert _counts(series, "kvbank:e2e_request_latency_seconds") == {"0": 1, "3": 1}
    assert series["kvbank:time_to_first_token_seconds"]["3"]["sum"] == 0.25
    assert series["kvbank:e2e_request_latency_seconds"]["0"]["sum"] == 1.0
    # a's two tokens of the second step came 0.5 s after its first: 0.25 s apart each, then 0.25 s to the last
    assert series["kvbank:inter_token_latency_seconds"]["0"]["sum"] == 0.75
    assert dict(series["kvbank:inter_token_latency_seconds"]["0"]["buckets"])["0.25"] == 3


def test_priorities_beyond_the_limit_share_the_other_series():
    timer = RequestTimer()
    priorities = [-(2**31) + 1, *range(1, MAX_PRIORITY_LABELS + 4), 2**31 - 1]
    timer.observe([_step(f"r{p}", p, 1, finished=True) for p in priorities], now=ARRIVAL + 1.0)
    timer.observe([_step("again", priorities[0], 1, finished=True)], now=ARRIVAL + 1.0)  # labelled before the limit
    counts = _counts(_parse(timer.render()), "kvbank:e2e_request_latency_seconds")
    own = priorities[: MAX_PRIORITY_LABELS - 1]  # 0 holds the remaining label from the start
    assert counts == {"0": 0, str(priorities[0]): 2, **{str(p): 1 for p in own[1:]}, OTHER_PRIORITY: 6}
    assert sum(counts.values()) == len(priorities) + 1


def test_a_requests_outputs_carry_its_priority():
    for priority in (0, -5, 7):
        request = Request("r", None, [1, 2], SamplingParams(priority=priority), b"", ARRIVAL)
        assert request.output().priority == priority
